"""Queues (with readers, poison events and depth history), services and contracts."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from airflow_broker.operations.counts import bounded_count
from airflow_broker.operations.monitoring.models import (
    DEFAULT_LIMIT,
    QUEUE_EVENTS_SHOWN,
    QUEUE_READERS_SHOWN,
    ContractInfo,
    DepthHistory,
    Page,
    PoisonEvent,
    QueueDetail,
    QueueInfo,
    ReaderInfo,
    ServiceInfo,
    _age,
    _check_offset,
    _e,
    _ev,
    _pairs,
    _poison_filter,
    _queue_id,
    _r,
    _ts,
    check_page,
)
from airflow_broker.operations.sampling import check_minutes, depth_samples
from airflow_broker.storage import readiness
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext


def _queue_rows(
    conn: Connection,
    *,
    name: str | None = None,
    contains: str | None = None,
    limit: int | None = None,
    offset: int = 0,
) -> list[Any]:
    """Queue rows by name (one, those whose name contains ``contains``, or a page of them)."""
    q = s.queue
    stmt = select(q).order_by(q.c.name)
    if name is not None:
        stmt = stmt.where(q.c.name == name)
    if contains is not None:
        stmt = stmt.where(q.c.name.contains(contains, autoescape=True))
    if limit is not None:
        stmt = stmt.limit(limit).offset(offset)
    return list(conn.execute(stmt))


def _queue_infos(conn: Connection, rows: list[Any], *, whole: bool = False) -> list[QueueInfo]:
    """The :class:`QueueInfo` of queue ``rows``: every aggregate read for these queues only
    (``whole``: they are every queue, so the counts need no filter)."""
    ids = [r.queue_id for r in rows]
    readers: dict[int, tuple[int, int]] = {
        r.queue_id: (int(r.running), int(r.starting))
        for r in conn.execute(
            select(
                _r.c.queue_id,
                func.count().filter(_r.c.started_at.is_not(None)).label("running"),
                func.count().filter(_r.c.started_at.is_(None)).label("starting"),
            )
            .where(_r.c.finished_at.is_(None), _r.c.queue_id.in_(ids))
            .group_by(_r.c.queue_id)
        )
    }
    now = utcnow()
    # Depth counts what a reader could take now; held and leased messages are counted apart.
    waiting = readiness.tally(conn, queue_ids=None if whole else ids, now=now)
    services: dict[int, list[str]] = {}
    for r in conn.execute(
        select(s.service.c.queue_id, s.service.c.name)
        .where(s.service.c.queue_id.in_(ids))
        .order_by(s.service.c.name)
    ):
        services.setdefault(r.queue_id, []).append(r.name)
    names = [r.name for r in rows]
    poison: dict[str, tuple[int, int]] = {
        r.object_name: (int(r.n), int(r.last))
        for r in conn.execute(
            select(_ev.c.object_name, func.count().label("n"), func.max(_ev.c.id).label("last"))
            .where(_poison_filter(), _ev.c.object_name.in_(names))
            .group_by(_ev.c.object_name)
        )
    }
    last: dict[int, PoisonEvent] = {
        r.id: PoisonEvent(r.id, _ts(r.occurred_at), r.detail)  # type: ignore[arg-type]
        for r in conn.execute(
            select(_ev.c.id, _ev.c.occurred_at, _ev.c.detail).where(
                _ev.c.id.in_([v[1] for v in poison.values()])
            )
        )
    }
    out = []
    for r in rows:
        counted = waiting.get(r.queue_id, readiness.QueueReadiness(r.queue_id))
        oldest = counted.ready.oldest_enqueued_at
        count, last_id = poison.get(r.name, (0, 0))
        out.append(
            QueueInfo(
                name=r.name,
                status="enabled" if r.status else "disabled",
                enabled=bool(r.status),
                depth=counted.ready.messages,
                oldest_enqueued_at=oldest,
                oldest_age_seconds=_age(now, oldest),
                groups_ready=counted.ready.groups,
                readers_running=readers.get(r.queue_id, (0, 0))[0],
                readers_starting=readers.get(r.queue_id, (0, 0))[1],
                rollback_count=int(r.rollback_count),
                poison_message_handling=bool(r.poison_message_handling),
                retention=bool(r.retention),
                activation=r.activation,
                services=services.get(r.queue_id, []),
                poison_events=count,
                last_poison_event=last.get(last_id),
                held=counted.held.messages,
                held_until=counted.held.until,
                leased=counted.leased.messages,
            )
        )
    return out


def queues(broker: BrokerContext) -> list[QueueInfo]:
    """Every queue, by name: depth (messages a reader could take now), the messages held and
    leased apart, oldest message, readers running, status, poison events."""
    with broker.read_connection() as conn:
        return _queue_infos(conn, _queue_rows(conn), whole=True)


def queue_page(
    broker: BrokerContext,
    *,
    limit: int = DEFAULT_LIMIT,
    offset: int = 0,
    name_contains: str | None = None,
) -> Page[QueueInfo]:
    """A page of :func:`queues`, by name (``name_contains``: only queues whose name contains
    it): ``limit`` queues from ``offset`` on, each counted as :func:`queues` counts it, every
    aggregate read for the page's queues only. The ``total`` is exact up to ``COUNT_CAP``
    queues, estimated beyond (:mod:`~airflow_broker.operations.counts`)."""
    check_page(limit, offset)
    conds = (
        [] if name_contains is None else [s.queue.c.name.contains(name_contains, autoescape=True)]
    )
    with broker.read_connection() as conn:
        total = bounded_count(conn, s.queue, conds)
        if not total.estimated:
            _check_offset(offset, total.value, "queues")
        rows = _queue_rows(conn, contains=name_contains, limit=limit, offset=offset)
        return Page(_queue_infos(conn, rows), total.value, limit, offset, total.estimated)


def queue_names(broker: BrokerContext) -> list[str]:
    """Every queue's name, sorted (the page's queue pickers): one index read, no counts."""
    with broker.read_connection() as conn:
        return list(conn.execute(select(s.queue.c.name).order_by(s.queue.c.name)).scalars())


def queue_depth_history(
    broker: BrokerContext, name: str, minutes: int = 60, *, now: datetime | None = None
) -> DepthHistory:
    """The depth samples of queue ``name`` (:mod:`airflow_broker.operations.sampling`) from the last
    ``minutes`` minutes (1..:data:`~airflow_broker.operations.sampling.MAX_HISTORY_MINUTES`)."""
    check_minutes(minutes)
    with broker.read_connection() as conn:
        queue_id = _queue_id(conn, name)
    return DepthHistory(name, minutes, depth_samples(broker, queue_id, minutes, now=now))


def _reader_state(r: Any) -> str:
    """``starting`` (fired for, not registered yet), ``running`` or ``finished``."""
    if r.finished_at is not None:
        return "finished"
    return "starting" if r.started_at is None else "running"


def queue(broker: BrokerContext, name: str) -> QueueDetail:
    """One queue, with its most recent readers and poison events."""
    with broker.read_connection() as conn:
        queue_id = _queue_id(conn, name)
        (info,) = _queue_infos(conn, _queue_rows(conn, name=name))
        readers = [
            ReaderInfo(
                reader_id=r.reader_id,
                state=_reader_state(r),
                monitor_key=r.monitor_key,
                fired_at=aware(r.fired_at),
                started_at=aware(r.started_at),
                heartbeat_at=aware(r.heartbeat_at),
                finished_at=aware(r.finished_at),
                outcome=r.outcome,
                label=r.label,
            )
            for r in conn.execute(
                select(_r)
                .where(_r.c.queue_id == queue_id)
                .order_by(func.coalesce(_r.c.started_at, _r.c.fired_at).desc(), _r.c.reader_id)
                .limit(QUEUE_READERS_SHOWN)
            )
        ]
        events = [
            PoisonEvent(r.id, aware(r.occurred_at), r.detail)  # type: ignore[arg-type]
            for r in conn.execute(
                select(_ev.c.id, _ev.c.occurred_at, _ev.c.detail)
                .where(_poison_filter(), _ev.c.object_name == name)
                .order_by(_ev.c.id.desc())
                .limit(QUEUE_EVENTS_SHOWN)
            )
        ]
    return QueueDetail(info, readers, events)


def services(broker: BrokerContext) -> list[ServiceInfo]:
    """Every service, by name: its queue, contracts, and how many conversations it has (counted
    while the broker holds at most ``COUNT_CAP`` endpoints; None beyond, where counting them
    would read every endpoint: the conversation list filtered by service counts one)."""
    with broker.read_connection() as conn:
        contracts: dict[str, list[str]] = {}
        for r in conn.execute(
            select(s.service_contract).order_by(s.service_contract.c.contract_name)
        ):
            contracts.setdefault(r.service_name, []).append(r.contract_name)
        routing = set(conn.execute(select(s.routing_service.c.name)).scalars())
        counted = not bounded_count(conn, _e).estimated
        counts = (
            _pairs(conn, select(_e.c.service_name, func.count()).group_by(_e.c.service_name))
            if counted
            else {}
        )
        return [
            ServiceInfo(
                name=r.name,
                queue=r.queue,
                contracts=contracts.get(r.name, []),
                routing_service=r.name in routing,
                conversations=int(counts.get(r.name, 0)) if counted else None,
            )
            for r in conn.execute(
                select(s.service.c.name, s.queue.c.name.label("queue"))
                .join(s.queue, s.queue.c.queue_id == s.service.c.queue_id)
                .order_by(s.service.c.name)
            )
        ]


def contracts(broker: BrokerContext) -> list[ContractInfo]:
    """Every contract, by name: its message types, who sends each, their validation, and the
    services that accept it."""
    with broker.read_connection() as conn:
        validation = _pairs(
            conn,
            select(s.message_type.c.name, s.message_type.c.validation),
        )
        types: dict[str, dict[str, str]] = {}
        for r in conn.execute(
            select(s.contract_message).order_by(s.contract_message.c.message_type_name)
        ):
            types.setdefault(r.contract_name, {})[r.message_type_name] = r.sent_by
        users: dict[str, list[str]] = {}
        for r in conn.execute(
            select(s.service_contract).order_by(s.service_contract.c.service_name)
        ):
            users.setdefault(r.contract_name, []).append(r.service_name)
        return [
            ContractInfo(
                name=name,
                message_types=types.get(name, {}),
                validation={mt: validation.get(mt, "none") for mt in types.get(name, {})},
                services=users.get(name, []),
            )
            for name in conn.execute(select(s.contract.c.name).order_by(s.contract.c.name))
            .scalars()
            .all()
        ]
