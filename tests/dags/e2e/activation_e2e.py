"""The reader DAG of tests/test_e2e_activation.py: activated by the broker queue ``e2e_q``
through the triggerer, it drains the queue with DrainQueueOperator and records every message
it handles (in the same transaction as the RECEIVE) in ``e2e_seen``, with the Celery worker the
task ran under (E2E_CELERY_WORKER, set by tests/support/airflow_stack.py; none under
LocalExecutor). With E2E_HANDLE_PAUSE it waits that many seconds after each conversation group,
so that a reader stays busy long enough for a second one to start beside it."""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import Asset, AssetWatcher, dag

from airflow_broker.operators.reader import DrainQueueOperator
from airflow_broker.provider.triggers.activation import QueueActivationTrigger

QUEUE = "e2e_q"
MAX_READERS = 2


def record(tx: Any, messages: list[Any]) -> None:
    """The handler: one row per message handled, then END the conversations that ended."""
    import os
    import time

    from sqlalchemy import text

    worker = os.environ.get("E2E_CELERY_WORKER")
    for m in messages:
        if m.message_type_name.endswith("/EndDialog"):
            tx.end_conversation(m.conversation_handle)
            continue
        tx.connection.execute(
            text(
                "INSERT INTO e2e_seen (conversation_handle, seq, body, worker)"
                " VALUES (:h, :s, :b, :w)"
            ),
            {
                "h": str(m.conversation_handle),
                "s": m.message_sequence_number,
                "b": m.text(),
                "w": worker,
            },
        )
    time.sleep(float(os.environ.get("E2E_HANDLE_PAUSE", "0")))


e2e_queue = Asset(
    "broker://e2e_q",
    watchers=[
        AssetWatcher(
            name="e2e_q_watcher",
            trigger=QueueActivationTrigger(queue=QUEUE, poll_interval=0.5),
        )
    ],
)


@dag(
    schedule=[e2e_queue],
    start_date=pendulum.datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=MAX_READERS,
)
def activation_e2e() -> None:
    DrainQueueOperator(task_id="drain", queue=QUEUE, handler="activation_e2e:record")


activation_e2e()
