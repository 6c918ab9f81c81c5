"""DAGs of bench/activation.py (not examples: a DAGs folder of their own).

``latency_reader`` is activated by the broker queue ``latency_q`` through the triggerer
(AssetWatcher + QueueActivationTrigger) and records, per message, when it was received.
``latency_plain`` is the scheduler's own baseline: a TriggerDagRunOperator run of
``latency_target``, whose first task records when it started.
"""

from __future__ import annotations

import time
from typing import Any

import pendulum
from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import Asset, AssetWatcher, dag, task
from sqlalchemy import text

from airflow_broker import Message, Transaction
from airflow_broker.constants import END_DIALOG, ERROR
from airflow_broker.hooks.broker import BrokerHook
from airflow_broker.operators.reader import DrainQueueOperator
from airflow_broker.provider.triggers.activation import QueueActivationTrigger

START = pendulum.datetime(2026, 1, 1)
QUEUE = "latency_q"

queue_asset = Asset(
    "broker://latency_q",
    watchers=[
        AssetWatcher(
            name="latency_q_watcher",
            trigger=QueueActivationTrigger(queue=QUEUE, poll_interval=0.5),
        )
    ],
)


def _record(kind: str, started: float, seen: float) -> None:
    broker = BrokerHook().get_broker()
    with broker.engine.begin() as conn:
        conn.execute(
            text("INSERT INTO bench_latency (kind, started, seen) VALUES (:k, :s, :t)"),
            {"k": kind, "s": started, "t": seen},
        )


#: When the reader task's execute() began (time.time()): the operator's own part of an
#: activation (connecting, taking a reader slot, the first RECEIVE) is what follows it.
_execute_started: float | None = None


class StampedDrainQueueOperator(DrainQueueOperator):
    """DrainQueueOperator that notes when execute() began, for the latency's breakdown."""

    def execute(self, context: Any) -> dict[str, Any]:
        global _execute_started
        _execute_started = time.time()
        return super().execute(context)


def record_latency(tx: Transaction, messages: list[Message]) -> None:
    """The reader's handler, inside the RECEIVE's transaction: the time of the first RECEIVE of
    each SEND, written in the same commit. The sender ends its side at once, so the EndDialog
    that follows each message is answered with END and nothing recorded."""
    seen = time.time()
    for m in messages:
        if m.message_type_name == END_DIALOG:
            tx.end_conversation(m.conversation_handle)
        elif m.message_type_name != ERROR:
            sent_at = float(m.json()["sent_at"])
            insert = text("INSERT INTO bench_latency (kind, started, seen) VALUES (:k, :s, :t)")
            tx.connection.execute(insert, {"k": "activation", "s": sent_at, "t": seen})
            if _execute_started is not None:
                tx.connection.execute(
                    insert, {"k": "activation_execute", "s": sent_at, "t": _execute_started}
                )


@dag(schedule=[queue_asset], start_date=START, catchup=False, max_active_runs=4)
def latency_reader() -> None:
    # Registers as a reader of the queue (the monitor counts it), drains, exits.
    StampedDrainQueueOperator(task_id="drain", queue=QUEUE, handler=record_latency)


@dag(schedule=None, start_date=START, catchup=False)
def latency_target() -> None:
    @task
    def first(**context: object) -> None:
        conf = context["dag_run"].conf  # type: ignore[attr-defined]
        _record("scheduler", float(conf["sent_at"]), time.time())

    first()


@dag(schedule=None, start_date=START, catchup=False)
def latency_plain() -> None:
    @task
    def stamp() -> float:
        return time.time()

    TriggerDagRunOperator(
        task_id="trigger",
        trigger_dag_id="latency_target",
        conf={"sent_at": "{{ ti.xcom_pull(task_ids='stamp') }}"},
    ).set_upstream(stamp())


latency_reader()
latency_target()
latency_plain()
