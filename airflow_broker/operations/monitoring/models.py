"""The monitoring read model: the frozen dataclasses the API returns, pages and their limits,
:func:`to_json`, and the small helpers every subject shares.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from sqlalchemy import and_, select
from sqlalchemy.engine import Connection

from airflow_broker.constants import STATE_DESC
from airflow_broker.errors import (
    BrokerError,
    InvalidDefinition,
    UnknownObject,
)
from airflow_broker.messaging.arguments import as_name
from airflow_broker.operations.sampling import DepthSample
from airflow_broker.security.certificates import CertificateRow
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware

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


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a list: ``items`` from ``offset`` on, of ``total`` that match; with
    ``total_estimated``, ``total`` is PostgreSQL's estimate
    (:mod:`~airflow_broker.operations.counts`), shown as "about N".
    """

    items: list[T]
    total: int
    limit: int
    offset: int
    total_estimated: bool = False

    @property
    def next_offset(self) -> int | None:
        """The offset of the next page, or None on the last one (an estimated total: a full
        page has a next one)."""
        following = self.offset + len(self.items)
        if self.total_estimated:
            return following if len(self.items) == self.limit else None
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
            "total_estimated": value.total_estimated,
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


@dataclass(frozen=True, slots=True)
class PoisonEvent:
    """Poison handling disabled a queue."""

    id: int
    occurred_at: datetime
    detail: str


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """A queue at a glance: depth, oldest message, readers, status, poison events.

    ``depth``, ``groups_ready`` and the oldest message count only messages a reader could take
    now; messages held after a failed attempt and leased ones are counted apart
    (:mod:`airflow_broker.storage.readiness`).
    """

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
    #: messages whose group waits out a failed attempt's backoff; ``depth`` does not count them
    held: int = 0
    #: when the first of them can be taken again (the earliest hold's end), or None
    held_until: datetime | None = None
    #: messages a lease holds; ``depth`` does not count them
    leased: int = 0


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
    #: None: not counted (more than ``COUNT_CAP`` endpoints in the broker)
    conversations: int | None


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
    #: the count is PostgreSQL's estimate (more than ``COUNT_CAP`` endpoints): "about N"
    estimated: bool = False


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
    #: messages a reader could take now, in all queues (held and leased ones are not counted)
    messages_ready: int
    conversations: list[StateCount]
    transmission_queue: int
    transmission_oldest_enqueued_at: datetime | None
    transmissions_failing: int
    in_transit: int | None
    poison_events: int
    #: the last consistency check (``airflow-broker check``, ``Broker.check()``): when, and its
    #: one-line summary ("no problems", or how many of which kinds); None when never run
    last_check_at: datetime | None = None
    last_check: str | None = None
    #: certificates ending within 30 days (``EXPIRY_WARNING``) or already past their end, the
    #: one ending first first: plan their renewal (dialog security)
    certificates_expiring: list[CertificateRow] = dataclasses.field(default_factory=list)
    #: messages, in all queues, whose group waits out a failed attempt's backoff
    messages_held: int = 0
    #: messages, in all queues, a lease holds
    messages_leased: int = 0
    #: the conversation counts are estimates (more than ``COUNT_CAP`` endpoints): "about N"
    conversations_estimated: bool = False


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


@dataclass(frozen=True, slots=True)
class DepthHistory:
    """A queue's depth samples from the last ``minutes`` minutes, oldest first."""

    queue: str
    minutes: int
    samples: list[DepthSample]
