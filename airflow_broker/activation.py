"""Activation: when a queue's monitor starts readers, and how readers register.

Seed 004's activation, made testable: a queue's monitor starts a reader when messages arrive and
none is running, starts more while the queue keeps growing, never more than ``max_readers`` and
never more than there are conversation groups with messages; each reader drains the queue and
exits.

This module is shared by the three monitors (the Airflow trigger, the deferrable sensor and the
in-process :class:`~airflow_broker.runner.ActivationRunner`) and by the two kinds of reader (the
Airflow ``DrainQueueOperator`` and the runner's threads), so that they all behave alike:

- :func:`readers_to_start` and :func:`decide` are the decisions, pure.
- :class:`Monitor` is one monitor of one queue: it observes the queue, applies :func:`decide` and
  records in the broker database (table ``broker_activation``) what it fired for. Firing is a
  compare-and-set on the monitor's cursor, so two monitors (two triggerers, or a restarted one)
  never fire twice for the same messages.
- :class:`ReaderSlot` registers a running reader (table ``broker_activation_reader``), keeps its
  heartbeat, and refuses a reader beyond ``max_readers`` or beyond the groups with messages;
  :func:`drain` is the reader's loop. A monitor counts registered readers whose heartbeat is
  fresh, plus the readers it fired for that have not registered yet, so that one arrival starts
  one reader however often the monitor looks.

Everything runs without Airflow, against either engine. On PostgreSQL the monitor and the reader
registration of one queue serialize on a transaction-scoped advisory lock; on SQLite a broker
transaction already holds the database's only write lock.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import and_, delete, func, insert, or_, select, text, update
from sqlalchemy.engine import Connection

from airflow_broker import schema as s
from airflow_broker.constants import STATUS_READY
from airflow_broker.engines import aware, utcnow
from airflow_broker.errors import InvalidDefinition, UnknownObject
from airflow_broker.sampling import sample_step

if TYPE_CHECKING:
    from airflow_broker.broker import Broker
    from airflow_broker.objects import Message
    from airflow_broker.transaction import Transaction

log = logging.getLogger("airflow_broker")

#: How often a running reader refreshes its heartbeat.
HEARTBEAT_SECONDS = 10.0
#: A registered reader whose heartbeat is older than this is counted as gone (killed).
READER_TIMEOUT_SECONDS = 60.0
#: A reader a monitor fired for counts as starting for this long, or until it registers, the
#: messages it was fired for are gone, or the queue is empty.
START_TIMEOUT_SECONDS = 120.0
#: Finished reader rows are kept this long (for the UI and for tests), then purged.
FINISHED_RETENTION = timedelta(hours=1)
#: The monitor key of a queue's activation (the trigger's and the runner's default).
ACTIVATION_KEY = "activation"

#: ``arrival``: seed 004's decision (start a reader). ``depth``: the queue holds at least
#: ``min_depth`` messages and some arrived since the monitor last fired. ``growth``: the queue is
#: deeper than when the monitor last looked (sampled once per ``sample_seconds``).
Mode = Literal["arrival", "depth", "growth"]
MODES: tuple[str, ...] = ("arrival", "depth", "growth")

# pg_advisory_xact_lock(ADVISORY_CLASS, queue_id): one queue's monitors and reader registrations
# (Broker.migrate uses class 727170000).
ADVISORY_CLASS = 727170001


# ---------------------------------------------------------------------------------------------
# Settings and decisions (pure)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Activation:
    """A queue's activation settings (Service Broker's ``ACTIVATION (...)`` clause).

    :param status: whether the monitor starts readers at all.
    :param max_readers: the most readers that may run at once on the queue.
    :param reader: what a reader is: an Airflow DAG id (in Airflow) or ``"module:function"``
        (the in-process runner); None leaves it to whoever runs the monitor.
    """

    status: bool = True
    max_readers: int = 1
    reader: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_readers, int) or self.max_readers < 1:
            raise InvalidDefinition(
                f"activation max_readers must be a whole number >= 1, not {self.max_readers!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_value(cls, value: Activation | dict[str, Any] | None) -> Activation | None:
        if value is None or isinstance(value, Activation):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"status", "max_readers", "reader"}
            if unknown:
                raise InvalidDefinition(
                    f"activation has unknown settings {sorted(unknown)}; "
                    "known: status, max_readers, reader"
                )
            return cls(**value)
        raise InvalidDefinition(f"activation must be an Activation or a dict, not {value!r}")


def readers_to_start(
    *, running: int, groups_ready: int, depth: int, previous_depth: int | None, max_readers: int
) -> int:
    """How many more readers the monitor should start now.

    One reader when messages are waiting and none runs; one more while the queue keeps growing;
    never more than ``max_readers`` in all, nor more than there are conversation groups with
    messages (a group is read by one reader at a time, so extra readers would only wait).
    """
    if depth <= 0:
        return 0
    ceiling = min(max_readers, groups_ready)
    if running >= ceiling:
        return 0
    if running == 0:
        return 1
    growing = previous_depth is not None and depth > previous_depth
    return 1 if growing else 0


@dataclass(frozen=True, slots=True)
class QueueObservation:
    """What a monitor sees of a queue: its settings and its ready messages."""

    queue_id: int
    enabled: bool
    activation: Activation
    depth: int
    groups_ready: int
    #: highest and lowest queuing_order among ready messages (None: the queue is empty)
    high_water: int | None
    low_water: int | None
    #: when the newest and the oldest ready message were enqueued
    newest_at: datetime | None = None
    oldest_at: datetime | None = None
    #: queuing_order only grows (PostgreSQL's sequence). SQLite reuses the numbers of deleted
    #: rows at the top of the table, so there "arrived since" also compares enqueue times (one
    #: machine, one clock).
    monotonic_order: bool = True

    def arrived_since(self, cursor: int, fired_at: datetime | None) -> bool:
        """Whether ready messages arrived after a monitor fired at ``cursor``/``fired_at``."""
        if self.high_water is None:
            return False
        if self.high_water > cursor:
            return True
        if self.monotonic_order or fired_at is None or self.newest_at is None:
            return False
        return self.newest_at > fired_at


@dataclass(frozen=True, slots=True)
class MonitorState:
    """What a monitor recorded the last time it acted (a row of ``broker_activation``)."""

    cursor: int = 0
    fires: int = 0
    fired_at: datetime | None = None
    last_depth: int | None = None
    observed_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of :func:`decide`: fire (and for ``arrival``, how many readers to start),
    and whether this observation becomes the new growth sample."""

    fire: bool
    readers: int
    sample: bool


