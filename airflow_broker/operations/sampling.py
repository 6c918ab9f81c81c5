"""Queue depth history: samples of every queue's depth, at most one pass per interval.

:func:`sample_queue_depths` writes one row per queue into ``broker_queue_sample`` in a single
``INSERT ... SELECT`` (the messages of ``broker_message`` a reader could take now counted by one
``GROUP BY``, queues without messages at 0: messages held after a failed attempt or leased are
not depth, see :mod:`airflow_broker.storage.readiness`), sets the ``broker.queue_depth.<queue>``
gauges, and ``broker.queue_held.<queue>`` / ``broker.queue_leased.<queue>`` for the others, when
metrics are on (:mod:`airflow_broker.metrics`), then deletes samples older than the retention in
bounded batches.

Many processes call it (activation monitors and triggers through
:func:`airflow_broker.activation.due_step`, the in-process runner, the monitoring API when the
queue list is read); one pass per interval happens across all of them: the pass first reads the
latest sample (an index lookup) and does nothing when it is younger than ``min_interval``. On
PostgreSQL the check and the insert run under a transaction-scoped advisory *try*-lock (a second
process that finds it taken skips the pass rather than wait); on SQLite the transaction holds the
database's write lock from its first statement. :func:`sample_step` adds a per-process throttle
(no query at all between two looks) and never raises: a failed sample is logged, not the caller's
problem.

Everything here runs without Airflow, against either engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy import delete, func, insert, literal, select, text, tuple_
from sqlalchemy.engine import Connection

from airflow_broker import metrics
from airflow_broker.errors import InvalidDefinition
from airflow_broker.storage import readiness
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")

#: The shortest time between two sampling passes (seconds), across every process.
DEFAULT_INTERVAL = 15.0
#: Samples older than this are deleted.
DEFAULT_RETENTION = timedelta(days=7)
#: Rows one retention DELETE removes at most ...
DELETE_BATCH = 5000
#: ... and the most such DELETEs one pass runs (each in its own transaction).
MAX_DELETE_BATCHES = 10
#: The longest history one can ask for (minutes): the default retention.
MAX_HISTORY_MINUTES = 10080

# pg_try_advisory_xact_lock(ADVISORY_CLASS, 0): one sampling pass at a time (Broker.migrate uses
# class 727170000, activation 727170001).
ADVISORY_CLASS = 727170002

_qs = s.queue_sample


@dataclass(frozen=True, slots=True)
class SampleReport:
    """What one sampling pass wrote and deleted."""

    sampled_at: datetime
    queues: int
    deleted: int


def _latest(conn: Connection) -> datetime | None:
    row = conn.execute(select(_qs.c.sampled_at).order_by(_qs.c.sampled_at.desc()).limit(1)).first()
    return None if row is None else aware(row.sampled_at)


def sample_queue_depths(
    broker: BrokerContext,
    *,
    now: datetime | None = None,
    min_interval: float = DEFAULT_INTERVAL,
    retention: timedelta = DEFAULT_RETENTION,
    batch: int = DELETE_BATCH,
) -> SampleReport | None:
    """Write one depth sample per queue, unless some process wrote one less than
    ``min_interval`` seconds before ``now`` (then None); then delete samples older than
    ``retention``, at most ``batch`` rows per statement."""
    if batch < 1:
        raise InvalidDefinition(f"batch must be >= 1, not {batch!r}")
    now = utcnow() if now is None else aware(now)
    assert now is not None
    q, m = s.queue, s.message
    depths: list[tuple[str, int]] = []
    ages = _Ages()
    with broker.engine.begin() as conn:
        if broker.dialect == "postgresql":
            got = conn.execute(
                text("SELECT pg_try_advisory_xact_lock(:cls, 0)"), {"cls": ADVISORY_CLASS}
            ).scalar()
            if not got:
                return None  # another process is sampling right now
        latest = _latest(conn)
        if latest is not None and latest > now - timedelta(seconds=min_interval):
            return None
        # Depth is what a reader could take now: held and leased messages are not counted.
        ready = (
            select(m.c.queue_id, func.count().label("depth"))
            .select_from(readiness.waiting_from())
            .where(readiness.ready_now(now))
            .group_by(m.c.queue_id)
            .subquery()
        )
        rows = select(
            q.c.queue_id,
            literal(now, s.Timestamp),
            func.coalesce(ready.c.depth, 0),
        ).select_from(q.outerjoin(ready, ready.c.queue_id == q.c.queue_id))
        # RETURNING: the driver's rowcount of an INSERT ... SELECT is not always known (-1).
        written = conn.execute(
            insert(_qs)
            .from_select(["queue_id", "sampled_at", "depth"], rows)
            .returning(_qs.c.queue_id, _qs.c.depth)
        ).all()
        if metrics.enabled() and written:
            names = dict(
                conn.execute(
                    select(q.c.queue_id, q.c.name).where(
                        q.c.queue_id.in_([r.queue_id for r in written])
                    )
                ).all()
            )
            depths = [(names[r.queue_id], int(r.depth)) for r in written if r.queue_id in names]
            ages = _ages(conn, now, names)
    for name, depth in depths:
        tags = {"queue": name}
        held, leased = ages.held.get(name, 0), ages.leased.get(name, 0)
        metrics.gauge(metrics.queue_stat(metrics.QUEUE_DEPTH, name), depth, tags)
        metrics.gauge(metrics.queue_stat(metrics.QUEUE_HELD, name), held, tags)
        metrics.gauge(metrics.queue_stat(metrics.QUEUE_LEASED, name), leased, tags)
        metrics.gauge(metrics.queue_stat(metrics.QUEUE_OLDEST_AGE, name), ages.get(name, 0.0), tags)
    if depths:
        metrics.gauge(metrics.TRANSMISSION_DEPTH, ages.transmission_depth)
        metrics.gauge(metrics.TRANSMISSION_OLDEST_AGE, ages.transmission_oldest)
    deleted = delete_old_samples(broker, now - retention, batch=batch)
    return SampleReport(sampled_at=now, queues=len(written), deleted=deleted)


class _Ages(dict[str, float]):
    """Seconds the oldest ready message of each queue has waited (by name), the messages held
    and leased apart (by name), and the transmission queue's depth and oldest age."""

    transmission_depth: int = 0
    transmission_oldest: float = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, int] = {}
        self.leased: dict[str, int] = {}


