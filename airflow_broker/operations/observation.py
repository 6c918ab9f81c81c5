"""The broker's catalog and health as value objects: what ``Broker.catalog()``,
``queue_status()``, ``transmission_summary()``, ``transmission_queue()``, ``events()`` and
``peek()`` return (the CLI's ``status`` prints them; the monitoring API has richer, paged views)."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from airflow_broker.constants import STATUS_READY
from airflow_broker.errors import InvalidDefinition, UnknownObject
from airflow_broker.messaging.arguments import as_name
from airflow_broker.messaging.objects import (
    BrokerEvent,
    Catalog,
    ContractDef,
    Message,
    MessageTypeDef,
    PriorityDef,
    QueueDef,
    QueueStatus,
    RouteDef,
    ServiceDef,
    TransmissionRow,
    TransmissionSummary,
    message_from_row,
)
from airflow_broker.security import certificates as certificate_store
from airflow_broker.security import permissions
from airflow_broker.storage import readiness
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow
from airflow_broker.storage.context import BrokerContext


def catalog(broker: BrokerContext) -> Catalog:
    """Every object declared in this broker."""
    with broker.read_connection() as conn:
        mts = {
            r.name: MessageTypeDef(r.name, r.validation, r.json_schema, r.xml_schema)
            for r in conn.execute(select(s.message_type))
        }
        contracts: dict[str, dict[str, str]] = {
            r.name: {} for r in conn.execute(select(s.contract))
        }
        for r in conn.execute(select(s.contract_message)):
            contracts[r.contract_name][r.message_type_name] = r.sent_by
        queue_rows = list(conn.execute(select(s.queue)))
        qnames = {r.queue_id: r.name for r in queue_rows}
        svc_contracts: dict[str, list[str]] = {}
        for r in conn.execute(
            select(s.service_contract).order_by(s.service_contract.c.contract_name)
        ):
            svc_contracts.setdefault(r.service_name, []).append(r.contract_name)
        return Catalog(
            message_types=mts,
            contracts={k: ContractDef(k, v) for k, v in contracts.items()},
            queues={
                r.name: QueueDef(
                    r.name,
                    r.status,
                    r.retention,
                    r.poison_message_handling,
                    r.activation,
                    r.retry_delay,
                    r.retry_delay_max,
                    r.max_receives,
                    r.dead_letter_queue,
                )
                for r in queue_rows
            },
            services={
                r.name: ServiceDef(r.name, qnames[r.queue_id], tuple(svc_contracts.get(r.name, ())))
                for r in conn.execute(select(s.service))
            },
            routes={
                r.name: RouteDef(
                    r.name,
                    r.service_name,
                    r.broker_instance,
                    r.address,
                    r.mirror_address,
                    aware(r.expires_at),
                )
                for r in conn.execute(select(s.route))
            },
            priorities={
                r.name: PriorityDef(
                    r.name, r.contract_name, r.local_service, r.remote_service, r.priority
                )
                for r in conn.execute(select(s.priority))
            },
            certificates={c.name: c for c in certificate_store.certificates(conn)},
            remote_service_bindings={b.name: b for b in certificate_store.bindings(conn)},
        )


def queue_status(broker: BrokerContext) -> list[QueueStatus]:
    """Depth, oldest message and health of every queue, by name.

    ``depth``, ``groups_ready`` and the oldest message count only messages a reader could take
    now; ``held`` and ``leased`` count the others apart, ``held_until`` is when the first held
    one can be taken again (see :class:`~airflow_broker.messaging.objects.QueueStatus` and
    :mod:`~airflow_broker.storage.readiness`).

    Its cost follows the number of queues and of waiting messages, never the number of
    conversations (open ones hold no message): two statements, the queues' shown columns and
    the waiting messages grouped by queue and state."""
    now = utcnow()
    q = s.queue
    # Only the columns shown: a thousand queues' activation settings (JSON) are not decoded.
    columns = (
        q.c.queue_id,
        q.c.name,
        q.c.status,
        q.c.rollback_count,
        q.c.poison_message_handling,
        q.c.retention,
    )
    with broker.read_connection() as conn:
        rows = conn.execute(select(*columns).order_by(q.c.name)).all()
        # Waiting messages only (never the conversations, open or not): grouped by the database.
        counts = readiness.tally(conn, now=now)
    out = []
    for r in rows:
        waiting = counts.get(r.queue_id, readiness.QueueReadiness(r.queue_id))
        ready = waiting.ready
        oldest = ready.oldest_enqueued_at
        out.append(
            QueueStatus(
                name=r.name,
                status=r.status,
                depth=ready.messages,
                oldest_enqueued_at=oldest,
                oldest_age_seconds=(now - oldest).total_seconds() if oldest else None,
                groups_ready=ready.groups,
                rollback_count=r.rollback_count,
                poison_message_handling=r.poison_message_handling,
                retention=r.retention,
                held=waiting.held.messages,
                leased=waiting.leased.messages,
                held_until=waiting.held.until,
            )
        )
    return out


def transmission_summary(broker: BrokerContext) -> list[TransmissionSummary]:
    """The transmission queue counted by target service and reason, most messages first."""
    t = s.transmission_queue
    stmt = (
        select(
            t.c.to_service_name,
            t.c.transmission_status,
            func.count().label("n"),
            func.min(t.c.enqueued_at).label("oldest"),
        )
        .group_by(t.c.to_service_name, t.c.transmission_status)
        .order_by(func.count().desc(), t.c.to_service_name)
    )
    with broker.read_connection() as conn:
        return [
            TransmissionSummary(
                r.to_service_name,
                r.transmission_status,
                r.n,
                aware(r.oldest),  # type: ignore[arg-type]
            )
            for r in conn.execute(stmt)
        ]


def transmission_queue(broker: BrokerContext, limit: int | None = None) -> list[TransmissionRow]:
    """Messages waiting to leave, oldest first, each with why it has not gone yet. A message
    that waits with others for one cause has that cause's next attempt."""
    t, w = s.transmission_queue, s.transmission_wait
    stmt = (
        select(
            *(c for c in t.c if c.name != "next_attempt_at"),
            func.coalesce(t.c.next_attempt_at, w.c.next_attempt_at).label("next_attempt_at"),
        )
        .outerjoin(w, w.c.id == t.c.wait_id)
        .order_by(t.c.id)
    )
    if limit is not None:
        stmt = stmt.limit(limit)
    with broker.read_connection() as conn:
        return [
            TransmissionRow(
                id=r.id,
                conversation_handle=r.conversation_handle,
                to_service_name=r.to_service_name,
                to_broker_instance=r.to_broker_instance,
                service_contract_name=r.service_contract_name,
                message_type_name=r.message_type_name,
                message_sequence_number=r.message_sequence_number,
                enqueued_at=aware(r.enqueued_at),  # type: ignore[arg-type]
                transmission_status=r.transmission_status,
                attempts=r.attempts,
                next_attempt_at=aware(r.next_attempt_at),
            )
            for r in conn.execute(stmt)
        ]


