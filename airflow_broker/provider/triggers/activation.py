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
notified by a trigger on ``broker_message`` whenever ready messages are written) through the
one LISTEN connection that every trigger of its event loop on that database shares
(:mod:`~airflow_broker.provider.triggers.hub`); ``poll_interval`` is then only the fallback, and
while the queue is idle (nothing waits, no reader: only a new message, which notifies, can
change that) the fallback is every :data:`IDLE_POLL_SECONDS`. On SQLite it polls every
``poll_interval``. Looks are batched: the triggers that look in the same turn of the event loop
learn which of them have anything to do from a few statements for all of them
(:func:`quiet_monitors`: idle queues, and queues whose readers are fired for while nothing
changed), and only those make their full look (about ten statements and a write), in the
database's few threads (:func:`in_database`: a database that hangs ties up only its own
triggers). The brokers are shared by the triggers of one
process on the same database and closed when the last one is cleaned up.

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
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import DBAPIError

from airflow_broker.activation import ACTIVATION_KEY, Fire, Monitor, check_mode, due_step
from airflow_broker.activation.monitor import Outlook, quiet_monitors
from airflow_broker.errors import BrokerError, InvalidDefinition
from airflow_broker.provider.compat import Asset, AssetWatcher, BaseEventTrigger, TriggerEvent
from airflow_broker.provider.triggers.hub import (
    Hub,
    Looks,
    _executor,
    aligned,
    database_key,
    hub,
    in_database,
    looks,
    release,
)
from airflow_broker.provider.triggers.hub import _listeners as _listeners  # tests look at it
from airflow_broker.storage.adapters import PostgresAdapter, channel

if TYPE_CHECKING:
    from airflow_broker.broker import Broker

log = logging.getLogger("airflow_broker")

#: Longest pause after a database error before the trigger tries again.
MAX_BACKOFF = 30.0
#: The fallback poll of a trigger whose queue is idle (nothing waits, no reader) while its
#: LISTEN works: only a new message, which notifies, can change that.
IDLE_POLL_SECONDS = 60.0
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
#: Airflow connection id -> the URL of the shared broker opened from it
_urls: dict[str, str] = {}
_opening: dict[str, threading.Lock] = {}


def _shared(url: str | None) -> Broker | None:
    """The shared broker of ``url``, counted once more (None: none is open); under the lock."""
    shared = _brokers.get(url) if url is not None else None
    if shared is None:
        return None
    shared.refs += 1
    return shared.broker


def acquire_broker(broker_conn_id: str) -> Broker:
    """The broker of an Airflow connection, shared with this process's other triggers on the
    same database (blocking: call it in a thread). Release it with :func:`release_broker`.

    One trigger at a time opens a connection's broker (the Airflow connection looked up, the
    broker's first connection made), the others that use the connection wait for it and share
    it: a thousand triggers starting at once make one lookup and one connection, not one
    each. A trigger that starts while others of its Airflow connection run shares their broker
    without looking the connection up again: a change to the connection takes effect for the
    triggers that start after the last of them stopped (a triggerer restart). The opening holds
    no lock that the triggers of other connections take: a database that hangs holds up only
    the triggers that use it."""
    from airflow_broker.hooks.broker import BrokerHook

    with _brokers_lock:
        found = _shared(_urls.get(broker_conn_id))
        if found is not None:
            return found
        opening = _opening.setdefault(broker_conn_id, threading.Lock())
    with opening:
        with _brokers_lock:
            found = _shared(_urls.get(broker_conn_id))
            if found is not None:
                return found
        hook = BrokerHook(broker_conn_id=broker_conn_id)
        url, _fallback = hook.broker_url()
        with _brokers_lock:
            found = _shared(url)  # another connection id of the same database
            if found is not None:
                _urls[broker_conn_id] = url
                return found
        opened = hook.get_broker()
        with _brokers_lock:
            _brokers[url] = _Shared(opened, refs=1)
            _urls[broker_conn_id] = url
        return opened


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


def release_broker(broker: Broker) -> None:
    """Give back a broker from :func:`acquire_broker`; the last one out disposes of it.
    Brokers that did not come from there (a test's own) are left alone."""
    with _brokers_lock:
        for url, shared in list(_brokers.items()):
            if shared.broker is broker:
                shared.refs -= 1
                if shared.refs <= 0:
                    del _brokers[url]
                    for conn_id in [c for c, u in _urls.items() if u == url]:
                        del _urls[conn_id]
                    broker.dispose()
                return


