"""What an operator sees of a broker and the few things an operator does to it.

The plugin's HTTP API (``airflow_broker.plugin.api``) is a thin layer over this module; the
module itself runs without Airflow, against either engine, and returns plain frozen dataclasses
(:func:`to_json` turns them into JSON-ready dicts).

Observation
    :func:`overview`, :func:`queues` / :func:`queue`, :func:`queue_depth_history` (samples
    written by :mod:`airflow_broker.sampling`), :func:`services`, :func:`contracts`,
    :func:`conversation_states`, :func:`conversations` / :func:`conversation`,
    :func:`transmission_queue`, :func:`routes`, :func:`routing_services`,
    :func:`routing_mappings`, :func:`events`. Lists that grow with traffic (conversations, the
    transmission queue, routing mappings, events) are pages (:class:`Page`): ``limit`` (at most
    :data:`MAX_LIMIT`) and ``offset``, counted and read by the database, never loaded whole.
    Lists of declared objects (queues, services, contracts, routes) are small by nature and are
    returned whole, each with its aggregates computed by one grouped statement, not per row.

Actions
    :func:`enable_queue` (re-enable a queue, e.g. one poison handling disabled),
    :func:`retry_transmission` (make a conversation's waiting messages due now and run a delivery
    pass), :func:`drop_transmission` (remove waiting messages), :func:`end_conversation` (END,
    WITH CLEANUP by default), :func:`start_probe` / :func:`probe` (an echo probe, see
    :mod:`airflow_broker.examples.echo`). Each runs in one transaction, refuses bad input before
    it changes anything, and records an ``operator_action`` event naming who did it.

Errors are the engine's: :class:`~airflow_broker.errors.UnknownObject` for a queue, conversation
or probe that does not exist, :class:`~airflow_broker.errors.InvalidDefinition` for malformed
input (a bad id, a limit out of range, an offset past the end), and :class:`NotReady` when the
broker lacks what an action needs (the echo example's prober service).
"""

from __future__ import annotations

import dataclasses
import enum
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sqlalchemy import and_, delete, func, inspect, select, update
from sqlalchemy.engine import Connection

from airflow_broker import schema as s
from airflow_broker.arguments import as_name, as_uuid
from airflow_broker.constants import STATE_DESC, STATUS_READY
from airflow_broker.engines import aware, utcnow
from airflow_broker.errors import (
    BrokerError,
    ConversationEnded,
    InvalidDefinition,
    QueueDisabled,
    UnknownObject,
)
from airflow_broker.events import record_event
from airflow_broker.examples import echo
from airflow_broker.objects import BrokerEvent
from airflow_broker.sampling import DepthSample, check_minutes, depth_samples

if TYPE_CHECKING:
    from airflow_broker.broker import Broker

T = TypeVar("T")

#: The most rows one page may hold.
MAX_LIMIT = 500
#: Rows per page when the caller does not say.
DEFAULT_LIMIT = 50
#: The largest offset accepted at all (a page past the end is refused anyway).
MAX_OFFSET = 1_000_000_000
#: Readers of one queue listed by :func:`queue` (newest first).
QUEUE_READERS_SHOWN = 50
#: Poison events of one queue listed by :func:`queue` (newest first).
QUEUE_EVENTS_SHOWN = 20
#: The event every action of this module records.
OPERATOR_ACTION = "operator_action"
#: Poison handling records this event (its detail names poison message handling).
QUEUE_DISABLED = "queue_disabled"
_POISON_DETAIL = "%poison message handling%"
#: What :func:`start_probe` hands out: ``probe-`` and 12 hex digits.
PROBE_ID = re.compile(r"^probe-[0-9a-f]{12}$")
#: A probe's timeout, in seconds: more than 0, at most an hour.
MAX_PROBE_TIMEOUT = 3600.0


class NotReady(BrokerError):
    """The broker lacks an object an action needs (e.g. the echo example's prober service)."""