def _ages(conn: Connection, now: datetime, names: dict[int, str]) -> _Ages:
    """What the age, held and leased gauges show, read only when metrics go somewhere."""
    t = s.transmission_queue
    ages = _Ages()
    for queue_id, counted in readiness.tally(conn, queue_ids=names, now=now).items():
        name = names[queue_id]
        oldest = counted.ready.oldest_enqueued_at
        if oldest is not None:
            ages[name] = _age(now, oldest)
        ages.held[name] = counted.held.messages
        ages.leased[name] = counted.leased.messages
    depth, oldest = conn.execute(select(func.count(), func.min(t.c.enqueued_at))).one()
    ages.transmission_depth = int(depth)
    ages.transmission_oldest = 0.0 if oldest is None else _age(now, oldest)
    return ages


def _age(now: datetime, then: datetime) -> float:
    return max((now - aware(then)).total_seconds(), 0.0)  # type: ignore[operator]


def delete_old_samples(
    broker: BrokerContext,
    before: datetime,
    *,
    batch: int = DELETE_BATCH,
    max_batches: int = MAX_DELETE_BATCHES,
) -> int:
    """Delete samples taken before ``before``: at most ``max_batches`` DELETEs of at most
    ``batch`` rows, each its own transaction (short locks); returns how many went."""
    deleted = 0
    for _ in range(max_batches):
        oldest = (
            select(_qs.c.queue_id, _qs.c.sampled_at)
            .where(_qs.c.sampled_at < before)
            .order_by(_qs.c.sampled_at)
            .limit(batch)
        )
        with broker.engine.begin() as conn:
            n = conn.execute(
                delete(_qs).where(tuple_(_qs.c.queue_id, _qs.c.sampled_at).in_(oldest))
            ).rowcount
        deleted += max(int(n or 0), 0)
        if n < batch:
            break
    return deleted


def sample_step(broker: BrokerContext, every: float = DEFAULT_INTERVAL) -> SampleReport | None:
    """A sampling pass if this process has not looked within ``every`` seconds (per
    :class:`Broker`); never raises (a failure is logged and tried again ``every`` seconds later).
    Called from the loops that already run periodically."""
    now = time.monotonic()
    if now < broker.next_depth_sample:
        return None
    broker.next_depth_sample = now + every
    try:
        return sample_queue_depths(broker, min_interval=every)
    except Exception as exc:  # a sample is never worth failing the caller's loop
        log.warning("queue depth sampling failed: %s: %s", type(exc).__name__, exc)
        return None


@dataclass(frozen=True, slots=True)
class DepthSample:
    """A queue's depth at one time."""

    at: datetime
    depth: int


def check_minutes(minutes: int) -> int:
    """A history length in whole minutes, 1..:data:`MAX_HISTORY_MINUTES`."""
    if not isinstance(minutes, int) or isinstance(minutes, bool):
        raise InvalidDefinition(f"minutes must be a whole number, not {minutes!r}")
    if not 1 <= minutes <= MAX_HISTORY_MINUTES:
        raise InvalidDefinition(
            f"minutes must be between 1 and {MAX_HISTORY_MINUTES}, not {minutes}"
        )
    return minutes


def depth_samples(
    broker: BrokerContext, queue_id: int, minutes: int, *, now: datetime | None = None
) -> list[DepthSample]:
    """The samples of one queue from the last ``minutes`` minutes, oldest first."""
    check_minutes(minutes)
    now = utcnow() if now is None else aware(now)
    assert now is not None
    with broker.read_connection() as conn:
        rows = conn.execute(
            select(_qs.c.sampled_at, _qs.c.depth)
            .where(_qs.c.queue_id == queue_id, _qs.c.sampled_at >= now - timedelta(minutes=minutes))
            .order_by(_qs.c.sampled_at)
        ).all()
    return [DepthSample(aware(r.sampled_at), int(r.depth)) for r in rows]  # type: ignore[arg-type]


__all__ = [
    "DEFAULT_INTERVAL",
    "DEFAULT_RETENTION",
    "MAX_HISTORY_MINUTES",
    "DepthSample",
    "SampleReport",
    "check_minutes",
    "delete_old_samples",
    "depth_samples",
    "sample_queue_depths",
    "sample_step",
]
