"""The broker's catalog and health as value objects: what ``Broker.catalog()``,
``queue_status()``, ``transmission_summary()``, ``transmission_queue()`` and ``events()`` return
(the CLI's ``status`` prints them; the monitoring API has richer, paged views)."""

from __future__ import annotations

from sqlalchemy import func, select

from airflow_broker.constants import STATUS_READY
from airflow_broker.messaging.objects import (
    BrokerEvent,
    Catalog,
    ContractDef,
    MessageTypeDef,
    PriorityDef,
    QueueDef,
    QueueStatus,
    RouteDef,
    ServiceDef,
    TransmissionRow,
    TransmissionSummary,
)
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow
from airflow_broker.storage.context import BrokerContext


def catalog(broker: BrokerContext) -> Catalog:
    """Every object declared in this broker."""
    with broker.engine.connect() as conn:
        mts = {
            r.name: MessageTypeDef(r.name, r.validation, r.json_schema)
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
                    r.name, r.status, r.retention, r.poison_message_handling, r.activation
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
        )


def queue_status(broker: BrokerContext) -> list[QueueStatus]:
    """Depth, oldest message and health of every queue, by name."""
    m = s.message
    ready = (
        select(
            m.c.queue_id,
            func.count().label("depth"),
            func.min(m.c.enqueued_at).label("oldest"),
            func.count(func.distinct(m.c.conversation_group_id)).label("groups"),
        )
        .where(m.c.status == STATUS_READY)
        .group_by(m.c.queue_id)
        .subquery()
    )
    stmt = (
        select(s.queue, ready.c.depth, ready.c.oldest, ready.c.groups)
        .outerjoin(ready, ready.c.queue_id == s.queue.c.queue_id)
        .order_by(s.queue.c.name)
    )
    now = utcnow()
    with broker.engine.connect() as conn:
        rows = list(conn.execute(stmt))
    out = []
    for r in rows:
        oldest = aware(r.oldest)
        out.append(
            QueueStatus(
                name=r.name,
                status=r.status,
                depth=r.depth or 0,
                oldest_enqueued_at=oldest,
                oldest_age_seconds=(now - oldest).total_seconds() if oldest else None,
                groups_ready=r.groups or 0,
                rollback_count=r.rollback_count,
                poison_message_handling=r.poison_message_handling,
                retention=r.retention,
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
    with broker.engine.connect() as conn:
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
    """Messages waiting to leave, oldest first, each with why it has not gone yet."""
    t = s.transmission_queue
    stmt = select(t).order_by(t.c.id)
    if limit is not None:
        stmt = stmt.limit(limit)
    with broker.engine.connect() as conn:
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
    with broker.engine.connect() as conn:
        return [
            BrokerEvent(r.id, aware(r.occurred_at), r.event, r.object_name, r.detail)  # type: ignore[arg-type]
            for r in conn.execute(select(e).order_by(e.c.id.desc()).limit(limit))
        ]


__all__ = [
    "catalog",
    "events",
    "queue_status",
    "transmission_queue",
    "transmission_summary",
]
