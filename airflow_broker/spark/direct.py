"""The Spark job's direct write, the driver's side: what the tasks need to know of a PostgreSQL
far broker (read once), the rows they are given, and what they report back. What each task
runs is :mod:`airflow_broker.spark.direct_task`."""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from airflow_broker.constants import (
    PRECEDENCE_NORMAL,
    SENDABLE_STATES,
    STATUS_NOT_COMPLETE,
    STATUS_READY,
    SYSTEM_MESSAGE_TYPES,
)
from airflow_broker.messaging.lookups import hosted_services, priority_for
from airflow_broker.messaging.validation import VALIDATION_CODES
from airflow_broker.spark import commit, copy_partition, direct_stream, direct_task, jdbc, stall
from airflow_broker.spark.transforms import part
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow
from airflow_broker.transport import deadlines

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

    from airflow_broker.storage.context import BrokerContext


@dataclass
class Written:
    """What the tasks wrote straight into a far broker's queues."""

    acks: list[commit.Ack]
    #: messages new in queues
    inserted: int
    #: rows staged for the staged commit (each task's counted once, however often it ran)
    staged: int


def _far(
    target: BrokerContext,
    plan: pa.Table,
    run_id: str,
    me: str,
    answer_timeout: float = direct_task.Far.answer_timeout,
) -> direct_task.Far:
    """What the tasks need to know of ``target``, read once; ``plan`` is the chosen
    conversations as the tasks are given them (:data:`direct_task.PLAN_COLUMNS`)."""
    routes = plan.group_by(["contract", "to_service", "from_service"]).aggregate([])
    cm, mt = s.contract_message, s.message_type
    with target.engine.connect() as conn:
        far_me = target.instance_id_on(conn)
        services = {
            name: direct_task.Service(h.queue_id, h.queue_status, h.router, h.contracts)
            for name, h in hosted_services(target, conn).items()
        }
        rules = conn.execute(
            select(cm.c.contract_name, cm.c.message_type_name, cm.c.sent_by, mt.c.validation).join(
                mt, mt.c.name == cm.c.message_type_name
            )
        ).all()
        priorities = {
            (contract, to, frm): priority_for(target, conn, contract, to, frm)
            for contract, to, frm in zip(
                routes["contract"].to_pylist(),
                routes["to_service"].to_pylist(),
                routes["from_service"].to_pylist(),
                strict=True,
            )
        }
    fast_types = frozenset(
        (contract, from_initiator, message_type)
        for contract, message_type, sent_by, validation in rules
        for from_initiator in (True, False)
        if message_type not in SYSTEM_MESSAGE_TYPES
        and validation == "none"
        and sent_by in ("initiator" if from_initiator else "target", "any")
    )
    return direct_task.Far(
        conninfo=jdbc.conninfo(target.engine.url),
        run_id=run_id,
        me=far_me,
        source_instance=me,
        services=services,
        fast_types=fast_types,
        priorities=priorities,
        now=utcnow(),
        status_ready=STATUS_READY,
        status_not_complete=STATUS_NOT_COMPLETE,
        precedence=PRECEDENCE_NORMAL,
        validation_none=VALIDATION_CODES["none"],
        sendable_states=frozenset(SENDABLE_STATES),
        answer_timeout=answer_timeout,
    )


def write_direct(
    pending: DataFrame,
    chosen: DataFrame,
    target: BrokerContext,
    run_id: str,
    me: str,
    parts: int,
    source: direct_stream.Source | None = None,
) -> Written:
    """Each partition of ``pending`` (messages, whole conversations in each) into ``target``'s
    queues by its own task (:func:`direct_task.write_partition`): the messages of the
    conversations ``chosen`` (rows of the plan) for it. With ``source`` (a PostgreSQL source:
    :func:`jdbc.stream_source`), ``pending`` is not read: each task reads its range of
    conversations from the source itself and streams their messages into the far queues
    (:func:`direct_stream.stream_part`).

    Spark does not join the messages to their plan: every task is given the chosen
    conversations (a broadcast Arrow table, one row each) and joins them to its messages
    itself, so that what a conversation's messages share is not repeated on every one of them
    through Spark."""
    from pyspark import cloudpickle
    from pyspark.sql import functions as F

    def lifetime_key(column: Any) -> Any:
        return F.coalesce(column, F.lit(float("-inf")))

    plan_columns = {
        "raw_handle": F.col("raw_handle"),
        "lifetime_key": lifetime_key(F.col("lifetime_epoch")),
        "conversation_id": F.col("conversation_id"),
        "source_handle": F.col("conversation_handle"),
        "from_service": F.col("from_service_name"),
        "to_service": F.col("to_service_name"),
        "to_broker_instance": F.col("target_instance"),
        "contract": F.col("service_contract_name"),
        "lifetime_epoch": F.col("lifetime_epoch"),
        "hops": F.col("hops").cast("int"),
        "part": part(parts),
    }
    plan = chosen.select(*[plan_columns[c].alias(c) for c in direct_task.PLAN_COLUMNS]).toArrow()
    seconds = jdbc.answer_timeout.get()
    with deadlines.answer_within(target, repr(target), seconds=seconds):
        far = _far(target, plan, run_id, me, seconds)
    sc = pending.sparkSession.sparkContext
    shared = sc.broadcast(plan)
    # Shipped by value: the executors need psycopg and pyarrow, not airflow_broker.
    cloudpickle.register_pickle_by_value(direct_task)
    cloudpickle.register_pickle_by_value(direct_stream)
    cloudpickle.register_pickle_by_value(copy_partition)
    cloudpickle.register_pickle_by_value(stall)
    try:
        if source is not None:
            tasks = len(source.ranges)
            results = (
                sc.parallelize(range(tasks), tasks)
                .mapPartitions(functools.partial(direct_stream.stream_shared, far, source, shared))
                .collect()
            )
        else:
            message_columns = {
                "raw_handle": F.col("conversation_handle"),
                "lifetime_key": lifetime_key(F.col("lifetime_epoch")),
                "from_initiator": F.col("is_initiator"),
                "seq": F.col("message_sequence_number"),
                "message_type": F.col("message_type_name"),
                "validation": F.col("validation"),
                "message_body": jdbc.bytea_text(F.col("message_body")),
            }
            messages = pending.select(
                *[message_columns[c].alias(c) for c in direct_task.INPUT_COLUMNS]
            )
            results = [
                r.asDict()
                for r in messages.mapInArrow(
                    functools.partial(direct_task.write_shared, far, shared),
                    direct_task.RESULT_SCHEMA,
                ).collect()
            ]
    finally:
        shared.destroy()
    written = Written([], 0, 0)
    for r in results:
        if r["kind"] == "ack":
            written.acks.append(
                commit.Ack(uuid.UUID(r["source_handle"]), int(r["upto"]), far.me, r["service"])
            )
            written.inserted += int(r["n"])
        else:
            written.staged += int(r["n"])
    if written.inserted:
        target.note_due(far.now)  # readers waiting on these queues in this process
    return written


__all__ = ["Written", "write_direct"]
