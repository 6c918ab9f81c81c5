"""Whether a waiting message could be taken now: *ready*, *held* or *leased*.

A message with status 1 (:data:`~airflow_broker.constants.STATUS_READY`) waits in its queue,
but RECEIVE (and a lease) takes it only when nothing holds its conversation group outside a
transaction (the claim's ``_FREE`` / ``_FREE_M`` in :mod:`~airflow_broker.storage.queries`):

- **leased**: a lease holds the group (``broker_conversation_group.lease_token``) or the message
  itself (``broker_message.lease_token``) until it is completed, released or expires
  (:mod:`~airflow_broker.messaging.leases`);
- **held**: the group waits out the backoff after a failed attempt, until its ``held_until``
  (:mod:`~airflow_broker.messaging.failure`);
- **ready**: neither; a reader could take it now.

Depth, the monitoring views, the metrics, ``queue_status()`` and activation count only ready
messages and show held and leased ones apart ("3 ready, 2 held until 12:04, 1 leased"): a queue
whose only messages are held starts no reader, and its depth is 0 until the hold ends.

This module is the one place that says so. :func:`reasons` lists why a message is not
takeable, each with the state it puts the message in (the first that applies wins);
:func:`not_takeable` is their disjunction and :func:`state` their CASE, so a new reason a group
cannot be taken is one more line in :func:`reasons`, and every count follows. A message whose
group row is missing (the outer join finds none) counts as ready, as the claim would take it.

Group holds outside a transaction only: a group locked by an open RECEIVE transaction is still
counted ready (its messages are gone when that transaction commits). Nothing here locks or
waits: on SQLite the reads that use it begin DEFERRED (``BrokerContext.read_connection``) and
read the last committed state while another transaction writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, case, false, func, not_, or_, select
from sqlalchemy.engine import Connection
from sqlalchemy.sql import FromClause

from airflow_broker.constants import STATUS_READY
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow

#: A reader could take the message now.
READY = "ready"
#: Its group waits out a failed attempt's backoff (``held_until`` is in the future).
HELD = "held"
#: A lease holds its group or the message.
LEASED = "leased"

_m, _g = s.message, s.conversation_group


def reasons(
    now: datetime, *, message: Any = _m, group: Any = _g
) -> list[tuple[str, ColumnElement[bool]]]:
    """Why a waiting message cannot be taken at ``now``: (the state it is then in, the
    condition), the first that applies decides the state. ``message`` and ``group`` are
    ``broker_message`` and ``broker_conversation_group`` (or aliases of them), the group joined
    (outer) on ``conversation_group_id``.

    Each condition is true or false, never NULL (a missing group row makes every group column
    NULL): ``NOT not_takeable(...)`` must keep such a message. Add a reason here, and every
    count of this module follows.
    """
    return [
        (LEASED, or_(group.c.lease_token.is_not(None), message.c.lease_token.is_not(None))),
        (HELD, and_(group.c.held_until.is_not(None), group.c.held_until > now)),
    ]


def not_takeable(now: datetime, *, message: Any = _m, group: Any = _g) -> ColumnElement[bool]:
    """True for a waiting message no reader could take at ``now`` (held, leased, ...): the
    disjunction of :func:`reasons`."""
    return or_(false(), *(cond for _state, cond in reasons(now, message=message, group=group)))


def ready_now(now: datetime, *, message: Any = _m, group: Any = _g) -> ColumnElement[bool]:
    """A message a reader could take at ``now``: waiting (status 1) and not
    :func:`not_takeable`."""
    return and_(
        message.c.status == STATUS_READY,
        not_(not_takeable(now, message=message, group=group)),
    )


def state(now: datetime, *, message: Any = _m, group: Any = _g) -> ColumnElement[str]:
    """The state of a waiting message at ``now``: :data:`READY`, :data:`HELD`, :data:`LEASED`
    (or a state a later reason adds)."""
    whens = [(cond, name) for name, cond in reasons(now, message=message, group=group)]
    return case(*whens, else_=READY)


def waiting_from(*, message: Any = _m, group: Any = _g) -> FromClause:
    """Messages with their conversation group (outer join): the FROM of the predicates above."""
    return message.outerjoin(
        group, group.c.conversation_group_id == message.c.conversation_group_id
    )


# -- counts ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tally:
    """The waiting messages of one queue in one state."""

    messages: int = 0
    #: conversation groups they are in
    groups: int = 0
    #: lowest and highest ``queuing_order`` among them (None: no message)
    low_water: int | None = None
    high_water: int | None = None
    #: when the oldest and the newest of them were enqueued
    oldest_enqueued_at: datetime | None = None
    newest_enqueued_at: datetime | None = None
    #: the earliest ``held_until`` of their groups: for held messages, when the first of them
    #: can be taken again; for leased ones, when the first lease expires (None for ready ones)
    until: datetime | None = None


EMPTY = Tally()


@dataclass(frozen=True, slots=True)
class QueueReadiness:
    """A queue's waiting messages (status 1) counted by state."""

    queue_id: int
    states: dict[str, Tally] = field(default_factory=dict)

    def of(self, name: str) -> Tally:
        return self.states.get(name, EMPTY)

    @property
    def ready(self) -> Tally:
        return self.of(READY)

    @property
    def held(self) -> Tally:
        return self.of(HELD)

    @property
    def leased(self) -> Tally:
        return self.of(LEASED)

    @property
    def waiting(self) -> int:
        """Every waiting message, whatever its state."""
        return sum(t.messages for t in self.states.values())

    @property
    def oldest_enqueued_at(self) -> datetime | None:
        """When the oldest waiting message (of any state) was enqueued."""
        times = [t.oldest_enqueued_at for t in self.states.values() if t.oldest_enqueued_at]
        return min(times) if times else None


