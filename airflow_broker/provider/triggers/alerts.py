"""BrokerAlertTrigger and alert_asset(): the broker's alerts as Airflow asset events.

A queue disabled by poison-message handling and transmissions that wait too long
(:mod:`airflow_broker.operations.alerts`) become asset events, once per episode, on documented
assets that a DAG can be scheduled on (or a notifier attached to the DAG that is)::

    from airflow_broker.provider.triggers.alerts import alert_asset

    @dag(schedule=alert_asset("queue_disabled") | alert_asset("transmission_waiting"))
    def broker_alerts(): ...

The assets' URIs are ``broker-alert://<broker conn id>/queue_disabled`` and
``broker-alert://<broker conn id>/transmission_waiting``; each event's ``extra["payload"]`` is
the alert: ``kind``, ``object`` (the queue, or the target service), ``detail`` (a sentence),
``count``, ``oldest_age_seconds`` and ``reason``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import DBAPIError

from airflow_broker.errors import BrokerError, InvalidDefinition
from airflow_broker.operations.alerts import DEFAULT_WAITING_THRESHOLD, KINDS, raise_alerts
from airflow_broker.provider.compat import (
    Asset,
    AssetWatcher,
    BaseEventTrigger,
    TriggerEvent,
)
from airflow_broker.provider.triggers.activation import (
    MAX_BACKOFF,
    acquire_broker,
    hold_broker,
    release_broker,
)
from airflow_broker.provider.triggers.hub import database_key, in_database

if TYPE_CHECKING:
    from airflow_broker.broker import Broker

log = logging.getLogger("airflow_broker")

#: The scheme of the alert assets' URIs.
ALERT_SCHEME = "broker-alert"


class BrokerAlertTrigger(BaseEventTrigger):
    """Yields one event per alert that starts (see the module docstring for the payload).

    :param kinds: ``queue_disabled``, ``transmission_waiting`` or both.
    :param broker_conn_id: the Airflow connection of the broker database.
    :param waiting_threshold_seconds: transmissions older than this raise
        ``transmission_waiting``.
    :param poll_interval: seconds between two looks.
    :param watcher: the name under which raised alerts are remembered (default from the kinds):
        triggers with one name raise each alert once between them.
    """

    def __init__(
        self,
        kinds: tuple[str, ...] | list[str] = KINDS,
        broker_conn_id: str = "broker_default",
        waiting_threshold_seconds: float = DEFAULT_WAITING_THRESHOLD.total_seconds(),
        poll_interval: float = 10.0,
        watcher: str | None = None,
    ) -> None:
        super().__init__()
        self.kinds = tuple(kinds)
        unknown = sorted(set(self.kinds) - set(KINDS))
        if unknown or not self.kinds:
            raise InvalidDefinition(f"alert kinds must be among {list(KINDS)}, not {kinds!r}")
        for name, value in (
            ("waiting_threshold_seconds", waiting_threshold_seconds),
            ("poll_interval", poll_interval),
        ):
            if not isinstance(value, int | float) or value <= 0:
                raise InvalidDefinition(f"{name} must be > 0, not {value!r}")
        self.broker_conn_id = broker_conn_id
        self.waiting_threshold_seconds = float(waiting_threshold_seconds)
        self.poll_interval = float(poll_interval)
        self.watcher = watcher or f"airflow:{'+'.join(self.kinds)}"
        self._held: Broker | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "kinds": list(self.kinds),
                "broker_conn_id": self.broker_conn_id,
                "waiting_threshold_seconds": self.waiting_threshold_seconds,
                "poll_interval": self.poll_interval,
                "watcher": self.watcher,
            },
        )

    def _look(self, broker: Broker) -> list[Any]:
        return raise_alerts(
            broker,
            watcher=self.watcher,
            kinds=self.kinds,
            waiting_threshold=timedelta(seconds=self.waiting_threshold_seconds),
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        broker = self._held = await hold_broker(
            self.broker_conn_id, functools.partial(acquire_broker, self.broker_conn_id)
        )
        failures = 0
        try:
            while True:
                try:
                    raised = await in_database(database_key(broker), self._look, broker)
                    failures = 0
                except (DBAPIError, BrokerError) as exc:
                    failures += 1
                    delay = min(self.poll_interval * 2 ** min(failures, 16), MAX_BACKOFF)
                    log.warning("broker alerts: %s; looking again in %.1f s", exc, delay)
                    await asyncio.sleep(delay)
                    continue
                for alert in raised:
                    self.log.error("broker alert %s: %s", alert.kind, alert.detail)
                    yield TriggerEvent(alert.payload())
                await asyncio.sleep(self.poll_interval)
        finally:
            await self.cleanup()

    async def cleanup(self) -> None:
        broker, self._held = self._held, None
        if broker is not None:
            release_broker(broker)


def alert_asset(kind: str, *, broker_conn_id: str = "broker_default", **kwargs: Any) -> Asset:
    """The asset of one kind of alert of ``broker_conn_id``'s database
    (``broker-alert://<conn id>/<kind>``), watched by a :class:`BrokerAlertTrigger`
    (``kwargs`` go to it)."""
    trigger = BrokerAlertTrigger(kinds=(kind,), broker_conn_id=broker_conn_id, **kwargs)
    return Asset(
        uri=f"{ALERT_SCHEME}://{broker_conn_id}/{kind}",
        name=f"broker_alert_{broker_conn_id}_{kind}",
        watchers=[AssetWatcher(name=f"{broker_conn_id}_{kind}_alerts", trigger=trigger)],
    )


__all__ = ["ALERT_SCHEME", "BrokerAlertTrigger", "alert_asset"]