# ---------------------------------------------------------------------------------------------
# Paging and JSON
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a list: ``items`` from ``offset`` on, of ``total`` that match."""

    items: list[T]
    total: int
    limit: int
    offset: int

    @property
    def next_offset(self) -> int | None:
        """The offset of the next page, or None on the last one."""
        following = self.offset + len(self.items)
        return following if following < self.total else None


def check_page(limit: int, offset: int) -> None:
    """Refuse a limit outside 1..MAX_LIMIT or a negative (or absurd) offset."""
    for value, what in ((limit, "limit"), (offset, "offset")):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidDefinition(f"{what} must be a whole number, not {value!r}")
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidDefinition(f"limit must be between 1 and {MAX_LIMIT}, not {limit}")
    if not 0 <= offset <= MAX_OFFSET:
        raise InvalidDefinition(f"offset must be between 0 and {MAX_OFFSET}, not {offset}")


def _check_offset(offset: int, total: int, what: str) -> None:
    """An offset at or past the end of the list is out of range (offset 0 never is)."""
    if offset > 0 and offset >= total:
        matching = f"no {what} match" if total == 0 else f"{total} {what} match"
        raise InvalidDefinition(
            f"offset {offset} is past the end: {matching} (offsets 0..{max(total - 1, 0)})"
        )


def to_json(value: Any) -> Any:
    """Dataclasses, pages, datetimes and UUIDs as JSON-ready dicts, lists, strings, numbers."""
    if isinstance(value, Page):
        return {
            "items": [to_json(v) for v in value.items],
            "total": value.total,
            "limit": value.limit,
            "offset": value.offset,
            "next_offset": value.next_offset,
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, datetime):
        return aware(value).isoformat()  # type: ignore[union-attr]
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def _ts(value: Any) -> datetime | None:
    """A timestamp from the database; min()/max() on SQLite hand back the stored text."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return aware(value)


def _pairs(conn: Connection, stmt: Any) -> dict[Any, Any]:
    """A two-column statement's rows as a dict."""
    return {row[0]: row[1] for row in conn.execute(stmt)}


