"""Bounded waits on far brokers: a broker that hangs stops nothing but its own messages.

A far broker that refuses connections answers at once; one that *hangs* (its server stopped,
or a network partition: connections neither refused nor answered) would hold the delivering
thread until TCP gives up, about 15 minutes on Linux. Every wait on another broker is bounded:

- **connecting**: libpq's ``connect_timeout`` (:data:`CONNECT_TIMEOUT`, 5 s);
- **each operation** (a batch's accept, an inbox push or collection): :func:`answer_within`
  gives it :data:`ANSWER_TIMEOUT` seconds (30; environment ``AIRFLOW_BROKER_ANSWER_TIMEOUT``).
  Past it a watchdog thread shuts down the sockets of the far broker's connections, so the
  waiting call fails at once (psycopg sees the connection closed, and SQLAlchemy's pool throws
  it away: a hung connection is never used again), and the operation raises
  :class:`~.packets.Unreachable` ("no answer from broker://b for 30 s"). The far broker is then
  *hung*: operations on it fail at once for the next :data:`ANSWER_TIMEOUT` seconds, and the
  delivery pass stops waiting for it (:mod:`.lanes`) until it answers again;
- **the server side**, on a direct connection (not behind a pooler): the far session's
  ``idle_in_transaction_session_timeout`` is twice the answer timeout, so a far transaction
  whose delivering process vanished in a partition releases its locks; and ``statement_timeout``
  is the answer timeout;
- **the network**: TCP keepalives and ``tcp_user_timeout`` (libpq parameters, unless the URL
  gives its own) notice a silent peer in seconds even between operations.

Per peer, the answer timeout and the delivery pass's patience (:data:`PATIENCE`) may be given as
query parameters of its URL (``?answer_timeout=10&patience=2``; in an Airflow connection, the
``extra`` keys of the same names): they are taken off before the URL reaches libpq.

Exactly once is untouched: a batch cut while the far broker may or may not have committed it
stays in the sender's transmission queue and goes again; the far broker recognizes what it
already has by sequence number and acknowledges it again.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import event, make_url
from sqlalchemy.engine import URL, Engine

from airflow_broker.storage.adapters import PEER_LIMIT_PARAMETERS
from airflow_broker.storage.context import BrokerContext
from airflow_broker.transport.packets import Unreachable

log = logging.getLogger("airflow_broker")


def env_number(name: str, default: float, kind: Callable[[str], float] = float) -> Any:
    """The positive number in environment variable ``name`` (``kind``: int or float), else
    ``default`` (a warning says so when the variable is set to something else)."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        number = kind(value)
    except ValueError:
        number = -1
    if number <= 0:
        log.warning("%s=%r is not a positive number: %s used", name, value, default)
        return default
    return number


#: Seconds to wait for a far database's server to answer a connection attempt.
CONNECT_TIMEOUT = 5
#: Seconds a far broker may take to answer one operation before its connections are cut and it
#: counts as hung (read at each use: a process or a test may change it).
ANSWER_TIMEOUT: float = env_number("AIRFLOW_BROKER_ANSWER_TIMEOUT", 30.0)
#: Seconds a delivery pass waits for a destination that answered last time before it records
#: that destination's messages as waiting and goes on (:mod:`.lanes`); the push goes on in the
#: background, bounded by ANSWER_TIMEOUT, and what it brings back is recorded then.
PATIENCE: float = env_number("AIRFLOW_BROKER_DELIVERY_PATIENCE", 5.0)

#: TCP settings given to libpq for a peer whose URL does not set them: an idle connection is
#: probed after 10 s and given up after 3 unanswered probes 5 s apart; data unacknowledged for
#: ANSWER_TIMEOUT ends the connection (tcp_user_timeout, milliseconds).
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
              "keepalives_count": 3}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Limits:
    """A peer's own bounds (None: the module's default at the time of use)."""

    answer_timeout: float | None = None
    patience: float | None = None

    def answer_seconds(self) -> float:
        return float(self.answer_timeout if self.answer_timeout is not None else ANSWER_TIMEOUT)

    def patience_seconds(self) -> float:
        return float(self.patience if self.patience is not None else PATIENCE)


def split_limits(url: str) -> tuple[str, Limits]:
    """``url`` without its :data:`~airflow_broker.storage.adapters.PEER_LIMIT_PARAMETERS`
    (they are not libpq's), and the limits they gave. A value that is not
    a positive number raises :class:`Unreachable` naming it."""
    parsed = make_url(url)
    given = {k: parsed.query[k] for k in PEER_LIMIT_PARAMETERS if k in parsed.query}
    if not given:
        return url, Limits()
    values: dict[str, float] = {}
    for key, raw in given.items():
        text = raw[-1] if isinstance(raw, tuple) else raw
        try:
            values[key] = float(text)
        except ValueError:
            values[key] = -1.0
        if values[key] <= 0:
            where = parsed.render_as_string(hide_password=True)
            raise Unreachable(f"{where}: {key}={text!r} is not a positive number of seconds")
    clean: URL = parsed.difference_update_query(list(given))
    return clean.render_as_string(hide_password=False), Limits(**values)


