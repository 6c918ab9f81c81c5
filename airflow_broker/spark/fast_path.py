"""The commit's fast path: a part of the staged conversations into their queues by set-based SQL
(INSERT ... SELECT over the staging tables), with sequence checks and acknowledgments, in one
transaction per part.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Table,
    Uuid,
    and_,
    func,
    insert,
    literal,
    not_,
    select,
    text,
    tuple_,
)
from sqlalchemy.engine import Connection

from airflow_broker.constants import (
    PRECEDENCE_NORMAL,
    SENDABLE_STATES,
    STATUS_NOT_COMPLETE,
    STATUS_READY,
    SYSTEM_MESSAGE_TYPES,
)
from airflow_broker.errors import BrokerError
from airflow_broker.messaging.lookups import contract_rule, hosted_services, priority_for
from airflow_broker.messaging.rows import QUEUE_INSERT_COLUMNS
from airflow_broker.messaging.validation import VALIDATION_CODES
from airflow_broker.spark.staged import Ack, Committed, _conversations, _same_conversation
from airflow_broker.storage import bulk
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

_scratch = MetaData()


#: The fast conversations of one commit, with their endpoint here (a temporary table).
_plan = Table(
    "broker_spark_commit_plan",
    _scratch,
    Column("conversation_id", Uuid, nullable=False),
    Column("from_initiator", Boolean, nullable=False),
    Column("handle", Uuid, nullable=False),
    Column("group_id", Uuid, nullable=False),
    Column("queue_id", Integer, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("service_name", String(256), nullable=False),
    Column("contract", String(256), nullable=False),
    Column("recv", BigInteger, nullable=False),
    prefixes=["TEMPORARY"],
)


def _scratch_table(conn: Connection, table: Table) -> None:
    conn.execute(text(f"DROP TABLE IF EXISTS {table.name}"))
    table.create(conn)


def _fast(
    target: BrokerContext,
    conn: Connection,
    run_id: str,
    source_instance: str,
    *,
    part: int,
    dedup: bool,
) -> tuple[Committed, list[tuple[uuid.UUID, bool]]]:
    st, e, m = s.spark_staging, s.conversation_endpoint, s.message
    me = target.instance_id_on(conn)
    now = utcnow()
    done = Committed(me)
    this_run = and_(st.c.run_id == run_id, st.c.part == part)
    conv = _conversations(run_id, part)
    on_conv = _same_conversation(conv, st)
    seqs = (
        select(
            st.c.conversation_id,
            st.c.from_initiator,
            func.min(st.c.seq).label("min_seq"),
            func.max(st.c.seq).label("max_seq"),
            # Without duplicates (``dedup`` false) a plain count says as much, without a sort.
            func.count(st.c.seq.distinct() if dedup else st.c.seq).label("n"),
        )
        .where(this_run)
        .group_by(st.c.conversation_id, st.c.from_initiator)
        .subquery("seqs")
    )
    conversations = conn.execute(
        select(conv, seqs.c.min_seq, seqs.c.max_seq, seqs.c.n).join(
            seqs,
            _same_conversation(seqs, conv),
        )
    ).all()
    if not conversations:
        return done, []
    # Message types that take the general path: system messages, types this side may not send
    # under the contract, types validated here.
    general_types: set[tuple[str, bool, str]] = set()
    for contract, from_initiator, message_type in conn.execute(
        select(conv.c.contract, st.c.from_initiator, st.c.message_type)
        .join(conv, on_conv)
        .where(this_run)
        .distinct()
    ):
        if message_type in SYSTEM_MESSAGE_TYPES:
            general_types.add((contract, from_initiator, message_type))
            continue
        try:
            sent_by, validation, _schema = contract_rule(target, conn, contract, message_type)
        except BrokerError:
            general_types.add((contract, from_initiator, message_type))
            continue
        side = "initiator" if from_initiator else "target"
        if sent_by not in (side, "any") or validation != "none":
            general_types.add((contract, from_initiator, message_type))
    general: set[tuple[uuid.UUID, bool]] = set()
    if general_types:
        general |= {
            (r[0], r[1])
            for r in conn.execute(
                select(st.c.conversation_id, st.c.from_initiator)
                .join(conv, on_conv)
                .where(this_run)
                .where(
                    tuple_(conv.c.contract, st.c.from_initiator, st.c.message_type).in_(
                        sorted(general_types)
                    )
                )
                .distinct()
            )
        }
    # The endpoints here, locked (in handle order) until the messages are in.
    staged_keys = select(conv.c.conversation_id, not_(conv.c.from_initiator))
    lock = (
        select(e)
        .where(tuple_(e.c.conversation_id, e.c.is_initiator).in_(staged_keys))
        .order_by(e.c.conversation_handle)
    )
    if target.dialect == "postgresql":
        lock = lock.with_for_update()
    endpoints = {(r.conversation_id, r.is_initiator): r for r in conn.execute(lock)}
    waiting_here = {
        r[0]
        for r in conn.execute(
            select(m.c.conversation_handle)
            .where(m.c.status == STATUS_NOT_COMPLETE)
            .where(
                m.c.conversation_handle.in_(
                    select(e.c.conversation_handle).where(
                        tuple_(e.c.conversation_id, e.c.is_initiator).in_(staged_keys)
                    )
                )
            )
            .distinct()
        )
    }
    hosted = hosted_services(target, conn)
    new_groups: list[dict[str, Any]] = []
    new_endpoints: list[dict[str, Any]] = []
    plan_rows: list[dict[str, Any]] = []
    raised: list[dict[str, Any]] = []
    bindings: list[dict[str, Any]] = []
    for c in conversations:
        key = (c.conversation_id, c.from_initiator)
        contiguous = c.n == c.max_seq - c.min_seq + 1
        for_me = c.to_broker_instance in (None, me)
        if key in general or not contiguous or not for_me:
            general.add(key)
            continue
        ep = endpoints.get((c.conversation_id, not c.from_initiator))
        if ep is None:
            svc = hosted.get(c.to_service)
            if (
                c.min_seq != 0
                or svc is None
                or svc.router
                or not svc.queue_status
                or not svc.accepts(c.contract)
            ):
                general.add(key)
                continue
            handle, group = uuid.uuid4(), uuid.uuid4()
            prio = priority_for(target, conn, c.contract, c.to_service, c.from_service)
            new_groups.append({"conversation_group_id": group, "queue_id": svc.queue_id})
            new_endpoints.append(
                {
                    "conversation_handle": handle,
                    "conversation_id": c.conversation_id,
                    "is_initiator": not c.from_initiator,
                    "conversation_group_id": group,
                    "queue_id": svc.queue_id,
                    "service_name": c.to_service,
                    "far_service": c.from_service,
                    "far_broker_instance": source_instance,
                    "far_handle": None,
                    "contract_name": c.contract,
                    "state": "CO",
                    "priority": prio,
                    "lifetime": _time(c.lifetime_epoch),
                    "send_sequence": 0,
                    "receive_sequence": c.max_seq + 1,
                    "created_at": now,
                }
            )
            plan_rows.append(
                {
                    "conversation_id": c.conversation_id,
                    "from_initiator": c.from_initiator,
                    "handle": handle,
                    "group_id": group,
                    "queue_id": svc.queue_id,
                    "priority": prio,
                    "service_name": c.to_service,
                    "contract": c.contract,
                    "recv": 0,
                }
            )
            done.inserted += c.max_seq + 1
            done.acks.append(Ack(c.source_handle, c.max_seq + 1, me, c.to_service))
            continue
        if (
            ep.state not in SENDABLE_STATES
            or ep.far_broker_instance not in (None, source_instance)
            or ep.conversation_handle in waiting_here
            or c.min_seq > ep.receive_sequence
        ):
            general.add(key)
            continue
        upto = max(ep.receive_sequence, c.max_seq + 1)
        if upto > ep.receive_sequence:
            plan_rows.append(
                {
                    "conversation_id": c.conversation_id,
                    "from_initiator": c.from_initiator,
                    "handle": ep.conversation_handle,
                    "group_id": ep.conversation_group_id,
                    "queue_id": ep.queue_id,
                    "priority": ep.priority,
                    "service_name": ep.service_name,
                    "contract": c.contract,
                    "recv": ep.receive_sequence,
                }
            )
            raised.append({"conversation_handle": ep.conversation_handle, "receive_sequence": upto})
            done.inserted += upto - ep.receive_sequence
        if ep.far_broker_instance is None:
            bindings.append(
                {
                    "conversation_handle": ep.conversation_handle,
                    "far_broker_instance": source_instance,
                }
            )
        done.acks.append(Ack(c.source_handle, upto, me, ep.service_name))
    bulk.insert_rows(conn, s.conversation_group, new_groups)
    bulk.insert_rows(conn, e, new_endpoints)
    if plan_rows:
        _scratch_table(conn, _plan)
        bulk.insert_rows(conn, _plan, plan_rows)
        if target.dialect == "postgresql":
            conn.execute(text(f"ANALYZE {_plan.name}"))
        p = _plan
        rows = (
            select(
                p.c.queue_id,
                p.c.group_id,
                p.c.handle,
                st.c.seq,
                literal(STATUS_READY, SmallInteger()),
                p.c.priority,
                literal(PRECEDENCE_NORMAL, SmallInteger()),
                p.c.service_name,
                p.c.contract,
                st.c.message_type,
                literal(VALIDATION_CODES["none"], String(1)),
                st.c.message_body,
                literal(now, m.c.enqueued_at.type),
            )
            .join(
                p,
                _same_conversation(p, st),
            )
            .where(this_run, st.c.seq >= p.c.recv)
        )
        # A retried Spark task staged some rows twice: each sequence number once.
        if dedup and target.dialect == "postgresql":
            rows = _distinct_on(rows, st.c.conversation_id, st.c.from_initiator, st.c.seq)
        elif dedup:
            rows = rows.group_by(st.c.conversation_id, st.c.from_initiator, st.c.seq)
        conn.execute(insert(m).from_select(list(QUEUE_INSERT_COLUMNS), rows))
        conn.execute(text(f"DROP TABLE {_plan.name}"))
    bulk.update_rows(conn, e, "conversation_handle", raised)
    bulk.update_rows(
        conn, e, "conversation_handle", bindings, only_if_null=("far_broker_instance",)
    )
    if done.inserted:
        target.note_due(now)  # readers waiting on these queues
    return done, sorted(general)


def _distinct_on(stmt: Any, *columns: Any) -> Any:
    """PostgreSQL's ``SELECT DISTINCT ON (columns)``: an extension from SQLAlchemy 2.1 on,
    ``distinct(*columns)`` (deprecated there) before."""
    try:
        from sqlalchemy.dialects.postgresql import distinct_on
    except ImportError:  # SQLAlchemy 2.0
        return stmt.distinct(*columns)
    return stmt.ext(distinct_on(*columns))


def _time(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC)
