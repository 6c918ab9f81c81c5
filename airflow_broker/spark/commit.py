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

The fast path's SQL is in :mod:`~airflow_broker.spark.fast_path`; the staged conversations and the
results in :mod:`~airflow_broker.spark.staged`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Table,
    Uuid,
    bindparam,
    delete,
    exists,
    func,
    select,
    text,
    update,
)

from airflow_broker.messaging.lookups import hosted_services
from airflow_broker.spark.fast_path import _fast, _scratch, _scratch_table, _time
from airflow_broker.spark.staged import Ack, Committed, _conversations, _same_conversation
from airflow_broker.storage import bulk
from airflow_broker.storage import schema as s
from airflow_broker.transport import MESSAGE, Inbound, Packet, apply_answers

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")


#: Packets per transaction on the general path (as :attr:`transport.Transport.BATCH`).
GENERAL_BATCH = 500


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


def instance_of(broker: BrokerContext) -> str:
    with broker.engine.connect() as conn:
        return broker.instance_id_on(conn)


def prepare(target: BrokerContext, source_instance: str, run_id: str) -> int:
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


def commit(
    target: BrokerContext,
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


def _general(
    target: BrokerContext,
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


def acknowledge(source: BrokerContext, done: Committed, *, classified: dict[uuid.UUID, str]) -> int:
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
    source: BrokerContext, reasons: dict[uuid.UUID, str], *, retry_in: timedelta, now: datetime
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
