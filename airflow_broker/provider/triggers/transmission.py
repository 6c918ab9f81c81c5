"""TransmissionTrigger: the transmitter's watcher, run by the Airflow triggerer.

It watches one broker database's transmission queue and yields an event when a transmitter run
should start: messages are due to leave, no transmitter is running, and the run it last started
has ended (:func:`airflow_broker.activation.transmitter.watch`, whose bookkeeping is in the
broker database, so a restarted triggerer or a second one does not start runs twice). In an
``AssetWatcher`` each event is an asset event and the transmitter DAG scheduled on the asset
gets a run (:func:`airflow_broker.provider.transmitter.transmitter_dag` builds both).

How it waits: on PostgreSQL it LISTENs on ``airflow_broker_transmit``, notified whenever a
statement queues messages to leave and whenever a transmitter run ends; on SQLite it polls.
Either way it also wakes at the next retry time of a message waiting for an unreachable
destination, and at least every ``poll_interval`` seconds. Each look also runs the broker's due
work (timers, lifetimes, dead readers) and depth sampling, as queue monitors do.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import DBAPIError

from airflow_broker.activation import due_step
from airflow_broker.activation.transmitter import (
    DEFAULT_START_TIMEOUT,
    Backlog,
    TransmitterFire,
    watch,
)
from airflow_broker.errors import BrokerError, InvalidDefinition
from airflow_broker.provider.compat import BaseEventTrigger, TriggerEvent
from airflow_broker.provider.triggers.activation import (
    MAX_BACKOFF,
    QueueWaiter,
    acquire_broker,
    hold_broker,
    release_broker,
)
from airflow_broker.provider.triggers.hub import database_key, in_database
from airflow_broker.storage.adapters import TRANSMIT_CHANNEL
from airflow_broker.storage.clock import utcnow

if TYPE_CHECKING:
    from airflow_broker.broker import Broker

log = logging.getLogger("airflow_broker")


class TransmissionTrigger(BaseEventTrigger):
    """Fires when the transmitter should run on ``broker_conn_id``'s database.

    Each event's payload: ``due`` (messages due to leave), ``waiting`` (all that wait),
    ``fires`` (this database's count of transmitter starts) and ``oldest_enqueued_at``.

    :param broker_conn_id: the Airflow connection of the broker database.
    :param poll_interval: the longest wait between two looks (seconds).
    :param start_timeout: a run started this long ago that never took the transmitter lock is
        taken as lost, and another is started.
    """

    def __init__(
        self,
        broker_conn_id: str = "broker_default",
        poll_interval: float = 5.0,
        start_timeout: float = DEFAULT_START_TIMEOUT,
    ) -> None:
        super().__init__()
        for name, value in (("poll_interval", poll_interval), ("start_timeout", start_timeout)):
            if not isinstance(value, int | float) or value <= 0:
                raise InvalidDefinition(f"{name} must be > 0, not {value!r}")
        self.broker_conn_id = broker_conn_id
        self.poll_interval = float(poll_interval)
        self.start_timeout = float(start_timeout)
        self._held: Broker | None = None
        self._waiter: QueueWaiter | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "broker_conn_id": self.broker_conn_id,
                "poll_interval": self.poll_interval,
                "start_timeout": self.start_timeout,
            },
        )

    def _look(self, broker: Broker) -> tuple[TransmitterFire | None, Backlog]:
        due_step(broker)  # timers and lifetimes fire with no reader running
        return watch(broker, start_timeout=self.start_timeout)

    def _timeout(self, seen: Backlog) -> float:
        """Until the next retry falls due (a little after), at most ``poll_interval``."""
        if seen.next_attempt_at is None:
            return self.poll_interval
        until = (seen.next_attempt_at - utcnow()).total_seconds() + 0.05
        return min(max(until, 0.05), self.poll_interval)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        broker = self._held = await hold_broker(
            self.broker_conn_id, functools.partial(acquire_broker, self.broker_conn_id)
        )
        failures = 0
        try:
            self._waiter = QueueWaiter(broker, 0, self.poll_interval, channel_name=TRANSMIT_CHANNEL)
            await self._waiter.open()
            while True:
                self._waiter.clear()
                try:
                    fire, seen = await in_database(database_key(broker), self._look, broker)
                    failures = 0
                except (DBAPIError, BrokerError) as exc:
                    # The database restarting, not migrated yet...: keep watching.
                    failures += 1
                    delay = min(self.poll_interval * 2 ** min(failures, 16), MAX_BACKOFF)
                    log.warning("transmitter watcher: %s; looking again in %.1f s", exc, delay)
                    await asyncio.sleep(delay)
                    continue
                if fire is not None:
                    self.log.info(
                        "%d message(s) due to leave (%d waiting): start the transmitter",
                        fire.due,
                        fire.waiting,
                    )
                    yield TriggerEvent(fire.payload())
                await self._waiter.wait(self._timeout(seen))
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


__all__ = ["TransmissionTrigger"]