def _age(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else max(0.0, (now - then).total_seconds())


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoisonEvent:
    """Poison handling disabled a queue."""

    id: int
    occurred_at: datetime
    detail: str


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """A queue at a glance: depth, oldest message, readers, status, poison events."""

    name: str
    status: str  # "enabled" | "disabled"
    enabled: bool
    depth: int
    oldest_enqueued_at: datetime | None
    oldest_age_seconds: float | None
    groups_ready: int
    readers_running: int
    readers_starting: int
    rollback_count: int
    poison_message_handling: bool
    retention: bool
    activation: dict[str, Any] | None
    services: list[str]
    poison_events: int
    last_poison_event: PoisonEvent | None


@dataclass(frozen=True, slots=True)
class ReaderInfo:
    """A row of ``broker_activation_reader``: a reader fired for, running or finished."""

    reader_id: uuid.UUID
    state: str  # "starting" | "running" | "finished"
    monitor_key: str | None
    fired_at: datetime | None
    started_at: datetime | None
    heartbeat_at: datetime | None
    finished_at: datetime | None
    outcome: str | None
    label: str | None


@dataclass(frozen=True, slots=True)
class QueueDetail:
    """One queue, with its recent readers and poison events."""

    queue: QueueInfo
    readers: list[ReaderInfo]
    poison_events: list[PoisonEvent]


@dataclass(frozen=True, slots=True)
class ServiceInfo:
    name: str
    queue: str
    contracts: list[str]
    routing_service: bool
    conversations: int


@dataclass(frozen=True, slots=True)
class ContractInfo:
    name: str
    #: message type -> who may send it ("initiator" | "target" | "any")
    message_types: dict[str, str]
    #: message type -> its validation ("none", "json", ...)
    validation: dict[str, str]
    services: list[str]


@dataclass(frozen=True, slots=True)
class StateCount:
    state: str
    state_desc: str
    count: int


@dataclass(frozen=True, slots=True)
class ConversationInfo:
    """A conversation endpoint of this broker, with what waits on it."""

    conversation_handle: uuid.UUID
    conversation_id: uuid.UUID
    conversation_group_id: uuid.UUID
    is_initiator: bool
    service_name: str
    far_service: str
    far_broker_instance: str | None
    contract_name: str
    state: str
    state_desc: str
    queue: str
    priority: int
    lifetime: datetime | None
    timer_due_at: datetime | None
    send_sequence: int
    receive_sequence: int
    created_at: datetime
    closed_at: datetime | None
    messages_ready: int
    transmissions_waiting: int


@dataclass(frozen=True, slots=True)
class TransmissionInfo:
    """A message in the transmission queue, with the reason it waits."""

    id: int
    conversation_handle: uuid.UUID
    conversation_id: uuid.UUID
    from_service_name: str
    to_service_name: str
    to_broker_instance: str | None
    service_contract_name: str
    message_type_name: str
    message_sequence_number: int
    enqueued_at: datetime
    age_seconds: float
    transmission_status: str
    attempts: int
    next_attempt_at: datetime | None
    body_bytes: int | None


@dataclass(frozen=True, slots=True)
class WaitingSummary:
    """Messages in the transmission queue for one service, for one reason."""

    to_service_name: str
    transmission_status: str
    count: int
    oldest_enqueued_at: datetime | None


@dataclass(frozen=True, slots=True)
class TransmissionPage:
    """A page of the transmission queue and the whole queue counted by service and reason."""

    page: Page[TransmissionInfo]
    summary: list[WaitingSummary]


@dataclass(frozen=True, slots=True)
class RouteInfo:
    name: str
    service_name: str | None
    broker_instance: str | None
    address: str
    mirror_address: str | None
    expires_at: datetime | None
    expired: bool
    kind: str  # "local" | "transport" | "broker"


@dataclass(frozen=True, slots=True)
class RoutingServiceInfo:
    name: str
    queue: str
    mode: str
    classifier: str
    mappings: int


@dataclass(frozen=True, slots=True)
class MappingInfo:
    """A row of ``broker_resolved_conversation``: the outbound dialog carrying an inbound one."""

    inbound_handle: uuid.UUID
    outbound_handle: uuid.UUID
    routing_service: str
    target_service: str
    created_at: datetime
    inbound_state: str | None
    outbound_state: str | None


@dataclass(frozen=True, slots=True)
class Overview:
    """The broker as a whole."""

    instance_id: str
    engine: str
    database: str
    forwarding: bool
    principal: bool
    queues: int
    queues_disabled: int
    messages_ready: int
    conversations: list[StateCount]
    transmission_queue: int
    transmission_oldest_enqueued_at: datetime | None
    transmissions_failing: int
    in_transit: int | None
    poison_events: int


@dataclass(frozen=True, slots=True)
class ActionResult:
    """What an action did: ``changed`` False means it found nothing to do."""

    action: str
    target: str
    changed: bool
    detail: str
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ProbeInfo:
    """An echo probe: ``status`` is waiting, alive, no_answer or failed."""

    probe_id: str
    conversation_handle: uuid.UUID
    service: str | None
    status: str
    sent_at: datetime
    answered_at: datetime | None
    round_trip_ms: float | None
    timeout_seconds: float
    detail: str | None


# ---------------------------------------------------------------------------------------------
# Observation
# ---------------------------------------------------------------------------------------------

_e = s.conversation_endpoint
_m = s.message
_t = s.transmission_queue
_r = s.activation_reader
_ev = s.event


def _queue_id(conn: Connection, name: str) -> int:
    as_name(name, "queue")
    queue_id = conn.execute(select(s.queue.c.queue_id).where(s.queue.c.name == name)).scalar()
    if queue_id is None:
        raise UnknownObject(f"queue {name!r} does not exist in this broker")
    return int(queue_id)


def _state_code(state: str) -> str:
    """A state code (``CO``) or its description (``CONVERSING``), any case -> the code."""
    wanted = str(state).strip().upper()
    for code, desc in STATE_DESC.items():
        if wanted in (code, desc):
            return code
    known = ", ".join(f"{c} ({d})" for c, d in STATE_DESC.items())
    raise InvalidDefinition(f"conversation state {state!r} is not one of {known}")


def _poison_filter() -> Any:
    return and_(_ev.c.event == QUEUE_DISABLED, _ev.c.detail.like(_POISON_DETAIL))


def _queue_infos(conn: Connection, name: str | None = None) -> list[QueueInfo]:
    ready = (
        select(
            _m.c.queue_id,
            func.count().label("depth"),
            func.min(_m.c.enqueued_at).label("oldest"),
            func.count(func.distinct(_m.c.conversation_group_id)).label("groups"),
        )
        .where(_m.c.status == STATUS_READY)
        .group_by(_m.c.queue_id)
        .subquery()
    )
    readers = (
        select(
            _r.c.queue_id,
            func.count().filter(_r.c.started_at.is_not(None)).label("running"),
            func.count().filter(_r.c.started_at.is_(None)).label("starting"),
        )
        .where(_r.c.finished_at.is_(None))
        .group_by(_r.c.queue_id)
        .subquery()
    )
    q = s.queue
    stmt = (
        select(
            q,
            ready.c.depth,
            ready.c.oldest,
            ready.c.groups,
            readers.c.running,
            readers.c.starting,
        )
        .outerjoin(ready, ready.c.queue_id == q.c.queue_id)
        .outerjoin(readers, readers.c.queue_id == q.c.queue_id)
        .order_by(q.c.name)
    )
    if name is not None:
        stmt = stmt.where(q.c.name == name)
    rows = list(conn.execute(stmt))
    ids = [r.queue_id for r in rows]
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
    now = utcnow()
    out = []
    for r in rows:
        oldest = _ts(r.oldest)
        count, last_id = poison.get(r.name, (0, 0))
        out.append(
            QueueInfo(
                name=r.name,
                status="enabled" if r.status else "disabled",
                enabled=bool(r.status),
                depth=int(r.depth or 0),
                oldest_enqueued_at=oldest,
                oldest_age_seconds=_age(now, oldest),
                groups_ready=int(r.groups or 0),
                readers_running=int(r.running or 0),
                readers_starting=int(r.starting or 0),
                rollback_count=int(r.rollback_count),
                poison_message_handling=bool(r.poison_message_handling),
                retention=bool(r.retention),
                activation=r.activation,
                services=services.get(r.queue_id, []),
                poison_events=count,
                last_poison_event=last.get(last_id),
            )
        )
    return out


def queues(broker: Broker) -> list[QueueInfo]:
    """Every queue, by name: depth, oldest message, readers running, status, poison events."""
    with broker.engine.connect() as conn:
        return _queue_infos(conn)


@dataclass(frozen=True, slots=True)
class DepthHistory:
    """A queue's depth samples from the last ``minutes`` minutes, oldest first."""

    queue: str
    minutes: int
    samples: list[DepthSample]


def queue_depth_history(
    broker: Broker, name: str, minutes: int = 60, *, now: datetime | None = None
) -> DepthHistory:
    """The depth samples of queue ``name`` (:mod:`airflow_broker.sampling`) from the last
    ``minutes`` minutes (1..:data:`~airflow_broker.sampling.MAX_HISTORY_MINUTES`)."""
    check_minutes(minutes)
    with broker.engine.connect() as conn:
        queue_id = _queue_id(conn, name)
    return DepthHistory(name, minutes, depth_samples(broker, queue_id, minutes, now=now))


def _reader_state(r: Any) -> str:
    """``starting`` (fired for, not registered yet), ``running`` or ``finished``."""
    if r.finished_at is not None:
        return "finished"
    return "starting" if r.started_at is None else "running"


def queue(broker: Broker, name: str) -> QueueDetail:
    """One queue, with its most recent readers and poison events."""
    with broker.engine.connect() as conn:
        queue_id = _queue_id(conn, name)
        (info,) = _queue_infos(conn, name)
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


def services(broker: Broker) -> list[ServiceInfo]:
    """Every service, by name: its queue, contracts, and how many conversations it has."""
    with broker.engine.connect() as conn:
        contracts: dict[str, list[str]] = {}
        for r in conn.execute(
            select(s.service_contract).order_by(s.service_contract.c.contract_name)
        ):
            contracts.setdefault(r.service_name, []).append(r.contract_name)
        routing = set(conn.execute(select(s.routing_service.c.name)).scalars())
        counts = _pairs(
            conn,
            select(_e.c.service_name, func.count()).group_by(_e.c.service_name),
        )
        return [
            ServiceInfo(
                name=r.name,
                queue=r.queue,
                contracts=contracts.get(r.name, []),
                routing_service=r.name in routing,
                conversations=int(counts.get(r.name, 0)),
            )
            for r in conn.execute(
                select(s.service.c.name, s.queue.c.name.label("queue"))
                .join(s.queue, s.queue.c.queue_id == s.service.c.queue_id)
                .order_by(s.service.c.name)
            )
        ]


def contracts(broker: Broker) -> list[ContractInfo]:
    """Every contract, by name: its message types, who sends each, their validation, and the
    services that accept it."""
    with broker.engine.connect() as conn:
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


def _state_counts(conn: Connection, conds: Sequence[Any] = ()) -> list[StateCount]:
    counts = _pairs(
        conn,
        select(_e.c.state, func.count()).where(*conds).group_by(_e.c.state),
    )
    return [StateCount(code, desc, int(counts.get(code, 0))) for code, desc in STATE_DESC.items()]


def conversation_states(broker: Broker, queue: str | None = None) -> list[StateCount]:
    """Conversation endpoints counted by state (every state, zeros included)."""
    with broker.engine.connect() as conn:
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
    broker: Broker,
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
    local service, far service and side."""
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
    with broker.engine.connect() as conn:
        if queue is not None:
            conds.append(_e.c.queue_id == _queue_id(conn, queue))
        total = int(conn.execute(select(func.count()).select_from(_e).where(*conds)).scalar_one())
        _check_offset(offset, total, "conversations")
        rows = list(
            conn.execute(
                _endpoint_select()
                .where(*conds)
                .order_by(_e.c.created_at.desc(), _e.c.conversation_handle)
                .limit(limit)
                .offset(offset)
            )
        )
        return Page(_conversation_rows(conn, rows), total, limit, offset)


def conversation(broker: Broker, handle: uuid.UUID | str) -> ConversationInfo:
    """One conversation endpoint by its handle."""
    h = as_uuid(handle, "conversation handle")
    with broker.engine.connect() as conn:
        rows = list(conn.execute(_endpoint_select().where(_e.c.conversation_handle == h)))
        if not rows:
            raise UnknownObject(f"conversation handle {h} does not exist in this broker")
        return _conversation_rows(conn, rows)[0]


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
    return select(
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
        _t.c.next_attempt_at,
        func.length(_t.c.message_body).label("body_bytes"),
    )


def transmission_queue(
    broker: Broker,
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
    with broker.engine.connect() as conn:
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


def routes(broker: Broker) -> list[RouteInfo]:
    """Every route, by name, with whether it has expired."""
    now = utcnow()
    with broker.engine.connect() as conn:
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


def routing_services(broker: Broker) -> list[RoutingServiceInfo]:
    """The data-dependent routing services, with how many mappings each holds."""
    rs, rc = s.routing_service, s.resolved_conversation
    with broker.engine.connect() as conn:
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
    broker: Broker,
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
    with broker.engine.connect() as conn:
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


def events(
    broker: Broker,
    *,
    event: str | None = None,
    object_name: str | None = None,
    limit: int = DEFAULT_LIMIT,
    offset: int = 0,
) -> Page[BrokerEvent]:
    """What the broker (and its operators) did, newest first: queues disabled by poison
    handling, re-enabled queues, dynamic routing requests, operator actions..."""
    check_page(limit, offset)
    conds: list[Any] = []
    if event is not None:
        conds.append(_ev.c.event == event)
    if object_name is not None:
        conds.append(_ev.c.object_name == object_name)
    with broker.engine.connect() as conn:
        total = int(conn.execute(select(func.count()).select_from(_ev).where(*conds)).scalar_one())
        _check_offset(offset, total, "events")
        items = [
            BrokerEvent(r.id, aware(r.occurred_at), r.event, r.object_name, r.detail)  # type: ignore[arg-type]
            for r in conn.execute(
                select(_ev).where(*conds).order_by(_ev.c.id.desc()).limit(limit).offset(offset)
            )
        ]
    return Page(items, total, limit, offset)


def overview(broker: Broker) -> Overview:
    """The broker as a whole: identity, settings and the counts an operator looks at first."""
    from airflow_broker.transport import in_transit

    bi = s.broker_instance
    with broker.engine.connect() as conn:
        me = conn.execute(select(bi.c.instance_id, bi.c.forwarding, bi.c.principal)).first()
        if me is None:
            raise BrokerError(f"{broker!r} is not migrated: run Broker.migrate()")
        queue_counts = conn.execute(
            select(func.count(), func.count().filter(s.queue.c.status.is_(False))).select_from(
                s.queue
            )
        ).one()
        ready = conn.execute(
            select(func.count()).select_from(_m).where(_m.c.status == STATUS_READY)
        ).scalar_one()
        tq = conn.execute(
            select(
                func.count(), func.min(_t.c.enqueued_at), func.count().filter(_t.c.attempts > 0)
            ).select_from(_t)
        ).one()
        poison = conn.execute(
            select(func.count()).select_from(_ev).where(_poison_filter())
        ).scalar_one()
        states = _state_counts(conn)
    # On SQLite a forwarding broker holds messages in transit in the delivering process's
    # memory: this process cannot count them.
    transit = len(in_transit(broker)) if broker.dialect == "postgresql" else None
    return Overview(
        instance_id=str(me.instance_id),
        engine=broker.dialect,
        database=broker.engine.url.render_as_string(hide_password=True),
        forwarding=bool(me.forwarding),
        principal=bool(me.principal),
        queues=int(queue_counts[0]),
        queues_disabled=int(queue_counts[1] or 0),
        messages_ready=int(ready),
        conversations=states,
        transmission_queue=int(tq[0]),
        transmission_oldest_enqueued_at=_ts(tq[1]),
        transmissions_failing=int(tq[2] or 0),
        in_transit=transit,
        poison_events=int(poison),
    )


# ---------------------------------------------------------------------------------------------
# Actions
# ---------------------------------------------------------------------------------------------


def _record(conn: Connection, target: str, detail: str, actor: str | None) -> None:
    who = f"{actor}: " if actor else ""
    record_event(conn, OPERATOR_ACTION, target[:256], f"{who}{detail}")


def enable_queue(broker: Broker, name: str, *, actor: str | None = None) -> ActionResult:
    """Re-enable a disabled queue (ALTER QUEUE ... STATUS = ON): its rollback count restarts
    and messages that waited for it in the transmission queue go on the next due pass. A queue
    that is already enabled is left as it is (``changed`` False)."""
    with broker.definitions() as d:
        conn = d.connection
        _queue_id(conn, name)
        enabled = conn.execute(
            select(s.queue.c.status).where(s.queue.c.name == name).with_for_update()
        ).scalar()
        if enabled:
            return ActionResult("enable_queue", name, False, f"queue {name!r} is already enabled")
        d.alter_queue(name, status=True)
        _record(conn, name, f"re-enabled queue {name!r}", actor)
    return ActionResult("enable_queue", name, True, f"queue {name!r} re-enabled")


def _count_waiting(conn: Connection, h: uuid.UUID) -> int:
    count = conn.execute(
        select(func.count()).select_from(_t).where(_t.c.conversation_handle == h)
    ).scalar_one()
    if not count:
        if conn.execute(select(_e.c.state).where(_e.c.conversation_handle == h)).first() is None:
            raise UnknownObject(f"conversation handle {h} does not exist in this broker")
        raise UnknownObject(f"conversation {h} has no messages in the transmission queue")
    return int(count)


def retry_transmission(
    broker: Broker,
    handle: uuid.UUID | str,
    *,
    deliver: bool = True,
    actor: str | None = None,
) -> ActionResult:
    """Retry now: make every waiting message of a conversation due at once (forgetting its
    backoff), then, with ``deliver``, run one delivery pass (which also moves anything else
    that is due). ``data`` holds the pass's report and the messages of the conversation that
    still wait, with their reasons."""
    h = as_uuid(handle, "conversation handle")
    now = utcnow()
    with broker.engine.begin() as conn:
        count = _count_waiting(conn, h)
        conn.execute(update(_t).where(_t.c.conversation_handle == h).values(next_attempt_at=now))
        _record(conn, str(h), f"retry now of {count} waiting message(s)", actor)
    data: dict[str, Any] = {"rescheduled": count}
    if deliver:
        report = broker.deliver()
        data["delivery"] = dataclasses.asdict(report)
    with broker.engine.connect() as conn:
        left = conn.execute(
            _transmission_select()
            .where(_t.c.conversation_handle == h)
            .order_by(_t.c.id)
            .limit(MAX_LIMIT)
        )
        data["waiting"] = [_transmission_info(r, utcnow()) for r in left]
    went = max(count - len(data["waiting"]), 0)
    detail = f"{count} message(s) made due now" + (
        f"; the delivery pass moved {went} of them" if deliver else ""
    )
    return ActionResult("retry_transmission", str(h), True, detail, data)


def drop_transmission(
    broker: Broker,
    handle: uuid.UUID | str,
    *,
    message_id: int | None = None,
    actor: str | None = None,
) -> ActionResult:
    """Remove a conversation's waiting messages from the transmission queue (all of them, or
    the one ``message_id``). The far side never gets them: later messages of the dialog would
    wait for the gap, so end the conversation too unless it is meant to go on."""
    h = as_uuid(handle, "conversation handle")
    if message_id is not None and (
        not isinstance(message_id, int) or isinstance(message_id, bool) or message_id < 1
    ):
        raise InvalidDefinition(f"message_id must be a whole number >= 1, not {message_id!r}")
    with broker.engine.begin() as conn:
        _count_waiting(conn, h)
        conds = [_t.c.conversation_handle == h]
        if message_id is not None:
            conds.append(_t.c.id == message_id)
            if conn.execute(select(_t.c.id).where(*conds)).first() is None:
                raise UnknownObject(
                    f"message {message_id} of conversation {h} is not in the transmission queue"
                )
        dropped = conn.execute(delete(_t).where(*conds)).rowcount
        what = f"message {message_id}" if message_id is not None else f"{dropped} message(s)"
        _record(conn, str(h), f"dropped {what} from the transmission queue", actor)
    return ActionResult(
        "drop_transmission",
        str(h),
        True,
        f"dropped {what} of conversation {h} from the transmission queue",
        {"dropped": dropped},
    )


def end_conversation(
    broker: Broker,
    handle: uuid.UUID | str,
    *,
    cleanup: bool = True,
    error_code: int | None = None,
    error_description: str | None = None,
    actor: str | None = None,
) -> ActionResult:
    """END CONVERSATION: WITH CLEANUP by default (the local endpoint, its queued messages and
    its waiting transmissions go, and nobody is told); ``cleanup=False`` ends it normally, or
    WITH ERROR given ``error_code`` and ``error_description``."""
    h = as_uuid(handle, "conversation handle")
    if cleanup and error_code is not None:
        raise InvalidDefinition("END CONVERSATION takes WITH ERROR or WITH CLEANUP, not both")
    with broker.transaction() as tx:
        conn = tx.connection
        state = conn.execute(select(_e.c.state).where(_e.c.conversation_handle == h)).scalar()
        if state is None:
            raise UnknownObject(f"conversation handle {h} does not exist in this broker")
        messages = conn.execute(
            select(func.count()).select_from(_m).where(_m.c.conversation_handle == h)
        ).scalar_one()
        waiting = conn.execute(
            select(func.count()).select_from(_t).where(_t.c.conversation_handle == h)
        ).scalar_one()
        tx.end_conversation(
            h, error_code=error_code, error_description=error_description, cleanup=cleanup
        )
        how = (
            "WITH CLEANUP"
            if cleanup
            else f"WITH ERROR {error_code}"
            if error_code is not None
            else "normally"
        )
        _record(conn, str(h), f"ended conversation {how} (it was {state})", actor)
    return ActionResult(
        "end_conversation",
        str(h),
        True,
        f"conversation {h} ended {how}",
        {
            "previous_state": state,
            "messages_removed": int(messages),
            "transmissions_removed": int(waiting) if cleanup else 0,
        },
    )


# -- echo probes -----------------------------------------------------------------------------


def _check_probe_id(probe_id: str) -> str:
    if not isinstance(probe_id, str) or not PROBE_ID.match(probe_id):
        raise InvalidDefinition(
            f"probe id {probe_id!r} is malformed: probe ids are 'probe-' and 12 hex digits"
        )
    return probe_id


def _probe_info(conn: Connection, row: Any, service: str | None = None) -> ProbeInfo:
    if service is None:
        service = conn.execute(
            select(_e.c.far_service).where(_e.c.conversation_handle == row["conversation_handle"])
        ).scalar()
    return ProbeInfo(
        probe_id=row["probe_id"],
        conversation_handle=row["conversation_handle"],
        service=service,
        status=row["status"],
        sent_at=aware(row["sent_at"]),  # type: ignore[arg-type]
        answered_at=aware(row["answered_at"]),
        round_trip_ms=row["round_trip_ms"],
        timeout_seconds=float(row["timeout_seconds"]),
        detail=row["detail"],
    )


def start_probe(
    broker: Broker,
    service: str,
    *,
    timeout_seconds: float = echo.DEFAULT_TIMEOUT_SECONDS,
    body: str | None = None,
    actor: str | None = None,
) -> ProbeInfo:
    """Send an echo probe to ``service`` (:func:`airflow_broker.examples.echo.send_probe`): a
    dialog from the echo example's prober service, a Ping, and a timer of
    ``timeout_seconds``. Poll :func:`probe` for the outcome.

    The target must accept the echo contract and answer a Ping with the same body (the echo
    example's echo service does). Raises :class:`NotReady` when the echo example is not set up
    in this broker (``echo_setup`` DAG, or ``echo.setup(broker)``)."""
    as_name(service, "service")
    if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, int | float):
        raise InvalidDefinition(f"timeout_seconds must be a number, not {timeout_seconds!r}")
    if not 0 < timeout_seconds <= MAX_PROBE_TIMEOUT:
        raise InvalidDefinition(
            f"timeout_seconds must be more than 0 and at most {MAX_PROBE_TIMEOUT:g}, "
            f"not {timeout_seconds}"
        )
    if body is not None and (not isinstance(body, str) or len(body) > 1000):
        raise InvalidDefinition("a probe body must be a string of at most 1000 characters")
    with broker.engine.connect() as conn:
        prober = conn.execute(
            select(s.service.c.name).where(s.service.c.name == echo.PROBER_SERVICE)
        ).first()
        has_table = inspect(conn).has_table(echo.echo_probe.name)
        accepts = set(
            conn.execute(
                select(s.service_contract.c.contract_name).where(
                    s.service_contract.c.service_name == service
                )
            ).scalars()
        )
        hosted = (
            conn.execute(select(s.service.c.name).where(s.service.c.name == service)).first()
            is not None
        )
    if prober is None or not has_table:
        raise NotReady(
            f"the echo example is not set up in this broker (service {echo.PROBER_SERVICE!r} "
            "and table 'echo_probe'): run the echo_setup DAG, or "
            "airflow_broker.examples.echo.setup(broker)"
        )
    if hosted and echo.CONTRACT not in accepts:
        raise InvalidDefinition(
            f"service {service!r} does not accept the echo contract {echo.CONTRACT!r}: it "
            "cannot be probed (add the contract to the service, and an echo to its reader)"
        )
    try:
        with broker.transaction() as tx:
            sent = echo.send_probe(
                tx, body=body, timeout_seconds=timeout_seconds, to_service=service
            )
            _record(tx.connection, service, f"echo probe {sent.probe_id} sent", actor)
    except ConversationEnded as exc:
        raise InvalidDefinition(f"the probe of service {service!r} failed at once: {exc}") from exc
    with broker.engine.connect() as conn:
        row = echo.probe_status(conn, sent.probe_id)
        assert row is not None
        return _probe_info(conn, row, service)


def probe(broker: Broker, probe_id: str) -> ProbeInfo:
    """An echo probe's outcome. While it waits, this collects its answer itself (the prober's
    reader DAG may not run): it RECEIVEs the probe's own conversation from the prober's queue
    and records the outcome as the reader would, after firing the probe's timer when its
    timeout has passed. ``round_trip_ms`` runs to the echo's arrival in the prober's queue."""
    _check_probe_id(probe_id)
    with broker.engine.connect() as conn:
        if not inspect(conn).has_table(echo.echo_probe.name):
            raise UnknownObject(f"probe {probe_id} does not exist (no probe was ever sent)")
        row = echo.probe_status(conn, probe_id)
    if row is None:
        raise UnknownObject(f"probe {probe_id} does not exist in this broker")
    if row["status"] == "waiting":
        _collect(broker, row)
        with broker.engine.connect() as conn:
            row = echo.probe_status(conn, probe_id)
            assert row is not None
    with broker.engine.connect() as conn:
        return _probe_info(conn, row)


def _collect(broker: Broker, row: dict[str, Any]) -> None:
    sent_at = aware(row["sent_at"])
    assert sent_at is not None
    if utcnow() >= sent_at + timedelta(seconds=float(row["timeout_seconds"])):
        broker.run_due()  # fires the probe's DialogTimer: the outcome becomes no_answer
    h = row["conversation_handle"]
    try:
        with broker.transaction() as tx:
            arrived = tx.connection.execute(
                select(func.min(_m.c.enqueued_at)).where(
                    _m.c.conversation_handle == h,
                    _m.c.message_type_name == echo.PING,
                    _m.c.status == STATUS_READY,
                )
            ).scalar()
            messages = tx.receive(echo.PROBER_QUEUE, conversation_handle=h)
            if not messages:
                return
            echo.probe_reply_handler(tx, messages)
            arrived_at = _ts(arrived)
            if arrived_at is not None:
                # The reply handler timed the round trip to now; the echo came back earlier.
                p = echo.echo_probe
                tx.connection.execute(
                    update(p)
                    .where(p.c.conversation_handle == h, p.c.status == "alive")
                    .values(
                        answered_at=arrived_at,
                        round_trip_ms=max(0.0, (arrived_at - sent_at).total_seconds() * 1000),
                    )
                )
    except QueueDisabled:
        return  # the prober's queue is disabled: the probe stays waiting, the queue shows why


__all__ = [
    "DEFAULT_LIMIT",
    "MAX_LIMIT",
    "ActionResult",
    "ContractInfo",
    "ConversationInfo",
    "MappingInfo",
    "NotReady",
    "Overview",
    "Page",
    "ProbeInfo",
    "QueueDetail",
    "QueueInfo",
    "ReaderInfo",
    "RouteInfo",
    "RoutingServiceInfo",
    "ServiceInfo",
    "StateCount",
    "TransmissionInfo",
    "TransmissionPage",
    "WaitingSummary",
    "check_page",
    "contracts",
    "conversation",
    "conversation_states",
    "conversations",
    "drop_transmission",
    "enable_queue",
    "end_conversation",
    "events",
    "overview",
    "probe",
    "queue",
    "queues",
    "retry_transmission",
    "routes",
    "routing_mappings",
    "routing_services",
    "services",
    "start_probe",
    "to_json",
    "transmission_queue",
]
