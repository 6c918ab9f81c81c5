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

import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.engine import Connection

from airflow_broker import routing
from airflow_broker import schema as s
from airflow_broker.constants import END_DIALOG, ERROR
from airflow_broker.events import record_event

if TYPE_CHECKING:
    from airflow_broker.broker import Broker

log = logging.getLogger("airflow_broker")

#: Service Broker's names for the dynamic routing service, its contract and its message.
BROKER_CONFIGURATION = "http://schemas.microsoft.com/SQL/ServiceBroker/BrokerConfiguration"
BROKER_CONFIGURATION_NOTICE = (
    "http://schemas.microsoft.com/SQL/ServiceBroker/BrokerConfigurationNotice"
)
MISSING_ROUTE = (
    "http://schemas.microsoft.com/SQL/ServiceBroker/BrokerConfigurationNotice/MissingRoute"
)
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


def request_routes(broker: Broker, service_names: set[str]) -> None:
    """Send the dynamic routing service one MissingRoute request per service name."""
    if not service_names:
        return
    _ensure_requester(broker)
    with broker.transaction() as tx:
        for name in sorted(service_names):
            h = tx.begin_dialog(REQUESTER, BROKER_CONFIGURATION, BROKER_CONFIGURATION_NOTICE)
            tx.send(h, MISSING_ROUTE, name.encode())
            record_event(tx.connection, EVENT, name, f"asked on conversation {h}")
            log.info("no route to service %r: asked the dynamic routing service", name)


def answer_requests(broker: Broker) -> int:
    """End the request conversations the dynamic routing service has answered (EndDialog or
    Error); returns how many."""
    ended = 0
    with broker.engine.connect() as conn:
        known = conn.execute(
            select(s.queue.c.queue_id).where(s.queue.c.name == REQUESTER_QUEUE)
        ).first()
    if known is None:
        return 0
    while True:
        with broker.transaction() as tx:
            msgs = tx.receive(REQUESTER_QUEUE)
            if not msgs:
                return ended
            for m in msgs:
                if m.message_type_name == ERROR:
                    log.warning(
                        "the dynamic routing service answered a route request with an error: %s",
                        m.error,
                    )
                if m.message_type_name in (END_DIALOG, ERROR):
                    tx.end_conversation(m.conversation_handle)
                    ended += 1


def _ensure_requester(broker: Broker) -> None:
    """The requester's queue and service, created when first needed (``migrate()`` creates the
    MissingRoute message type and the BrokerConfigurationNotice contract)."""
    with broker.definitions() as d:
        conn = d.connection
        if (
            conn.execute(select(s.queue.c.name).where(s.queue.c.name == REQUESTER_QUEUE)).first()
            is None
        ):
            d.create_queue(REQUESTER_QUEUE)
        if (
            conn.execute(select(s.service.c.name).where(s.service.c.name == REQUESTER)).first()
            is None
        ):
            d.create_service(REQUESTER, queue=REQUESTER_QUEUE)
