"""What an operator sees of a broker and the few things an operator does to it.

The plugin's HTTP API (``airflow_broker.provider.plugin.api``) is a thin layer over this package;
the package itself runs without Airflow, against either engine, and returns plain frozen dataclasses
(:func:`to_json` turns them into JSON-ready dicts).

Observation
    :func:`overview`, :func:`queues` / :func:`queue`, :func:`queue_depth_history` (samples
    written by :mod:`airflow_broker.operations.sampling`), :func:`services`, :func:`contracts`,
    :func:`conversation_states`, :func:`conversations` / :func:`conversation`,
    :func:`transmission_queue`, :func:`routes`, :func:`routing_services`,
    :func:`routing_mappings`, :func:`events`, :func:`certificates` (dialog security's, ending
    soonest first; the overview lists those ending within 30 days), a queue's
    :func:`waiting_messages` (a peek: nothing received or locked, each body previewed by
    :func:`body_preview`) and its failure-handling
    :func:`queue_events` (dead-lettered, disabled, re-enabled). Lists that grow with traffic
    (conversations, the transmission queue, routing mappings, events, waiting messages) are
    pages (:class:`Page`): ``limit`` (at most :data:`MAX_LIMIT`) and ``offset``, counted and read
    by the database, never loaded whole. Queues are paged too (:func:`queue_page`, a thousand
    queues are one deployment's worth; :func:`queues` still returns them all), each page's
    aggregates read for its queues only. Counts do not scan
    (:mod:`~airflow_broker.operations.counts`): exact up to :data:`COUNT_CAP` rows,
    PostgreSQL's estimate beyond (``total_estimated``, "about N"); the overview's conversation
    counts likewise.
    Lists of declared objects (services, contracts, routes) are returned whole, each with its
    aggregates computed by one grouped statement, not per row.

Actions
    :func:`enable_queue` (re-enable a queue, e.g. one poison handling disabled),
    :func:`retry_transmission` (make a conversation's waiting messages due now and run a delivery
    pass), :func:`drop_transmission` (remove waiting messages), :func:`end_conversation` (END,
    WITH CLEANUP by default), :func:`start_probe` / :func:`probe` (an echo probe, see
    :mod:`airflow_broker.operations.echo`). Each runs in one transaction, refuses bad input before
    it changes anything, and records an ``operator_action`` event naming who did it.

Modules by subject: :mod:`.models` (the dataclasses, pages, :func:`to_json`), :mod:`.overview`,
:mod:`.queues`, :mod:`.messages` (a queue's waiting messages and events), :mod:`.conversations`,
:mod:`.transmission`, :mod:`.actions`, :mod:`.probes`.

Errors are the engine's: :class:`~airflow_broker.errors.UnknownObject` for a queue, conversation
or probe that does not exist, :class:`~airflow_broker.errors.InvalidDefinition` for malformed
input (a bad id, a limit out of range, an offset past the end), and :class:`NotReady` when the
broker lacks what an action needs (the echo example's prober service).
"""

from __future__ import annotations

from airflow_broker.operations.counts import COUNT_CAP, Count, bounded_count
from airflow_broker.operations.monitoring.actions import (
    drop_transmission,
    enable_queue,
    end_conversation,
    retry_transmission,
)
from airflow_broker.operations.monitoring.conversations import (
    conversation,
    conversation_states,
    conversations,
)
from airflow_broker.operations.monitoring.messages import (
    DEAD_LETTERED,
    MAX_PREVIEW_CHARS,
    PREVIEW_CHARS,
    QUEUE_ENABLED,
    QUEUE_EVENT_KINDS,
    BodyPreview,
    WaitingMessage,
    WaitingPage,
    body_preview,
    queue_events,
    waiting_messages,
)
from airflow_broker.operations.monitoring.models import (
    DEFAULT_LIMIT,
    MAX_LIMIT,
    MAX_OFFSET,
    MAX_PROBE_TIMEOUT,
    OPERATOR_ACTION,
    PROBE_ID,
    QUEUE_DISABLED,
    QUEUE_EVENTS_SHOWN,
    QUEUE_READERS_SHOWN,
    ActionResult,
    ContractInfo,
    ConversationInfo,
    DepthHistory,
    MappingInfo,
    NotReady,
    Overview,
    Page,
    PoisonEvent,
    ProbeInfo,
    QueueDetail,
    QueueInfo,
    ReaderInfo,
    RouteInfo,
    RoutingServiceInfo,
    ServiceInfo,
    StateCount,
    TransmissionInfo,
    TransmissionPage,
    WaitingSummary,
    check_page,
    to_json,
)
from airflow_broker.operations.monitoring.overview import certificates, events, overview
from airflow_broker.operations.monitoring.probes import probe, start_probe
from airflow_broker.operations.monitoring.queues import (
    contracts,
    queue,
    queue_depth_history,
    queue_names,
    queue_page,
    queues,
    services,
)
from airflow_broker.operations.monitoring.transmission import (
    routes,
    routing_mappings,
    routing_services,
    transmission_queue,
)

__all__ = [
    "COUNT_CAP",
    "DEAD_LETTERED",
    "DEFAULT_LIMIT",
    "MAX_LIMIT",
    "MAX_OFFSET",
    "MAX_PREVIEW_CHARS",
    "MAX_PROBE_TIMEOUT",
    "OPERATOR_ACTION",
    "PREVIEW_CHARS",
    "PROBE_ID",
    "QUEUE_DISABLED",
    "QUEUE_ENABLED",
    "QUEUE_EVENTS_SHOWN",
    "QUEUE_EVENT_KINDS",
    "QUEUE_READERS_SHOWN",
    "ActionResult",
    "BodyPreview",
    "ContractInfo",
    "ConversationInfo",
    "Count",
    "DepthHistory",
    "MappingInfo",
    "NotReady",
    "Overview",
    "Page",
    "PoisonEvent",
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
    "WaitingMessage",
    "WaitingPage",
    "WaitingSummary",
    "body_preview",
    "bounded_count",
    "certificates",
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
    "queue_depth_history",
    "queue_events",
    "queue_names",
    "queue_page",
    "queues",
    "retry_transmission",
    "routes",
    "routing_mappings",
    "routing_services",
    "services",
    "start_probe",
    "to_json",
    "transmission_queue",
    "waiting_messages",
]
