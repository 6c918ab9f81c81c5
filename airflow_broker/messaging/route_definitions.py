"""CREATE / ALTER / DROP ROUTE and BROKER PRIORITY: the definitions delivery looks up again for
every conversation it routes or begins, so that changing one changes nothing already stored.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, insert, select, update

from airflow_broker.errors import InvalidDefinition, UnknownObject
from airflow_broker.messaging.arguments import UNSET, as_name, as_uuid
from airflow_broker.messaging.definitions_core import DefinitionsCore
from airflow_broker.storage import schema as s
from airflow_broker.storage import waits
from airflow_broker.storage.clock import utcnow


class RouteDefinitions(DefinitionsCore):
    """Routes and broker priorities of a :class:`~airflow_broker.messaging.definitions.Definitions`
    transaction."""

    # -- routes --------------------------------------------------------------------------------
    def create_route(
        self,
        name: str,
        service_name: str | None = None,
        broker_instance: str | None = None,
        address: str = "LOCAL",
        mirror_address: str | None = None,
        lifetime_seconds: int | None = None,
    ) -> None:
        """CREATE ROUTE. ``address``: ``LOCAL``, ``TRANSPORT`` or ``broker://NAME`` (a logical
        broker name, resolved to a connection when delivering; no credentials here)."""
        as_name(name, "route")
        broker_instance = check_route(name, service_name, broker_instance, address, mirror_address)
        expires_at = route_expiry(name, lifetime_seconds)
        self._refuse_existing(s.route, s.route.c.name, name, "route")
        self._conn.execute(
            insert(s.route).values(
                name=name,
                service_name=service_name,
                broker_instance=broker_instance,
                address=address,
                mirror_address=mirror_address,
                expires_at=expires_at,
                created_at=utcnow(),
            )
        )
        # Messages that waited for a route to this service go now (one cause, one wait).
        waits.wake_for_route(self._conn, service_name, (address, mirror_address))

    def alter_route(
        self,
        name: str,
        *,
        service_name: str | None = UNSET,
        broker_instance: str | None = UNSET,
        address: str = UNSET,
        mirror_address: str | None = UNSET,
        lifetime_seconds: int | None = UNSET,
    ) -> None:
        """ALTER ROUTE: only the arguments given change. None is a value here:
        ``service_name=None`` makes the route match every service, ``mirror_address=None``
        removes the mirror, ``lifetime_seconds=None`` makes the route last for ever; a new
        ``lifetime_seconds`` counts from now. The route that results is checked whole, as CREATE
        ROUTE checks it (a mirror needs a ``broker://`` address and a broker instance)."""
        row = self._conn.execute(select(s.route).where(s.route.c.name == name)).first()
        if row is None:
            raise UnknownObject(f"route {name!r} does not exist in this broker")
        given = {
            key: value
            for key, value in (
                ("service_name", service_name),
                ("broker_instance", broker_instance),
                ("address", address),
                ("mirror_address", mirror_address),
            )
            if value is not UNSET
        }
        route: dict[str, Any] = {
            "service_name": row.service_name,
            "broker_instance": row.broker_instance,
            "address": row.address,
            "mirror_address": row.mirror_address,
            **given,
        }
        route["broker_instance"] = check_route(name, **route)
        values = {key: route[key] for key in given}
        if lifetime_seconds is not UNSET:
            values["expires_at"] = route_expiry(name, lifetime_seconds)
        if values:
            self._conn.execute(update(s.route).where(s.route.c.name == name).values(**values))
            waits.wake_for_route(
                self._conn,
                route["service_name"],
                (row.address, row.mirror_address, route["address"], route["mirror_address"]),
            )
            if row.service_name != route["service_name"]:
                waits.wake_for_route(self._conn, row.service_name, ())

    def drop_route(self, name: str) -> None:
        self._require(s.route, s.route.c.name, name, "route")
        self._conn.execute(delete(s.route).where(s.route.c.name == name))

    # -- priorities ----------------------------------------------------------------------------
    def create_priority(
        self,
        name: str,
        contract: str | None = None,
        local_service: str | None = None,
        remote_service: str | None = None,
        priority: int = 5,
    ) -> None:
        """CREATE BROKER PRIORITY: conversations matching get ``priority`` (1-10, default 5)."""
        as_name(name, "priority")
        self._check_priority(name, contract, local_service, priority)
        self._refuse_existing(s.priority, s.priority.c.name, name, "priority")
        self._conn.execute(
            insert(s.priority).values(
                name=name,
                contract_name=contract,
                local_service=local_service,
                remote_service=remote_service,
                priority=priority,
            )
        )

    def alter_priority(
        self,
        name: str,
        *,
        contract: str | None = UNSET,
        local_service: str | None = UNSET,
        remote_service: str | None = UNSET,
        priority: int = UNSET,
    ) -> None:
        """ALTER BROKER PRIORITY: only the arguments given change (None: any contract or
        service). Conversations begun from now on get the new priority; those that exist keep
        the one they were given when they began, as in Service Broker."""
        self._require(s.priority, s.priority.c.name, name, "priority")
        self._check_priority(
            name,
            None if contract is UNSET else contract,
            None if local_service is UNSET else local_service,
            5 if priority is UNSET else priority,
        )
        values = {
            column: value
            for column, value in (
                ("contract_name", contract),
                ("local_service", local_service),
                ("remote_service", remote_service),
                ("priority", priority),
            )
            if value is not UNSET
        }
        if values:
            self._conn.execute(update(s.priority).where(s.priority.c.name == name).values(**values))

    def _check_priority(
        self, name: str, contract: str | None, local_service: str | None, priority: Any
    ) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool) or not 1 <= priority <= 10:
            raise InvalidDefinition(f"priority {name!r}: priority must be 1..10, not {priority!r}")
        if contract is not None:
            self._require(s.contract, s.contract.c.name, contract, "contract")
        if local_service is not None:
            self._require(s.service, s.service.c.name, local_service, "service")

    def drop_priority(self, name: str) -> None:
        self._require(s.priority, s.priority.c.name, name, "priority")
        self._conn.execute(delete(s.priority).where(s.priority.c.name == name))


