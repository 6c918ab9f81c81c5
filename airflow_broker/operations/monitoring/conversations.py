"""Conversations: counts by state, filtered and paged lists, one conversation."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from airflow_broker.constants import STATE_DESC, STATUS_READY
from airflow_broker.errors import InvalidDefinition, UnknownObject
from airflow_broker.messaging.arguments import as_uuid
from airflow_broker.operations.counts import bounded_count, bounded_counts_by
from airflow_broker.operations.monitoring.models import (
    DEFAULT_LIMIT,
    ConversationInfo,
    Page,
    StateCount,
    _check_offset,
    _e,
    _m,
    _pairs,
    _queue_id,
    _state_code,
    _t,
    check_page,
)
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext


def _state_counts(conn: Connection, conds: Sequence[Any] = ()) -> list[StateCount]:
    """Endpoints by state: exact up to ``COUNT_CAP`` endpoints, estimated beyond."""
    counts, estimated = bounded_counts_by(conn, _e, _e.c.state, list(STATE_DESC), conds)
    return [
        StateCount(code, desc, int(counts.get(code, 0)), estimated)
        for code, desc in STATE_DESC.items()
    ]


def conversation_states(broker: BrokerContext, queue: str | None = None) -> list[StateCount]:
    """Conversation endpoints counted by state (every state, zeros included); past
    ``COUNT_CAP`` endpoints the counts are PostgreSQL's estimates (``estimated``)."""
    with broker.read_connection() as conn:
        conds = [] if queue is None else [_e.c.queue_id == _queue_id(conn, queue)]
        return _state_counts(conn, conds)


def _conversation_rows(conn: Connection, rows: list[Any]) -> list[ConversationInfo]:
    handles = [r.conversation_handle for r in rows]
    ready: dict[uuid.UUID, int] = {}
    waiting: dict[uuid.UUID, int] = {}
    if handles:
        ready = _pairs(
            conn,
            select(_m.c.conversation_handle, func.count())
            .where(_m.c.conversation_handle.in_(handles), _m.c.status == STATUS_READY)
            .group_by(_m.c.conversation_handle),
        )
        waiting = _pairs(
            conn,
            select(_t.c.conversation_handle, func.count())
            .where(_t.c.conversation_handle.in_(handles))
            .group_by(_t.c.conversation_handle),
        )
    return [
        ConversationInfo(
            conversation_handle=r.conversation_handle,
            conversation_id=r.conversation_id,
            conversation_group_id=r.conversation_group_id,
            is_initiator=bool(r.is_initiator),
            service_name=r.service_name,
            far_service=r.far_service,
            far_broker_instance=r.far_broker_instance,
            contract_name=r.contract_name,
            state=r.state,
            state_desc=STATE_DESC.get(r.state, r.state),
            queue=r.queue_name,
            priority=int(r.priority),
            lifetime=aware(r.lifetime),
            timer_due_at=aware(r.timer_due_at),
            send_sequence=int(r.send_sequence),
            receive_sequence=int(r.receive_sequence),
            created_at=aware(r.created_at),  # type: ignore[arg-type]
            closed_at=aware(r.closed_at),
            messages_ready=int(ready.get(r.conversation_handle, 0)),
            transmissions_waiting=int(waiting.get(r.conversation_handle, 0)),
        )
        for r in rows
    ]


def _endpoint_select() -> Any:
    return select(_e, s.queue.c.name.label("queue_name")).join(
        s.queue, s.queue.c.queue_id == _e.c.queue_id
    )


def conversations(
    broker: BrokerContext,
    *,
    state: str | None = None,
    queue: str | None = None,
    service: str | None = None,
    far_service: str | None = None,
    is_initiator: bool | None = None,
    limit: int = DEFAULT_LIMIT,
    offset: int = 0,
) -> Page[ConversationInfo]:
    """Conversation endpoints, newest first, filtered by state (code or description), queue,
    local service, far service and side. The page's ``total`` is exact up to ``COUNT_CAP``
    matches and PostgreSQL's estimate beyond (``total_estimated``,
    :mod:`~airflow_broker.operations.counts`)."""
    check_page(limit, offset)
    conds: list[Any] = []
    if state is not None:
        conds.append(_e.c.state == _state_code(state))
    if service is not None:
        conds.append(_e.c.service_name == service)
    if far_service is not None:
        conds.append(_e.c.far_service == far_service)
    if is_initiator is not None:
        conds.append(_e.c.is_initiator.is_(bool(is_initiator)))
    with broker.read_connection() as conn:
        if queue is not None:
            conds.append(_e.c.queue_id == _queue_id(conn, queue))
        total = bounded_count(conn, _e, conds)
        if not total.estimated:
            _check_offset(offset, total.value, "conversations")
        rows = list(
            conn.execute(
                _endpoint_select()
                .where(*conds)
                .order_by(_e.c.created_at.desc(), _e.c.conversation_handle.desc())
                .limit(limit)
                .offset(offset)
            )
        )
        if total.estimated and offset > 0 and not rows:
            raise InvalidDefinition(
                f"offset {offset} is past the end: about {total.value} conversations match"
            )
        return Page(_conversation_rows(conn, rows), total.value, limit, offset, total.estimated)


def conversation(broker: BrokerContext, handle: uuid.UUID | str) -> ConversationInfo:
    """One conversation endpoint by its handle."""
    h = as_uuid(handle, "conversation handle")
    with broker.read_connection() as conn:
        rows = list(conn.execute(_endpoint_select().where(_e.c.conversation_handle == h)))
        if not rows:
            raise UnknownObject(f"conversation handle {h} does not exist in this broker")
        return _conversation_rows(conn, rows)[0]
