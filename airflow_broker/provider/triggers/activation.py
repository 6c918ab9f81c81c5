"""QueueActivationTrigger: a queue's activation monitor, run by the Airflow triggerer.

The trigger makes seed 004's decision (:class:`airflow_broker.activation.Monitor`) each time the
queue may have changed, and yields one event per reader to start. In an ``AssetWatcher`` each
event becomes an asset event, and the reader DAG scheduled on that asset gets a run::

    queue_asset = Asset("broker://SupplierQueue", watchers=[AssetWatcher(
        name="supplier_queue", trigger=QueueActivationTrigger(queue="SupplierQueue"))])

    @dag(schedule=[queue_asset], max_active_runs=4)
    def supplier_reader():
        DrainQueueOperator(task_id="drain", queue="SupplierQueue", handler="pkg.mod:handle")

Everything the monitor knows is in the broker database (tables ``broker_activation`` and
``broker_activation_reader``), not in the trigger: a restarted triggerer, or a second one running
the same trigger, does not fire again for messages already fired for.

How it waits: on PostgreSQL it LISTENs on the queue's channel (``airflow_broker_q<queue_id>``,
notified by a trigger on ``broker_message`` whenever ready messages are written) through one
psycopg async connection per queue and process, shared by every trigger waiting on that queue;
``poll_interval`` is then only the fallback. On SQLite it polls every ``poll_interval``. The
blocking database work runs in threads of its own per database (:func:`in_database`: a database
that hangs ties up only its own triggers); the brokers are shared by the
triggers of one process on the same database and closed when the last one is cleaned up.

When the server ends a LISTEN connection (a restart, ``pg_terminate_backend``), the listener logs
one warning naming the channel and the error, connects again at once and then every
:data:`~airflow_broker.activation.runner.LISTEN_RECONNECT_SECONDS` (2 s) until the server takes
it, LISTENs again and wakes every trigger waiting on it: each looks at the queue again, since
what was notified while the connection was away is lost. Meanwhile the triggers poll every
``poll_interval``; the listener never gives up while a trigger uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy.exc import DBAPIError

from airflow_broker.activation import ACTIVATION_KEY, Fire, Monitor, check_mode, due_step
from airflow_broker.activation.runner import LISTEN_RECONNECT_SECONDS
from airflow_broker.errors import BrokerError, InvalidDefinition
from airflow_broker.provider.compat import (
    Asset,
    AssetWatcher,
    BaseEventTrigger,
    TriggerEvent,
    to_thread_in,
)
from airflow_broker.storage.adapters import PostgresAdapter, channel

if TYPE_CHECKING:
    from airflow_broker.broker import Broker

log = logging.getLogger("airflow_broker")
_R = TypeVar("_R")

#: Longest pause after a database error before the trigger tries again.
MAX_BACKOFF = 30.0
#: How long a trigger polls after its first LISTEN failed before it tries to LISTEN again (a
#: listener that worked and lost its connection reconnects every LISTEN_RECONNECT_SECONDS).
LISTEN_RETRY_SECONDS = 30.0

# ---------------------------------------------------------------------------------------------
# Brokers shared by the triggers of one process
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Shared:
    broker: Broker
    refs: int = 0


_brokers: dict[str, _Shared] = {}
_brokers_lock = threading.Lock()


def acquire_broker(broker_conn_id: str) -> Broker:
    """The broker of an Airflow connection, shared with this process's other triggers on the
    same database (blocking: call it in a thread). Release it with :func:`release_broker`.

    The broker is opened (its first connection made) outside the lock that guards the shared
    ones: a database that hangs holds up only the triggers that use it."""
    from airflow_broker.hooks.broker import BrokerHook

    hook = BrokerHook(broker_conn_id=broker_conn_id)
    url, _fallback = hook.broker_url()
    with _brokers_lock:
        shared = _brokers.get(url)
        if shared is not None:
            shared.refs += 1
            return shared.broker
    opened = hook.get_broker()
    with _brokers_lock:
        shared = _brokers.get(url)
        if shared is None:
            shared = _brokers[url] = _Shared(opened)
            opened = None
        shared.refs += 1
    if opened is not None:
        opened.dispose()  # another trigger opened it meanwhile
    return shared.broker


#: Threads per broker database for the triggers' blocking work on it.
DATABASE_THREADS = 4
_executors: dict[str, ThreadPoolExecutor] = {}


def _executor(key: str) -> ThreadPoolExecutor:
    with _brokers_lock:
        found = _executors.get(key)
        if found is None:
            found = _executors[key] = ThreadPoolExecutor(
                DATABASE_THREADS, thread_name_prefix="airflow-broker-db"
            )
        return found


async def in_database(key: str, func: Callable[..., _R], *args: Any) -> _R:
    """Run a trigger's blocking work on a broker database in that database's own threads
    (:data:`DATABASE_THREADS`, keyed by ``key``: the Airflow connection id): a database that
    hangs ties up its own threads, never those the triggers of other databases wait on."""
    return await to_thread_in(_executor(key), func, *args)


async def hold_broker(key: str, opener: Callable[[], Broker]) -> Broker:
    """``opener()`` (:func:`acquire_broker`, or a trigger's own) in the database's threads. A
    trigger cancelled while the database is slow to answer does not keep the broker: it is
    given back (:func:`release_broker`) once opened."""
    task = asyncio.ensure_future(in_database(key, opener))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:

        def give_back(done: asyncio.Future[Broker]) -> None:
            if not done.cancelled() and done.exception() is None:
                _executor(key).submit(release_broker, done.result())

        task.add_done_callback(give_back)
        raise


def _forget_in_child() -> None:
    _executors.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def release_broker(broker: Broker) -> None:
    """Give back a broker from :func:`acquire_broker`; the last one out disposes of it.
    Brokers that did not come from there (a test's own) are left alone."""
    with _brokers_lock:
        for url, shared in list(_brokers.items()):
            if shared.broker is broker:
                shared.refs -= 1
                if shared.refs <= 0:
                    del _brokers[url]
                    broker.dispose()
                return


# ---------------------------------------------------------------------------------------------
# Waiting: one LISTEN connection per event loop, database and queue
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Listener:
    """A psycopg async connection LISTENing on one queue's channel; wakes its subscribers.

    It keeps listening for as long as it is open: when the server ends its connection it
    connects again (at once, then every :data:`LISTEN_RECONNECT_SECONDS`), LISTENs again and
    wakes its subscribers, whose callers look at the queue again (see the module docstring).
    """

    params: dict[str, Any]
    channel: str
    subscribers: set[asyncio.Event] = field(default_factory=set)
    refs: int = 0
    conn: Any = None
    task: asyncio.Task[None] | None = None
    ready: asyncio.Future[None] | None = None
    #: closed for good (by its last subscriber, or its first LISTEN failed)
    broken: bool = False
    #: times it listened again after losing its connection
    reconnects: int = 0

    async def open(self) -> None:
        await self._connect()
        self.task = asyncio.create_task(self._listen(), name=f"airflow-broker-{self.channel}")

    async def _connect(self) -> None:
        import psycopg

        conn = await psycopg.AsyncConnection.connect(autocommit=True, **self.params)
        try:
            await conn.execute(f'LISTEN "{self.channel}"')  # our channel name, never user text
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.close()
            raise
        self.conn = conn

    async def _listen(self) -> None:
        while True:
            error: object = "the connection ended"
            try:
                async for _note in self.conn.notifies():
                    self.wake()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                error = exc
            log.warning(
                "LISTEN on %s lost (%s): connecting again every %g s, polling meanwhile",
                self.channel,
                str(error).strip(),
                LISTEN_RECONNECT_SECONDS,
            )
            await self._reconnect()
            self.reconnects += 1
            log.info("LISTEN on %s again", self.channel)
            self.wake()  # what was notified while the connection was away is lost: look again

    async def _reconnect(self) -> None:
        """Until connected and listening again: at once, then every LISTEN_RECONNECT_SECONDS."""
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
                log.debug("LISTEN on %s: cannot connect yet (%s)", self.channel, exc)
            await asyncio.sleep(LISTEN_RECONNECT_SECONDS)

    def wake(self) -> None:
        for event in list(self.subscribers):
            event.set()

    async def close(self) -> None:
        self.broken = True
        if self.task is not None:
            self.task.cancel()
            await asyncio.wait({self.task})  # without raising its CancelledError here
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close()


_listeners: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], _Listener]]
_listeners = weakref.WeakKeyDictionary()


