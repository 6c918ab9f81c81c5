"""Committing what the Spark job staged in a far broker, exactly once, and acknowledging it at
the source.

Exactly once rests on the far broker, as in the Python delivery path
(:mod:`airflow_broker.transport`): a message goes into a queue only if its sequence number is new
for its conversation and direction (``receive_sequence``, in the transaction that raises it),
and the source deletes a message from its transmission queue only after the far broker has
committed it. The staging table is scratch space: a run that dies at any point leaves at most
rows there that the next run from the same source deletes before it stages again
(:func:`prepare`), and messages that were committed are recognized as duplicates when they come
again.

:func:`commit` takes each staged conversation one of two ways:

fast (set-based)
    the common case: in-order messages of an ordinary message type (no validation, allowed to
    this side by the contract) on a conversation that is open here or new here with its first
    message. One ``INSERT ... SELECT`` moves them from the staging table into the queues, under
    the lock of their endpoints, whatever their number; on PostgreSQL several transactions do
    so in parallel, each for the conversations of one ``part`` (the far database's cores share
    the index maintenance). Each is atomic for its conversations: after a crash between them,
    the next run's messages of the committed ones are duplicates by their sequence numbers.
general
    everything else (EndDialog and Error, gaps, validation, a failed or foreign conversation, a
    service not hosted here, a routing service...) goes through :class:`transport.Inbound`, the
    Python delivery path's receiving code itself, in batches.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
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
    bindparam,
    delete,
    exists,
    func,
    insert,
    literal,
    not_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.engine import Connection

from airflow_broker import bulk
from airflow_broker import schema as s
from airflow_broker.constants import (
    PRECEDENCE_NORMAL,
    SENDABLE_STATES,
    STATUS_NOT_COMPLETE,
    STATUS_READY,
    SYSTEM_MESSAGE_TYPES,
)
from airflow_broker.delivery import contract_rule, hosted_services, priority_for
from airflow_broker.engines import utcnow
from airflow_broker.errors import BrokerError
from airflow_broker.transport import MESSAGE, Inbound, Packet, apply_answers
from airflow_broker.validation import VALIDATION_CODES

if TYPE_CHECKING:
    from airflow_broker.broker import Broker

log = logging.getLogger("airflow_broker")

#: Packets per transaction on the general path (as :attr:`transport.Transport.BATCH`).
GENERAL_BATCH = 500

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
#: The conversations the general path takes (a temporary table).
_general_keys = Table(
    "broker_spark_general_keys",
    _scratch,
    Column("conversation_id", Uuid, nullable=False),
    Column("from_initiator", Boolean, nullable=False),
    prefixes=["TEMPORARY"],
)
#: Acknowledged conversations at the source (a temporary table).
_acks = Table(
    "broker_spark_acks",
    _scratch,
    Column("handle", Uuid, nullable=False),
    Column("upto", BigInteger, nullable=False),
    prefixes=["TEMPORARY"],
)


@dataclass(frozen=True, slots=True)
class Ack:
    """A conversation the far broker has every message of below ``upto``."""

    source_handle: uuid.UUID
    upto: int
    far_instance: str
    far_service: str


@dataclass(slots=True)
class Committed:
    """What one :func:`commit` did at the far broker."""

    far_instance: str
    #: conversations taken the set-based way, for the source to acknowledge
    acks: list[Ack] = field(default_factory=list)
    #: answers of the general path (acknowledgments, Error notices) for the source
    answers: list[Packet] = field(default_factory=list)
    #: conversations (source handle) with general-path messages the far broker did not take
    #: for good, and why
    waiting: dict[uuid.UUID, str] = field(default_factory=dict)
    #: messages the set-based way put into queues (new ones, duplicates not counted)
    inserted: int = 0
    #: messages that took the general path
    general: int = 0


def instance_of(broker: Broker) -> str:
    with broker.engine.connect() as conn:
        return broker.instance_id_on(conn)


def prepare(target: Broker, source_instance: str, run_id: str) -> int:
    """Before a run stages into ``target``: delete what earlier runs from the same source left
    there (they died before committing; their messages come again in this run). A run writes
    its conversations before its messages, so its messages are found by its conversations."""
    st, sc = s.spark_staging, s.spark_staged_conversation
    dead = select(sc.c.run_id).where(sc.c.source_instance == source_instance, sc.c.run_id != run_id)
    with target.engine.begin() as conn:
        gone = conn.execute(delete(st).where(st.c.run_id.in_(dead))).rowcount
        conn.execute(
            delete(sc).where(sc.c.source_instance == source_instance, sc.c.run_id != run_id)
        )
    if gone:
        log.info(
            "deleted %d staged rows that earlier runs from broker instance %s left in %r",
            gone,
            source_instance,
            target,
        )
    return int(gone or 0)


def _conversations(run_id: str, part: int | None) -> Any:
    """The staged conversations of a run (of one part of its commit), each once: a retried
    Spark task may have written some twice."""
    sc = s.spark_staged_conversation
    stmt = select(
        sc.c.conversation_id,
        sc.c.from_initiator,
        sc.c.source_handle,
        sc.c.from_service,
        sc.c.to_service,
        sc.c.to_broker_instance,
        sc.c.contract,
        sc.c.lifetime_epoch,
        sc.c.hops,
    ).where(sc.c.run_id == run_id)
    if part is not None:
        stmt = stmt.where(sc.c.part == part)
    return stmt.distinct().subquery("conv")


def _same_conversation(a: Any, b: Any) -> Any:
    """Rows of ``a`` and ``b`` (tables or subqueries) about one conversation and direction."""
    return and_(
        a.c.conversation_id == b.c.conversation_id, a.c.from_initiator == b.c.from_initiator
    )


def _scratch_table(conn: Connection, table: Table) -> None:
    conn.execute(text(f"DROP TABLE IF EXISTS {table.name}"))
    table.create(conn)


def commit(
    target: Broker,
    run_id: str,
    source_instance: str,
    *,
    written: int | None = None,
    parts: int = 1,
) -> Committed:
    """Move the messages run ``run_id`` staged in ``target`` into its queues, exactly once.

    ``written`` is how many rows the run wrote (Spark counts each partition once, however
    often its task ran): when the staging table holds more, a retried task wrote some twice
    and the commit takes each sequence number once (a sort it otherwise skips). ``parts`` is
    how many transactions commit in parallel (the run wrote each conversation's ``part``
    below it); SQLite takes one writer, so one transaction there."""
    st = s.spark_staging
    with target.engine.begin() as conn:
        me = target.instance_id_on(conn)
        hosted_services(target, conn)  # cached for the parts
        if target.dialect == "postgresql":
            # Just filled, never analyzed: without statistics the planner joins it to the
            # commit plan by nested loops.
            conn.execute(text(f"ANALYZE {st.name}"))
            conn.execute(text(f"ANALYZE {s.spark_staged_conversation.name}"))
        staged = conn.execute(
            select(func.count()).select_from(st).where(st.c.run_id == run_id)
        ).scalar_one()
    dedup = written is None or staged != written
    if dedup and written is not None:
        log.info(
            "run %s staged %d rows in %r for %d messages: a retried Spark task wrote some "
            "twice; each is committed once",
            run_id,
            staged,
            target,
            written,
        )

    def one(part: int) -> tuple[Committed, list[tuple[uuid.UUID, bool]]]:
        with target.engine.begin() as conn:
            return _fast(target, conn, run_id, source_instance, part=part, dedup=dedup)

    if target.dialect == "sqlite" or parts <= 1:
        results = [one(part) for part in range(max(1, parts))]
    else:
        with ThreadPoolExecutor(parts, thread_name_prefix="broker-spark-commit") as pool:
            results = list(pool.map(one, range(parts)))
    done = Committed(me)
    general_keys: list[tuple[uuid.UUID, bool]] = []
    for part_done, keys in results:
        done.acks += part_done.acks
        done.inserted += part_done.inserted
        general_keys += keys
    if general_keys:
        _general(target, run_id, source_instance, sorted(general_keys), done)
    with target.engine.begin() as conn:
        conn.execute(delete(st).where(st.c.run_id == run_id))
        sc = s.spark_staged_conversation
        conn.execute(delete(sc).where(sc.c.run_id == run_id))
    return done


def _fast(
    target: Broker,
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
        conn.execute(
            insert(m).from_select(
                [
                    "queue_id",
                    "conversation_group_id",
                    "conversation_handle",
                    "message_sequence_number",
                    "status",
                    "priority",
                    "precedence",
                    "service_name",
                    "service_contract_name",
                    "message_type_name",
                    "validation",
                    "message_body",
                    "enqueued_at",
                ],
                rows,
            )
        )
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


def _general(
    target: Broker,
    run_id: str,
    source_instance: str,
    keys: Sequence[tuple[uuid.UUID, bool]],
    done: Committed,
) -> None:
    """The staged messages of ``keys`` through the Python path's receiving code."""
    st = s.spark_staging
    packets: dict[tuple[uuid.UUID, bool, int], Packet] = {}
    handles: dict[tuple[uuid.UUID, bool], uuid.UUID] = {}
    k = _general_keys
    with target.engine.begin() as conn:
        _scratch_table(conn, k)
        bulk.insert_rows(conn, k, [{"conversation_id": c, "from_initiator": f} for c, f in keys])
        conv = _conversations(run_id, None)
        for r in conn.execute(
            select(
                st.c.seq,
                st.c.message_type,
                st.c.validation,
                st.c.message_body,
                *conv.c,
            )
            .join(
                conv,
                _same_conversation(conv, st),
            )
            .join(
                k,
                _same_conversation(k, st),
            )
            .where(st.c.run_id == run_id)
            .order_by(st.c.conversation_id, st.c.from_initiator, st.c.seq)
        ):
            handles[(r.conversation_id, r.from_initiator)] = r.source_handle
            packets.setdefault(
                (r.conversation_id, r.from_initiator, r.seq),
                Packet(
                    MESSAGE,
                    r.conversation_id,
                    r.from_initiator,
                    r.from_service,
                    source_instance,
                    r.to_service,
                    r.to_broker_instance,
                    r.seq,
                    contract=r.contract,
                    message_type=r.message_type,
                    validation=r.validation,
                    body=r.message_body,
                    lifetime=_time(r.lifetime_epoch),
                    hops=r.hops,
                ),
            )
        conn.execute(text(f"DROP TABLE {k.name}"))
    ordered = list(packets.values())
    done.general += len(ordered)
    inbound = Inbound(target)
    for start in range(0, len(ordered), GENERAL_BATCH):
        batch = ordered[start : start + GENERAL_BATCH]
        outcome = inbound.accept(batch)
        done.answers += [a for a in outcome.answers if a.to_broker_instance == source_instance]
        answered = {(a.conversation_id, a.seq) for a in outcome.answers}
        for j, p in enumerate(batch):
            if (p.conversation_id, p.seq) in answered:
                continue
            _kind, why = outcome.notes.get(j, ("held", "sent; waiting for an acknowledgment"))
            done.waiting[handles[(p.conversation_id, p.from_initiator)]] = why


