"""Leases: messages handed out without an open transaction, for handlers that run for minutes.

``Broker.lease`` takes a conversation group's messages as RECEIVE would, but instead of removing
them it marks them with a token, holds the group (``broker_conversation_group.lease_token``) and
commits at once. Until the lease ends nothing else takes the group: RECEIVE and other leases skip
it, and messages that arrive in it meanwhile wait behind the leased ones, so order holds. The
lease ends by

- ``tx.complete(token)`` inside a later broker transaction: the leased messages go when that
  transaction commits, together with whatever it SENDs and writes (exactly once);
- ``Broker.release(token, delay=0)``: they are ready again (after ``delay`` seconds), a failed
  attempt;
- expiry: the due-work pass returns them, a failed attempt (see
  :mod:`~airflow_broker.messaging.failure`: receive counts, backoff, dead-lettering).

``Broker.extend(token, seconds)`` pushes the expiry out. A lease whose expiry the due-work pass
has processed is gone: ``complete``, ``release`` and ``extend`` then raise :class:`LeaseExpired`
(the messages may since have gone to another reader). A lease past its expiry that no pass has
processed yet is still held (nobody else can have the group) and completes normally.

Lock order (PostgreSQL): a lease's row, then its group, as everywhere else (rule 0 of
:mod:`airflow_broker.messaging`) the group before anything of its conversations.
"""

from __future__ import annotations

import logging
import math
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Connection

from airflow_broker.errors import InvalidDefinition, LeaseExpired
from airflow_broker.messaging.arguments import Handle, as_uuid
from airflow_broker.messaging.failure import record_failed_attempts
from airflow_broker.messaging.objects import Message, messages_from_rows
from airflow_broker.security import permissions
from airflow_broker.storage import queries
from airflow_broker.storage import schema as s
from airflow_broker.storage.adapters import FailedHold
from airflow_broker.storage.clock import aware, utcnow

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")


@dataclass(frozen=True, slots=True)
class Lease:
    """Messages of one conversation group, held for a handler until :attr:`expires_at`."""

    #: what ``tx.complete``, ``Broker.release`` and ``Broker.extend`` take
    token: uuid.UUID
    #: the queue they came from
    queue: str
    #: the leased messages, in the order RECEIVE would return them
    messages: list[Message]
    conversation_group_id: uuid.UUID
    expires_at: datetime


def _seconds(value: Any, what: str, *, positive: bool) -> float:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        bound = "> 0" if positive else ">= 0"
        raise InvalidDefinition(f"{what} must be a number of seconds {bound}, not {value!r}")
    return float(value)


def take_lease(
    tx: Any,
    queue: str,
    *,
    lease_seconds: float,
    top: int | None = None,
    wait_seconds: float = 0,
    conversation_group_id: Handle | None = None,
) -> Lease | None:
    """Inside ``tx`` (a :class:`~airflow_broker.messaging.transaction.Transaction` its caller
    commits at once): lease the next free group's messages; None when there are none."""
    seconds = _seconds(lease_seconds, "lease_seconds", positive=True)
    token = uuid.uuid4()

    def hand_out(q: Any, rows: list[Any], look: bool) -> list[Any] | None:
        # As RECEIVE does (Receiving._hold): a reader of the queue that ended without
        # committing is counted before its messages can be handed out again.
        if rows and look and tx.broker.adapter.dead_lease_on(q.queue_id):
            return None
        return rows

    q, rows = tx._claim_handing_out(
        queue, top, None, conversation_group_id, wait_seconds, hand_out, lease_token=token
    )
    if not rows:
        return None
    group = rows[0][1]  # conversation_group_id (MESSAGE_COLUMNS)
    now = utcnow()
    expires = now + timedelta(seconds=seconds)
    conn = tx.connection
    g = s.conversation_group
    conn.execute(
        update(g)
        .where(g.c.conversation_group_id == group)
        .values(lease_token=token, held_until=expires)
    )
    conn.execute(
        insert(s.lease).values(
            token=token,
            queue_id=q.queue_id,
            conversation_group_id=group,
            leased_at=now,
            expires_at=expires,
        )
    )
    log.info(
        "queue %r: leased %d message(s) of group %s until %s (lease %s)",
        q.name,
        len(rows),
        group,
        expires.isoformat(),
        token,
    )
    ordered = queries.claim_is_ordered(tx.broker.dialect)
    return Lease(
        token, q.name, messages_from_rows(rows, counted=True, ordered=ordered), group, expires
    )


def _locked_lease(broker: BrokerContext, conn: Connection, token: Handle, verb: str) -> Any:
    """The lease's row, locked (then its group, the lock order); LeaseExpired when gone."""
    t = as_uuid(token, "lease token")
    stmt = select(s.lease).where(s.lease.c.token == t)
    if broker.dialect == "postgresql":
        stmt = stmt.with_for_update()
    row = conn.execute(stmt).first()
    if row is None:
        if broker.client_role is not None:  # a lease of a queue the role may not RECEIVE from
            permissions.refuse_lease(conn, broker.client_role, t)
        raise LeaseExpired(
            f"cannot {verb} lease {t}: it is no longer held. It expired (or was released or "
            "completed) and its messages went back to their queue, where another reader may "
            "have taken them; nothing was changed"
        )
    if broker.dialect == "postgresql":
        g = s.conversation_group
        conn.execute(
            select(g.c.conversation_group_id)
            .where(g.c.conversation_group_id == row.conversation_group_id)
            .with_for_update(key_share=True)
        )
    return row


