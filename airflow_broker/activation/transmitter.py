"""The transmitter: delivery between broker databases that starts by itself.

Service Broker's transmitter is always on. Here it is activated like a reader: something watches
the transmission queue (in Airflow, :class:`~airflow_broker.provider.triggers.transmission.
TransmissionTrigger` in the triggerer) and, when messages are due, starts a run that calls
:func:`transmit`. A run delivers until nothing is due (every message delivered, or waiting for
its next retry because its destination cannot take it yet), then ends; the watcher wakes again
at the next retry time or when a new message is queued.

A run also does what no reader does for queues nobody reads: due work (timers, lifetimes, dead
readers, waiting local transmissions) and housekeeping (:mod:`airflow_broker.operations.
housekeeping`), so a deployment with a transmitter needs nothing else to keep itself in order.

Above ``spark_threshold`` due messages a run hands the backlog to the Spark routing job (the
``spark`` callable it is given) instead of the Python pass: :data:`DEFAULT_SPARK_THRESHOLD` is
where ``python -m bench.spark_routing`` measured the job overtaking ``deliver()`` on this
project's 2-core machine (0.26x at 10^4 messages, 2.85x at 10^5; the crossover interpolates to
about 3.6 x 10^4), rounded up so that a small cluster's start-up is paid only when it pays.

One transmitter runs per broker database at a time: :func:`transmitter_lock` is a session
advisory lock on PostgreSQL and an ``flock`` on a file beside the database on SQLite, both
released by the operating system when the holder dies, so a killed run never blocks the next.
Two runs at once would still be correct (delivery is exactly once whoever sends), only wasteful.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import exists, func, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from airflow_broker.errors import InvalidDefinition
from airflow_broker.messaging.duework import run_due
from airflow_broker.operations.housekeeping import Retention, housekeeping_step
from airflow_broker.storage import schema as s
from airflow_broker.storage.adapters import TRANSMIT_CHANNEL
from airflow_broker.storage.clock import aware, utcnow
from airflow_broker.transport import DeliveryReport, Transport, inbox

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")

#: Due messages from which a run hands the backlog to the Spark job (see the module docstring).
DEFAULT_SPARK_THRESHOLD = 40_000
#: A run stops after this long even if more keeps arriving; the watcher starts the next one.
DEFAULT_MAX_SECONDS = 600.0
# pg_advisory_lock(ADVISORY_CLASS, 0): one transmitter per database (migrate 727170000,
# activation 727170001, depth sampling 727170002).
ADVISORY_CLASS = 727170003

_memory_locks: dict[str, threading.Lock] = {}


@dataclass(frozen=True, slots=True)
class Backlog:
    """What waits to leave this broker database.

    :ivar due: transmission-queue rows whose next attempt is due now (and, on a forwarder,
        messages in transit that are due), plus one for each cause of waiting that is due (a
        pass tries one of its dialogs for all: :mod:`airflow_broker.transport.causes`). Rows
        that wait for a cause whose next attempt is later are not due, however many.
    :ivar waiting: every transmission-queue row, due or not.
    :ivar next_attempt_at: the earliest next attempt of a row or a cause not yet due (None:
        none).
    :ivar oldest_enqueued_at: when the longest-waiting row was queued (None: empty).
    :ivar causes: causes of waiting that hold rows (due or not).
    """

    due: int = 0
    waiting: int = 0
    next_attempt_at: datetime | None = None
    oldest_enqueued_at: datetime | None = None
    causes: int = 0


def backlog(broker: BrokerContext, now: datetime | None = None) -> Backlog:
    """The transmission queue (and, on PostgreSQL, messages in transit) as a transmitter sees it."""
    now = utcnow() if now is None else now
    t = s.transmission_queue
    due_rows = t.c.next_attempt_at <= now
    with broker.read_connection() as conn:
        row = conn.execute(
            select(
                func.count().filter(due_rows),
                func.count(),
                func.min(t.c.next_attempt_at).filter(~due_rows),
                func.min(t.c.enqueued_at),
            )
        ).one()
        due = int(row[0])
        next_at = row[2]
        # Causes of waiting (one per destination and reason): each due one is one attempt,
        # whatever the number of rows that wait for it.
        w = s.transmission_wait
        due_causes = w.c.next_attempt_at <= now
        causes_row = conn.execute(
            select(
                func.count().filter(due_causes),
                func.min(w.c.next_attempt_at).filter(~due_causes),
                func.count(),
            ).where(exists().where(t.c.wait_id == w.c.id))
        ).one()
        due += int(causes_row[0])
        if causes_row[1] is not None:
            next_at = causes_row[1] if next_at is None else min(next_at, causes_row[1])
        causes = int(causes_row[2])
        if broker.dialect == "postgresql":
            tr = s.transit
            held = conn.execute(
                select(
                    func.count().filter(tr.c.next_attempt_at <= now), func.min(tr.c.next_attempt_at)
                )
            ).one()
            due += int(held[0]) + inbox.pending(conn)
            if held[1] is not None and aware(held[1]) > now:  # type: ignore[operator]
                next_at = held[1] if next_at is None else min(next_at, held[1])
    return Backlog(
        due=due,
        waiting=int(row[1]),
        next_attempt_at=aware(next_at),
        oldest_enqueued_at=aware(row[3]),
        causes=causes,
    )


# ---------------------------------------------------------------------------------------------
# One transmitter at a time
# ---------------------------------------------------------------------------------------------


def _lock_file(broker: BrokerContext) -> Path | None:
    database = broker.engine.url.database
    if not database or database == ":memory:" or database.startswith("file::memory:"):
        return None
    path = Path(database).resolve()
    return path.with_name(path.name + "-transmitter.lock")


@contextlib.contextmanager
def transmitter_lock(broker: BrokerContext) -> Iterator[bool]:
    """Hold this database's transmitter lock for the ``with`` block; yields False (holding
    nothing) when another transmitter holds it."""
    if broker.dialect == "postgresql" and broker.adapter.pooled:
        # Behind a transaction-mode pooler a session lock would stay with a server process
        # that others go on using: a transaction-level lock in a transaction kept open for the
        # run instead (idle between statements: it holds no snapshot back from VACUUM), which
        # ends however the process does.
        with broker.engine.connect() as conn:
            got = bool(
                conn.execute(
                    text("SELECT pg_try_advisory_xact_lock(:cls, 0)"), {"cls": ADVISORY_CLASS}
                ).scalar()
            )
            try:
                yield got
            finally:
                conn.rollback()
        return
    if broker.dialect == "postgresql":
        with broker.engine.connect() as conn:
            got = bool(
                conn.execute(
                    text("SELECT pg_try_advisory_lock(:cls, 0)"), {"cls": ADVISORY_CLASS}
                ).scalar()
            )
            conn.commit()
            try:
                yield got
            finally:
                if got:
                    conn.execute(
                        text("SELECT pg_advisory_unlock(:cls, 0)"), {"cls": ADVISORY_CLASS}
                    )
                    conn.commit()
        return
    path = _lock_file(broker)
    if path is None:
        lock = _memory_locks.setdefault(str(broker.engine.url), threading.Lock())
        got = lock.acquire(blocking=False)
        try:
            yield got
        finally:
            if got:
                lock.release()
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            got = True
        except BlockingIOError:
            got = False
        try:
            yield got
        finally:
            if got:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def transmitter_running(broker: BrokerContext) -> bool:
    """Whether some process holds this database's transmitter lock now."""
    if broker.dialect == "postgresql":
        with broker.engine.connect() as conn:
            return bool(
                conn.execute(
                    text(
                        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory'"
                        " AND granted AND classid = :cls AND objid = 0 AND objsubid = 2"
                        " AND database = (SELECT oid FROM pg_database"
                        "                 WHERE datname = current_database()))"
                    ),
                    {"cls": ADVISORY_CLASS},
                ).scalar()
            )
    with transmitter_lock(broker) as got:
        return not got