# ---------------------------------------------------------------------------------------------
# At the source
# ---------------------------------------------------------------------------------------------


def acknowledge(source: Broker, done: Committed, *, classified: dict[uuid.UUID, str]) -> int:
    """Apply a far broker's :func:`commit` at the source, in one transaction: messages below
    each acknowledged sequence number leave the transmission queue, the conversation is bound
    to the far broker instance (and, classified, to the service the classifier named), and the
    general path's answers are applied as the Python delivery path applies them
    (:func:`transport.apply_answers`). Returns how many transmission-queue rows left."""
    t, e = s.transmission_queue, s.conversation_endpoint
    removed = 0
    with source.engine.begin() as conn:
        me = source.instance_id_on(conn)
        if done.acks:
            _scratch_table(conn, _acks)
            bulk.insert_rows(
                conn, _acks, [{"handle": a.source_handle, "upto": a.upto} for a in done.acks]
            )
            a = _acks
            removed += int(
                conn.execute(
                    delete(t).where(
                        exists().where(
                            a.c.handle == t.c.conversation_handle,
                            t.c.message_sequence_number < a.c.upto,
                        )
                    )
                ).rowcount
                or 0
            )
            conn.execute(text(f"DROP TABLE {_acks.name}"))
            bulk.update_rows(
                conn,
                e,
                "conversation_handle",
                [
                    {"conversation_handle": a.source_handle, "far_broker_instance": a.far_instance}
                    for a in done.acks
                ],
                only_if_null=("far_broker_instance",),
            )
        renamed = [
            {"conversation_handle": h, "far_service": service} for h, service in classified.items()
        ]
        bulk.update_rows(conn, e, "conversation_handle", renamed)
        if done.answers:
            acks, _notices = apply_answers(source, conn, me, done.answers)
            removed += acks
    return removed


def record_waiting(
    source: Broker, reasons: dict[uuid.UUID, str], *, retry_in: timedelta, now: datetime
) -> None:
    """Conversations whose messages stay in the transmission queue: say why, count the attempt,
    and try again after ``retry_in`` (as the Python delivery pass records what it could not
    send)."""
    if not reasons:
        return
    t = s.transmission_queue
    stmt = (
        update(t)
        .where(t.c.conversation_handle == bindparam("h"))
        .values(
            transmission_status=bindparam("why"),
            attempts=t.c.attempts + 1,
            next_attempt_at=bindparam("at", t.c.next_attempt_at.type),
        )
    )
    rows = [{"h": h, "why": why, "at": now + retry_in} for h, why in reasons.items()]
    with source.engine.begin() as conn:
        for start in range(0, len(rows), 5000):
            conn.execute(stmt, rows[start : start + 5000])
    source.note_due(now + retry_in)


__all__ = ["Ack", "Committed", "acknowledge", "commit", "instance_of", "prepare", "record_waiting"]