# ---------------------------------------------------------------------------------------------
# Waiting: one LISTEN connection per event loop and database (hub.Hub)
# ---------------------------------------------------------------------------------------------


def _connect_params(broker: Broker) -> tuple[str, dict[str, Any]] | None:
    """Where to LISTEN for ``broker``: its database key and psycopg's parameters; None behind
    a transaction-mode pooler with no ``listen_url`` (storage.pooler): then it polls."""
    adapter = broker.adapter
    assert isinstance(adapter, PostgresAdapter)
    params = adapter.session_params()
    if params is None:
        return None
    return database_key(broker), params


class QueueWaiter:
    """Sleeps until a queue may have changed: a NOTIFY on its channel (PostgreSQL) or
    ``poll_interval`` seconds, whichever comes first.

    Call :meth:`clear` before looking at the queue and :meth:`wait` after: a NOTIFY that
    arrives while the caller looks is not lost. The waiters of one event loop and database
    share one LISTEN connection (:class:`~airflow_broker.provider.triggers.hub.Hub`).
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
        self._listener: Hub | None = None
        #: when to try LISTEN again after it failed (loop time; None: not failed)
        self._retry_at: float | None = None

    async def open(self) -> None:
        if self.broker.dialect != "postgresql":
            return
        loop = asyncio.get_running_loop()
        self._retry_at = loop.time() + LISTEN_RETRY_SECONDS  # cleared once listening
        where = await in_database(database_key(self.broker), _connect_params, self.broker)
        if where is None:
            self._retry_at = None  # behind a pooler: poll every poll_interval, for good
            return
        found = hub(*where)
        if not await found.subscribe(self.channel_name, self.event):
            await release(found)
            return
        self._listener = found
        self._retry_at = None

    def clear(self) -> None:
        self.event.clear()

    async def wait(self, timeout: float | None = None, *, idle: bool = False) -> bool:
        """Until a NOTIFY, the listener listening again after it lost its connection, or the
        next multiple of ``poll_interval`` on the loop's clock (:func:`hub.aligned`; or
        ``timeout`` seconds, if shorter).

        ``idle``: the last look found nothing that only time can change (an empty queue, no
        reader: :attr:`~airflow_broker.activation.monitor.Outlook.IDLE`), so while LISTEN
        works only a NOTIFY can bring news, and the fallback poll is every
        :data:`IDLE_POLL_SECONDS` instead. Returns whether it was woken (not timed out)."""
        listener = self._listener
        loop = asyncio.get_running_loop()
        if listener is not None and listener.broken:
            await self.close()
            await self.open()  # a closed listener: open another (or poll for a while)
        elif self._retry_at is not None and loop.time() >= self._retry_at:
            await self.open()
        every = self.poll_interval
        if idle and self._listener is not None and not self._listener.broken:
            every = max(every, IDLE_POLL_SECONDS)
        limit = aligned(every, loop.time())
        if timeout is not None:
            limit = min(timeout, limit)
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
        # arrives in the loop turn the event is set in (a NOTIFY as the triggerer cancels the
        # trigger), and the cancelled trigger then runs on for good.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(limit, 0.0)):
                await self.event.wait()
        return self.event.is_set()

    async def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None and listener.unsubscribe(self.channel_name, self.event):
            await release(listener)


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

    async def _next_look(self, batch: Looks, broker: Broker, monitor: Monitor) -> Any:
        """One look at the queue, batched with those of the other triggers on its database
        that look in the same turn: a monitor whose full look would do nothing
        (:func:`quiet_monitors`: the queue is idle, or its readers are fired for and nothing
        changed) needs no look of its own, and gets :attr:`Outlook.IDLE` or
        :attr:`Outlook.QUIET` instead. The first look is always a full one: it finds the
        queue's id, whose channel the trigger then LISTENs on."""
        if monitor.queue_id is None:
            return await in_database(batch.key, self._look, broker, monitor)
        return await batch.ask(
            quiet_monitors, monitor.watched(), functools.partial(self._look, broker, monitor)
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        broker = self._held = await hold_broker(self.broker_conn_id, self._broker)
        monitor = self._monitor(broker)
        batch = looks(broker, due_step)
        failures = 0
        try:
            while True:
                if self._waiter is not None:
                    self._waiter.clear()
                try:
                    fire = await self._next_look(batch, broker, monitor)
                    idle = fire is Outlook.IDLE
                    if isinstance(fire, Outlook):
                        fire = None
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
                    await self._waiter.wait(idle=idle)
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