# ---------------------------------------------------------------------------------------------
# Activation: when a watcher starts a run
# ---------------------------------------------------------------------------------------------

#: A run a watcher started but that has not taken the lock after this long is taken as lost
#: (its DAG run never started): the watcher starts another.
DEFAULT_START_TIMEOUT = 60.0

_tx = s.transmitter


def _ensure_row(conn: Connection) -> None:
    ins = (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(_tx)
    conn.execute(ins.values(id=1, fires=0).on_conflict_do_nothing(index_elements=["id"]))


def _mark(broker: BrokerContext, column: str) -> None:
    with broker.engine.begin() as conn:
        _ensure_row(conn)
        conn.execute(update(_tx).where(_tx.c.id == 1).values({column: utcnow()}))
        if column == "finished_at" and broker.dialect == "postgresql":
            # Wake the watchers: what was queued during the run's last pass starts the next.
            conn.execute(text("SELECT pg_notify(:ch, '')"), {"ch": TRANSMIT_CHANNEL})


@dataclass(frozen=True, slots=True)
class TransmitterFire:
    """A watcher decided to start a transmitter run."""

    due: int
    waiting: int
    fires: int
    oldest_enqueued_at: datetime | None

    def payload(self) -> dict[str, object]:
        """The event payload (JSON): what the trigger hands to Airflow."""
        oldest = self.oldest_enqueued_at
        return {
            "due": self.due,
            "waiting": self.waiting,
            "fires": self.fires,
            "oldest_enqueued_at": None if oldest is None else oldest.isoformat(),
        }


def watch(
    broker: BrokerContext,
    *,
    start_timeout: float = DEFAULT_START_TIMEOUT,
    now: datetime | None = None,
) -> tuple[TransmitterFire | None, Backlog]:
    """One look of a transmitter watcher: fire (start a run) when messages are due, no
    transmitter is running, and the run it last started has started and ended since (or never
    started within ``start_timeout`` seconds). Firing is a compare-and-set, so two watchers
    never start two runs for one look. Returns the fire (or None) and the backlog seen, whose
    ``next_attempt_at`` tells the watcher when to look again."""
    now = utcnow() if now is None else now
    seen = backlog(broker, now)
    if seen.due == 0 or transmitter_running(broker):
        return None, seen
    with broker.engine.begin() as conn:
        _ensure_row(conn)
        row = conn.execute(select(_tx).where(_tx.c.id == 1)).one()
        fired_at, started_at = aware(row.fired_at), aware(row.started_at)
        ready = (
            fired_at is None
            or (started_at is not None and started_at >= fired_at)  # that run has ended
            or (now - fired_at).total_seconds() >= start_timeout  # it never started
        )
        if not ready:
            return None, seen
        won = conn.execute(
            update(_tx)
            .where(_tx.c.id == 1, _tx.c.fires == row.fires)
            .values(fires=row.fires + 1, fired_at=now)
        ).rowcount
    if won != 1:
        return None, seen
    return TransmitterFire(seen.due, seen.waiting, row.fires + 1, seen.oldest_enqueued_at), seen


# ---------------------------------------------------------------------------------------------
# A run
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TransmitReport:
    """What one transmitter run did.

    :ivar skipped: another transmitter held the lock; this run did nothing.
    :ivar passes: Python delivery passes made.
    :ivar spark_runs: times the backlog was handed to the Spark job.
    :ivar delivery: the delivery passes' counts, added up.
    :ivar left: what still waits when the run ended (due rows there wait for a destination
        that could not take them; the next run retries at ``left.next_attempt_at``).
    """

    skipped: bool = False
    passes: int = 0
    spark_runs: int = 0
    seconds: float = 0.0
    delivery: DeliveryReport = field(default_factory=DeliveryReport)
    left: Backlog = field(default_factory=Backlog)


def _add(a: DeliveryReport, b: DeliveryReport) -> DeliveryReport:
    return replace(
        a,
        delivered=a.delivered + b.delivered,
        acknowledged=a.acknowledged + b.acknowledged,
        delayed=b.delayed,  # what still waits after the latest pass
        failed=a.failed + b.failed,
        discarded=a.discarded + b.discarded,
        forwarded=a.forwarded + b.forwarded,
        hung={**a.hung, **b.hung},
    )


def _moved(r: DeliveryReport) -> int:
    return r.delivered + r.acknowledged + r.failed + r.discarded + r.forwarded


def _run(
    broker: BrokerContext,
    spark: Callable[[Backlog], None] | None,
    spark_threshold: int,
    max_seconds: float,
    started: float,
) -> tuple[int, int, DeliveryReport]:
    """Due work and delivery passes until one moves nothing; (passes, Spark runs, counts)."""
    transport = Transport(broker)
    total = DeliveryReport()
    passes = spark_runs = 0
    while True:
        run_due(broker)
        due = backlog(broker)
        if spark is not None and due.due >= spark_threshold:
            log.info(
                "%d messages due (threshold %d): handing them to the Spark routing job",
                due.due,
                spark_threshold,
            )
            spark(due)
            spark_runs += 1
        report = transport.deliver()
        passes += 1
        total = _add(total, report)
        if _moved(report) == 0 or time.monotonic() - started >= max_seconds:
            return passes, spark_runs, total


def transmit(
    broker: BrokerContext,
    *,
    spark: Callable[[Backlog], None] | None = None,
    spark_threshold: int = DEFAULT_SPARK_THRESHOLD,
    max_seconds: float = DEFAULT_MAX_SECONDS,
    retention: Retention | None = None,
) -> TransmitReport:
    """One transmitter run: due work, then delivery passes until a pass moves nothing (nothing
    is due, or what is due cannot go yet), handing large backlogs to ``spark``; then
    housekeeping. Returns at once, ``skipped``, when another transmitter runs."""
    if not isinstance(spark_threshold, int) or spark_threshold < 1:
        raise InvalidDefinition(
            f"spark_threshold must be a whole number >= 1, not {spark_threshold!r}"
        )
    started = time.monotonic()
    with transmitter_lock(broker) as got:
        if not got:
            log.info("another transmitter is running on this broker database: nothing to do")
            return TransmitReport(skipped=True, left=backlog(broker))
        _mark(broker, "started_at")
        try:
            passes, spark_runs, total = _run(broker, spark, spark_threshold, max_seconds, started)
            housekeeping_step(broker, retention)
            left = backlog(broker)
        finally:
            _mark(broker, "finished_at")
    result = TransmitReport(
        passes=passes,
        spark_runs=spark_runs,
        seconds=time.monotonic() - started,
        delivery=total,
        left=left,
    )
    log.info(
        "transmitter: %d passes, %d Spark runs, delivered %d, acknowledged %d, failed %d; "
        "%d still wait (%d due), next attempt %s",
        passes,
        spark_runs,
        total.delivered,
        total.acknowledged,
        total.failed,
        left.waiting,
        left.due,
        left.next_attempt_at,
    )
    for address, why in total.hung.items():
        log.warning("transmitter: %s did not answer in this run: %s", address, why)
    return result


__all__ = [
    "DEFAULT_MAX_SECONDS",
    "DEFAULT_SPARK_THRESHOLD",
    "DEFAULT_START_TIMEOUT",
    "Backlog",
    "TransmitReport",
    "TransmitterFire",
    "backlog",
    "transmit",
    "transmitter_lock",
    "transmitter_running",
    "watch",
]
