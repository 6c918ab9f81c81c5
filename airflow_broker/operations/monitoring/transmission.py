"""The transmission queue with its reasons, routes, routing services and their mappings."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select

from airflow_broker.messaging.arguments import as_uuid
from airflow_broker.operations.monitoring.models import (
    DEFAULT_LIMIT,
    MappingInfo,
    Page,
    RouteInfo,
    RoutingServiceInfo,
    TransmissionInfo,
    TransmissionPage,
    WaitingSummary,
    _age,
    _check_offset,
    _e,
    _pairs,
    _t,
    _ts,
    check_page,
)
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

_w = s.transmission_wait


def _transmission_info(r: Any, now: datetime) -> TransmissionInfo:
    enqueued = aware(r.enqueued_at)
    return TransmissionInfo(
        id=int(r.id),
        conversation_handle=r.conversation_handle,
        conversation_id=r.conversation_id,
        from_service_name=r.from_service_name,
        to_service_name=r.to_service_name,
        to_broker_instance=r.to_broker_instance,
        service_contract_name=r.service_contract_name,
        message_type_name=r.message_type_name,
        message_sequence_number=int(r.message_sequence_number),
        enqueued_at=enqueued,  # type: ignore[arg-type]
        age_seconds=_age(now, enqueued) or 0.0,
        transmission_status=r.transmission_status or "not tried yet",
        attempts=int(r.attempts),
        next_attempt_at=aware(r.next_attempt_at),
        body_bytes=None if r.body_bytes is None else int(r.body_bytes),
    )


def _transmission_select() -> Any:
    """The rows as listed; a row parked under a cause (``wait_id``: one cause, one wait) has
    no next attempt of its own and shows its cause's."""
    return (
        select(
            _t.c.id,
            _t.c.conversation_handle,
            _t.c.conversation_id,
            _t.c.from_service_name,
            _t.c.to_service_name,
            _t.c.to_broker_instance,
            _t.c.service_contract_name,
            _t.c.message_type_name,
            _t.c.message_sequence_number,
            _t.c.enqueued_at,
            _t.c.transmission_status,
            _t.c.attempts,
            func.coalesce(_t.c.next_attempt_at, _w.c.next_attempt_at).label("next_attempt_at"),
            func.length(_t.c.message_body).label("body_bytes"),
        )
        .select_from(_t)
        .outerjoin(_w, _w.c.id == _t.c.wait_id)
    )


def transmission_queue(
    broker: BrokerContext,
    *,
    conversation_handle: uuid.UUID | str | None = None,
    to_service: str | None = None,
    limit: int = DEFAULT_LIMIT,
    offset: int = 0,
) -> TransmissionPage:
    """Messages waiting to leave, oldest first, each with the reason it waits; and the whole
    transmission queue counted by target service and reason."""
    check_page(limit, offset)
    conds: list[Any] = []
    if conversation_handle is not None:
        conds.append(
            _t.c.conversation_handle == as_uuid(conversation_handle, "conversation handle")
        )
    if to_service is not None:
        conds.append(_t.c.to_service_name == to_service)
    now = utcnow()
    with broker.read_connection() as conn:
        total = int(conn.execute(select(func.count()).select_from(_t).where(*conds)).scalar_one())
        _check_offset(offset, total, "messages")
        rows = conn.execute(
            _transmission_select().where(*conds).order_by(_t.c.id).limit(limit).offset(offset)
        )
        items = [_transmission_info(r, now) for r in rows]
        summary = [
            WaitingSummary(r.to_service_name, r.transmission_status, int(r.n), _ts(r.oldest))
            for r in conn.execute(
                select(
                    _t.c.to_service_name,
                    _t.c.transmission_status,
                    func.count().label("n"),
                    func.min(_t.c.enqueued_at).label("oldest"),
                )
                .where(*conds)
                .group_by(_t.c.to_service_name, _t.c.transmission_status)
                .order_by(func.count().desc(), _t.c.to_service_name)
            )
        ]
    return TransmissionPage(Page(items, total, limit, offset), summary)


def _route_kind(address: str) -> str:
    if address.upper() == "LOCAL":
        return "local"
    if address.upper() == "TRANSPORT":
        return "transport"
    return "broker"


def routes(broker: BrokerContext) -> list[RouteInfo]:
    """Every route, by name, with whether it has expired."""
    now = utcnow()
    with broker.read_connection() as conn:
        out = []
        for r in conn.execute(select(s.route).order_by(s.route.c.name)):
            expires = aware(r.expires_at)
            out.append(
                RouteInfo(
                    name=r.name,
                    service_name=r.service_name,
                    broker_instance=r.broker_instance,
                    address=r.address,
                    mirror_address=r.mirror_address,
                    expires_at=expires,
                    expired=expires is not None and expires <= now,
                    kind=_route_kind(r.address),
                )
            )
        return out


def routing_services(broker: BrokerContext) -> list[RoutingServiceInfo]:
    """The data-dependent routing services, with how many mappings each holds."""
    rs, rc = s.routing_service, s.resolved_conversation
    with broker.read_connection() as conn:
        counts = _pairs(
            conn,
            select(rc.c.routing_service, func.count()).group_by(rc.c.routing_service),
        )
        return [
            RoutingServiceInfo(r.name, r.queue, r.mode, r.classifier, int(counts.get(r.name, 0)))
            for r in conn.execute(
                select(rs.c.name, rs.c.mode, rs.c.classifier, s.queue.c.name.label("queue"))
                .join(s.service, s.service.c.name == rs.c.name)
                .join(s.queue, s.queue.c.queue_id == s.service.c.queue_id)
                .order_by(rs.c.name)
            )
        ]


def routing_mappings(
    broker: BrokerContext,
    *,
    routing_service: str | None = None,
    target_service: str | None = None,
    limit: int = DEFAULT_LIMIT,
    offset: int = 0,
) -> Page[MappingInfo]:
    """Data-dependent routing's inbound -> outbound mappings, newest first, with the state of
    each endpoint (None once it is gone)."""
    check_page(limit, offset)
    rc = s.resolved_conversation
    inbound, outbound = _e.alias("inbound"), _e.alias("outbound")
    conds: list[Any] = []
    if routing_service is not None:
        conds.append(rc.c.routing_service == routing_service)
    if target_service is not None:
        conds.append(rc.c.target_service == target_service)
    with broker.read_connection() as conn:
        total = int(conn.execute(select(func.count()).select_from(rc).where(*conds)).scalar_one())
        _check_offset(offset, total, "mappings")
        stmt = (
            select(rc, inbound.c.state.label("in_state"), outbound.c.state.label("out_state"))
            .outerjoin(inbound, inbound.c.conversation_handle == rc.c.inbound_handle)
            .outerjoin(outbound, outbound.c.conversation_handle == rc.c.outbound_handle)
            .where(*conds)
            .order_by(rc.c.created_at.desc(), rc.c.inbound_handle)
            .limit(limit)
            .offset(offset)
        )
        items = [
            MappingInfo(
                inbound_handle=r.inbound_handle,
                outbound_handle=r.outbound_handle,
                routing_service=r.routing_service,
                target_service=r.target_service,
                created_at=aware(r.created_at),  # type: ignore[arg-type]
                inbound_state=r.in_state,
                outbound_state=r.out_state,
            )
            for r in conn.execute(stmt)
        ]
    return Page(items, total, limit, offset)