def events(broker: BrokerContext, limit: int = 100) -> list[BrokerEvent]:
    """The most recent things the broker did on its own, newest first."""
    e = s.event
    with broker.read_connection() as conn:
        return [
            BrokerEvent(r.id, aware(r.occurred_at), r.event, r.object_name, r.detail)  # type: ignore[arg-type]
            for r in conn.execute(select(e).order_by(e.c.id.desc()).limit(limit))
        ]


# -- peek ---------------------------------------------------------------------------------------


def peek_queue(conn: Connection, name: str) -> Any:
    """The row of queue ``name`` (``queue_id``, ``name``, ``status``, ``retention``);
    :class:`~airflow_broker.errors.UnknownObject` naming it when there is no such queue."""
    as_name(name, "queue")
    q = s.queue
    row = conn.execute(
        select(q.c.queue_id, q.c.name, q.c.status, q.c.retention).where(q.c.name == name)
    ).first()
    if row is None:
        raise UnknownObject(f"queue {name!r} does not exist in this broker")
    return row


def check_peek(
    top: int, offset: int, conversation_handle: uuid.UUID | str | None
) -> uuid.UUID | None:
    """Refuse (:class:`~airflow_broker.errors.InvalidDefinition`) a ``top`` below 1, a negative
    ``offset``, either not a whole number, and a conversation handle that is not a UUID; the
    handle as a UUID."""
    for value, what, least in ((top, "top", 1), (offset, "offset", 0)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidDefinition(f"peek: {what} must be a whole number, not {value!r}")
        if value < least:
            raise InvalidDefinition(f"peek: {what} must be at least {least}, not {value}")
    if conversation_handle is None or isinstance(conversation_handle, uuid.UUID):
        return conversation_handle
    try:
        return uuid.UUID(str(conversation_handle))
    except ValueError:
        raise InvalidDefinition(
            f"peek: conversation_handle must be a UUID, not {conversation_handle!r}"
        ) from None


def _waiting(queue_id: int, handle: uuid.UUID | None) -> list[Any]:
    m = s.message
    conds = [m.c.queue_id == queue_id, m.c.status == STATUS_READY]
    if handle is not None:
        conds.append(m.c.conversation_handle == handle)
    return conds


def count_waiting(conn: Connection, queue_id: int, handle: uuid.UUID | None = None) -> int:
    """How many messages :func:`peek_on` can show: ready messages of the queue (and
    conversation)."""
    stmt = select(func.count()).select_from(s.message).where(*_waiting(queue_id, handle))
    return int(conn.execute(stmt).scalar_one())


def peek_on(
    conn: Connection,
    queue_id: int,
    *,
    top: int,
    offset: int = 0,
    handle: uuid.UUID | None = None,
) -> list[Message]:
    """:func:`peek` on an open connection, by queue id (the caller checked the arguments)."""
    m = s.message
    if handle is None:
        # The order RECEIVE picks conversation groups in (ix_broker_message_ready).
        order: tuple[Any, ...] = (m.c.priority.desc(), m.c.queuing_order)
    else:
        # One dialog as RECEIVE returns it: its timer, then an Error, then in sequence order.
        order = (m.c.priority.desc(), m.c.precedence, m.c.message_sequence_number)
    stmt = select(m).where(*_waiting(queue_id, handle)).order_by(*order).limit(top).offset(offset)
    return [
        message_from_row(r, int(r.receive_count), status=r.status, enqueued_at=aware(r.enqueued_at))
        for r in conn.execute(stmt)
    ]


def peek(
    broker: BrokerContext,
    queue: str,
    *,
    top: int = 20,
    conversation_handle: uuid.UUID | str | None = None,
    offset: int = 0,
) -> list[Message]:
    """The messages waiting in ``queue``, without receiving or locking anything.

    A plain SELECT of the queue's ready messages (status 1): nothing is taken, no conversation
    group is locked, no count changes, and on PostgreSQL it neither waits for nor holds up a
    RECEIVE that holds a group (it sees the messages that RECEIVE took until it commits). On
    SQLite neither: it reads on a read-only connection (``BEGIN DEFERRED``,
    :meth:`~airflow_broker.storage.context.BrokerContext.read_connection`), which sees the last
    committed state while another transaction holds the database's write lock.

    Order: the whole queue in the order RECEIVE picks conversation groups (priority, highest
    first, then arrival: ``queuing_order``); with ``conversation_handle``, that dialog's messages
    as RECEIVE returns them (in ``message_sequence_number`` order, a DialogTimer and an Error
    first). ``top`` messages from ``offset`` on. Messages kept by retention (received, status 0;
    sent, status 3) and messages that arrived out of order (status 2) are not waiting and are not
    shown.

    Each :class:`~airflow_broker.messaging.objects.Message` has ``status``, ``enqueued_at`` and
    ``dead_letter`` set, and its ``receive_count`` is the number of times it has been handed out
    so far without being removed (rolled back, reader killed, lease expired or released): 0 for
    a message never received. RECEIVE reports one more, its own hand-out included.

    :raises UnknownObject: ``queue`` does not exist.
    :raises InvalidDefinition: ``top`` below 1, ``offset`` below 0, either not a whole number,
        or a ``conversation_handle`` that is not a UUID.
    """
    handle = check_peek(top, offset, conversation_handle)
    with broker.read_connection() as conn:
        if broker.client_role is not None:  # a client role peeks where it may RECEIVE
            permissions.grants_of(conn, broker.client_role).require_receive(queue)
        queue_id = peek_queue(conn, queue).queue_id
        return peek_on(conn, queue_id, top=top, offset=offset, handle=handle)


__all__ = [
    "catalog",
    "check_peek",
    "count_waiting",
    "events",
    "peek",
    "peek_on",
    "peek_queue",
    "queue_status",
    "transmission_queue",
    "transmission_summary",
]
