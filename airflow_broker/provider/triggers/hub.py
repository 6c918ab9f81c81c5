"""What the triggers of one process share per broker database: one LISTEN connection, a few
threads, and looks batched per wake-up.

A triggerer runs all its triggers in one event loop; a deployment may have a thousand queues
activated and a thousand dialogs waited on in it. Per broker database and event loop, whatever
the number of triggers, there is:

- **one LISTEN connection** (:class:`Hub`), LISTENing on every channel a trigger waits on (a
  queue's ``airflow_broker_q<id>``, the transmitter's ``airflow_broker_transmit``); a
  notification wakes only the triggers waiting on its channel. Channels are LISTENed when the
  first trigger waits on them and UNLISTENed when the last one stops; the connection is closed
  with its last trigger.
- **a few threads** (:data:`DATABASE_THREADS`, :func:`in_database`) for the triggers' blocking
  work, each using at most one connection of the shared broker's pool at a time: a database
  that hangs ties up only its own threads, never those of the triggers of another database.
- **batched looks** (:class:`Looks`): the looks asked for in one turn of the event loop (the
  triggers whose polls fall due together, or those a notification woke) are sorted out by one
  query for all of them (which of them have anything to do: a queue with nothing waiting and
  no reader has none), and only the others make their full look, on those threads.

So a triggerer holds at most ``1 + DATABASE_THREADS`` connections to a broker database (plus
one for a moment while the first trigger opens the broker), however many triggers it runs:
docs/airflow.md documents the number.

Polls are aligned: a trigger waiting ``poll_interval`` seconds wakes at the next multiple of it
on the event loop's clock, so triggers with one interval wake in the same turn and share one
batched look.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from airflow_broker.activation.runner import LISTEN_RECONNECT_SECONDS
from airflow_broker.provider.compat import to_thread_in

if TYPE_CHECKING:
    from airflow_broker.broker import Broker

log = logging.getLogger("airflow_broker")
_R = TypeVar("_R")

# ---------------------------------------------------------------------------------------------
# Threads per database
# ---------------------------------------------------------------------------------------------

#: Threads per broker database for the triggers' blocking work on it (each uses at most one
#: connection at a time).
DATABASE_THREADS = 3
_executors: dict[str, ThreadPoolExecutor] = {}
_executors_lock = threading.Lock()


def _executor(key: str) -> ThreadPoolExecutor:
    with _executors_lock:
        found = _executors.get(key)
        if found is None:
            found = _executors[key] = ThreadPoolExecutor(
                DATABASE_THREADS, thread_name_prefix="airflow-broker-db"
            )
        return found


async def in_database(key: str, func: Callable[..., _R], *args: Any) -> _R:
    """Run a trigger's blocking work on a broker database in that database's own threads
    (:data:`DATABASE_THREADS`, keyed by ``key``: :func:`database_key`, or the Airflow
    connection id while the broker is not open yet): a database that hangs ties up its own
    threads, never those the triggers of other databases wait on."""
    return await to_thread_in(_executor(key), func, *args)


def database_key(broker: Broker) -> str:
    """The key of ``broker``'s database: its threads, its hub."""
    return broker.engine.url.render_as_string(hide_password=False)


def _forget_in_child() -> None:
    _executors.clear()


os.register_at_fork(after_in_child=_forget_in_child)

# ---------------------------------------------------------------------------------------------
# One LISTEN connection per database and event loop
# ---------------------------------------------------------------------------------------------


def _named(channels: Iterable[str], shown: int = 3) -> str:
    names = sorted(channels)
    if len(names) <= shown:
        return ", ".join(names) or "no channel"
    return f"{', '.join(names[:shown])} and {len(names) - shown} more"


