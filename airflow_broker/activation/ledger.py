"""What the monitor and the reader registry share: locking one queue's activation, observing
its depth and groups, and tidying ``broker_activation`` / ``broker_activation_reader`` rows.

On PostgreSQL the monitor and the reader registration of one queue serialize on a
transaction-scoped advisory lock; on SQLite a broker transaction already holds the database's
only write lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, text, update
from sqlalchemy.engine import Connection

from airflow_broker.activation.decision import (
    ADVISORY_CLASS,
    FINISHED_RETENTION,
    READER_TIMEOUT_SECONDS,
    START_TIMEOUT_SECONDS,
    QueueObservation,
)
from airflow_broker.errors import UnknownObject
from airflow_broker.messaging.definitions import Activation
from airflow_broker.storage import readiness
from airflow_broker.storage import schema as s

# ---------------------------------------------------------------------------------------------
# Observation and bookkeeping (shared by the monitor and reader registration)
# ---------------------------------------------------------------------------------------------

_r = s.activation_reader
_a = s.activation_monitor


def lock_queue(conn: Connection, queue_id: int) -> None:
    """Serialize one queue's monitors and reader registrations (PostgreSQL; SQLite already holds
    its single write lock from the transaction's first statement)."""
    if conn.dialect.name == "postgresql":
        conn.execute(
            text("SELECT pg_advisory_xact_lock(:cls, :queue_id)"),
            {"cls": ADVISORY_CLASS, "queue_id": queue_id},
        )


def queue_row(conn: Connection, queue: str) -> Any:
    row = conn.execute(
        select(s.queue.c.queue_id, s.queue.c.status, s.queue.c.activation).where(
            s.queue.c.name == queue
        )
    ).first()
    if row is None:
        raise UnknownObject(f"queue {queue!r} does not exist in this broker")
    return row


def observe(conn: Connection, row: Any) -> QueueObservation:
    """What the monitor sees of queue ``row``: only messages a reader could take now
    (:mod:`~airflow_broker.storage.readiness`). Messages whose group is held after a failed
    attempt or leased are not counted: a queue that holds only those starts no reader (it would
    find nothing to RECEIVE) until a hold ends."""
    counted = readiness.tally(conn, queue_ids=[row.queue_id]).get(row.queue_id)
    return observation(row, counted, monotonic_order=conn.dialect.name == "postgresql")


def observation(
    row: Any, counted: readiness.QueueReadiness | None, *, monotonic_order: bool
) -> QueueObservation:
    """The observation of queue ``row`` (``queue_id, status, activation``) from its tally
    (:func:`readiness.tally`; None: nothing waits)."""
    ready = counted.ready if counted is not None else readiness.EMPTY
    return QueueObservation(
        queue_id=row.queue_id,
        enabled=bool(row.status),
        activation=Activation.from_value(row.activation) or Activation(),
        depth=ready.messages,
        groups_ready=ready.groups,
        high_water=ready.high_water,
        low_water=ready.low_water,
        newest_at=ready.newest_enqueued_at,
        oldest_at=ready.oldest_enqueued_at,
        monotonic_order=monotonic_order,
    )


def tidy(conn: Connection, queue_id: int, obs: QueueObservation | None, now: datetime) -> None:
    """Close what no longer counts: fires whose reader never came (or whose messages are gone),
    readers whose heartbeat stopped; purge rows finished long ago."""
    started_too_late = _r.c.fired_at < now - timedelta(seconds=START_TIMEOUT_SECONDS)
    stale: Any = started_too_late
    if obs is not None:
        if obs.low_water is None:
            stale = or_(started_too_late, _r.c.fired_at.is_not(None))  # the queue is empty
        elif obs.monotonic_order or obs.oldest_at is None:
            stale = or_(started_too_late, _r.c.cursor < obs.low_water)
        else:
            # SQLite: a reused queuing_order may hide that the messages fired for are gone.
            stale = or_(
                started_too_late, _r.c.cursor < obs.low_water, _r.c.fired_at < obs.oldest_at
            )
    conn.execute(
        update(_r)
        .where(
            _r.c.queue_id == queue_id,
            _r.c.started_at.is_(None),
            _r.c.finished_at.is_(None),
            stale,
        )
        .values(finished_at=now, outcome="expired")
    )
    conn.execute(
        update(_r)
        .where(
            _r.c.queue_id == queue_id,
            _r.c.started_at.is_not(None),
            _r.c.finished_at.is_(None),
            _r.c.heartbeat_at < now - timedelta(seconds=READER_TIMEOUT_SECONDS),
        )
        .values(finished_at=now, outcome="lost")
    )
    conn.execute(
        delete(_r).where(_r.c.queue_id == queue_id, _r.c.finished_at < now - FINISHED_RETENTION)
    )


