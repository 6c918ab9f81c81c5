"""Dynamic routing: matching step 4 of seed 001.

"If a route to a dynamic routing service is present, and no request for a route to the service
is pending, mark the conversation delayed and request routing information from that service."

As in Service Broker, the dynamic routing service is the service named
:data:`BROKER_CONFIGURATION`; a route for that name says where it runs (``LOCAL`` or another
broker). When a conversation finds no route of its own, the delivery pass sends the service a
``MissingRoute`` message on the ``BrokerConfigurationNotice`` contract whose body is the service
name looked for (UTF-8 text), from this broker's own requester service, and marks the
conversation delayed. The dynamic routing service answers by creating the route (in the broker
that asked) and ending the conversation; the next delivery pass finds the route. A request counts
as pending for :data:`REQUEST_PENDING` after it was sent, then it is asked again.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.engine import Connection

from airflow_broker.constants import (
    BROKER_CONFIGURATION,
    BROKER_CONFIGURATION_NOTICE,
    MISSING_ROUTE,
)
from airflow_broker.routing import rules as routing
from airflow_broker.storage import schema as s

#: This broker's side of route requests: a service and queue it creates when first needed.
REQUESTER = "airflow-broker/RouteRequests"
REQUESTER_QUEUE = "broker_route_requests"
#: How long a request for one service's route is pending before it is asked again.
REQUEST_PENDING = timedelta(seconds=60)
EVENT = "route_requested"


def present(routes: list[routing.Route], service_name: str, now: datetime) -> bool:
    """Whether a live route names the dynamic routing service (and this is not a conversation
    with that service itself, which must be routed by ordinary routes)."""
    return service_name != BROKER_CONFIGURATION and any(
        r.service_name == BROKER_CONFIGURATION for r in routing.live_routes(routes, now)
    )


def pending(conn: Connection, service_name: str, now: datetime) -> bool:
    """Whether a route request for ``service_name`` was sent within :data:`REQUEST_PENDING`."""
    e = s.event
    return (
        conn.execute(
            select(e.c.id)
            .where(e.c.event == EVENT, e.c.object_name == service_name)
            .where(e.c.occurred_at > now - REQUEST_PENDING)
            .limit(1)
        ).first()
        is not None
    )


__all__ = [
    "BROKER_CONFIGURATION",
    "BROKER_CONFIGURATION_NOTICE",
    "EVENT",
    "MISSING_ROUTE",
    "REQUESTER",
    "REQUESTER_QUEUE",
    "REQUEST_PENDING",
    "pending",
    "present",
]