@dataclass(eq=False)
class Hub:
    """One psycopg async connection LISTENing on every channel the triggers of one event loop
    wait on in one database; wakes the waiters of the channel a notification names.

    It keeps listening for as long as a trigger waits: when the server ends its connection it
    connects again (at once, then every :data:`LISTEN_RECONNECT_SECONDS`), LISTENs on every
    channel again and wakes every waiter, each of which looks again (what was notified while
    the connection was away is lost).
    """

    key: str
    params: dict[str, Any]
    #: channel -> the events of the triggers waiting on it
    waiters: dict[str, set[asyncio.Event]] = field(default_factory=dict)
    _counted: set[tuple[str, asyncio.Event]] = field(default_factory=set)
    conn: Any = None
    task: asyncio.Task[None] | None = None
    #: closed for good (by its last waiter, or its first connection failed)
    broken: bool = False
    #: times it listened again after losing its connection
    reconnects: int = 0
    _listening: set[str] = field(default_factory=set)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: futures resolved once the connection LISTENs on every channel wanted when they came
    _synced: list[asyncio.Future[bool]] = field(default_factory=list)
    #: the connection was lost and made again: wake every waiter after the next LISTENs
    _again: bool = False

    @property
    def refs(self) -> int:
        """Waits in all whose channel is LISTENed on (a trigger waiting on two channels counts
        twice)."""
        return len(self._counted)

    async def subscribe(self, channel: str, event: asyncio.Event) -> bool:
        """Wake ``event`` on each notification on ``channel``; returns once the connection
        LISTENs on it (True), or False when it could not connect (then the caller polls)."""
        if self.broken:
            return False
        self.waiters.setdefault(channel, set()).add(event)
        if not (channel in self._listening and self.conn is not None):
            done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self._synced.append(done)
            self._changed.set()
            if self.task is None:
                self.task = asyncio.create_task(self._run(), name=f"airflow-broker-{self.key}")
            if not await asyncio.shield(done):
                self._drop(channel, event)
                return False
        self._counted.add((channel, event))
        return True

    def unsubscribe(self, channel: str, event: asyncio.Event) -> bool:
        """Stop waking ``event``; True when no trigger waits any more (close the hub)."""
        self._drop(channel, event)
        return not self.waiters

    def _drop(self, channel: str, event: asyncio.Event) -> None:
        self._counted.discard((channel, event))
        events = self.waiters.get(channel)
        if events is not None and event in events:
            events.discard(event)
            if not events:
                del self.waiters[channel]
                self._changed.set()  # UNLISTEN it

    def wake(self, channel: str | None = None) -> None:
        """Wake the waiters of ``channel`` (None: every waiter)."""
        if channel is None:
            for events in self.waiters.values():
                for event in events:
                    event.set()
            return
        for event in self.waiters.get(channel, ()):
            event.set()

    def _dispatch(self, note: Any) -> None:
        self.wake(note.channel)

    # -- the connection ---------------------------------------------------------------------

    async def _connect(self) -> None:
        import psycopg

        self.conn = await psycopg.AsyncConnection.connect(autocommit=True, **self.params)
        self._listening = set()

    async def _sync(self) -> None:
        """LISTEN on the channels waited on, UNLISTEN the others (one statement each, our own
        channel names, never user text); then tell the subscribers that asked before it
        began. What is notified while a statement runs is dispatched too (a notify handler
        meanwhile)."""
        conn = self.conn
        synced, self._synced = self._synced, []
        wanted = set(self.waiters)
        conn.add_notify_handler(self._dispatch)
        try:
            for ch in sorted(self._listening - wanted):
                await conn.execute(f'UNLISTEN "{ch}"')
                self._listening.discard(ch)
            for ch in sorted(wanted - self._listening):
                await conn.execute(f'LISTEN "{ch}"')
                self._listening.add(ch)
        except BaseException:
            self._synced[:0] = synced  # told after the next one
            raise
        finally:
            conn.remove_notify_handler(self._dispatch)
        for done in synced:
            if not done.done():
                done.set_result(True)
        if self._again:
            self._again = False
            log.info("LISTEN on %s again", _named(self.waiters))
            self.wake()  # what was notified while the connection was away is lost: look again

    async def _notes(self) -> None:
        notes = self.conn.notifies()
        try:
            async for note in notes:
                self._dispatch(note)
        finally:
            await notes.aclose()  # gives the connection's lock back at once
        raise ConnectionError("the connection ended")

    async def _serve(self) -> None:
        """Listen until the connection is lost (raises what ended it)."""
        while True:
            self._changed.clear()
            await self._sync()
            reading = asyncio.ensure_future(self._notes())
            changed = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait({reading, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
                if not reading.done():
                    reading.cancel()  # an idle connection: nothing half-read is lost
                await asyncio.wait({reading})
            if not reading.cancelled():
                reading.result()  # the connection was lost: raises

    async def _run(self) -> None:
        try:
            await self._connect()
        except Exception as exc:
            log.warning("cannot LISTEN on %s (%s): polling instead", _named(self.waiters), exc)
            self._fail()
            return
        while True:
            try:
                await self._serve()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "LISTEN on %s lost (%s): connecting again every %g s, polling meanwhile",
                    _named(self.waiters),
                    str(exc).strip() or type(exc).__name__,
                    LISTEN_RECONNECT_SECONDS,
                )
            await self._reconnect()
            self.reconnects += 1
            self._again = True  # wake every waiter once it LISTENs again

    async def _reconnect(self) -> None:
        """Until connected again: at once, then every LISTEN_RECONNECT_SECONDS."""
        lost, self.conn = self.conn, None
        if lost is not None:
            with contextlib.suppress(Exception):
                await lost.close()
        while True:
            try:
                await self._connect()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # reported once, when the connection was lost
                log.debug("LISTEN on %s: cannot connect yet (%s)", _named(self.waiters), exc)
            await asyncio.sleep(LISTEN_RECONNECT_SECONDS)

    def _fail(self) -> None:
        self.broken = True
        table = _listeners.get(asyncio.get_running_loop(), {})
        if table.get(self.key) is self:
            del table[self.key]
        synced, self._synced = self._synced, []
        for done in synced:
            if not done.done():
                done.set_result(False)

    async def close(self) -> None:
        self.broken = True
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})  # without raising its CancelledError here
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close()
        for done in self._synced:
            if not done.done():
                done.set_result(False)


#: event loop -> database key -> its hub
_listeners: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Hub]]
_listeners = weakref.WeakKeyDictionary()


