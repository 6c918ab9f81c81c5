"""Dynamic routing's conversation: asking the dynamic routing service for a missing route.

When a conversation finds no route of its own and :func:`airflow_broker.routing.dynamic.present`
says a dynamic routing service is routed, the delivery pass sends it a ``MissingRoute`` message on
the ``BrokerConfigurationNotice`` contract whose body is the service name looked for (UTF-8
text), from this broker's own requester service. The service answers by creating the route and
ending the conversation; :func:`answer_requests` ends this side.
"""

from __future__ import annotations

import logging

from sqlalchemy import select

from airflow_broker.constants import (
    BROKER_CONFIGURATION,
    BROKER_CONFIGURATION_NOTICE,
    END_DIALOG,
    ERROR,
    MISSING_ROUTE,
)
from airflow_broker.messaging.definitions import define
from airflow_broker.messaging.events import record_event
from airflow_broker.messaging.transaction import Transaction
from airflow_broker.routing.dynamic import EVENT, REQUESTER, REQUESTER_QUEUE
from airflow_broker.storage import schema as s
from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")


def request_routes(broker: BrokerContext, service_names: set[str]) -> None:
    """Send the dynamic routing service one MissingRoute request per service name."""
    if not service_names:
        return
    _ensure_requester(broker)
    with Transaction(broker) as tx:
        for name in sorted(service_names):
            # The broker's own notice: secured where dialog security is configured.
            h = tx.begin_dialog(
                REQUESTER, BROKER_CONFIGURATION, BROKER_CONFIGURATION_NOTICE, encryption=False
            )
            tx.send(h, MISSING_ROUTE, name.encode())
            record_event(tx.connection, EVENT, name, f"asked on conversation {h}")
            log.info("no route to service %r: asked the dynamic routing service", name)


def answer_requests(broker: BrokerContext) -> int:
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
        with Transaction(broker) as tx:
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


def _ensure_requester(broker: BrokerContext) -> None:
    """The requester's queue and service, created when first needed (``migrate()`` creates the
    MissingRoute message type and the BrokerConfigurationNotice contract)."""
    with define(broker) as d:
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


__all__ = ["answer_requests", "request_routes"]