def tally_statement(now: datetime, queue_ids: Iterable[int] | None = None) -> Select[Any]:
    """One row per (queue, state) with waiting messages: ``queue_id, state, messages, groups,
    low_water, high_water, oldest, newest, until`` (see :class:`Tally`)."""
    m, g = _m, _g
    where: list[ColumnElement[bool]] = [m.c.status == STATUS_READY]
    if queue_ids is not None:
        where.append(m.c.queue_id.in_(sorted(set(queue_ids))))
    # The state is computed once, in a subquery: grouping by the CASE itself would bind ``now``
    # twice, and PostgreSQL would not know the two expressions are the same.
    rows = (
        select(
            m.c.queue_id,
            state(now).label("state"),
            m.c.conversation_group_id,
            m.c.queuing_order,
            m.c.enqueued_at,
            g.c.held_until,
        )
        .select_from(waiting_from())
        .where(*where)
        .subquery()
    )
    return select(
        rows.c.queue_id,
        rows.c.state,
        func.count().label("messages"),
        func.count(func.distinct(rows.c.conversation_group_id)).label("groups"),
        func.min(rows.c.queuing_order).label("low_water"),
        func.max(rows.c.queuing_order).label("high_water"),
        func.min(rows.c.enqueued_at).label("oldest"),
        func.max(rows.c.enqueued_at).label("newest"),
        func.min(rows.c.held_until).label("until"),
    ).group_by(rows.c.queue_id, rows.c.state)


def tally(
    conn: Connection, *, queue_ids: Iterable[int] | None = None, now: datetime | None = None
) -> dict[int, QueueReadiness]:
    """Every queue's (or those of ``queue_ids``) waiting messages by state at ``now`` (default:
    :func:`~airflow_broker.storage.clock.utcnow`). A queue without waiting messages is absent:
    use ``.get(queue_id, QueueReadiness(queue_id))``."""
    at = utcnow() if now is None else now
    out: dict[int, dict[str, Tally]] = {}
    for r in conn.execute(tally_statement(at, queue_ids)):
        out.setdefault(r.queue_id, {})[r.state] = Tally(
            messages=int(r.messages),
            groups=int(r.groups),
            low_water=r.low_water,
            high_water=r.high_water,
            oldest_enqueued_at=timestamp(r.oldest),
            newest_enqueued_at=timestamp(r.newest),
            until=None if r.state == READY else timestamp(r.until),
        )
    return {queue_id: QueueReadiness(queue_id, states) for queue_id, states in out.items()}


def timestamp(value: Any) -> datetime | None:
    """min()/max() of a timestamp column: SQLite hands back the stored text."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return aware(value)


__all__ = [
    "EMPTY",
    "HELD",
    "LEASED",
    "READY",
    "QueueReadiness",
    "Tally",
    "not_takeable",
    "ready_now",
    "reasons",
    "state",
    "tally",
    "tally_statement",
    "timestamp",
    "waiting_from",
]
