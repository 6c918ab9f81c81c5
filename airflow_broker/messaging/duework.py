"""Due work: conversation timers, lifetimes, readers that died holding messages, waiting local
transmissions and old closed endpoints."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    delete,
    exists,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection

from airflow_broker.constants import (
    DIALOG_TIMER,
    END_DIALOG,
    ERR_LIFETIME_EXPIRED,
    ERROR,
)
from airflow_broker.messaging.delivery import Delivery, backoff
from airflow_broker.messaging.failure import record_failed_attempts
from airflow_broker.messaging.fast_send import endpoint_statement
from airflow_broker.messaging.leases import expire_leases
from airflow_broker.messaging.objects import (
    error_body,
)
from airflow_broker.messaging.rows import drop_waiting, to_endpoint
from airflow_broker.storage import bulk, direct
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow
from airflow_broker.storage.prepared import Prepared
from airflow_broker.storage.receive_leases import LEASE_ENDED, NO_MARKER

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")

#: Closed endpoints are kept this long (duplicate detection, as Service Broker does), then purged.
CLOSED_ENDPOINT_RETENTION = timedelta(minutes=30)
#: How many conversation groups on each side of a random id a purge looks at for being empty,
#: besides those of the endpoints it removed (DueWork.purge_closed).
GROUP_WINDOW = 500


@dataclass(frozen=True, slots=True)
class DueReport:
    """What one pass of :meth:`Broker.run_due` did."""

    timers_fired: int = 0
    lifetimes_expired: int = 0
    rollbacks_counted: int = 0
    queues_disabled: int = 0
    transmissions_delivered: int = 0
    endpoints_purged: int = 0
    leases_expired: int = 0


# ---------------------------------------------------------------------------------------------
# Due work: timers, lifetimes, dead readers, waiting local transmissions
# ---------------------------------------------------------------------------------------------

#: PostgreSQL: whether a pass would find anything to do at $1 (old closed endpoints to purge:
#: those closed at $2 or before; NULL: none), and when the next timer, lifetime, retry or lease
#: falls due. Every reader, trigger and transmitter runs the due work about once a second, and
#: nearly always finds nothing: this one statement, in one round trip, replaces the pass's eight
#: then. Each part reads an index (or a table that is empty but for transactions in flight), so
#: it costs the same whatever the number of open conversations. Its conditions are those of
#: the pass's own statements: when it says nothing is due, the pass would have done nothing.
IDLE_PROBE = Prepared(
    f"""
SELECT (SELECT min(timer_due_at) FROM broker_conversation_endpoint
        WHERE timer_due_at IS NOT NULL),
       (SELECT min(lifetime) FROM broker_conversation_endpoint
        WHERE lifetime IS NOT NULL AND state NOT IN ('ER', 'CD')),
       (SELECT min(next_attempt_at) FROM broker_transmission_queue),
       (SELECT min(expires_at) FROM broker_lease),
       EXISTS (SELECT FROM broker_transmission_queue t
               WHERE t.next_attempt_at <= $1
                 AND (t.to_broker_instance IS NULL
                      OR t.to_broker_instance = (SELECT instance_id FROM broker_instance
                                                 WHERE id = 1))
                 AND t.to_service_name IN (SELECT name FROM broker_service))
       OR EXISTS (SELECT FROM broker_conversation_endpoint e
                  WHERE e.state = 'CD' AND e.closed_at <= $2
                    AND NOT EXISTS (SELECT FROM broker_message m
                                    WHERE m.conversation_handle = e.conversation_handle
                                      AND m.dead_letter IS NOT NULL))
       OR EXISTS (SELECT FROM broker_receive_commit)
       OR EXISTS (SELECT FROM broker_receive_lease l WHERE {NO_MARKER} AND {LEASE_ENDED})