@dataclass(frozen=True, slots=True)
class ReaderRows:
    """One queue's ``broker_activation_reader`` rows, summed up (:func:`reader_rows`)."""

    #: registered and not finished
    live: int = 0
    #: fired for and not yet registered
    starting: int = 0
    #: of the starting ones: the lowest cursor, the first fire
    starting_cursor: int | None = None
    starting_fired_at: datetime | None = None
    #: the oldest heartbeat of the live ones
    live_heartbeat_at: datetime | None = None
    #: the first finish of the finished ones
    finished_at: datetime | None = None

    def untidy(self, obs: QueueObservation, now: datetime) -> bool:
        """Whether :func:`tidy` would change a row: it is written from the same rules."""
        if self.starting:
            if self.starting_fired_at is not None and self.starting_fired_at < now - timedelta(
                seconds=START_TIMEOUT_SECONDS
            ):
                return True
            if obs.low_water is None:
                return True
            if self.starting_cursor is not None and self.starting_cursor < obs.low_water:
                return True
            if not (obs.monotonic_order or obs.oldest_at is None) and (
                self.starting_fired_at is not None and self.starting_fired_at < obs.oldest_at
            ):
                return True
        heartbeat = self.live_heartbeat_at if self.live else None
        if heartbeat is not None and heartbeat < now - timedelta(seconds=READER_TIMEOUT_SECONDS):
            return True
        return self.finished_at is not None and self.finished_at < now - FINISHED_RETENTION


def reader_rows(conn: Connection, queue_ids: list[int]) -> dict[int, ReaderRows]:
    """The reader rows of ``queue_ids``, summed up per queue (one statement); a queue without
    rows is absent."""
    live = and_(_r.c.started_at.is_not(None), _r.c.finished_at.is_(None))
    starting = and_(_r.c.started_at.is_(None), _r.c.finished_at.is_(None))
    rows = conn.execute(
        select(
            _r.c.queue_id,
            func.count().filter(live),
            func.count().filter(starting),
            func.min(_r.c.cursor).filter(starting),
            func.min(_r.c.fired_at).filter(starting),
            func.min(_r.c.heartbeat_at).filter(live),
            func.min(_r.c.finished_at),
        )
        .where(_r.c.queue_id.in_(queue_ids))
        .group_by(_r.c.queue_id)
    )
    return {
        row[0]: ReaderRows(
            live=int(row[1] or 0),
            starting=int(row[2] or 0),
            starting_cursor=row[3],
            starting_fired_at=readiness.timestamp(row[4]),
            live_heartbeat_at=readiness.timestamp(row[5]),
            finished_at=readiness.timestamp(row[6]),
        )
        for row in rows
    }


def counts(conn: Connection, queue_id: int) -> tuple[int, int]:
    """(readers registered and not finished, readers fired for and not yet registered), after
    :func:`tidy`."""
    row = conn.execute(
        select(
            func.count().filter(_r.c.started_at.is_not(None)),
            func.count().filter(_r.c.started_at.is_(None)),
        ).where(_r.c.queue_id == queue_id, _r.c.finished_at.is_(None))
    ).one()
    return int(row[0] or 0), int(row[1] or 0)
