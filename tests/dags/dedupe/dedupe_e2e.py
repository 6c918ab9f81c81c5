"""The DAG of tests/test_e2e_dedupe.py: a SEND whose first try fails right after its commit.

``SendAndFail`` commits its SEND (``SendOperator.execute``), then raises on try 1, as a worker
that dies between the broker's commit and Airflow's record of success would look to Airflow.
Airflow retries it; the retry's SEND carries the same dedupe key (the task instance's identity)
and sends nothing.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pendulum
from airflow.sdk import dag

from airflow_broker.operators import SendOperator


class SendAndFail(SendOperator):
    """SendOperator whose first try raises after its transaction committed."""

    def execute(self, context: Any) -> int:
        count = super().execute(context)
        if context["ti"].try_number == 1:
            raise RuntimeError("injected failure after commit")
        return count


@dag(schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def dedupe_e2e() -> None:
    SendAndFail(
        task_id="send",
        conversation_handle="{{ dag_run.conf['handle'] }}",
        body="{{ dag_run.conf['body'] }}",
        retries=1,
        retry_delay=timedelta(seconds=1),
    )


dedupe_e2e()