def connect_args(url: str, limits: Limits) -> dict[str, Any]:
    """libpq parameters for a PostgreSQL peer: the connect timeout, keepalives and
    ``tcp_user_timeout``, each unless the URL gives its own (the URL's would be overridden)."""
    query = make_url(url).query
    args: dict[str, Any] = {}
    if "connect_timeout" not in query:
        args["connect_timeout"] = CONNECT_TIMEOUT
    for key, value in KEEPALIVES.items():
        if key not in query:
            args[key] = value
    if "tcp_user_timeout" not in query:
        args["tcp_user_timeout"] = int(limits.answer_seconds() * 1000)
    return args


# ---------------------------------------------------------------------------------------------
# Peers: their limits, their connections, whether they answer
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Watched:
    """What this module keeps of a peer broker."""

    limits: Limits
    #: the peer's open DBAPI connections (cut all at once when it hangs)
    connections: weakref.WeakSet[Any]
    #: time.monotonic() until which operations fail at once (it did not answer), or 0
    hung_until: float = 0.0
    #: why it counts as hung
    reason: str = ""
    #: it was cut and has not answered since (a pass does not wait for it: lanes)
    suspect: bool = False


_watched: weakref.WeakKeyDictionary[Engine, _Watched] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def watch(peer: BrokerContext, limits: Limits) -> None:
    """Keep ``peer``'s connections so a deadline can cut them, and on a direct PostgreSQL
    connection set the server-side timeouts (see the module docstring)."""
    with _lock:
        _track(peer, _Watched(limits, weakref.WeakSet()), server_side=True)


def _track(peer: BrokerContext, watched: _Watched, *, server_side: bool) -> _Watched:
    """Register ``watched`` for ``peer``'s engine (the caller holds :data:`_lock`): its new
    connections are kept (and with ``server_side`` given the far session's timeouts), and none
    is made while it counts as hung."""
    engine = peer.engine
    _watched[engine] = watched
    if engine.dialect.name != "postgresql":
        return watched

    def made(dbapi_conn: Any, _record: Any) -> None:
        watched.connections.add(dbapi_conn)
        # Known by now: the adapter's own connect handler, which runs first, found out.
        pooled = getattr(getattr(peer, "adapter", None), "_pooled", None)
        if server_side and pooled is False:
            seconds = watched.limits.answer_seconds()
            # One round trip per new connection; never behind a pooler (a SET there would stay
            # with a server connection other clients share).
            with dbapi_conn.cursor() as cur:
                cur.execute(
                    "SELECT set_config('statement_timeout', %s, false), "
                    "set_config('idle_in_transaction_session_timeout', %s, false)",
                    (f"{int(seconds * 1000)}", f"{int(seconds * 2000)}"),
                )
            if not dbapi_conn.autocommit:
                dbapi_conn.commit()

    def connecting(_dialect: Any, _record: Any, _cargs: Any, _cparams: Any) -> None:
        # No new connection to a peer that counts as hung (a pool's reconnect after its
        # connections were cut would wait out the connect timeout on a server that does not
        # answer): the attempt fails at once, as a refused connection does.
        if watched.hung_until > time.monotonic():
            import psycopg

            raise psycopg.OperationalError(f"{watched.reason}: not connecting again yet")

    # After the adapter's own connect handlers (it finds out about a pooler on the first).
    event.listen(engine, "connect", made)
    event.listen(engine, "do_connect", connecting)
    return watched


def limits_of(peer: BrokerContext) -> Limits:
    watched = _watched.get(peer.engine)
    return watched.limits if watched is not None else Limits()


def _entry(peer: BrokerContext) -> _Watched:
    with _lock:
        watched = _watched.get(peer.engine)
        if watched is None:
            # A broker the resolver handed over as an object: watched from its first deadline
            # (its sessions are the caller's: no server-side timeouts set on them).
            watched = _track(peer, _Watched(Limits(), weakref.WeakSet()), server_side=False)
        return watched


def hung(peer: BrokerContext) -> str | None:
    """Why ``peer`` counts as hung now (it did not answer within its answer timeout a moment
    ago), or None."""
    watched = _watched.get(peer.engine)
    now = time.monotonic()
    if watched is None or watched.hung_until <= now:
        return None
    again = datetime.now(UTC) + timedelta(seconds=watched.hung_until - now)
    return f"{watched.reason}; tried again from {again:%H:%M:%S} UTC"


def suspected(peer: BrokerContext) -> bool:
    """Whether ``peer`` did not answer in time and has not answered since."""
    watched = _watched.get(peer.engine)
    return watched is not None and watched.suspect


def answered(peer: BrokerContext) -> None:
    """``peer`` answered: it no longer counts as hung."""
    watched = _watched.get(peer.engine)
    if watched is not None and watched.suspect:
        watched.hung_until = 0.0
        watched.suspect = False
        log.info("%r answers again", peer)


