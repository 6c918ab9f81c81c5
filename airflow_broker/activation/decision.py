"""Activation's decisions, pure: how many readers a queue's monitor starts, and when.

Seed 004: a monitor starts a reader when messages arrive and none is running, starts more while
the queue keeps growing, never more than ``max_readers`` and never more than there are
conversation groups with messages. The ``depth`` and ``growth`` modes are this project's
additions for queues whose readers should start in batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from airflow_broker.errors import InvalidDefinition
from airflow_broker.messaging.definitions import Activation

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