def _connect_params(broker: Broker) -> tuple[str, dict[str, Any]] | None:
    """Where to LISTEN for ``broker``: the key of its listeners and psycopg's parameters; None
    behind a transaction-mode pooler with no ``listen_url`` (storage.pooler): then it polls."""
    adapter = broker.adapter
    assert isinstance(adapter, PostgresAdapter)
    params = adapter.session_params()
    if params is None:
        return None
    return broker.engine.url.render_as_string(hide_password=False), params


class QueueWaiter:
    """Sleeps until a queue may have changed: a NOTIFY on its channel (PostgreSQL) or
    ``poll_interval`` seconds, whichever comes first.

    Call :meth:`clear` before looking at the queue and :meth:`wait` after: a NOTIFY that
    arrives while the caller looks is not lost.
    """

    def __init__(
        self,
        broker: Broker,
        queue_id: int,
        poll_interval: float,
        *,
        channel_name: str | None = None,
    ) -> None:
        self.broker = broker
        self.queue_id = queue_id
        self.poll_interval = poll_interval
        #: the NOTIFY channel (default: the queue's; the transmitter's is TRANSMIT_CHANNEL)
        self.channel_name = channel_name or channel(queue_id)
        self.event = asyncio.Event()
        self._listener: _Listener | None = None
        self._key: tuple[str, str] | None = None
        #: when to try LISTEN again after it failed (loop time; None: not failed)
        self._retry_at: float | None = None

    async def open(self) -> None:
        if self.broker.dialect != "postgresql":
            return
        loop = asyncio.get_running_loop()
        self._retry_at = loop.time() + LISTEN_RETRY_SECONDS  # cleared once listening
        where = await in_database(str(self.broker.engine.url), _connect_params, self.broker)
        if where is None:
            self._retry_at = None  # behind a pooler: poll every poll_interval, for good
            return
        url, params = where
        key = (url, self.channel_name)
        table = _listeners.setdefault(loop, {})
        listener = table.get(key)
        if listener is None or listener.broken:
            listener = table[key] = _Listener(params, key[1])
            listener.ready = loop.create_future()
            try:
                await listener.open()
            except Exception as exc:
                log.warning("cannot LISTEN on %s (%s): polling instead", key[1], exc)
                listener.broken = True
                table.pop(key, None)
                listener.ready.set_result(None)
                return
            listener.ready.set_result(None)
        elif listener.ready is not None and not listener.ready.done():
            await asyncio.shield(listener.ready)
            if listener.broken:
                return
        listener.refs += 1
        listener.subscribers.add(self.event)
        self._listener, self._key = listener, key
        self._retry_at = None

    def clear(self) -> None:
        self.event.clear()

    async def wait(self, timeout: float | None = None) -> None:
        """Until a NOTIFY, the listener listening again after it lost its connection, or
        ``poll_interval`` (or the shorter ``timeout``) seconds."""
        listener = self._listener
        if listener is not None and listener.broken:
            await self.close()
            await self.open()  # a closed listener: open another (or poll for a while)
        elif self._retry_at is not None and asyncio.get_running_loop().time() >= self._retry_at:
            await self.open()
        limit = self.poll_interval if timeout is None else min(timeout, self.poll_interval)
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
        # arrives in the loop turn the event is set in (a NOTIFY as the triggerer cancels the
        # trigger), and the cancelled trigger then runs on for good.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(limit, 0.0)):
                await self.event.wait()

    async def close(self) -> None:
        listener, key = self._listener, self._key
        self._listener = self._key = None
        if listener is None or key is None:
            return
        listener.subscribers.discard(self.event)
        listener.refs -= 1
        if listener.refs <= 0:
            table = _listeners.get(asyncio.get_running_loop(), {})
            if table.get(key) is listener:
                del table[key]
            await listener.close()