def check_route(
    name: str,
    service_name: str | None,
    broker_instance: str | None,
    address: Any,
    mirror_address: str | None,
) -> str | None:
    """Refuse a route that could not work; returns its broker instance id in its usual form."""
    if service_name is not None:
        as_name(service_name, "route service")
    if broker_instance is not None:
        as_uuid(broker_instance, f"route {name!r}: broker_instance")
        broker_instance = str(uuid.UUID(str(broker_instance)))
    check_address(name, address, "address")
    if mirror_address is not None:
        check_address(name, mirror_address, "mirror_address")
        if not address.startswith("broker://") or not mirror_address.startswith("broker://"):
            raise InvalidDefinition(
                f"route {name!r}: a mirror_address goes with a broker:// address only"
            )
        if broker_instance is None:
            raise InvalidDefinition(f"route {name!r}: a mirror_address needs broker_instance")
    return broker_instance


def route_expiry(name: str, lifetime_seconds: Any) -> datetime | None:
    """When a route given ``lifetime_seconds`` from now expires (None: never)."""
    if lifetime_seconds is None:
        return None
    if (
        not isinstance(lifetime_seconds, int)
        or isinstance(lifetime_seconds, bool)
        or lifetime_seconds <= 0
    ):
        raise InvalidDefinition(f"route {name!r}: lifetime_seconds must be a positive whole number")
    return utcnow() + timedelta(seconds=lifetime_seconds)


def check_address(route: str, address: Any, what: str) -> None:
    if not isinstance(address, str) or not (
        address in ("LOCAL", "TRANSPORT")
        or (address.startswith("broker://") and len(address) > len("broker://"))
    ):
        raise InvalidDefinition(
            f"route {route!r}: {what} {address!r} must be LOCAL, TRANSPORT or broker://NAME"
        )
