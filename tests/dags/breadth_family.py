"""The family reader DAG of tests/test_e2e_breadth.py (issue 46): ONE DAG, ``breadth_family``,
scheduled on the assets of BREADTH_QUEUES queues (500 unless the test says otherwise:
``breadth_q000``, ``breadth_q001``, ...), each watched by its queue's activation trigger. A run
reads the queues its asset events name; the handler records every message it handles in the
application table ``breadth_seen``, in the RECEIVE's transaction."""

from __future__ import annotations

import os
from typing import Any

from airflow_broker.provider.readers import queue_family_dag

#: the queues' names: PREFIX + a three-digit number (tests/test_e2e_breadth.py makes the same)
PREFIX = "breadth_q"


def record(tx: Any, messages: list[Any]) -> None:
    """One row per message handled (its service names its queue), in the same transaction."""
    from sqlalchemy import text

    for m in messages:
        tx.connection.execute(
            text(
                "INSERT INTO breadth_seen (service, conversation_handle, seq, body)"
                " VALUES (:s, :h, :n, :b)"
            ),
            {
                "s": m.service_name,
                "h": str(m.conversation_handle),
                "n": m.message_sequence_number,
                "b": m.text(),
            },
        )


queue_family_dag(
    "breadth_family",
    queues=[f"{PREFIX}{i:03d}" for i in range(int(os.environ.get("BREADTH_QUEUES", "500")))],
    handler="breadth_family:record",
    max_readers=1,
    # Four runs at once, not the default 16: on the test's two cores every task process that
    # starts takes CPU from the triggerer; events that arrive meanwhile ride in the next run,
    # which reads four of its queues at once.
    max_active_runs=4,
    operator_kwargs={"parallel": 4},
)
