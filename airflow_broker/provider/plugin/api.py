"""The broker's monitoring API: a FastAPI app the plugin mounts at ``/broker``.

Every endpoint is under ``/broker/api`` and answers JSON; the work is done by
:mod:`airflow_broker.operations.monitoring`, which runs without Airflow. The broker is the database
of the Airflow connection ``broker_default`` (through
:class:`~airflow_broker.hooks.broker.BrokerHook`,
so without that connection the embedded ``$AIRFLOW_HOME/broker.db``), opened on the first
request and kept for the life of the API server's worker.

Reading (GET)::

    /api/overview                      identity, settings, counts (messages ready, held,
                                       leased)
    /api/queues                        paged, by name; ?name_contains= &limit= &offset=: depth
                                       (messages a reader could take now), held (with
                                       held_until, when the first hold ends) and leased apart,
                                       oldest message, readers, status, poison events
    /api/queue-names                   every queue's name, sorted (the page's pickers)
    /api/queues/{queue}                one queue, its recent readers and poison events
    /api/queues/{queue}/messages       paged peek: the messages waiting, in RECEIVE's order, each
                                       with a body preview, age and receive count (nothing is
                                       received or locked); ?conversation_handle= &preview=200
    /api/queues/{queue}/events         paged, newest first: dead-lettered, disabled, re-enabled
    /api/queues/{queue}/depth-history  the queue's depth samples, oldest first; ?minutes=60
                                       (1..10080)
    /api/services                      services: queue, contracts, conversations
    /api/contracts                     contracts: message types, senders, validation, services
    /api/conversations/states          conversations counted by state (?queue=)
    /api/conversations                 paged; ?state= &queue= &service= &far_service=
                                       &initiator= &limit= &offset=
    /api/conversations/{handle}        one conversation endpoint
    /api/transmission-queue            paged, each message with why it waits; ?conversation_handle=
                                       &to_service= ; plus the queue counted by service and reason
    /api/routes                        routes, with expiry
    /api/certificates                  dialog security's certificates (never a private key), the
                                       one ending first first; ?expiring_within_days= (the
                                       overview lists those ending within 30 days)
    /api/routing-services              data-dependent routing services
    /api/routing-mappings              paged inbound -> outbound mappings; ?routing_service=
                                       &target_service=
    /api/events                        paged, newest first; ?event= &object_name=
    /api/probes/{probe_id}             an echo probe's outcome (collects its answer)

Acting (POST)::

    /api/queues/{queue}/enable                 re-enable a disabled queue
    /api/transmission-queue/{handle}/retry     retry now: {"deliver": true}
    /api/transmission-queue/{handle}/drop      drop waiting messages: {"message_id": null}
    /api/conversations/{handle}/end            END: {"cleanup": true, "error_code": null,
                                               "error_description": null}
    /api/probes                                echo probe: {"service": ..., "timeout_seconds": 60}

Authentication and authorization are Airflow's (:mod:`airflow_broker.provider.plugin.security`): 401
without a token or the UI's session cookie; reading needs read access to DAGs; acting needs edit
access to the broker's Airflow connection, because that connection is the broker database and
these actions lose or move its messages (a custom view is not used: the simple auth manager
treats any custom-view request as a read, and FAB grants a new custom resource to nobody).

Paged lists answer ``{"items", "total", "limit", "offset", "next_offset", "total_estimated"}``:
``limit`` 1..500 (default 50), and a ``total`` that is exact up to 10,000 matching rows and
PostgreSQL's estimate beyond (``total_estimated``: the page shows "about N"; see
:mod:`airflow_broker.operations.counts`). The overview's conversation counts, and
a service's, follow the same rule.

Bad input is refused before anything changes: an unknown queue, conversation or probe is 404
naming it; a malformed UUID or probe id, an unknown state, a limit outside 1..500, a negative
offset or one past the end of the list, an unexpected body field are 422, each with a message
saying what was wrong; an action that conflicts with the conversation's state is 409.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import DBAPIError

from airflow_broker import __version__
from airflow_broker.broker import Broker
from airflow_broker.errors import (
    BrokerError,
    ContractViolation,
    ConversationEnded,
    InvalidDefinition,
    MessageValidationError,
    ObjectExists,
    QueueDisabled,
    UnknownObject,
)
from airflow_broker.operations import monitoring as mon
from airflow_broker.operations.echo import DEFAULT_TIMEOUT_SECONDS
from airflow_broker.operations.sampling import MAX_HISTORY_MINUTES, sample_step
from airflow_broker.provider.plugin.security import Editor, require_read
from airflow_broker.provider.plugin.ui import mount_ui

log = logging.getLogger("airflow_broker.provider.plugin")

DEFAULT_CONN_ID = "broker_default"
NAME_MAX = 256
#: Bad input (FastAPI's own validation answers 422 too).
UNPROCESSABLE = 422

# -- where the broker comes from --------------------------------------------------------------


class BrokerSource:
    """The broker of the app: given, or opened from the Airflow connection on first use."""

    def __init__(self, broker_conn_id: str, broker: Broker | None = None) -> None:
        self.broker_conn_id = broker_conn_id
        self._broker = broker
        self._lock = threading.Lock()

    def get(self) -> Broker:
        with self._lock:
            if self._broker is None:
                from airflow_broker.hooks.broker import BrokerHook

                self._broker = BrokerHook(self.broker_conn_id).get_broker()
            return self._broker


class BrokerUnavailable(Exception):
    """The broker database cannot be opened or answered with a database error."""


def _broker(request: Request) -> Iterator[Broker]:
    """The app's broker, for one request; a database error while the request uses it is the
    broker's (503), not an error of Airflow's own database (which its handlers answer)."""
    source: BrokerSource = request.app.state.broker_source
    try:
        broker = source.get()
    except Exception as exc:  # the message is the point: shown to the operator
        log.exception("the broker of connection %r cannot be opened", source.broker_conn_id)
        raise BrokerUnavailable(
            f"the broker database of Airflow connection {source.broker_conn_id!r} cannot be "
            f"opened: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        yield broker
    except DBAPIError as exc:
        log.exception("broker database error on %s %s", request.method, request.url.path)
        first = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else repr(exc)
        raise BrokerUnavailable(f"the broker database failed: {first}") from exc


BrokerDep = Annotated[Broker, Depends(_broker)]

# -- request bodies -----------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RetryBody(_Body):
    deliver: bool = Field(
        default=True, description="run a delivery pass at once (else the next pass takes them)"
    )


class DropBody(_Body):
    message_id: int | None = Field(
        default=None, ge=1, description="drop only this message (its id); default: all of them"
    )


class EndBody(_Body):
    cleanup: bool = Field(default=True, description="END WITH CLEANUP: remove it, tell nobody")
    error_code: int | None = Field(default=None, description="END WITH ERROR (with cleanup false)")
    error_description: str | None = Field(default=None, min_length=1, max_length=4000)


class ProbeBody(_Body):
    service: str = Field(..., min_length=1, max_length=NAME_MAX)
    timeout_seconds: float = Field(default=DEFAULT_TIMEOUT_SECONDS, gt=0, le=mon.MAX_PROBE_TIMEOUT)
    body: str | None = Field(default=None, max_length=1000)


# -- parameters ---------------------------------------------------------------------------------

Limit = Annotated[
    int, Query(ge=1, le=mon.MAX_LIMIT, description=f"rows per page, 1..{mon.MAX_LIMIT}")
]
Offset = Annotated[int, Query(ge=0, le=mon.MAX_OFFSET, description="rows to skip")]
Name = Annotated[str | None, Query(min_length=1, max_length=NAME_MAX)]
QueueName = Annotated[str, Path(min_length=1, max_length=NAME_MAX)]
Handle = Annotated[uuid.UUID, Path(description="a conversation handle (UUID)")]
ProbeId = Annotated[str, Path(pattern=mon.PROBE_ID.pattern, description="probe-<12 hex digits>")]

# -- errors -------------------------------------------------------------------------------------

_STATUS: list[tuple[type[Exception], int]] = [
    (UnknownObject, status.HTTP_404_NOT_FOUND),
    (InvalidDefinition, UNPROCESSABLE),
    (MessageValidationError, UNPROCESSABLE),
    (ConversationEnded, status.HTTP_409_CONFLICT),
    (ContractViolation, status.HTTP_409_CONFLICT),
    (QueueDisabled, status.HTTP_409_CONFLICT),
    (ObjectExists, status.HTTP_409_CONFLICT),
    (mon.NotReady, status.HTTP_409_CONFLICT),
    (BrokerUnavailable, status.HTTP_503_SERVICE_UNAVAILABLE),
    (BrokerError, status.HTTP_500_INTERNAL_SERVER_ERROR),
]


def _error_response(request: Request, exc: Exception) -> JSONResponse:
    code = next(c for kind, c in _STATUS if isinstance(exc, kind))
    return JSONResponse(status_code=code, content={"detail": str(exc)})


def _json(value: Any) -> Any:
    return mon.to_json(value)


# -- the app ------------------------------------------------------------------------------------


def create_app(*, broker_conn_id: str = DEFAULT_CONN_ID, broker: Broker | None = None) -> FastAPI:
    """The monitoring app. ``broker`` (tests, embedding) replaces the connection's broker; the
    connection id still names the resource whose edit right the actions need."""
    app = FastAPI(
        title="Service Broker",
        description="Monitoring and operating airflow-broker (SQL Server Service Broker's "
        "messaging on the Airflow database). Under Airflow's authentication: GET needs read "
        f"access to DAGs, POST edit access to connection {broker_conn_id!r}.",
        version=__version__,
        # The API server serves its own docs; this app's OpenAPI stays reachable.
        docs_url="/api/docs",
        redoc_url=None,
        openapi_url="/api/openapi.json",
    )
    app.state.broker_source = BrokerSource(broker_conn_id, broker)
    app.state.broker_conn_id = broker_conn_id  # whose edit right the actions need
    for kind, _code in _STATUS:
        app.add_exception_handler(kind, _error_response)
    api = APIRouter(prefix="/api", dependencies=[Depends(require_read)])

    # -- reading ---------------------------------------------------------------------------
    @api.get("/overview", summary="The broker as a whole")
    def overview(broker: BrokerDep) -> Any:
        return _json(mon.overview(broker))

    @api.get(
        "/queues",
        summary="Queues by name, paged: depth, oldest message, readers, status, poison",
    )
    def queues(
        broker: BrokerDep,
        name_contains: Annotated[
            str | None,
            Query(min_length=1, max_length=NAME_MAX, description="only queues whose name has it"),
        ] = None,
        limit: Limit = mon.DEFAULT_LIMIT,
        offset: Offset = 0,
    ) -> Any:
        sample_step(broker)  # a freshly opened page has a point of history (never raises)
        return _json(
            mon.queue_page(broker, limit=limit, offset=offset, name_contains=name_contains)
        )

    @api.get("/queue-names", summary="Every queue's name, sorted (no counts)")
    def queue_names(broker: BrokerDep) -> Any:
        return mon.queue_names(broker)

    # Before /queues/{queue:path}, which would take "X/depth-history" for a queue's name.
    @api.get(
        "/queues/{queue:path}/depth-history",
        summary="A queue's depth samples from the last minutes, oldest first",
    )
    def queue_depth_history(
        broker: BrokerDep,
        queue: QueueName,
        minutes: Annotated[
            int,
            Query(
                ge=1,
                le=MAX_HISTORY_MINUTES,
                description=f"how far back, in minutes (1..{MAX_HISTORY_MINUTES})",
            ),
        ] = 60,
    ) -> Any:
        sample_step(broker)
        history = mon.queue_depth_history(broker, queue, minutes)
        return {
            "queue": history.queue,
            "minutes": history.minutes,
            "samples": [{"at": _json(p.at), "depth": p.depth} for p in history.samples],
        }

    @api.get(
        "/queues/{queue:path}/messages",
        summary="Peek: the messages waiting in a queue, in the order RECEIVE would take them",
    )
    def queue_messages(
        broker: BrokerDep,
        queue: QueueName,
        conversation_handle: uuid.UUID | None = None,
        preview: Annotated[
            int,
            Query(
                ge=1,
                le=mon.MAX_PREVIEW_CHARS,
                description=f"body characters shown (1..{mon.MAX_PREVIEW_CHARS})",
            ),
        ] = mon.PREVIEW_CHARS,
        limit: Limit = mon.DEFAULT_LIMIT,
        offset: Offset = 0,
    ) -> Any:
        waiting = mon.waiting_messages(
            broker,
            queue,
            conversation_handle=conversation_handle,
            limit=limit,
            offset=offset,
            preview_chars=preview,
        )
        fields = _json(waiting)
        return {**fields.pop("page"), **fields}

    @api.get(
        "/queues/{queue:path}/events",
        summary="A queue's dead-lettering, disabling and re-enabling events, newest first",
    )
    def queue_events(
        broker: BrokerDep, queue: QueueName, limit: Limit = mon.DEFAULT_LIMIT, offset: Offset = 0
    ) -> Any:
        return _json(mon.queue_events(broker, queue, limit=limit, offset=offset))

    @api.get("/queues/{queue:path}", summary="One queue, its readers and poison events")
    def queue(broker: BrokerDep, queue: QueueName) -> Any:
        return _json(mon.queue(broker, queue))

    @api.get("/services", summary="Every service")
    def services(broker: BrokerDep) -> Any:
        return _json(mon.services(broker))

    @api.get("/contracts", summary="Every contract and its message types")
    def contracts(broker: BrokerDep) -> Any:
        return _json(mon.contracts(broker))

    @api.get("/conversations/states", summary="Conversations counted by state")
    def conversation_states(broker: BrokerDep, queue: Name = None) -> Any:
        return _json(mon.conversation_states(broker, queue))

    @api.get("/conversations", summary="Conversations, newest first, filtered and paged")
    def conversations(
        broker: BrokerDep,
        state: Annotated[
            str | None, Query(max_length=32, description="a state code or its description")
        ] = None,
        queue: Name = None,
        service: Name = None,
        far_service: Name = None,
        initiator: bool | None = None,
        limit: Limit = mon.DEFAULT_LIMIT,
        offset: Offset = 0,
    ) -> Any:
        return _json(
            mon.conversations(
                broker,
                state=state,
                queue=queue,
                service=service,
                far_service=far_service,
                is_initiator=initiator,
                limit=limit,
                offset=offset,
            )
        )

    @api.get("/conversations/{handle}", summary="One conversation endpoint")
    def conversation(broker: BrokerDep, handle: Handle) -> Any:
        return _json(mon.conversation(broker, handle))

    @api.get("/transmission-queue", summary="Messages waiting to leave, and why")
    def transmission_queue(
        broker: BrokerDep,
        conversation_handle: uuid.UUID | None = None,
        to_service: Name = None,
        limit: Limit = mon.DEFAULT_LIMIT,
        offset: Offset = 0,
    ) -> Any:
        page = mon.transmission_queue(
            broker,
            conversation_handle=conversation_handle,
            to_service=to_service,
            limit=limit,
            offset=offset,
        )
        return {**_json(page.page), "summary": _json(page.summary)}

    @api.get("/routes", summary="Routes")
    def routes(broker: BrokerDep) -> Any:
        return _json(mon.routes(broker))

    @api.get("/certificates", summary="Dialog security's certificates, ending first first")
    def certificates(
        broker: BrokerDep,
        expiring_within_days: Annotated[
            int | None,
            Query(ge=0, le=36500, description="only those ending within this many days"),
        ] = None,
    ) -> Any:
        return _json(mon.certificates(broker, expiring_within_days=expiring_within_days))

    @api.get("/routing-services", summary="Data-dependent routing services")
    def routing_services(broker: BrokerDep) -> Any:
        return _json(mon.routing_services(broker))

    @api.get("/routing-mappings", summary="Data-dependent routing's conversation mappings")
    def routing_mappings(
        broker: BrokerDep,
        routing_service: Name = None,
        target_service: Name = None,
        limit: Limit = mon.DEFAULT_LIMIT,
        offset: Offset = 0,
    ) -> Any:
        return _json(
            mon.routing_mappings(
                broker,
                routing_service=routing_service,
                target_service=target_service,
                limit=limit,
                offset=offset,
            )
        )

    @api.get("/events", summary="Recent events and errors, newest first")
    def events(
        broker: BrokerDep,
        event: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
        object_name: Name = None,
        limit: Limit = mon.DEFAULT_LIMIT,
        offset: Offset = 0,
    ) -> Any:
        return _json(
            mon.events(broker, event=event, object_name=object_name, limit=limit, offset=offset)
        )

    @api.get("/probes/{probe_id}", summary="An echo probe's outcome")
    def probe(broker: BrokerDep, probe_id: ProbeId) -> Any:
        return _json(mon.probe(broker, probe_id))

    # -- acting ----------------------------------------------------------------------------
    @api.post("/queues/{queue:path}/enable", summary="Re-enable a disabled queue")
    def enable_queue(user: Editor, broker: BrokerDep, queue: QueueName) -> Any:
        return _json(mon.enable_queue(broker, queue, actor=user.get_name()))

    @api.post(
        "/transmission-queue/{handle}/retry",
        summary="Retry a conversation's waiting messages now",
    )
    def retry_transmission(
        user: Editor, broker: BrokerDep, handle: Handle, body: RetryBody | None = None
    ) -> Any:
        body = body or RetryBody()
        return _json(
            mon.retry_transmission(broker, handle, deliver=body.deliver, actor=user.get_name())
        )

    @api.post(
        "/transmission-queue/{handle}/drop",
        summary="Drop a conversation's waiting messages (or one of them)",
    )
    def drop_transmission(
        user: Editor, broker: BrokerDep, handle: Handle, body: DropBody | None = None
    ) -> Any:
        body = body or DropBody()
        return _json(
            mon.drop_transmission(broker, handle, message_id=body.message_id, actor=user.get_name())
        )

    @api.post("/conversations/{handle}/end", summary="END CONVERSATION (WITH CLEANUP)")
    def end_conversation(
        user: Editor, broker: BrokerDep, handle: Handle, body: EndBody | None = None
    ) -> Any:
        body = body or EndBody()
        return _json(
            mon.end_conversation(
                broker,
                handle,
                cleanup=body.cleanup,
                error_code=body.error_code,
                error_description=body.error_description,
                actor=user.get_name(),
            )
        )

    @api.post(
        "/probes",
        summary="Send an echo probe to a service; poll GET /api/probes/{probe_id}",
        status_code=status.HTTP_202_ACCEPTED,
    )
    def start_probe(user: Editor, broker: BrokerDep, body: ProbeBody) -> Any:
        return _json(
            mon.start_probe(
                broker,
                body.service,
                timeout_seconds=body.timeout_seconds,
                body=body.body,
                actor=user.get_name(),
            )
        )

    app.include_router(api)
    mount_ui(app)  # the broker page at /ui/ (plugin/ui.py)
    return app


__all__ = ["DEFAULT_CONN_ID", "BrokerSource", "create_app"]