def decide(
    mode: str,
    obs: QueueObservation,
    state: MonitorState,
    *,
    running: int,
    max_readers: int,
    min_depth: int,
    now: datetime,
    sample_seconds: float,
) -> Decision:
    """The monitor's decision for one observation (pure).

    Growth is judged once per ``sample_seconds``: a monitor woken by every single SEND would
    otherwise see "growth" on each message and start a reader per message, which is exactly
    what seed 004 says activation does not do. Between samples only the "no reader runs" rule
    applies.

    :param running: readers registered and alive plus readers fired for and not yet registered.
    """
    due = state.observed_at is None or (now - state.observed_at).total_seconds() >= sample_seconds
    previous = state.last_depth if due else None
    if mode == "arrival":
        if not (obs.enabled and obs.activation.status) or obs.depth < min_depth:
            return Decision(False, 0, due)
        n = readers_to_start(
            running=running,
            groups_ready=obs.groups_ready,
            depth=obs.depth,
            previous_depth=previous,
            max_readers=max_readers,
        )
        return Decision(n > 0, n, due)
    if mode == "depth":
        fire = obs.depth >= min_depth and obs.arrived_since(state.cursor, state.fired_at)
        return Decision(fire, 0, due)
    if mode == "growth":
        fire = previous is not None and obs.depth > previous and obs.depth >= min_depth
        return Decision(fire, 0, due)
    raise InvalidDefinition(f"activation mode must be one of {', '.join(MODES)}, not {mode!r}")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise InvalidDefinition(f"activation mode must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


# ---------------------------------------------------------------------------------------------
# Observation and bookkeeping (shared by the monitor and reader registration)
# ---------------------------------------------------------------------------------------------

_m = s.message
_r = s.activation_reader
_a = s.activation_monitor


def _lock_queue(conn: Connection, queue_id: int) -> None:
    """Serialize one queue's monitors and reader registrations (PostgreSQL; SQLite already holds
    its single write lock from the transaction's first statement)."""
    if conn.dialect.name == "postgresql":
        conn.execute(
            text("SELECT pg_advisory_xact_lock(:cls, :queue_id)"),
            {"cls": ADVISORY_CLASS, "queue_id": queue_id},
        )


def _queue_row(conn: Connection, queue: str) -> Any:
    row = conn.execute(
        select(s.queue.c.queue_id, s.queue.c.status, s.queue.c.activation).where(
            s.queue.c.name == queue
        )
    ).first()
    if row is None:
        raise UnknownObject(f"queue {queue!r} does not exist in this broker")
    return row


def _observe(conn: Connection, row: Any) -> QueueObservation:
    ready = conn.execute(
        select(
            func.count(),
            func.count(func.distinct(_m.c.conversation_group_id)),
            func.max(_m.c.queuing_order),
            func.min(_m.c.queuing_order),
            func.max(_m.c.enqueued_at),
            func.min(_m.c.enqueued_at),
        ).where(_m.c.queue_id == row.queue_id, _m.c.status == STATUS_READY)
    ).one()
    return QueueObservation(
        queue_id=row.queue_id,
        enabled=bool(row.status),
        activation=Activation.from_value(row.activation) or Activation(),
        depth=int(ready[0] or 0),
        groups_ready=int(ready[1] or 0),
        high_water=ready[2],
        low_water=ready[3],
        newest_at=_timestamp(ready[4]),
        oldest_at=_timestamp(ready[5]),
        monotonic_order=conn.dialect.name == "postgresql",
    )


def _timestamp(value: Any) -> datetime | None:
    """min()/max() of a timestamp: SQLite hands back the stored text."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return aware(value)


def _tidy(conn: Connection, queue_id: int, obs: QueueObservation | None, now: datetime) -> None:
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


def _counts(conn: Connection, queue_id: int) -> tuple[int, int]:
    """(readers registered and not finished, readers fired for and not yet registered), after
    :func:`_tidy`."""
    row = conn.execute(
        select(
            func.count().filter(_r.c.started_at.is_not(None)),
            func.count().filter(_r.c.started_at.is_(None)),
        ).where(_r.c.queue_id == queue_id, _r.c.finished_at.is_(None))
    ).one()
    return int(row[0] or 0), int(row[1] or 0)


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

    broker: Broker
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

    def check(self) -> Fire | None:
        """Observe the queue once; record and return a :class:`Fire` when the monitor fires."""
        with self.broker.engine.begin() as conn:
            return self._check(conn, utcnow())

    def state(self) -> MonitorState:
        """What this monitor recorded last (a fresh state if it never ran)."""
        with self.broker.engine.connect() as conn:
            row = _queue_row(conn, self.queue)
            return self._load(conn, row.queue_id) or MonitorState()

    def _load(self, conn: Connection, queue_id: int) -> MonitorState | None:
        row = conn.execute(
            select(_a).where(_a.c.queue_id == queue_id, _a.c.monitor_key == self.key)
        ).first()
        if row is None:
            return None
        return MonitorState(
            cursor=row.cursor,
            fires=row.fires,
            fired_at=aware(row.fired_at),
            last_depth=row.last_depth,
            observed_at=aware(row.observed_at),
        )

    def _check(self, conn: Connection, now: datetime) -> Fire | None:
        qrow = _queue_row(conn, self.queue)
        queue_id = self.queue_id = qrow.queue_id
        _lock_queue(conn, queue_id)
        state = self._load(conn, queue_id)
        if state is None:
            conn.execute(insert(_a).values(queue_id=queue_id, monitor_key=self.key, cursor=0))
            state = MonitorState()
        obs = _observe(conn, qrow)
        _tidy(conn, queue_id, obs, now)
        live, starting = _counts(conn, queue_id)
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


# ---------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReaderRow:
    """One row of ``broker_activation_reader``."""

    reader_id: uuid.UUID
    queue: str
    monitor_key: str | None
    fired_at: datetime | None
    started_at: datetime | None
    heartbeat_at: datetime | None
    finished_at: datetime | None
    outcome: str | None
    label: str | None

    @property
    def state(self) -> str:
        """``starting`` (fired for, not registered), ``running`` or ``finished``."""
        if self.finished_at is not None:
            return "finished"
        return "starting" if self.started_at is None else "running"


def readers(broker: Broker, queue: str | None = None) -> list[ReaderRow]:
    """The readers the broker knows of (all queues, or one), oldest first."""
    stmt = (
        select(_r, s.queue.c.name)
        .join(s.queue, s.queue.c.queue_id == _r.c.queue_id)
        .order_by(func.coalesce(_r.c.fired_at, _r.c.started_at), _r.c.reader_id)
    )
    if queue is not None:
        stmt = stmt.where(s.queue.c.name == queue)
    with broker.engine.connect() as conn:
        return [
            ReaderRow(
                reader_id=r.reader_id,
                queue=r.name,
                monitor_key=r.monitor_key,
                fired_at=aware(r.fired_at),
                started_at=aware(r.started_at),
                heartbeat_at=aware(r.heartbeat_at),
                finished_at=aware(r.finished_at),
                outcome=r.outcome,
                label=r.label,
            )
            for r in conn.execute(stmt)
        ]


def register_reader(
    broker: Broker,
    queue: str,
    *,
    max_readers: int | None = None,
    label: str | None = None,
    fire_id: str | None = None,
) -> tuple[uuid.UUID, bool]:
    """Register a reader of ``queue``; returns ``(reader_id, admitted)``.

    The reader takes the place of a reader a monitor fired for (``fire_id``, or the oldest one
    waiting), so that the monitor stops counting it as starting. It is refused (recorded with
    outcome ``refused``) when ``max_readers`` readers already run, or at least as many as there
    are conversation groups with messages: it would find nothing to read.
    """
    now = utcnow()
    with broker.engine.begin() as conn:
        qrow = _queue_row(conn, queue)
        queue_id = qrow.queue_id
        _lock_queue(conn, queue_id)
        obs = _observe(conn, qrow)
        _tidy(conn, queue_id, obs, now)
        live, _starting = _counts(conn, queue_id)
        cap = max_readers or obs.activation.max_readers
        admitted = live < cap and live < obs.groups_ready
        waiting = and_(
            _r.c.queue_id == queue_id, _r.c.started_at.is_(None), _r.c.finished_at.is_(None)
        )
        claim = None
        if fire_id is not None:
            claim = conn.execute(
                select(_r.c.reader_id).where(waiting, _r.c.reader_id == uuid.UUID(fire_id))
            ).scalar()
        if claim is None:
            claim = conn.execute(
                select(_r.c.reader_id).where(waiting).order_by(_r.c.fired_at).limit(1)
            ).scalar()
        values: dict[str, Any] = {"started_at": now, "heartbeat_at": now, "label": label}
        if not admitted:
            values.update(finished_at=now, outcome="refused")
        if claim is not None:
            conn.execute(update(_r).where(_r.c.reader_id == claim).values(**values))
            reader_id: uuid.UUID = claim
        else:
            reader_id = uuid.uuid4()
            conn.execute(insert(_r).values(reader_id=reader_id, queue_id=queue_id, **values))
    if not admitted:
        log.info(
            "reader of queue %r not started: %d of at most %d readers run, %d group(s) have "
            "messages",
            queue,
            live,
            cap,
            obs.groups_ready,
        )
    return reader_id, admitted


def release_fires(broker: Broker, fire_ids: list[str]) -> int:
    """Readers a monitor fired for that will never come, because one reader came for all of
    them (Airflow merges asset events that arrive before the run starts into one run): stop
    counting them, so that the monitor may start another reader if the queue still grows.
    Returns how many were still waiting."""
    ids = [uuid.UUID(str(f)) for f in fire_ids]
    if not ids:
        return 0
    with broker.engine.begin() as conn:
        return int(
            conn.execute(
                update(_r)
                .where(
                    _r.c.reader_id.in_(ids), _r.c.started_at.is_(None), _r.c.finished_at.is_(None)
                )
                .values(finished_at=utcnow(), outcome="merged")
            ).rowcount
        )


def heartbeat_reader(broker: Broker, reader_id: uuid.UUID) -> None:
    """The reader is alive. A reader counted as lost (its heartbeat was late) counts again."""
    with broker.engine.begin() as conn:
        alive_or_lost = or_(_r.c.finished_at.is_(None), _r.c.outcome == "lost")
        conn.execute(
            update(_r)
            .where(_r.c.reader_id == reader_id, alive_or_lost)
            .values(heartbeat_at=utcnow(), finished_at=None, outcome=None)
        )


def finish_reader(broker: Broker, reader_id: uuid.UUID, outcome: str = "drained") -> None:
    """The reader has stopped (``drained``, ``failed``, ``stopped``...)."""
    with broker.engine.begin() as conn:
        conn.execute(
            update(_r)
            .where(_r.c.reader_id == reader_id)
            .values(finished_at=utcnow(), outcome=outcome)
        )


class ReaderSlot:
    """A registered reader of a queue, for the length of a ``with`` block.

    Registers on entry (see :func:`register_reader`); while admitted, a daemon thread refreshes
    the heartbeat every :data:`HEARTBEAT_SECONDS`; on exit the reader is recorded as finished
    (``failed`` when the block raised).

    :ivar admitted: False when the reader was refused: the block should read nothing.
    """

    def __init__(
        self,
        broker: Broker,
        queue: str,
        *,
        max_readers: int | None = None,
        label: str | None = None,
        fire_id: str | None = None,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
    ) -> None:
        self.broker = broker
        self.queue = queue
        self.max_readers = max_readers
        self.label = label
        self.fire_id = fire_id
        self.heartbeat_seconds = heartbeat_seconds
        self.reader_id: uuid.UUID | None = None
        self.admitted = False
        #: the outcome recorded on a clean exit
        self.outcome = "drained"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ReaderSlot:
        self.reader_id, self.admitted = register_reader(
            self.broker,
            self.queue,
            max_readers=self.max_readers,
            label=self.label,
            fire_id=self.fire_id,
        )
        if self.admitted:
            self._thread = threading.Thread(
                target=self._beat, name=f"broker-reader-heartbeat-{self.queue}", daemon=True
            )
            self._thread.start()
        return self

    def _beat(self) -> None:
        assert self.reader_id is not None
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                heartbeat_reader(self.broker, self.reader_id)
            except Exception:  # the next beat tries again; a reader is not killed by this
                log.warning("reader heartbeat on queue %r failed", self.queue, exc_info=True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.admitted and self.reader_id is not None:
            finish_reader(self.broker, self.reader_id, "failed" if exc_type else self.outcome)


# ---------------------------------------------------------------------------------------------
# The reader's loop
# ---------------------------------------------------------------------------------------------

#: A reader's handler: called with the transaction and the messages of one conversation group,
#: inside that transaction (it SENDs and ENDs through ``tx``; application state through
#: ``tx.connection``). Raising rolls the transaction back: the messages return to the queue.
Handler = Callable[["Transaction", "list[Message]"], Any]


@dataclass(frozen=True, slots=True)
class DrainReport:
    """What one reader did: transactions that received messages, and messages."""

    batches: int = 0
    messages: int = 0
    #: True when the reader stopped because the queue was empty (not max_batches or stop)
    drained: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_handler(handler: Handler | str) -> Handler:
    """A handler given as a callable, or as ``"package.module:function"``."""
    if callable(handler):
        return handler
    if not isinstance(handler, str) or ":" not in handler:
        raise InvalidDefinition(
            f"handler must be a callable or 'package.module:function', not {handler!r}"
        )
    module_name, _, attr = handler.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise InvalidDefinition(f"handler {handler!r} cannot be imported: {exc}") from exc
    if not callable(target):
        raise InvalidDefinition(f"handler {handler!r} is not callable")
    resolved: Handler = target
    return resolved


def drain(
    broker: Broker,
    queue: str,
    handler: Handler,
    *,
    top: int | None = None,
    max_batches: int | None = None,
    wait_seconds: float = 0,
    stop: threading.Event | None = None,
    committed: Callable[[int], Any] | None = None,
) -> DrainReport:
    """Read ``queue`` until it is empty: one conversation group per transaction, each handed to
    ``handler(tx, messages)`` inside that transaction.

    :param top: at most this many messages per RECEIVE.
    :param max_batches: stop after this many transactions that received messages.
    :param wait_seconds: how long a RECEIVE waits for more messages before the reader decides
        the queue is empty (seed 004's activated procedures use ``WAITFOR (RECEIVE ...)``).
    :param stop: stop between two transactions once this is set.
    :param committed: called with the number of messages after each transaction that received
        them has committed.
    """
    if max_batches is not None and (not isinstance(max_batches, int) or max_batches < 1):
        raise InvalidDefinition(f"max_batches must be a whole number >= 1, not {max_batches!r}")
    batches = messages = 0
    while max_batches is None or batches < max_batches:
        if stop is not None and stop.is_set():
            return DrainReport(batches, messages, False)
        with broker.transaction() as tx:
            received = tx.receive(queue, top=top, wait_seconds=wait_seconds)
            if received:
                handler(tx, received)
        if not received:
            return DrainReport(batches, messages, True)
        batches += 1
        messages += len(received)
        if committed is not None:
            committed(len(received))
    return DrainReport(batches, messages, False)


def due_step(broker: Broker, every: float = 1.0) -> None:
    """Run the broker's due work (timers, lifetimes, dead readers) at most every ``every``
    seconds per :class:`Broker`: a monitor does it so that a timer on a queue nobody reads still
    fires, and its DialogTimer message then activates a reader. Monitors also keep the queue
    depth history (:func:`airflow_broker.sampling.sample_step`, its own interval; never raises).
    """
    now = time.monotonic()
    if now >= broker.next_due_work:
        broker.next_due_work = now + every
        broker.run_due()
    sample_step(broker)


__all__ = [
    "ACTIVATION_KEY",
    "MODES",
    "Activation",
    "Decision",
    "DrainReport",
    "Fire",
    "Handler",
    "Monitor",
    "MonitorState",
    "QueueObservation",
    "ReaderRow",
    "ReaderSlot",
    "decide",
    "drain",
    "due_step",
    "finish_reader",
    "heartbeat_reader",
    "readers",
    "readers_to_start",
    "register_reader",
    "release_fires",
    "resolve_handler",
]