""",
    ["timestamptz", "timestamptz"],
    index_scans=True,  # the transmission queue and leases: often empty when planned
)


def idle(broker: BrokerContext, now: datetime, *, purge: bool) -> tuple[bool, datetime | None]:
    """PostgreSQL, the owner: (nothing is due at ``now``, when something next falls due), by
    :data:`IDLE_PROBE` in a transaction of its own. (False, None): look with a pass."""
    if broker.dialect != "postgresql" or broker.client_role is not None:
        return False, None
    before = now - CLOSED_ENDPOINT_RETENTION if purge else None
    fairy = broker.engine.raw_connection()
    try:
        [row] = direct.execute_committed(fairy, broker.engine, IDLE_PROBE, [now, before])
    finally:
        fairy.close()
    found = [aware(c) for c in row[:4] if c is not None]
    next_due = min(found) if found else None  # type: ignore[type-var]
    return not row[4] and (next_due is None or next_due > now), next_due


class DueWork:
    BATCH = 500

    def __init__(self, broker: BrokerContext, conn: Connection) -> None:
        self.b = broker
        self.conn = conn
        self.instance_id = broker.instance_id_on(conn)
        #: the earliest time something falls due after this pass (None: nothing scheduled)
        self.next_due: datetime | None = None

    def _due_handles(self, column: Any, now: datetime, extra: Any = None) -> Any:
        e = s.conversation_endpoint
        inner = select(e.c.conversation_handle).where(column <= now)
        if extra is not None:
            inner = inner.where(extra)
        inner = inner.limit(self.BATCH)
        if self.b.dialect == "postgresql":
            inner = inner.with_for_update(skip_locked=True)
        return e.c.conversation_handle.in_(inner.scalar_subquery())

    def run(self, now: datetime, *, purge: bool = False) -> DueReport:
        timers = self._fire_timers(now)
        expired = self._expire_lifetimes(now)
        counted, disabled = record_failed_attempts(
            self.b, self.conn, self.b.adapter.reap_dead_leases(self.conn), now
        )
        leases = expire_leases(self.b, self.conn, now)
        delivered = self._retry_local_transmissions(now)
        purged = self.purge_closed(now) if purge else 0
        self.next_due = self._next_due()
        return DueReport(timers, expired, counted, disabled, delivered, purged, leases)

    def _next_due(self) -> datetime | None:
        e, t = s.conversation_endpoint, s.transmission_queue
        candidates = self.conn.execute(
            select(
                select(func.min(e.c.timer_due_at))
                .where(e.c.timer_due_at.is_not(None))
                .scalar_subquery(),
                select(func.min(e.c.lifetime))
                .where(e.c.lifetime.is_not(None), e.c.state.notin_(("ER", "CD")))
                .scalar_subquery(),
                select(func.min(t.c.next_attempt_at)).scalar_subquery(),
                select(func.min(s.lease.c.expires_at)).scalar_subquery(),
            )
        ).one()
        found = [aware(c) for c in candidates if c is not None]
        return min(found) if found else None  # type: ignore[type-var]

    def _fire_timers(self, now: datetime) -> int:
        e = s.conversation_endpoint
        rows = self.conn.execute(
            update(e)
            .where(self._due_handles(e.c.timer_due_at, now))
            .values(timer_due_at=None)
            .returning(
                e.c.conversation_handle,
                e.c.conversation_group_id,
                e.c.queue_id,
                e.c.service_name,
                e.c.contract_name,
                e.c.priority,
                e.c.state,
                e.c.receive_sequence,
            )
        ).all()
        fired = 0
        for r in sorted(rows, key=lambda r: r.conversation_handle):  # as _expire_lifetimes
            if r.state == "CD":
                continue
            self.conn.execute(to_endpoint(r, DIALOG_TIMER, 0, None, "E", now))
            fired += 1
        return fired

    def _expire_lifetimes(self, now: datetime) -> int:
        e = s.conversation_endpoint
        rows = self.conn.execute(
            update(e)
            .where(self._due_handles(e.c.lifetime, now, e.c.state.notin_(("ER", "CD"))))
            .values(state="ER", timer_due_at=None)
            .returning(
                e.c.conversation_handle,
                e.c.conversation_group_id,
                e.c.queue_id,
                e.c.service_name,
                e.c.contract_name,
                e.c.priority,
                e.c.receive_sequence,
            )
        ).all()
        # In handle order: the Errors of conversations that expire together are queued in an
        # order that does not depend on where their rows lie (RETURNING's order).
        for r in sorted(rows, key=lambda r: r.conversation_handle):
            self.conn.execute(drop_waiting(r.conversation_handle))
            self.conn.execute(
                to_endpoint(
                    r,
                    ERROR,
                    r.receive_sequence,
                    error_body(ERR_LIFETIME_EXPIRED, "The conversation's lifetime has expired"),
                    "X",
                    now,
                )
            )
            log.info("conversation %s expired (lifetime reached)", r.conversation_handle)
        return len(rows)

    def _retry_local_transmissions(self, now: datetime) -> int:
        """Messages that waited for a local queue (disabled, or a service not yet created)."""
        t = s.transmission_queue
        stmt = (
            select(t.c.conversation_handle)
            .where(t.c.next_attempt_at <= now)
            .where(
                or_(t.c.to_broker_instance.is_(None), t.c.to_broker_instance == self.instance_id)
            )
            .where(t.c.to_service_name.in_(select(s.service.c.name)))
            .group_by(t.c.conversation_handle)
            # the conversation waiting longest first (a retried row keeps its enqueued_at)
            .order_by(func.min(t.c.enqueued_at), func.min(t.c.id))
            .limit(self.BATCH)
        )
        handles = self.conn.execute(stmt).scalars().all()
        delivered = 0
        for handle in handles:
            delivered += self.flush_conversation(handle, now)
        return delivered

    def flush_conversation(self, handle: uuid.UUID, now: datetime) -> int:
        """Deliver what waits in the transmission queue for ``handle``'s local far side, in
        sequence order, up to the first message that still cannot go; returns how many went.

        PostgreSQL: only the run of rows this transaction can lock from the dialog's first one:
        a row another pass holds ends it (that pass, or a later one, delivers it and what
        follows). Two passes that split a dialog's rows between them (their batches lock rows
        SKIP LOCKED) used to wait for each other's rows here, and deadlocked.
        """
        t = s.transmission_queue
        by_seq = select(t).where(t.c.conversation_handle == handle)
        pending = self.conn.execute(by_seq.order_by(t.c.message_sequence_number)).all()
        held: set[int] | None = None
        if self.b.dialect == "postgresql" and pending:
            held = set(
                self.conn.execute(
                    select(t.c.id)
                    .where(t.c.conversation_handle == handle)
                    .with_for_update(skip_locked=True)
                ).scalars()
            )
        delivery = Delivery(self.b, self.conn)
        delivered = 0
        for msg in pending:
            if held is not None and msg.id not in held:
                break
            sender = self.conn.execute(
                endpoint_statement(self.b.dialect), {"handles": [handle]}
            ).first()
            if sender is None or (
                sender.state in ("ER", "CD") and msg.message_type_name not in (END_DIALOG, ERROR)
            ):
                # A closed side's own END (EndDialog, or Error WITH ERROR) still goes out.
                break
            # Take the message out first; routing it again re-queues it if it still cannot go.
            # Another process's pass may have taken it meanwhile (the DELETE waited for its
            # commit and found nothing): then it is delivered already, and so are the rest.
            if self.conn.execute(delete(t).where(t.c.id == msg.id)).rowcount != 1:
                break
            sender_now = {**sender._mapping, "has_pending": False}
            went = delivery.route(
                RowView(sender_now),
                msg.message_type_name,
                msg.message_sequence_number,
                msg.message_body,
                msg.validation,
                now,
            )
            if not went:
                # Still cannot go: keep the original order, back off, and stop for this dialog.
                # The whole dialog backs off: a later row still due would bring the dialog back
                # at every pass (every waiting RECEIVE's, once a second) and retry it at once.
                retry_at = now + backoff(msg.attempts + 2)
                self.conn.execute(
                    update(t)
                    .where(
                        t.c.conversation_handle == handle,
                        t.c.message_sequence_number == msg.message_sequence_number,
                    )
                    .values(
                        attempts=msg.attempts + 1,
                        enqueued_at=msg.enqueued_at,
                        next_attempt_at=retry_at,
                    )
                )
                self.conn.execute(
                    update(t)
                    .where(t.c.conversation_handle == handle, t.c.next_attempt_at < retry_at)
                    .values(next_attempt_at=retry_at)
                )
                # The re-queued row has a new id; later rows keep theirs, and sequence numbers
                # (not ids) give the order.
                break
            delivered += 1
        return delivered

    def purge_closed(self, now: datetime, retention: timedelta = CLOSED_ENDPOINT_RETENTION) -> int:
        """Remove up to :attr:`BATCH` endpoints closed (CD) more than ``retention`` ago, their
        messages, and conversation groups left empty; returns how many endpoints went."""
        e = s.conversation_endpoint
        m = s.message
        old = (
            select(e.c.conversation_handle)
            .where(e.c.state == "CD", e.c.closed_at <= now - retention)
            # A dead-lettered conversation stays while its dead letters wait to be received.
            .where(
                ~exists().where(
                    m.c.conversation_handle == e.c.conversation_handle,
                    m.c.dead_letter.is_not(None),
                )
            )
            .limit(self.BATCH)
        )
        if self.b.dialect == "postgresql":
            # The lock order: an endpoint is removed only under its FOR UPDATE lock (a writer
            # into its queue holds KEY SHARE: skip it, the next pass purges it).
            old = old.with_for_update(skip_locked=True)
        handles = self.conn.execute(old).scalars().all()
        if not handles:
            return 0
        self.conn.execute(delete(m).where(m.c.conversation_handle.in_(handles)))
        left = self.conn.execute(
            delete(e)
            .where(e.c.conversation_handle.in_(handles))
            .returning(e.c.conversation_group_id)
        ).scalars()
        groups = set(left)
        g = s.conversation_group
        empty = ~exists().where(e.c.conversation_group_id == g.c.conversation_group_id)
        if self.b.dialect == "postgresql":
            # The groups the purged endpoints were in, and a window of the others (groups a
            # MOVE CONVERSATION or an END WITH CLEANUP left empty): a look at every group was a
            # scan of them all, seconds with 10^6 open conversations. A window starts at a
            # random id and wraps around, so every group comes into one in time (all of them
            # at once while there are fewer than GROUP_WINDOW).
            start = uuid.uuid4()
            for side in (g.c.conversation_group_id >= start, g.c.conversation_group_id < start):
                groups.update(
                    self.conn.execute(
                        select(g.c.conversation_group_id)
                        .where(side)
                        .order_by(g.c.conversation_group_id)
                        .limit(GROUP_WINDOW)
                    ).scalars()
                )
            # A group goes only under its own lock, and only if still empty under it: a
            # transaction putting a new endpoint into an existing group holds it FOR KEY SHARE
            # until it commits (skipped: a later pass sees it again), and one that committed
            # since this statement's snapshot is seen by the DELETE's, taken after the lock. No
            # foreign key guards the endpoints' groups on PostgreSQL (migration 0021).
            candidates = bulk.any_of(g.c.conversation_group_id, sorted(groups), "postgresql")
            ids = (
                self.conn.execute(
                    select(g.c.conversation_group_id)
                    .where(candidates, empty)
                    .with_for_update(skip_locked=True)
                )
                .scalars()
                .all()
            )
            if ids:
                self.conn.execute(
                    delete(g).where(
                        bulk.any_of(g.c.conversation_group_id, ids, "postgresql"), empty
                    )
                )
        else:
            self.conn.execute(delete(g).where(empty))
        return len(handles)


class RowView:
    """Attribute access over a mapping (a sender row with some columns replaced)."""

    def __init__(self, mapping: Any) -> None:
        self.__dict__.update(mapping)


def run_due(broker: BrokerContext, *, purge: bool = True) -> DueReport:
    """Fire due conversation timers, expire lifetimes, count the rollbacks of readers that died
    holding messages, retry waiting local transmissions and purge old closed endpoints, in one
    transaction; tell ``broker``'s due clock when something next falls due. On PostgreSQL one
    statement first looks whether anything is due (:data:`IDLE_PROBE`): nearly always nothing.
    ``purge``: False leaves old closed endpoints alone."""
    now = utcnow()
    nothing, next_due = idle(broker, now, purge=purge)
    if nothing:
        if next_due is not None:
            broker.note_due(next_due)
        return DueReport()
    with broker.engine.begin() as conn:
        work = DueWork(broker, conn)
        report = work.run(now, purge=purge)
    if work.next_due is not None:
        broker.note_due(work.next_due)
    return report
