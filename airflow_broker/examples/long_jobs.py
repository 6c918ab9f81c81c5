"""Long jobs: a handler that works for minutes on leased messages, exactly once.

A requester begins a dialog to the worker service and sends a Job (``{"job_id", "numbers"}``);
the worker answers with a Result (``{"job_id", "count", "total", "mean"}``) and ENDs the dialog.
The work takes minutes, too long to hold a RECEIVE's transaction open, so the worker **leases**
the messages (``Broker.lease``): the lease commits at once, and the conversation group stays
held, with no transaction open, while :func:`work` runs. Then :func:`finish` writes each result
(table ``long_job_result``), SENDs the Results, ENDs the dialogs and completes the lease in
**one** transaction: the removal of the messages commits with everything the handler wrote, or
nothing does. When the lease expired first and another reader took the group, ``complete``
raises ``LeaseExpired`` and the whole transaction rolls back: no second result, no second reply.

- :data:`DECLARATIONS`: the message types, the contract, a queue and a service for each side;
- :func:`setup`: the declarations and the ``long_job_result`` table (safe to run again);
- :func:`submit_job`: the requester's side, in the caller's transaction;
- :func:`work`: the slow part, outside any transaction; keeps the lease alive (``extend``);
- :func:`finish`: results, replies and ``tx.complete``, in the caller's transaction.

``dags/long_handler.py`` runs it in Airflow. Nothing here imports Airflow.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import yaml
from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table, Text, Uuid, insert

from airflow_broker.constants import END_DIALOG, ERROR
from airflow_broker.operations.declarations import apply_declarations
from airflow_broker.storage.schema import NAMING_CONVENTION

if TYPE_CHECKING:
    from airflow_broker.broker import Broker
    from airflow_broker.messaging.leases import Lease
    from airflow_broker.messaging.objects import Message
    from airflow_broker.messaging.transaction import Transaction
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker.examples.long_jobs")

PREFIX = "//airflow-broker/examples/long"
WORKER_SERVICE = f"{PREFIX}/Worker"
REQUESTER_SERVICE = f"{PREFIX}/Requester"
CONTRACT = f"{PREFIX}/JobContract"
JOB = f"{PREFIX}/Job"
RESULT = f"{PREFIX}/Result"
JOBS_QUEUE = "long_jobs_queue"
RESULTS_QUEUE = "long_results_queue"
HANDLER_DAG = "long_handler"
#: How many conversation groups are worked on at once (the handler DAG's max_active_runs).
MAX_READERS = 2

DECLARATIONS = "# The long-jobs example (airflow_broker.examples.long_jobs).\n" + yaml.safe_dump(
    {
        "version": 1,
        "message_types": [
            {"name": JOB, "validation": "json"},
            {"name": RESULT, "validation": "json"},
        ],
        "contracts": [{"name": CONTRACT, "message_types": {JOB: "initiator", RESULT: "target"}}],
        "queues": [
            {"name": JOBS_QUEUE, "activation": {"max_readers": MAX_READERS, "reader": HANDLER_DAG}},
            {"name": RESULTS_QUEUE},
        ],
        "services": [
            {"name": WORKER_SERVICE, "queue": JOBS_QUEUE, "contracts": [CONTRACT]},
            {"name": REQUESTER_SERVICE, "queue": RESULTS_QUEUE},
        ],
    },
    sort_keys=False,
    width=100,
)

metadata = MetaData(naming_convention=NAMING_CONVENTION)

long_job_result = Table(
    "long_job_result",
    metadata,
    Column("conversation_handle", Uuid, primary_key=True, comment="the worker's side"),
    Column("job_id", String(200), nullable=False),
    Column("result", Text, nullable=False, comment="the Result's body (JSON)"),
    Column("receive_count", Integer, nullable=False, comment="the attempt that produced it"),
    Column("handled_at", DateTime(timezone=True), nullable=False),
    comment="One row per job handled: written in the transaction that completes its lease.",
)


def setup(broker: BrokerContext) -> None:
    """The broker objects and the ``long_job_result`` table; safe to run again."""
    apply_declarations(broker, DECLARATIONS, "long_jobs.DECLARATIONS")
    metadata.create_all(broker.engine, checkfirst=True)


def submit_job(tx: Transaction, numbers: Sequence[float], job_id: str | None = None) -> uuid.UUID:
    """The requester begins a dialog to the worker and sends a Job; returns its handle."""
    handle = tx.begin_dialog(REQUESTER_SERVICE, WORKER_SERVICE, contract=CONTRACT)
    tx.send(handle, JOB, {"job_id": job_id or f"job-{uuid.uuid4()}", "numbers": list(numbers)})
    return handle


def compute(job: Any) -> dict[str, Any]:
    """A Job's result (the quick part of the work); ValueError for a job it cannot do."""
    if not isinstance(job, dict) or not isinstance(job.get("numbers"), list):
        raise ValueError(f"a Job is {{'job_id': ..., 'numbers': [...]}}, not {job!r:.200}")
    numbers = job["numbers"]
    if not all(isinstance(n, int | float) and not isinstance(n, bool) for n in numbers):
        raise ValueError(
            f"job {job.get('job_id')!r}: numbers must be numbers, not {numbers!r:.200}"
        )
    total = sum(numbers)
    return {
        "job_id": str(job.get("job_id")),
        "count": len(numbers),
        "total": total,
        "mean": total / len(numbers) if numbers else None,
    }