def _cut(watched: _Watched, address: str, reason: str, seconds: float) -> int:
    """Shut down the sockets of a hung peer's connections: whatever waits on them fails now,
    and the pool throws them away; it counts as hung for ``seconds``. Returns how many were
    cut."""
    watched.hung_until = time.monotonic() + seconds
    watched.suspect = True
    watched.reason = f"{reason} (at {datetime.now(UTC):%H:%M:%S} UTC)"
    cut = 0
    for dbapi_conn in list(watched.connections):
        try:
            if dbapi_conn.closed:
                continue
            fd = dbapi_conn.pgconn.socket
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
            cut += 1
        except Exception as exc:  # closed meanwhile
            log.debug("cutting a connection to %s: %s", address, exc)
    log.warning("%s; its %d connection(s) were cut", reason, cut)
    return cut


# ---------------------------------------------------------------------------------------------
# Deadlines and their watchdog thread
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Deadline:
    at: float
    seconds: float
    address: str
    watched: _Watched
    #: the operation ended (the watchdog leaves it alone)
    done: bool = False
    #: the watchdog cut it
    struck: bool = False


_heap: list[tuple[float, int, _Deadline]] = []
_order = itertools.count()
_wake = threading.Condition()
_watchdog: threading.Thread | None = None
_local = threading.local()


def _watch_deadlines() -> None:
    global _watchdog
    while True:
        due: list[_Deadline] = []
        with _wake:
            if _watchdog is not threading.current_thread():
                return
            now = time.monotonic()
            while _heap and (_heap[0][2].done or _heap[0][0] <= now):
                _at, _n, d = heapq.heappop(_heap)
                if not d.done:
                    d.struck = True
                    due.append(d)
            if not due:
                _wake.wait(_heap[0][0] - now if _heap else 60.0)
                if not _heap:
                    _watchdog = None  # started again by the next deadline
                    return
                continue
        for d in due:
            _cut(
                d.watched,
                d.address,
                f"no answer from {d.address} for {_secs(d.seconds)} s",
                d.seconds,
            )


def _arm(d: _Deadline) -> None:
    global _watchdog
    with _wake:
        heapq.heappush(_heap, (d.at, next(_order), d))
        if _watchdog is None or not _watchdog.is_alive():
            _watchdog = threading.Thread(
                target=_watch_deadlines, name="airflow-broker-deadlines", daemon=True
            )
            _watchdog.start()
        elif _heap[0][2] is d:
            _wake.notify()


def _secs(seconds: float) -> str:
    return f"{round(seconds, 1):g}"


def _connect_timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is libpq's connect timeout."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if "timeout expired" in str(getattr(seen, "orig", None) or seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _reset_in_child() -> None:
    """A forked child has no watchdog thread and none of its parent's deadlines."""
    global _watchdog, _wake, _lock
    _heap.clear()
    _watchdog = None
    _wake = threading.Condition()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_in_child)


@contextlib.contextmanager
def answer_within(
    peer: BrokerContext, address: str, *, seconds: float | None = None
) -> Iterator[None]:
    """Bound what the block does on ``peer`` (the broker at ``address``) to its answer timeout
    (or ``seconds``): past it the peer's connections are cut and the block raises
    :class:`Unreachable` ("no answer from ADDRESS for N s"). A peer that did not answer a
    moment ago fails at once. A deadline inside another (a forwarder's onward push) ends a
    little before the outer one."""
    if peer.engine.dialect.name != "postgresql":
        yield
        return
    watched = _entry(peer)
    reason = hung(peer)
    if reason is not None:
        raise Unreachable(reason)
    if seconds is None:
        seconds = watched.limits.answer_seconds()
    now = time.monotonic()
    outer: _Deadline | None = getattr(_local, "deadline", None)
    if outer is not None and not outer.done:
        seconds = max(min(seconds, (outer.at - now) * 0.8), 0.1)
    d = _Deadline(now + seconds, seconds, address, watched)
    _arm(d)
    _local.deadline = d
    try:
        yield
    except Exception as exc:
        if d.struck:
            raise Unreachable(f"no answer from {address} for {_secs(seconds)} s") from exc
        if _connect_timed_out(exc):
            # A server that takes connections but never answers them (a stopped server, a
            # partition): as hung as one that stops answering a statement.
            d.done = True
            given = peer.engine.url.query.get("connect_timeout", CONNECT_TIMEOUT)
            reason = f"no answer from {address} for {given} s (connecting)"
            _cut(watched, address, reason, seconds)
            raise Unreachable(reason) from exc
        raise
    finally:
        d.done = True
        _local.deadline = outer
    if d.struck:
        # The block ended on its own just as the watchdog struck: its connections are cut
        # all the same, and what it did stands.
        log.info("%s answered just as its deadline struck", address)
    elif watched.suspect:
        answered(peer)


__all__ = [
    "ANSWER_TIMEOUT",
    "CONNECT_TIMEOUT",
    "PATIENCE",
    "Limits",
    "answer_within",
    "answered",
    "connect_args",
    "hung",
    "limits_of",
    "split_limits",
    "suspected",
    "watch",
]
