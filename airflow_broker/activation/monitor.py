"""One monitor of one queue: observe, decide, and record what it fired for.

:class:`Monitor` applies :func:`~airflow_broker.activation.decision.decide` and records in the
broker database (table ``broker_activation``) what it fired for. Firing is a compare-and-set on
the monitor's cursor, so two monitors (two triggerers, or a restarted one) never fire twice for
the same messages. :func:`due_step` is what every monitor also does as it polls: due work and
queue-depth sampling.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, insert, select, text, update
from sqlalchemy.engine import Connection

from airflow_broker.activation.decision import ACTIVATION_KEY, MonitorState, check_mode, decide
from airflow_broker.activation.ledger import (
    ReaderRows,
    _a,
    _r,
    counts,
    lock_queue,
    observation,
    observe,
    queue_row,
    reader_rows,
    tidy,
)
from airflow_broker.constants import STATUS_READY
from airflow_broker.errors import InvalidDefinition
from airflow_broker.messaging.duework import run_due
from airflow_broker.operations.sampling import sample_step
from airflow_broker.storage import readiness
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext


# ---------------------------------------------------------------------------------------------
# The monitor
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fire:
    """A monitor fired: for ``arrival``, start ``readers`` reader(s)."""

    queue: str
    mode: str
    monitor_key: str
    depth: int
    groups_ready: int
    cursor: int
    readers: int
    running: int
    fire_id: str | None = None

    def payload(self) -> dict[str, Any]:
        """The event payload (JSON): what triggers and sensors hand to Airflow."""
        return asdict(self)


@dataclass(slots=True)
class Monitor:
    """One monitor of one queue; :meth:`check` observes once and fires at most once.

    All the state lives in the broker database (keyed by queue and ``key``), so a new Monitor
    with the same key continues where another left off, and two monitors with the same key
    (two triggerers) never fire twice for one arrival.

    :param broker: the broker database.
    :param queue: the queue's name.
    :param key: the monitor's name; monitors with different keys keep different cursors, and
        all monitors of a queue see the same readers.
    :param mode: ``arrival`` (start readers, seed 004), ``depth`` or ``growth`` (see :data:`Mode`).
    :param min_depth: do nothing while fewer messages wait.
    :param max_readers: the most readers at once (None: the queue's ``Activation.max_readers``).
    :param sample_seconds: how often the queue's depth is sampled to judge growth.
    """

    broker: BrokerContext
    queue: str
    key: str = ACTIVATION_KEY
    mode: str = "arrival"
    min_depth: int = 1
    max_readers: int | None = None
    sample_seconds: float = 1.0
    queue_id: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        check_mode(self.mode)
        if not isinstance(self.min_depth, int) or self.min_depth < 1:
            raise InvalidDefinition(
                f"min_depth must be a whole number >= 1, not {self.min_depth!r}"
            )
        if self.max_readers is not None and (
            not isinstance(self.max_readers, int) or self.max_readers < 1
        ):
            raise InvalidDefinition(
                f"max_readers must be a whole number >= 1 or None, not {self.max_readers!r}"
            )

    def watched(self) -> Watched:
        """What :func:`quiet_monitors` needs to know of this monitor (after a first
        :meth:`check`, which finds the queue's id)."""
        if self.queue_id is None:
            raise InvalidDefinition(f"monitor of queue {self.queue!r}: check() it once first")
        return Watched(
            self.queue_id,
            self.key,
            self.mode,
            self.min_depth,
            self.max_readers,
            self.sample_seconds,
        )

    def check(self) -> Fire | None:
        """Observe the queue once; record and return a :class:`Fire` when the monitor fires."""
        with self.broker.engine.begin() as conn:
            return self._check(conn, utcnow())

    def state(self) -> MonitorState:
        """What this monitor recorded last (a fresh state if it never ran)."""
        with self.broker.read_connection() as conn:
            row = queue_row(conn, self.queue)
            return self._load(conn, row.queue_id) or MonitorState()

    def _load(self, conn: Connection, queue_id: int) -> MonitorState | None:
        row = conn.execute(
            select(_a).where(_a.c.queue_id == queue_id, _a.c.monitor_key == self.key)
        ).first()
        return None if row is None else _state(row)

    def _check(self, conn: Connection, now: datetime) -> Fire | None:
        qrow = queue_row(conn, self.queue)
        queue_id = self.queue_id = qrow.queue_id
        lock_queue(conn, queue_id)
        state = self._load(conn, queue_id)
        if state is None:
            conn.execute(insert(_a).values(queue_id=queue_id, monitor_key=self.key, cursor=0))
            state = MonitorState()
        obs = observe(conn, qrow)
        tidy(conn, queue_id, obs, now)
        live, starting = counts(conn, queue_id)
        max_readers = self.max_readers or obs.activation.max_readers
        d = decide(
            self.mode,
            obs,
            state,
            running=live + starting,
            max_readers=max_readers,
            min_depth=self.min_depth,
            now=now,
            sample_seconds=self.sample_seconds,
        )
        mine = and_(_a.c.queue_id == queue_id, _a.c.monitor_key == self.key)
        if not d.fire:
            if d.sample and obs.depth != state.last_depth:
                # An unchanged depth needs no new sample (an idle queue costs no writes).
                conn.execute(update(_a).where(mine).values(last_depth=obs.depth, observed_at=now))
            return None
        cursor = max(state.cursor, obs.high_water or 0)
        # Compare-and-set: only the monitor that read this cursor and fire count may fire.
        won = conn.execute(
            update(_a)
            .where(mine, _a.c.cursor == state.cursor, _a.c.fires == state.fires)
            .values(
                cursor=cursor,
                fires=state.fires + 1,
                fired_at=now,
                last_depth=obs.depth,
                observed_at=now,
            )
        ).rowcount
        if won != 1:
            return None
        fire_id: str | None = None
        readers = max(d.readers, 1) if self.mode == "arrival" else 0
        if self.mode == "arrival":
            for _ in range(readers):
                rid = uuid.uuid4()
                conn.execute(
                    insert(_r).values(
                        reader_id=rid,
                        queue_id=queue_id,
                        monitor_key=self.key,
                        cursor=cursor,
                        fired_at=now,
                    )
                )
                fire_id = str(rid)
        return Fire(
            queue=self.queue,
            mode=self.mode,
            monitor_key=self.key,
            depth=obs.depth,
            groups_ready=obs.groups_ready,
            cursor=cursor,
            readers=readers,
            running=live + starting,
            fire_id=fire_id,
        )


def _state(row: Any) -> MonitorState:
    """A ``broker_activation`` row as the monitor's state."""
    return MonitorState(
        cursor=row.cursor,
        fires=row.fires,
        fired_at=aware(row.fired_at),
        last_depth=row.last_depth,
        observed_at=aware(row.observed_at),
    )


class Outlook(enum.Enum):
    """What :func:`quiet_monitors` found a monitor's full look would do: nothing."""

    #: Nothing waits in the queue and no reader of it runs or starts: only a new message,
    #: whose INSERT notifies the queue's channel, can change that.
    IDLE = "idle"
    #: Nothing to do now (no reader to start, no row to tidy, no sample to write), but a
    #: reader finishing or time passing (a start or heartbeat timeout) may change that.
    QUIET = "quiet"


@dataclass(frozen=True, slots=True)
class Watched:
    """A monitor as :func:`quiet_monitors` takes it (:meth:`Monitor.watched`; hashable)."""

    queue_id: int
    key: str
    mode: str
    min_depth: int
    max_readers: int | None
    sample_seconds: float


def quiet_monitors(broker: BrokerContext, monitors: Sequence[Watched]) -> dict[Watched, Outlook]:
    """Of ``monitors``, those whose :meth:`Monitor.check` would do nothing now (neither fire
    nor write), each with why; the others are absent and need their full look. Five statements
    whatever the number of monitors, none of them a write or a lock: the idle ones first
    (:func:`_idle`), then, for the rest, each queue's settings, its monitors' state,
    its messages by state and its reader rows, read once for all of them, and for each monitor
    :func:`~airflow_broker.activation.decision.decide` applied as its full look would. A
    monitor whose state row or queue is missing is not quiet: its full look makes the row, or
    reports the queue gone.

    A trigger holding many queues asks this for all those that look in one turn: after a
    burst of messages to a thousand queues, the queues waiting for the readers fired for them
    cost five statements a poll between them, not ten each."""
    wanted = list(dict.fromkeys(monitors))
    out: dict[Watched, Outlook] = {}
    if not wanted:
        return out
    now = utcnow()
    with broker.read_connection() as conn:
        idle = _idle(conn, [(w.queue_id, w.key) for w in wanted])
        rest = []
        for w in wanted:
            if (w.queue_id, w.key) in idle:
                out[w] = Outlook.IDLE
            else:
                rest.append(w)
        if not rest:
            return out
        ids = sorted({w.queue_id for w in rest})
        queues = {
            row.queue_id: row
            for row in conn.execute(
                select(s.queue.c.queue_id, s.queue.c.status, s.queue.c.activation).where(
                    s.queue.c.queue_id.in_(ids)
                )
            )
        }
        states = {
            (row.queue_id, row.monitor_key): _state(row)
            for row in conn.execute(select(_a).where(_a.c.queue_id.in_(ids)))
        }
        tallies = readiness.tally(conn, queue_ids=ids, now=now)
        readers = reader_rows(conn, ids)
        monotonic = conn.dialect.name == "postgresql"
    for w in rest:
        qrow, state = queues.get(w.queue_id), states.get((w.queue_id, w.key))
        if qrow is None or state is None:
            continue
        obs = observation(qrow, tallies.get(w.queue_id), monotonic_order=monotonic)
        rows = readers.get(w.queue_id) or _NO_READERS
        if rows.untidy(obs, now):
            continue
        d = decide(
            w.mode,
            obs,
            state,
            running=rows.live + rows.starting,
            max_readers=w.max_readers or obs.activation.max_readers,
            min_depth=w.min_depth,
            now=now,
            sample_seconds=w.sample_seconds,
        )
        if d.fire or (d.sample and obs.depth != state.last_depth):
            continue
        out[w] = Outlook.QUIET
    return out


_NO_READERS = ReaderRows()


def _idle(conn: Connection, wanted: list[tuple[int, str]]) -> set[tuple[int, str]]:
    """Of ``wanted`` (queue id, monitor key), those with nothing to do: no message waits in
    the queue (ready, held or leased), no reader of it is starting, running or unaccounted
    for, and the monitor's last look recorded it empty. :meth:`Monitor.check` would neither
    fire nor write anything for them (bar purging reader rows finished long ago, which its next
    real look does), in any mode; and only a new message can change that (its INSERT notifies
    the queue's channel). One statement for all of them (:func:`quiet_monitors`' first). A
    queue id that no longer exists is not idle: its look by name reports what happened."""
    if conn.dialect.name == "postgresql":
        rows = conn.execute(
            _IDLE_PG,
            {"ids": [qid for qid, _ in wanted], "keys": [key for _, key in wanted]},
        ).all()
    else:
        a, q, m = _a, s.queue, s.message
        waiting = select(m.c.queue_id).where(
            m.c.queue_id == q.c.queue_id, m.c.status == STATUS_READY
        )
        reading = select(_r.c.queue_id).where(
            _r.c.queue_id == q.c.queue_id, _r.c.finished_at.is_(None)
        )
        rows = conn.execute(
            select(a.c.queue_id, a.c.monitor_key)
            .join(q, q.c.queue_id == a.c.queue_id)
            .where(
                a.c.queue_id.in_(sorted({qid for qid, _ in wanted})),
                a.c.last_depth == 0,
                ~waiting.exists(),
                ~reading.exists(),
            )
        ).all()
    return {(row[0], row[1]) for row in rows} & set(wanted)


# One statement for a thousand monitors: the pairs travel as two arrays (an IN list of 2,000
# parameters costs more to send and convert than the query takes to run).
_IDLE_PG = text(
    """
    SELECT a.queue_id, a.monitor_key
    FROM unnest(CAST(:ids AS integer[]), CAST(:keys AS text[])) AS w(queue_id, monitor_key)
    JOIN broker_activation a ON a.queue_id = w.queue_id AND a.monitor_key = w.monitor_key
    WHERE a.last_depth = 0
      AND NOT EXISTS (SELECT 1 FROM broker_message m
                      WHERE m.queue_id = a.queue_id AND m.status = :ready)
      AND NOT EXISTS (SELECT 1 FROM broker_activation_reader r
                      WHERE r.queue_id = a.queue_id AND r.finished_at IS NULL)
    """
).bindparams(ready=STATUS_READY)


def due_step(broker: BrokerContext, every: float = 1.0) -> None:
    """Run the broker's due work (timers, lifetimes, dead readers) at most every ``every``
    seconds per :class:`Broker`: a monitor does it so that a timer on a queue nobody reads still
    fires, and its DialogTimer message then activates a reader. Monitors also keep the queue
    depth history (:func:`airflow_broker.operations.sampling.sample_step`, its own interval; never
    raises).
    """
    now = time.monotonic()
    if now >= broker.next_due_work:
        broker.next_due_work = now + every
        run_due(broker)
    sample_step(broker)