def _unhold(conn: Connection, row: Any) -> list[int]:
    """End the lease ``row``: its messages and group are free again; returns the messages."""
    m = s.message
    held = (
        conn.execute(
            update(m)
            .where(m.c.lease_token == row.token)
            .values(lease_token=None)
            .returning(m.c.queuing_order)
        )
        .scalars()
        .all()
    )
    _free(conn, row)
    return list(held)


def _free(conn: Connection, row: Any) -> None:
    """The lease ``row``'s group is no longer held, and the lease is gone."""
    g = s.conversation_group
    conn.execute(
        update(g)
        .where(g.c.conversation_group_id == row.conversation_group_id, g.c.lease_token == row.token)
        .values(lease_token=None, held_until=None)
    )
    conn.execute(delete(s.lease).where(s.lease.c.token == row.token))


def complete(broker: BrokerContext, conn: Connection, token: Handle) -> tuple[str, int]:
    """Inside the caller's transaction: remove the lease's messages (kept as received on a
    queue with retention) and free its group; returns the queue and how many messages went."""
    row = _locked_lease(broker, conn, token, "complete")
    m, qt = s.message, s.queue
    q = conn.execute(select(qt.c.retention, qt.c.name).where(qt.c.queue_id == row.queue_id)).one()
    taken = m.c.lease_token == row.token
    if q.retention:
        done = conn.execute(update(m).where(taken).values(status=0, lease_token=None)).rowcount
    else:
        done = conn.execute(delete(m).where(taken)).rowcount
    _free(conn, row)
    # A completed lease breaks the queue's run of failed attempts, as a committed RECEIVE does.
    conn.execute(
        update(qt)
        .where(qt.c.queue_id == row.queue_id, qt.c.rollback_count > 0)
        .values(rollback_count=0)
    )
    return q.name, done or 0


def release(broker: BrokerContext, token: Handle, delay: float = 0) -> None:
    """Give the lease's messages back: ready again after ``delay`` seconds (a failed attempt,
    which counts toward ``max_receives`` and the queue's poison handling)."""
    seconds = _seconds(delay, "delay", positive=False)
    with broker.engine.begin() as conn:
        row = _locked_lease(broker, conn, token, "release")
        held = _unhold(conn, row)
        record_failed_attempts(
            broker,
            conn,
            [FailedHold(row.queue_id, tuple(held))],
            utcnow(),
            counted=True,
            delay=seconds,
        )
    log.info(
        "lease %s released: %d message(s) ready again in %.1f s", row.token, len(held), seconds
    )


def extend(broker: BrokerContext, token: Handle, seconds: float) -> datetime:
    """Hold the lease until ``seconds`` from now; returns the new expiry."""
    span = _seconds(seconds, "seconds", positive=True)
    with broker.engine.begin() as conn:
        row = _locked_lease(broker, conn, token, "extend")
        expires = utcnow() + timedelta(seconds=span)
        conn.execute(update(s.lease).where(s.lease.c.token == row.token).values(expires_at=expires))
        g = s.conversation_group
        conn.execute(
            update(g)
            .where(
                g.c.conversation_group_id == row.conversation_group_id,
                g.c.lease_token == row.token,
            )
            .values(held_until=expires)
        )
    return expires


def expire_leases(broker: BrokerContext, conn: Connection, now: datetime, limit: int = 100) -> int:
    """Due work: return the messages of leases past their expiry, each a failed attempt.
    Leases another transaction is completing (or whose group it holds) wait for the next pass."""
    stmt = select(s.lease).where(s.lease.c.expires_at <= now).order_by(s.lease.c.expires_at)
    stmt = stmt.limit(limit)
    if broker.dialect == "postgresql":
        stmt = stmt.with_for_update(skip_locked=True)
    rows = conn.execute(stmt).all()
    g = s.conversation_group
    expired = 0
    for row in rows:
        if broker.dialect == "postgresql":
            free = conn.execute(
                select(g.c.conversation_group_id)
                .where(g.c.conversation_group_id == row.conversation_group_id)
                .with_for_update(key_share=True, skip_locked=True)
            ).first()
            if free is None:
                continue
        held = _unhold(conn, row)
        record_failed_attempts(
            broker, conn, [FailedHold(row.queue_id, tuple(held))], now, counted=True
        )
        expired += 1
        log.warning(
            "lease %s expired at %s: %d message(s) of group %s are ready again (a failed attempt)",
            row.token,
            aware(row.expires_at),
            len(held),
            row.conversation_group_id,
        )
    return expired