@dataclass(frozen=True, slots=True)
class Outcome:
    """What :func:`work` made of one leased message."""

    message: Message
    #: the Result's body for a Job; None for a message that only ends the dialog
    result: dict[str, Any] | None


def work(
    lease: Lease,
    seconds: float,
    *,
    broker: Broker | None = None,
    lease_seconds: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Outcome]:
    """The slow part: ``seconds`` of work on the lease's messages, with no transaction open.

    With ``broker`` and ``lease_seconds``, the lease is extended by ``lease_seconds`` whenever
    less than half of it is left, so that work longer than the lease keeps it. Raises
    ValueError for a Job it cannot do (the caller's task fails; its lease is released).
    """
    outcomes: list[Outcome] = []
    for m in lease.messages:
        if m.message_type_name == JOB:
            outcomes.append(Outcome(m, compute(m.json())))
        elif m.message_type_name in (END_DIALOG, ERROR):
            outcomes.append(Outcome(m, None))
        else:
            raise ValueError(f"unexpected message type {m.message_type_name!r} on {JOBS_QUEUE}")
    expires_at = lease.expires_at
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if broker is not None and lease_seconds is not None:
            remaining = (expires_at - datetime.now(UTC)).total_seconds()
            if remaining < lease_seconds / 2:
                expires_at = broker.extend(lease.token, lease_seconds)
                log.info("lease %s extended until %s", lease.token, expires_at)
        sleep(min(left, 5.0))
    return outcomes


def finish(tx: Transaction, lease: Lease, outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """In the caller's transaction: each result's row, its Result and END; EndDialog and Error
    END the worker's side; then ``tx.complete(lease.token)``. Returns the results.

    All of it commits together when the transaction does: the handler's effects happen exactly
    once. ``LeaseExpired`` (the lease lapsed and another reader took the group) rolls it all back.
    """
    results: list[dict[str, Any]] = []
    ended: set[uuid.UUID] = set()
    for o in outcomes:
        handle = o.message.conversation_handle
        if handle in ended:
            continue
        if o.result is not None:
            tx.connection.execute(
                insert(long_job_result).values(
                    conversation_handle=handle,
                    job_id=o.result["job_id"],
                    result=json.dumps(o.result),
                    receive_count=o.message.receive_count,
                    handled_at=datetime.now(UTC),
                )
            )
            tx.send(handle, RESULT, o.result)
            results.append(o.result)
        tx.end_conversation(handle)
        ended.add(handle)
    tx.complete(lease.token)
    return results


__all__ = [
    "DECLARATIONS",
    "JOB",
    "JOBS_QUEUE",
    "RESULT",
    "RESULTS_QUEUE",
    "Outcome",
    "compute",
    "finish",
    "long_job_result",
    "metadata",
    "setup",
    "submit_job",
    "work",
]