# ---------------------------------------------------------------------------------------------
# The trigger
# ---------------------------------------------------------------------------------------------


class QueueActivationTrigger(BaseEventTrigger):
    """Fires when a reader of ``queue`` should start (seed 004's activation).

    Each event's payload: ``queue``, ``depth``, ``groups_ready``, ``cursor`` (the highest
    queuing_order fired for), ``readers`` (readers to start), ``running`` (readers running or
    starting before this one), ``mode``, ``monitor_key`` and ``fire_id`` (the reader row it
    created, which the reader claims when it registers).

    :param queue: the broker queue's name. (Through ``MessageQueueTrigger(scheme="broker")``,
        whose own ``queue`` argument means something else, give it as ``broker_queue``.)
    :param broker_conn_id: the Airflow connection of the broker database.
    :param poll_interval: the longest wait between two looks at the queue (seconds); also the
        period at which its growth is judged.
    :param min_depth: do nothing while fewer messages wait.
    :param max_readers: the most readers at once (None: the queue's ``Activation.max_readers``).
    :param mode: ``arrival`` (start readers, the default), ``depth`` (at least ``min_depth``
        messages, some new since the last event) or ``growth`` (deeper than at the last look).
    :param monitor_key: the monitor's name: its cursor is kept under it. All monitors of a
        queue see the same readers; the queue's activation is ``"activation"``.
    """

    def __init__(
        self,
        queue: str | None = None,
        broker_conn_id: str = "broker_default",
        poll_interval: float = 1.0,
        min_depth: int = 1,
        max_readers: int | None = None,
        mode: str = "arrival",
        monitor_key: str = ACTIVATION_KEY,
        *,
        broker_queue: str | None = None,
    ) -> None:
        super().__init__()
        if queue is not None and broker_queue is not None and queue != broker_queue:
            raise InvalidDefinition(
                f"give the queue once: queue={queue!r} and broker_queue={broker_queue!r}"
            )
        name = queue if queue is not None else broker_queue
        if not name:
            raise InvalidDefinition("QueueActivationTrigger needs the queue's name (queue=...)")
        if not isinstance(poll_interval, int | float) or poll_interval <= 0:
            raise InvalidDefinition(f"poll_interval must be > 0, not {poll_interval!r}")
        # Not ``self.queue``: Airflow may use that name for the triggerer queue a trigger runs in.
        self.queue_name: str = name
        self.broker_conn_id = broker_conn_id
        self.poll_interval = float(poll_interval)
        self.min_depth = min_depth
        self.max_readers = max_readers
        self.mode = check_mode(mode)
        self.monitor_key = monitor_key
        self._monitor()  # validates min_depth and max_readers now, not in the triggerer
        self._held: Broker | None = None
        self._waiter: QueueWaiter | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "queue": self.queue_name,
                "broker_conn_id": self.broker_conn_id,
                "poll_interval": self.poll_interval,
                "min_depth": self.min_depth,
                "max_readers": self.max_readers,
                "mode": self.mode,
                "monitor_key": self.monitor_key,
            },
        )

    def _monitor(self, broker: Any = None) -> Monitor:
        return Monitor(
            broker,
            self.queue_name,
            key=self.monitor_key,
            mode=self.mode,
            min_depth=self.min_depth,
            max_readers=self.max_readers,
            sample_seconds=self.poll_interval,
        )

    def _broker(self) -> Broker:
        """The broker database of ``broker_conn_id`` (blocking)."""
        return acquire_broker(self.broker_conn_id)

    @staticmethod
    def _look(broker: Broker, monitor: Monitor) -> Fire | None:
        due_step(broker)  # timers fire on queues nobody reads, and then activate them
        return monitor.check()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        broker = self._held = await hold_broker(self.broker_conn_id, self._broker)
        monitor = self._monitor(broker)
        failures = 0
        try:
            while True:
                if self._waiter is not None:
                    self._waiter.clear()
                try:
                    fire = await in_database(self.broker_conn_id, self._look, broker, monitor)
                    failures = 0
                except (DBAPIError, BrokerError) as exc:
                    # The queue not declared yet, the database restarting...: keep watching.
                    failures += 1
                    delay = min(self.poll_interval * 2 ** min(failures, 16), MAX_BACKOFF)
                    log.warning(
                        "activation monitor of queue %r: %s; looking again in %.1f s",
                        self.queue_name,
                        exc,
                        delay,
                    )
                    await asyncio.sleep(delay)
                    continue
                if fire is not None:
                    self.log.info(
                        "queue %r: start a reader (depth %d, %d group(s), %d running)",
                        self.queue_name,
                        fire.depth,
                        fire.groups_ready,
                        fire.running,
                    )
                    yield TriggerEvent(fire.payload())
                if self._waiter is None and monitor.queue_id is not None:
                    self._waiter = QueueWaiter(broker, monitor.queue_id, self.poll_interval)
                    await self._waiter.open()
                    continue  # look once more now that a NOTIFY cannot be missed
                if self._waiter is not None:
                    await self._waiter.wait()
                else:
                    await asyncio.sleep(self.poll_interval)
        finally:
            await self.cleanup()

    async def cleanup(self) -> None:
        """Stop listening and give the broker back (closed when no other trigger uses it)."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            with contextlib.suppress(Exception):
                await waiter.close()
        broker, self._held = self._held, None
        if broker is not None:
            release_broker(broker)


def queue_asset(
    queue: str, *, broker_conn_id: str = "broker_default", name: str | None = None, **kwargs: Any
) -> Asset:
    """The asset a queue's reader DAG is scheduled on: named ``broker_queue_QUEUE`` (or
    ``name``), watched by the queue's :class:`QueueActivationTrigger` (``kwargs`` go to it)::

        @dag(schedule=[queue_asset("SupplierQueue")], max_active_runs=4)
        def supplier_reader():
            DrainQueueOperator(task_id="drain", queue="SupplierQueue", handler="pkg.mod:handle")
    """
    trigger = QueueActivationTrigger(queue=queue, broker_conn_id=broker_conn_id, **kwargs)
    return Asset(
        name=name or f"broker_queue_{queue}",
        watchers=[AssetWatcher(name=f"{queue}_activation", trigger=trigger)],
    )


__all__ = [
    "QueueActivationTrigger",
    "QueueWaiter",
    "acquire_broker",
    "queue_asset",
    "release_broker",
]
