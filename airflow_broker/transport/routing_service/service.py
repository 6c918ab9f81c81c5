"""Routing services as objects: create, look up, run (drain the queue through the router) and
sweep their finished mappings.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, exists, insert, select
from sqlalchemy.exc import IntegrityError

from airflow_broker.errors import (
    InvalidDefinition,
    UnknownObject,
)
from airflow_broker.messaging.arguments import as_name
from airflow_broker.messaging.definitions import Definitions
from airflow_broker.messaging.transaction import Transaction
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow
from airflow_broker.transport.routing_service.classifiers import classifier_spec, compile_classifier
from airflow_broker.transport.routing_service.router import (
    ENDED_STATES,
    MODES,
    RoutingService,
    _Router,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from airflow_broker.messaging.objects import Message
    from airflow_broker.messaging.transaction import Transaction
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")


def create_routing_service(
    broker: BrokerContext, name: str, queue: str, classifier: Any, mode: str = "forward"
) -> None:
    """Create service ``name`` on ``queue`` and make it a data-dependent routing service.

    All or nothing, in one transaction. The queue must exist and serve no other service (the
    router RECEIVEs everything on it); the name must be free; ``mode`` is ``"forward"`` or
    ``"redirect"``; the classifier is checked (see the module docstring) and stored as text.
    """
    as_name(name, "routing service")
    if mode not in MODES:
        raise InvalidDefinition(
            f"routing service {name!r}: mode {mode!r} must be 'forward' or 'redirect'"
        )
    spec = classifier_spec(classifier)
    try:
        with broker.engine.begin() as conn:
            d = Definitions(broker, conn)
            d.create_service(name, queue=queue)
            others = sorted(
                conn.execute(
                    select(s.service.c.name)
                    .join(s.queue, s.queue.c.queue_id == s.service.c.queue_id)
                    .where(s.queue.c.name == queue, s.service.c.name != name)
                ).scalars()
            )
            if others:
                raise InvalidDefinition(
                    f"routing service {name!r}: queue {queue!r} already serves "
                    f"{', '.join(others)}; a routing service RECEIVEs everything on its queue, "
                    "so it needs a queue of its own"
                )
            conn.execute(
                insert(s.routing_service).values(
                    name=name, mode=mode, classifier=spec, created_at=utcnow()
                )
            )
    except IntegrityError as exc:
        raise InvalidDefinition(
            f"routing service {name!r} refused by the database: {exc.orig}"
        ) from exc
    finally:
        broker.invalidate_definitions()
    log.info(
        "routing service %r created on queue %r (%s mode, classifier %s)", name, queue, mode, spec
    )


def routing_service(broker: BrokerContext, name: str) -> RoutingService:
    """The stored definition of routing service ``name`` (:class:`UnknownObject` if none)."""
    rs = s.routing_service
    with broker.engine.connect() as conn:
        row = conn.execute(
            select(rs.c.name, rs.c.mode, rs.c.classifier, s.queue.c.name.label("queue"))
            .join(s.service, s.service.c.name == rs.c.name)
            .join(s.queue, s.queue.c.queue_id == s.service.c.queue_id)
            .where(rs.c.name == name)
        ).first()
        if row is None:
            raise UnknownObject(f"routing service {name!r} does not exist in this broker")
        others = sorted(
            conn.execute(
                select(s.service.c.name)
                .join(s.queue, s.queue.c.queue_id == s.service.c.queue_id)
                .where(s.queue.c.name == row.queue, s.service.c.name != name)
            ).scalars()
        )
    if others:
        raise InvalidDefinition(
            f"routing service {name!r}: its queue {row.queue!r} also serves "
            f"{', '.join(others)}; the router would take their messages, so it does not run"
        )
    return RoutingService(row.name, row.queue, row.mode, row.classifier)


def routing_handler(
    broker: BrokerContext, name: str
) -> tuple[str, Callable[[Transaction, list[Message]], None]]:
    """Routing service ``name`` as a reader's handler: its queue, and ``handler(tx, messages)``
    that routes what one RECEIVE returned inside that transaction. An activated reader (the
    Airflow ``RoutingServiceOperator``, an ``ActivationRunner``) drains the queue with it as
    :func:`run_routing_service` does."""
    svc = routing_service(broker, name)
    classify = compile_classifier(svc.classifier)

    def handler(tx: Transaction, messages: list[Message]) -> None:
        router = _Router(tx, svc, classify)
        for m in messages:
            router.handle(m)

    return svc.queue, handler


def run_routing_service(broker: BrokerContext, name: str, max_messages: int | None = None) -> int:
    """One pass of routing service ``name``: RECEIVE from its queue, a conversation group per
    transaction, and route every message, until the queue is empty or ``max_messages`` were
    handled. Returns how many messages were handled (DialogTimers and ignored ones included)."""
    if max_messages is not None and (
        not isinstance(max_messages, int) or isinstance(max_messages, bool) or max_messages < 1
    ):
        raise InvalidDefinition(f"max_messages must be a whole number >= 1, not {max_messages!r}")
    queue, handle = routing_handler(broker, name)
    handled = 0
    while max_messages is None or handled < max_messages:
        top = None if max_messages is None else max_messages - handled
        with Transaction(broker) as tx:
            messages = tx.receive(queue, top=top)
            handle(tx, messages)
        if not messages:
            break
        handled += len(messages)
    swept = sweep_mappings(broker, name)
    if handled or swept:
        log.info(
            "routing service %r handled %d message(s)%s",
            name,
            handled,
            f", forgot {swept} finished mapping(s)" if swept else "",
        )
    return handled


def sweep_mappings(broker: BrokerContext, name: str) -> int:
    """Delete the mappings of routing service ``name`` whose two halves the router has ended
    (or that no longer exist): the ones a far side closed without a message to the router."""
    r = s.resolved_conversation
    e = s.conversation_endpoint
    live = (
        select(e.c.conversation_handle)
        .where(
            e.c.conversation_handle.in_([r.c.inbound_handle, r.c.outbound_handle]),
            e.c.state.not_in(sorted(ENDED_STATES)),
        )
        .correlate(r)
    )
    with broker.engine.begin() as conn:
        result = conn.execute(delete(r).where(r.c.routing_service == name, ~exists(live)))
    return int(result.rowcount or 0)
