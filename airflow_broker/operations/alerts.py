"""Alerts: the outages seed 004 warns about, raised once per episode.

Two conditions are worth waking someone for:

- ``queue_disabled``: poison-message handling disabled a queue (five rolled-back receives in a
  row). Every conversation on it stops until an operator re-enables it. A queue an operator
  disabled on purpose (``alter_queue(status=False)``) is not alerted.
- ``transmission_waiting``: messages for a target service have waited in the transmission
  queue longer than a threshold (its destination unreachable, a route missing, its queue
  disabled): "messages queuing up for hours" unnoticed.

:func:`raise_alerts` looks for both and returns the :class:`Alert` s that start now. What it
raised is kept in ``broker_alert`` under the watcher's name while the condition holds: an alert is
raised once per episode, by whichever watcher (triggerer) looks first, and again only after the
condition ended (the queue was re-enabled, the transmissions left) and came back. In Airflow a
:class:`~airflow_broker.provider.triggers.alerts.BrokerAlertTrigger` turns them into asset
events.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, delete, func, insert, select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from airflow_broker.errors import InvalidDefinition
from airflow_broker.messaging.events import POISON_DISABLED
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

QUEUE_DISABLED = "queue_disabled"
TRANSMISSION_WAITING = "transmission_waiting"
KINDS = (QUEUE_DISABLED, TRANSMISSION_WAITING)
#: Transmissions waiting longer than this raise ``transmission_waiting`` by default.
DEFAULT_WAITING_THRESHOLD = timedelta(minutes=15)

_al, _q, _ev, _t = s.alert, s.queue, s.event, s.transmission_queue


@dataclass(frozen=True, slots=True)
class Alert:
    """One alert that starts now.

    :ivar kind: ``queue_disabled`` or ``transmission_waiting``.
    :ivar object: the queue, or the target service.
    :ivar detail: a sentence for a person.
    :ivar count: messages concerned (ready in the queue; waiting for the service).
    :ivar oldest_age_seconds: how long the oldest of them has waited.
    :ivar reason: why the transmissions wait (their ``transmission_status``), or None.
    """

    kind: str
    object: str
    detail: str
    count: int
    oldest_age_seconds: float
    reason: str | None = None

    def payload(self) -> dict[str, Any]:
        """The event payload (JSON)."""
        return asdict(self)


def _check_kinds(kinds: tuple[str, ...]) -> None:
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise InvalidDefinition(f"alert kinds must be among {list(KINDS)}, not {list(kinds)}")


def _age(now: datetime, then: Any) -> float:
    return 0.0 if then is None else max((now - aware(then)).total_seconds(), 0.0)  # type: ignore[operator]


def _disabled_queues(conn: Connection, now: datetime) -> dict[str, tuple[str, int, float]]:
    """Queues poison handling disabled and nobody re-enabled since: name -> (detail, ready
    messages, oldest age)."""
    newest = (
        select(func.max(_ev.c.id).label("id"))
        .where(_ev.c.event == "queue_disabled")
        .group_by(_ev.c.object_name)
        .subquery()
    )
    latest = (
        select(_ev.c.object_name, _ev.c.occurred_at.label("at"))
        .join(newest, newest.c.id == _ev.c.id)
        # disabled by poison handling, not by an operator's ALTER QUEUE
        .where(_ev.c.detail.contains(POISON_DISABLED, autoescape=True))
        .subquery()
    )
    m = s.message
    depth = (
        select(m.c.queue_id, func.count().label("n"), func.min(m.c.enqueued_at).label("oldest"))
        .group_by(m.c.queue_id)
        .subquery()
    )
    rows = conn.execute(
        select(_q.c.name, depth.c.n, depth.c.oldest)
        .join(latest, latest.c.object_name == _q.c.name)
        .outerjoin(depth, depth.c.queue_id == _q.c.queue_id)
        # The event was recorded with (after) the status change; a later ALTER QUEUE moves
        # modified_at past it.
        .where(_q.c.status.is_(False), latest.c.at >= _q.c.modified_at)
    ).all()
    return {
        r.name: (
            f"queue {r.name!r} was disabled by poison message handling (five rolled-back "
            f"receives in a row); {int(r.n or 0)} message(s) wait on it until it is re-enabled",
            int(r.n or 0),
            _age(now, r.oldest),
        )
        for r in rows
    }


def _waiting_services(
    conn: Connection, now: datetime, threshold: timedelta
) -> dict[str, tuple[str, int, float, str | None]]:
    """Target services with transmissions older than ``threshold``: name -> (detail, count,
    oldest age, reason of the oldest)."""
    old = _t.c.enqueued_at <= now - threshold
    rows = conn.execute(
        select(_t.c.to_service_name, func.count(), func.min(_t.c.enqueued_at))
        .where(old)
        .group_by(_t.c.to_service_name)
    ).all()
    found: dict[str, tuple[str, int, float, str | None]] = {}
    for service, count, oldest in rows:
        reason = conn.execute(
            select(_t.c.transmission_status)
            .where(old, _t.c.to_service_name == service)
            .order_by(_t.c.enqueued_at)
            .limit(1)
        ).scalar()
        age = _age(now, oldest)
        found[service] = (
            f"{count} message(s) for service {service!r} have waited to leave for up to "
            f"{age / 60:.0f} minute(s): {reason or 'no reason recorded'}",
            int(count),
            age,
            reason,
        )
    return found


def raise_alerts(
    broker: BrokerContext,
    *,
    watcher: str = "alerts",
    kinds: tuple[str, ...] = KINDS,
    waiting_threshold: timedelta = DEFAULT_WAITING_THRESHOLD,
    now: datetime | None = None,
) -> list[Alert]:
    """The alerts of ``kinds`` that start now for ``watcher``; forgets those whose condition
    ended. One look, in one transaction; two watchers of the same name raise each alert once."""
    _check_kinds(kinds)
    if not isinstance(waiting_threshold, timedelta) or waiting_threshold < timedelta(0):
        raise InvalidDefinition(
            f"waiting_threshold must be a timedelta >= 0, not {waiting_threshold!r}"
        )
    now = utcnow() if now is None else now
    raised: list[Alert] = []
    with broker.engine.begin() as conn:
        for kind in kinds:
            if kind == QUEUE_DISABLED:
                current: dict[str, tuple[Any, ...]] = dict(_disabled_queues(conn, now))
            else:
                current = dict(_waiting_services(conn, now, waiting_threshold))
            mine = and_(_al.c.watcher == watcher, _al.c.kind == kind)
            held = set(conn.execute(select(_al.c.object_name).where(mine)).scalars())
            ended = held - set(current)
            if ended:
                conn.execute(delete(_al).where(mine, _al.c.object_name.in_(ended)))
            for name in sorted(set(current) - held):
                try:
                    with conn.begin_nested():
                        conn.execute(
                            insert(_al).values(
                                watcher=watcher, kind=kind, object_name=name, fired_at=now
                            )
                        )
                except IntegrityError:
                    continue  # another watcher of the same name raised it first
                detail, count, age, *reason = current[name]
                raised.append(Alert(kind, name, detail, count, age, reason[0] if reason else None))
    return raised


__all__ = [
    "DEFAULT_WAITING_THRESHOLD",
    "KINDS",
    "QUEUE_DISABLED",
    "TRANSMISSION_WAITING",
    "Alert",
    "raise_alerts",
]