def hub(key: str, params: dict[str, Any]) -> Hub:
    """The running event loop's hub for database ``key`` (made on first use)."""
    table = _listeners.setdefault(asyncio.get_running_loop(), {})
    found = table.get(key)
    if found is None or found.broken:
        found = table[key] = Hub(key, params)
    return found


async def release(found: Hub) -> None:
    """Close ``found`` if no trigger waits on it any more."""
    if found.waiters:
        return
    table = _listeners.get(asyncio.get_running_loop(), {})
    if table.get(found.key) is found:
        del table[found.key]
    await found.close()


def aligned(limit: float, now: float) -> float:
    """How long to sleep to wake at the next multiple of ``limit`` seconds (at most ``limit``):
    triggers polling at one interval wake in the same turn of the loop and share one look."""
    if limit <= 0:
        return 0.0
    return limit - (now % limit)


# ---------------------------------------------------------------------------------------------
# Looks batched per turn of the event loop
# ---------------------------------------------------------------------------------------------

#: ``sort_out(broker, items)``: of the items asked about in one batch, those whose full look
#: would find nothing to do (it is skipped), each mapped to the result to give instead.
SortOut = Callable[[Any, Any], Mapping[Any, Any]]


class _Idle:
    def __repr__(self) -> str:
        return "IDLE"


#: What :meth:`Looks.ask` returns for an item its sort-out found idle.
IDLE: Any = _Idle()


@dataclass(eq=False)
class _Ask:
    item: Hashable
    full: Callable[[], Any]
    future: asyncio.Future[Any]


@dataclass(eq=False)
class Looks:
    """Looks of many triggers on one database, batched per turn of the event loop: one query
    (a ``SortOut``, per kind of look) tells which of them have anything to do, and only those
    make their full look."""

    key: str
    broker: Broker
    before: Callable[[Broker], None] | None = None
    _pending: dict[SortOut, list[_Ask]] = field(default_factory=dict)
    _running: asyncio.Task[None] | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    #: batches sorted out, and full looks made (for tests and the bench)
    batches: int = 0
    full_looks: int = 0

    async def ask(self, sort_out: SortOut, item: Hashable, full: Callable[[], _R]) -> _R | Any:
        """``full()`` (in the database's threads) unless ``sort_out`` finds ``item`` has
        nothing to do (then what it maps ``item`` to instead)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.setdefault(sort_out, []).append(_Ask(item, full, future))
        if self._running is None:
            self._running = loop.create_task(self._rounds())
        return await future

    def _sort(self, batch: dict[SortOut, list[_Ask]]) -> dict[SortOut, Mapping[Hashable, Any]]:
        if self.before is not None:
            self.before(self.broker)
        return {
            sort_out: sort_out(self.broker, list(dict.fromkeys(a.item for a in asks)))
            for sort_out, asks in batch.items()
        }

    async def _full(self, ask: _Ask) -> None:
        try:
            result = await in_database(self.key, ask.full)
        except Exception as exc:
            if not ask.future.done():
                ask.future.set_exception(exc)
            return
        if not ask.future.done():
            ask.future.set_result(result)

    async def _rounds(self) -> None:
        try:
            await asyncio.sleep(0)  # the rest of this turn's asks join the batch
            while self._pending:
                batch, self._pending = self._pending, {}
                try:
                    idle = await in_database(self.key, self._sort, batch)
                except Exception as exc:
                    # Each trigger's own look meets the error and handles it as it does.
                    log.debug("batched look on %s failed (%s): each looks alone", self.key, exc)
                    idle = {}
                self.batches += 1
                for sort_out, asks in batch.items():
                    quiet = idle.get(sort_out, {})
                    for ask in asks:
                        if ask.future.done():
                            continue  # its trigger was cancelled meanwhile
                        if ask.item in quiet:
                            ask.future.set_result(quiet[ask.item])
                        else:
                            self.full_looks += 1
                            task = asyncio.ensure_future(self._full(ask))
                            self._tasks.add(task)
                            task.add_done_callback(self._tasks.discard)
                await asyncio.sleep(0)
        finally:
            self._running = None
            # Left only when this task was cancelled (the loop closing): nobody will answer.
            left, self._pending = self._pending, {}
            for asks in left.values():
                for ask in asks:
                    ask.future.cancel()


#: event loop -> database key -> its looks
_looks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Looks]]
_looks = weakref.WeakKeyDictionary()


def looks(broker: Broker, before: Callable[[Broker], None] | None = None) -> Looks:
    """The running event loop's batched looks on ``broker``'s database. ``before(broker)``
    runs once per batch, before the sorting out (the due work every look does)."""
    key = database_key(broker)
    table = _looks.setdefault(asyncio.get_running_loop(), {})
    found = table.get(key)
    if found is None or found.broker is not broker:
        found = table[key] = Looks(key, broker, before)
    return found


__all__ = [
    "DATABASE_THREADS",
    "IDLE",
    "Hub",
    "Looks",
    "aligned",
    "database_key",
    "hub",
    "in_database",
    "looks",
    "release",
]
