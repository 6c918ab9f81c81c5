"""Failure handling per conversation: receive counts, backoff and dead-lettering.

A *failed attempt* is a hand-out of messages that did not remove them: the receiving transaction
rolled back, its reader died holding them, or a lease expired or was released. Each one:

1. counts toward the messages' ``receive_count`` (a lease counted its hand-out when it was
   taken; a RECEIVE's hand-out is counted here, since its own transaction is gone);
2. with the queue's ``max_receives`` set, dead-letters every conversation one of whose messages
   reached it: the conversation is ended WITH ERROR ``DEAD_LETTERED`` (the far side receives the
   Error), and its unprocessed messages move, in order, to the queue's ``dead_letter_queue``.
   Other conversations of the queue are untouched and the queue stays enabled. With
   ``max_receives`` unset, the queue keeps Service Broker's rule (five rolled-back receives in a
   row disable it; :func:`~airflow_broker.messaging.events.record_rollbacks`);
3. with ``retry_delay`` set, holds the conversation group for ``retry_delay * 2 ** (n - 1)``
   seconds, at most ``retry_delay_max``, where n is the highest receive count of the attempt:
   RECEIVE skips a held group, and new messages in it wait with the others, so order holds.

A dead-lettered conversation's endpoint moves, closed, into the dead-letter queue with its
messages, so that no message exists without its endpoint; the purge of closed endpoints leaves
it until the dead letters are received.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import insert, select, text, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from airflow_broker import metrics
from airflow_broker.constants import DEAD_LETTERED, STATUS_NOT_COMPLETE, STATUS_READY
from airflow_broker.errors import ConversationEnded, InvalidDefinition
from airflow_broker.messaging.ending import Ending
from airflow_broker.messaging.events import record_event, record_rollbacks
from airflow_broker.messaging.objects import DeadLetter
from airflow_broker.storage import schema as s
from airflow_broker.storage.adapters import FailedHold
from airflow_broker.storage.clock import utcnow

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")

#: The queue options of failure handling, in the order create_queue takes them.
OPTIONS = ("retry_delay", "retry_delay_max", "max_receives", "dead_letter_queue")


def check_options(queue: str, values: dict[str, Any]) -> dict[str, Any]:
    """Validate the failure-handling options given for ``queue`` (None clears one); returns them
    ready to store. Whether ``dead_letter_queue`` exists is checked by the caller."""
    out: dict[str, Any] = {}
    for name in ("retry_delay", "retry_delay_max"):
        if name in values:
            v = values[name]
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0
            ):
                raise InvalidDefinition(
                    f"queue {queue!r}: {name} must be a number of seconds >= 0, not {v!r}"
                )
            out[name] = None if v is None else float(v)
    if "max_receives" in values:
        v = values["max_receives"]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise InvalidDefinition(
                f"queue {queue!r}: max_receives must be a whole number >= 1, not {v!r}"
            )
        out["max_receives"] = v
    if "dead_letter_queue" in values:
        v = values["dead_letter_queue"]
        if v is not None and (not isinstance(v, str) or not v):
            raise InvalidDefinition(
                f"queue {queue!r}: dead_letter_queue must be the name of a queue, not {v!r}"
            )
        if v == queue:
            raise InvalidDefinition(f"queue {queue!r} cannot be its own dead_letter_queue")
        out["dead_letter_queue"] = v
    return out


def check_combination(queue: str, row: dict[str, Any]) -> None:
    """The options as they will stand together (after an ALTER)."""
    if (row.get("max_receives") is None) != (row.get("dead_letter_queue") is None):
        raise InvalidDefinition(
            f"queue {queue!r}: max_receives and dead_letter_queue go together: a message that "
            "reaches max_receives needs a queue to go to (give both, or neither)"
        )
    delay, top = row.get("retry_delay"), row.get("retry_delay_max")
    if top is not None and delay is None:
        raise InvalidDefinition(f"queue {queue!r}: retry_delay_max needs retry_delay")
    if top is not None and delay is not None and top < delay:
        raise InvalidDefinition(
            f"queue {queue!r}: retry_delay_max ({top}) is less than retry_delay ({delay})"
        )


#: How long counting a dead reader's attempt waits for a lock before it leaves the count to the
#: next due-work pass (count_dead_attempts).
COUNT_LOCK_TIMEOUT = "2s"
#: PostgreSQL's SQLSTATE for a lock not granted within lock_timeout.
LOCK_NOT_AVAILABLE = "55P03"


def count_dead_attempts(broker: BrokerContext, queue_id: int) -> bool:
    """Count, in a transaction of its own, the attempts of ``queue_id``'s readers that ended
    without committing and that nobody has counted yet (RECEIVE does this before it hands out
    messages, when its lease row found such a reader). Returns False when a lock stayed held
    past :data:`COUNT_LOCK_TIMEOUT` (the caller's own transaction can hold one: then the
    due-work pass counts the attempt instead), True otherwise."""
    try:
        with broker.engine.begin() as conn:
            conn.execute(text(f"SET LOCAL lock_timeout = '{COUNT_LOCK_TIMEOUT}'"))
            holds = broker.adapter.reap_dead_leases(conn, queue_id)
            if holds:
                record_failed_attempts(broker, conn, holds, utcnow())
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
            raise
        log.warning(
            "queue id %d: a dead reader's attempt waits for the next due-work pass to be "
            "counted (a lock stayed held for %s: %s)",
            queue_id,
            COUNT_LOCK_TIMEOUT,
            exc.orig,
        )
        return False
    return True


def backoff_seconds(q: Any, attempts: int) -> float | None:
    """How long a group waits after its ``attempts``-th failed attempt (None: not at all)."""
    if not q.retry_delay:
        return None
    delay = float(q.retry_delay) * 2 ** max(0, attempts - 1)
    if q.retry_delay_max is not None:
        delay = min(delay, float(q.retry_delay_max))
    return delay


def record_failed_attempts(
    broker: BrokerContext,
    conn: Connection,
    holds: Iterable[FailedHold],
    now: datetime,
    *,
    counted: bool = False,
    delay: float | None = None,
) -> tuple[int, int]:
    """Account for failed attempts (see the module's docstring) inside ``conn``'s transaction.

    :param counted: the messages' receive_count already counts these hand-outs (leases).
    :param delay: hold the groups this long instead of the queue's backoff (a release).
    Returns (queues' rollbacks counted, queues disabled) of Service Broker's rule.
    """
    by_queue: dict[int, list[int]] = defaultdict(list)
    for hold in holds:
        by_queue[hold.queue_id].extend(hold.held)
    counted_rb = disabled = 0
    for queue_id, held in sorted(by_queue.items()):
        q = conn.execute(select(s.queue).where(s.queue.c.queue_id == queue_id)).first()
        if q is None:
            continue
        rows = _count(conn, broker.dialect, queue_id, held, counted=counted)
        if q.max_receives is None:
            c, d = record_rollbacks(conn, [queue_id])
            counted_rb, disabled = counted_rb + c, disabled + d
        poisoned = {
            r.conversation_handle: r.receive_count
            for r in rows
            if q.max_receives is not None and r.receive_count >= q.max_receives
        }
        for handle, count in sorted(poisoned.items(), key=lambda kv: str(kv[0])):
            dead_letter(broker, conn, q, handle, count, now)
        rest = [r for r in rows if r.conversation_handle not in poisoned]
        _hold_groups(conn, broker.dialect, q, rest, now, delay)
    return counted_rb, disabled


def _count(
    conn: Connection, dialect: str, queue_id: int, held: list[int], *, counted: bool
) -> list[Any]:
    """The failed attempt's messages still in the queue, with their receive counts.

    On PostgreSQL their conversation groups are locked first (rule 0 of
    :mod:`airflow_broker.messaging`: a group before its messages). A reader that holds one took
    it after this attempt failed, and gives it back without handing anything out once its
    lease row finds this attempt uncounted (``Receiving._hold``): so a group held by another
    transaction is tried again for up to :data:`GROUP_WAIT_SECONDS` (without blocking on it:
    that transaction may be this process's own, waiting for this one). Holding the groups,
    the accounting is done before anyone can take them again, dead-lettering and the backoff
    hold included. Messages of a group still held after that are left to that reader's own
    attempt, which decides."""
    m = s.message
    cols = (m.c.queuing_order, m.c.conversation_handle, m.c.conversation_group_id)
    if not held:
        return []
    where: tuple[Any, ...] = (m.c.queue_id == queue_id, m.c.queuing_order.in_(sorted(set(held))))
    if dialect == "postgresql":
        locked = _lock_groups(conn, select(m.c.conversation_group_id).where(*where).distinct())
        where = (*where, m.c.conversation_group_id.in_(sorted(locked)))
        # Never waiting for a message either (whoever could hold one holds its group too).
        free = select(m.c.queuing_order).where(*where).with_for_update(skip_locked=True)
        where = (m.c.queuing_order.in_(free.scalar_subquery()),)
    if counted:
        return list(conn.execute(select(*cols, m.c.receive_count).where(*where)).all())
    return list(
        conn.execute(
            update(m)
            .where(*where)
            .values(receive_count=m.c.receive_count + 1)
            .returning(*cols, m.c.receive_count)
        ).all()
    )


#: How long failure accounting tries again for a conversation group another transaction holds.
GROUP_WAIT_SECONDS = 2.0


def _lock_groups(conn: Connection, groups: Any) -> set[uuid.UUID]:
    """Lock the conversation groups ``groups`` (a SELECT of their ids) FOR NO KEY UPDATE, each
    tried again every few milliseconds while another transaction holds it, for up to
    :data:`GROUP_WAIT_SECONDS`; returns those locked."""
    g = s.conversation_group
    wanted = set(conn.execute(groups).scalars())
    locked: set[uuid.UUID] = set()
    deadline = time.monotonic() + GROUP_WAIT_SECONDS
    while True:
        rest = sorted(wanted - locked)
        if not rest:
            return locked
        locked.update(
            conn.execute(
                select(g.c.conversation_group_id)
                .where(g.c.conversation_group_id.in_(rest))
                .order_by(g.c.conversation_group_id)
                .with_for_update(key_share=True, skip_locked=True)
            ).scalars()
        )
        if locked >= wanted or time.monotonic() >= deadline:
            return locked
        time.sleep(0.005)


def _hold_groups(
    conn: Connection, dialect: str, q: Any, rows: list[Any], now: datetime, delay: float | None
) -> None:
    worst: dict[uuid.UUID, int] = {}
    for r in rows:
        worst[r.conversation_group_id] = max(worst.get(r.conversation_group_id, 0), r.receive_count)
    g = s.conversation_group
    for group, attempts in sorted(worst.items(), key=lambda kv: str(kv[0])):
        seconds = delay if delay is not None else backoff_seconds(q, attempts)
        if not seconds:
            continue
        target: Any = g.c.conversation_group_id == group
        if dialect == "postgresql":  # a group another reader holds now is not waited for
            free = select(g.c.conversation_group_id).where(target)
            target = g.c.conversation_group_id.in_(
                free.with_for_update(key_share=True, skip_locked=True).scalar_subquery()
            )
        conn.execute(
            update(g)
            .where(target, g.c.lease_token.is_(None))
            .values(held_until=now + timedelta(seconds=seconds))
        )
        log.info(
            "queue %r: conversation group %s waits %.1f s before its next attempt (attempt %d "
            "failed)",
            q.name,
            group,
            seconds,
            attempts,
        )


def _try_lock_group(conn: Connection, handle: uuid.UUID) -> bool:
    e, g = s.conversation_endpoint, s.conversation_group
    group = select(e.c.conversation_group_id).where(e.c.conversation_handle == handle)
    locked = conn.execute(
        select(g.c.conversation_group_id)
        .where(g.c.conversation_group_id == group.scalar_subquery())
        .with_for_update(key_share=True, skip_locked=True)
    ).first()
    return locked is not None


def dead_letter(
    broker: BrokerContext, conn: Connection, q: Any, handle: uuid.UUID, count: int, now: datetime
) -> int:
    """End ``handle`` WITH ERROR DEAD_LETTERED and move its unprocessed messages, in order, to
    ``q``'s dead-letter queue, inside ``conn``'s transaction. Returns how many moved."""
    m, e, g = s.message, s.conversation_endpoint, s.conversation_group
    dlq = conn.execute(
        select(s.queue.c.queue_id, s.queue.c.name).where(s.queue.c.name == q.dead_letter_queue)
    ).first()
    if dlq is None:
        log.error(
            "queue %r: cannot dead-letter conversation %s, its dead_letter_queue %r does not exist",
            q.name,
            handle,
            q.dead_letter_queue,
        )
        return 0
    reason = (
        f"a message of conversation {handle} was handed out {count} times on queue {q.name!r} "
        f"without being processed (max_receives {q.max_receives})"
    )
    ending = Ending(broker, within=conn)
    if broker.dialect == "postgresql" and not _try_lock_group(conn, handle):
        # Another reader took the group since this attempt failed: its attempt decides (it
        # sees the count, and dead-letters if it fails too). Never wait for its handler.
        log.info("queue %r: conversation %s is being received again", q.name, handle)
        return 0
    messages = conn.execute(
        select(m)
        .where(
            m.c.conversation_handle == handle,
            m.c.queue_id == q.queue_id,
            m.c.status.in_((STATUS_READY, STATUS_NOT_COMPLETE)),
        )
        .order_by(m.c.message_sequence_number, m.c.queuing_order)
    ).all()
    try:
        ending.end_conversation(
            handle, error_code=DEAD_LETTERED, error_description=f"dead-lettered: {reason}"
        )
    except ConversationEnded:
        # Ended on this side already (its END waits for the far side's): nothing to tell.
        conn.execute(m.delete().where(m.c.conversation_handle == handle))
    group = uuid.uuid4()
    conn.execute(insert(g).values(conversation_group_id=group, queue_id=dlq.queue_id))
    conn.execute(
        update(e)
        .where(e.c.conversation_handle == handle)
        .values(queue_id=dlq.queue_id, conversation_group_id=group)
    )
    if messages:
        conn.execute(
            insert(m),
            [
                {
                    "queue_id": dlq.queue_id,
                    "conversation_group_id": group,
                    "conversation_handle": handle,
                    "message_sequence_number": r.message_sequence_number,
                    "status": STATUS_READY,
                    "priority": r.priority,
                    "precedence": r.precedence,
                    "service_name": r.service_name,
                    "service_contract_name": r.service_contract_name,
                    "message_type_name": r.message_type_name,
                    "validation": r.validation,
                    "message_body": r.message_body,
                    "enqueued_at": now,
                    "receive_count": 0,
                    "dead_letter": DeadLetter(q.name, handle, r.receive_count, reason).to_json(),
                }
                for r in messages
            ],
        )
    detail = f"{reason}: ended WITH ERROR, {len(messages)} message(s) moved to {dlq.name!r}"
    record_event(conn, "dead_lettered", q.name, detail)
    log.warning("queue %r: conversation %s dead-lettered; %s", q.name, handle, detail)
    metrics.incr(metrics.DEAD_LETTERED, 1, {"queue": q.name})
    return len(messages)
