"""Delivery between broker databases: the transmission queue, acknowledgments, forwarding.

Each broker database is one broker instance. A message for a service that is not hosted here waits
in this broker's transmission queue (``broker_transmission_queue``) until :meth:`Transport.deliver`
moves it. There is no wire and no daemon: the delivering process opens a connection to the far
database itself (through the broker's *resolver*, from the logical name in a route's address) and
runs the far broker's receiving code, :class:`Inbound`, in one transaction there.

Exactly once across two databases
    The far broker inserts a message only if its sequence number is new for that conversation and
    direction (the endpoint's ``receive_sequence``, plus the out-of-order messages it holds), and
    answers with an acknowledgment either way. The sender removes a message from its transmission
    queue only when that acknowledgment arrives. A delivery process that dies between the far
    commit and its own leaves the message in place; the next pass sends it again, the far broker
    recognizes the duplicate and acknowledges it again.

Acknowledgments and errors
    travel back as :class:`Packet` objects returned by the far broker's :meth:`Inbound.accept`.
    Along a chain of forwarders they travel back the way the message came: each forwarder hands
    its caller whatever the next hop returned.

Forwarding (seed 002)
    A broker with forwarding on passes messages for services it does not host to the next hop by
    its own routes, adding one to the hop count; past :data:`routing.MAX_HOPS` or the message's
    lifetime it discards the message and returns an Error for the sender. When the next hop cannot
    be reached the forwarder keeps the message in non-durable storage (an UNLOGGED table on
    PostgreSQL, process memory on SQLite) for its own :meth:`Transport.deliver` to retry; it never
    acknowledges anything itself, so the sender keeps every message until the final destination
    has it.

Mirrors
    A database that says it is not the principal (``Broker.configure(principal=False)``, or a
    PostgreSQL server in recovery) refuses deliveries; the sender then tries the route's mirror
    address, which names a copy of the same broker instance.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, insert, select, text, tuple_, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from airflow_broker import bulk, dynamic, metrics, routing
from airflow_broker import schema as s
from airflow_broker.constants import (
    END_DIALOG,
    ERR_CONTRACT_NOT_SUPPORTED,
    ERR_HOPS_EXCEEDED,
    ERR_LIFETIME_EXPIRED,
    ERR_MESSAGE_INVALID,
    ERR_SERVICE_NOT_FOUND,
    ERROR,
    SENDABLE_STATES,
    STATUS_NOT_COMPLETE,
    STATUS_READY,
    SYSTEM_MESSAGE_TYPES,
)
from airflow_broker.delivery import (
    RETRY_BASE,
    RETRY_CAP,
    contract_rule,
    hosted_services,
    insert_message,
    precedence,
    priority_for,
    routes_of,
)
from airflow_broker.engines import aware, utcnow
from airflow_broker.errors import BrokerError, ContractViolation, MessageValidationError
from airflow_broker.objects import TransitRow, error_body
from airflow_broker.validation import VALIDATION_CODES, validate_body

if TYPE_CHECKING:
    from airflow_broker.broker import Broker

log = logging.getLogger("airflow_broker")

MESSAGE, ACK, NOTICE = "M", "A", "E"

#: Seconds to wait for a far database's server to answer a connection attempt.
CONNECT_TIMEOUT = 5
#: A delivery pass's count of messages no far broker took (not a DeliveryReport field).
_UNREACHABLE = "unreachable"

# ---------------------------------------------------------------------------------------------
# What travels
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Packet:
    """One unit between brokers: a message (``M``), an acknowledgment (``A``) or an Error notice
    from a broker on the way (``E``). Acknowledgments and notices are addressed back to the
    sender of the message they answer and carry its sequence number."""

    kind: str
    conversation_id: uuid.UUID
    #: the side that sent this packet is the dialog's initiator
    from_initiator: bool
    from_service: str
    from_broker_instance: str
    to_service: str
    to_broker_instance: str | None
    seq: int
    contract: str = ""
    message_type: str = ""
    validation: str = "N"
    body: bytes | None = None
    lifetime: datetime | None = None
    hops: int = 0
    error_code: int | None = None
    error_description: str | None = None

    def answer(
        self,
        kind: str,
        by_broker_instance: str,
        code: int | None = None,
        description: str | None = None,
    ) -> Packet:
        """An acknowledgment or an Error notice for this message, addressed to its sender."""
        return Packet(
            kind,
            self.conversation_id,
            not self.from_initiator,
            self.to_service,
            by_broker_instance,
            self.from_service,
            self.from_broker_instance,
            self.seq,
            contract=self.contract,
            message_type=self.message_type,
            lifetime=self.lifetime,
            error_code=code,
            error_description=description,
        )

    def describe(self) -> str:
        what = {MESSAGE: "message", ACK: "acknowledgment of message", NOTICE: "error notice on"}
        return f"{what[self.kind]} {self.seq} of conversation {self.conversation_id}"


#: Outcome of one packet at a broker that did not take it for good.
HELD, DROPPED = "held", "dropped"


@dataclass(slots=True)
class Outcome:
    """What a broker did with a batch of packets: the answers (acknowledgments and Error
    notices, for this broker's caller to apply or pass back), and for packets it did not take
    for good, why (by index in the batch)."""

    answers: list[Packet] = field(default_factory=list)
    #: index -> (HELD or DROPPED, reason)
    notes: dict[int, tuple[str, str]] = field(default_factory=dict)
    discarded: int = 0
    forwarded: int = 0


class Unreachable(BrokerError):
    """The broker at an address could not be reached (or refused: not the principal)."""


@dataclass(frozen=True, slots=True)
class DeliveryReport:
    """What one :meth:`Broker.deliver` pass did.

    :ivar delivered: messages that reached their destination: a local queue, or a far broker
        that acknowledged them.
    :ivar acknowledged: messages removed from the transmission queue by an acknowledgment.
    :ivar delayed: messages still waiting (no route, destination unreachable, held by a
        forwarder, queue disabled); each has a ``transmission_status`` saying why.
    :ivar failed: messages whose conversation failed with an Error instead (contract not
        supported, invalid body, too many hops...).
    :ivar discarded: messages this broker, forwarding, threw away (hop count, lifetime, no route).
    :ivar forwarded: messages this broker, forwarding, passed on to their next hop.
    """

    delivered: int = 0
    acknowledged: int = 0
    delayed: int = 0
    failed: int = 0
    discarded: int = 0
    forwarded: int = 0


# ---------------------------------------------------------------------------------------------
# Resolving addresses
# ---------------------------------------------------------------------------------------------

_peers: dict[str, Broker] = {}
_peers_lock = threading.Lock()


def env_name(name: str) -> str:
    """The environment variable that gives the URL of broker ``name`` outside Airflow."""
    return "AIRFLOW_BROKER_ADDRESS_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def address_name(address: str) -> str:
    if not address.startswith(routing.BROKER_SCHEME) or len(address) <= len(routing.BROKER_SCHEME):
        raise Unreachable(f"address {address!r} is not broker://NAME")
    return address[len(routing.BROKER_SCHEME) :]


def resolve(broker: Broker, address: str) -> Broker:
    """The broker at ``broker://NAME``: the resolver's entry for NAME (a URL or a Broker), else
    the environment variable ``AIRFLOW_BROKER_ADDRESS_<NAME>``, else (Airflow installed) the
    Airflow connection whose id is NAME. Brokers opened from URLs are
    shared by the whole process and inherit the resolver of the broker that first named them."""
    from airflow_broker.broker import Broker

    name = address_name(address)
    resolver = broker.resolver
    target: Any = None
    if callable(resolver):
        target = resolver(name)
    elif resolver is not None:
        target = resolver.get(name)
    if target is None:
        target = os.environ.get(env_name(name))
    if target is None:
        from airflow_broker.hooks.connections import airflow_connection_url

        try:
            target = airflow_connection_url(name)
        except ValueError as exc:
            raise Unreachable(f"cannot use {address}: {exc}") from exc
    if target is None:
        raise Unreachable(
            f"no connection for {address}: give the broker a resolver entry {name!r}, set "
            f"{env_name(name)}, or (in Airflow) create a connection with id {name!r}"
        )
    if isinstance(target, Broker):
        return target
    url = str(target)
    with _peers_lock:
        peer = _peers.get(url)
        if peer is None:
            kwargs: dict[str, Any] = {"pool_pre_ping": True}
            if not url.startswith("sqlite"):
                kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT}
            peer = Broker.connect(url, resolver=resolver, **kwargs)
            _peers[url] = peer
    return peer


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0]


# ---------------------------------------------------------------------------------------------
# The receiving side
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Settings:
    instance_id: str
    forwarding: bool
    principal: bool


class Inbound:
    """What a broker does with packets that arrive from another broker (or that it relays)."""

    def __init__(self, broker: Broker) -> None:
        self.b = broker

    def _settings(self, conn: Connection) -> _Settings:
        bi = s.broker_instance
        cols: list[Any] = [bi.c.instance_id, bi.c.forwarding, bi.c.principal]
        if self.b.dialect == "postgresql":
            cols.append(text("pg_is_in_recovery()"))
        row = conn.execute(select(*cols)).first()
        if row is None:
            raise Unreachable(f"{self.b!r} is not migrated")
        principal = bool(row[2]) and not (len(row) > 3 and row[3])
        return _Settings(str(row[0]), bool(row[1]), principal)

    def accept(self, packets: Sequence[Packet], *, depth: int = 0) -> Outcome:
        """Take a batch of packets: those for this broker in one transaction (messages into
        queues, acknowledgments and notices applied), the others forwarded or refused."""
        out = Outcome()
        try:
            with self.b.engine.connect() as conn:
                settings = self._settings(conn)
        except DBAPIError as exc:
            raise Unreachable(_first_line(exc)) from exc
        if not settings.principal:
            raise Unreachable(
                f"broker instance {settings.instance_id} at {self.b!r} is not the principal"
            )
        mine: list[int] = []
        others: list[int] = []
        with self.b.engine.connect() as conn:
            hosted = hosted_services(self.b, conn)
        for i, p in enumerate(packets):
            if p.to_broker_instance == settings.instance_id or (
                p.to_broker_instance is None and p.kind == MESSAGE and p.to_service in hosted
            ):
                mine.append(i)
            else:
                others.append(i)
        if mine:
            self._take(packets, mine, settings, out)
        if others:
            if settings.forwarding:
                Forwarder(self.b, settings).forward(packets, others, out, depth)
            else:
                for i in others:
                    p = packets[i]
                    if p.to_broker_instance is not None:
                        why = (
                            f"it is for broker instance {p.to_broker_instance}; broker instance "
                            f"{settings.instance_id} dropped it (forwarding is off there)"
                        )
                    else:
                        why = (
                            f"service {p.to_service!r} is not hosted by broker instance "
                            f"{settings.instance_id}, which does not forward"
                        )
                    out.notes[i] = (DROPPED, why)
        return out

    # -- packets for this broker ---------------------------------------------------------------
    def _take(
        self, packets: Sequence[Packet], indexes: list[int], settings: _Settings, out: Outcome
    ) -> None:
        for attempt in (1, 2):
            answers: list[Packet] = []
            notes: dict[int, tuple[str, str]] = {}
            try:
                with self.b.engine.begin() as conn:
                    _Taker(self.b, conn, settings.instance_id, answers, notes).run(packets, indexes)
            except IntegrityError:
                # Another delivery created the same far endpoint at the same moment: the second
                # try finds it and treats these messages as the duplicates they are.
                if attempt == 2:
                    raise
                continue
            except OperationalError as exc:
                raise Unreachable(_first_line(exc)) from exc
            out.answers.extend(answers)
            out.notes.update(notes)
            return


class _Taker:
    """One transaction of a broker taking the packets addressed to it."""

    def __init__(
        self,
        broker: Broker,
        conn: Connection,
        instance_id: str,
        answers: list[Packet],
        notes: dict[int, tuple[str, str]],
    ) -> None:
        self.b = broker
        self.conn = conn
        self.me = instance_id
        self.answers = answers
        self.notes = notes
        self.now = utcnow()
        # Writes are collected and made set-based at the end of run(): a batch of a few hundred
        # messages on a few dozen conversations costs a handful of statements.
        self.new_groups: list[dict[str, Any]] = []
        self.new_endpoints: list[dict[str, Any]] = []
        self.new_messages: list[dict[str, Any]] = []
        self.sequences: list[dict[str, Any]] = []
        self.bindings: list[dict[str, Any]] = []
        self.acked: list[tuple[uuid.UUID, int]] = []
        #: sequence number -> validation code, of the conversation being taken
        self.validation: dict[int, str] = {}

    def run(self, packets: Sequence[Packet], indexes: list[int]) -> None:
        e = s.conversation_endpoint
        keys = {(packets[i].conversation_id, not packets[i].from_initiator) for i in indexes}
        stmt = (
            select(e)
            .where(tuple_(e.c.conversation_id, e.c.is_initiator).in_(sorted(keys)))
            .order_by(e.c.conversation_handle)
        )
        if self.b.dialect == "postgresql":
            stmt = stmt.with_for_update()
        endpoints = {
            (r.conversation_id, r.is_initiator): dict(r._mapping) for r in self.conn.execute(stmt)
        }
        with_messages = {
            (packets[i].conversation_id, not packets[i].from_initiator)
            for i in indexes
            if packets[i].kind == MESSAGE
        }
        held = self._held(
            [ep["conversation_handle"] for k, ep in endpoints.items() if k in with_messages]
        )
        by_conversation: dict[tuple[uuid.UUID, bool], list[int]] = defaultdict(list)
        for i in indexes:
            p = packets[i]
            by_conversation[(p.conversation_id, not p.from_initiator)].append(i)
        for key, idx in by_conversation.items():
            ep = endpoints.get(key)
            acks = [i for i in idx if packets[i].kind == ACK]
            notices = [i for i in idx if packets[i].kind == NOTICE]
            messages = sorted(
                (i for i in idx if packets[i].kind == MESSAGE), key=lambda i: packets[i].seq
            )
            if ep is not None and acks:
                self._acks(ep, [packets[i] for i in acks])
            if ep is not None and notices:
                self._notice(ep, packets[notices[0]])
            if messages:
                self._messages(ep, packets, messages, held)
        self._write()

    def _write(self) -> None:
        e = s.conversation_endpoint
        bulk.insert_rows(self.conn, s.conversation_group, self.new_groups)
        if self.new_endpoints:
            columns = sorted({c for ep in self.new_endpoints for c in ep} - {"_new"})
            bulk.insert_rows(
                self.conn, e, [{c: ep.get(c) for c in columns} for ep in self.new_endpoints]
            )
        bulk.insert_rows(self.conn, s.message, self.new_messages)
        bulk.update_rows(self.conn, e, "conversation_handle", self.sequences)
        bulk.update_rows(
            self.conn,
            e,
            "conversation_handle",
            self.bindings,
            only_if_null=("far_broker_instance",),
        )
        bulk.delete_rows(
            self.conn,
            s.transmission_queue,
            ("conversation_handle", "message_sequence_number"),
            self.acked,
        )

    def _held(self, handles: list[uuid.UUID]) -> dict[uuid.UUID, dict[int, str]]:
        """Messages that arrived out of order and wait for the gap before them to fill."""
        if not handles:
            return {}
        m = s.message
        held: dict[uuid.UUID, dict[int, str]] = defaultdict(dict)
        for r in self.conn.execute(
            select(m.c.conversation_handle, m.c.message_sequence_number, m.c.message_type_name)
            .where(m.c.conversation_handle.in_(handles))
            .where(m.c.status == STATUS_NOT_COMPLETE)
        ):
            held[r.conversation_handle][r.message_sequence_number] = r.message_type_name
        return held

    # acknowledgments and notices for conversations of this broker
    def _acks(self, ep: dict[str, Any], acks: list[Packet]) -> None:
        by = acks[0].from_broker_instance
        bound = ep["far_broker_instance"]
        if bound is not None and bound != by:
            log.warning(
                "acknowledgment from broker instance %s for conversation %s ignored: the "
                "conversation is bound to broker instance %s",
                by,
                ep["conversation_handle"],
                bound,
            )
            return
        handle = ep["conversation_handle"]
        if bound is None:
            self.bindings.append({"conversation_handle": handle, "far_broker_instance": by})
            ep["far_broker_instance"] = by
        self.acked += [(handle, a.seq) for a in acks]

    def _notice(self, ep: dict[str, Any], notice: Packet) -> None:
        self._fail(
            ep,
            notice.error_code or ERR_SERVICE_NOT_FOUND,
            notice.error_description or "the conversation failed on the way",
        )

    def _fail(self, ep: dict[str, Any], code: int, description: str) -> None:
        if ep.get("_new"):
            # Not written yet: it is created failed, with its Error message.
            ep["state"] = "ER"
            self.new_messages.append(
                self._row(ep, ERROR, ep["receive_sequence"], "X", error_body(code, description))
            )
            log.warning("conversation %s failed: %s", ep["conversation_handle"], description)
        else:
            fail_endpoint(self.conn, ep, code, description, self.now)

    # messages
    def _messages(
        self,
        ep: dict[str, Any] | None,
        packets: Sequence[Packet],
        indexes: list[int],
        held: dict[uuid.UUID, dict[int, str]],
    ) -> None:
        first = packets[indexes[0]]
        if ep is None:
            if not first.from_initiator:
                # The initiator's endpoint is gone here (ended WITH CLEANUP): EndDialog and
                # Error need nothing more; anything else fails the target's side.
                if all(packets[i].message_type in (END_DIALOG, ERROR) for i in indexes):
                    self.answers += [packets[i].answer(ACK, self.me) for i in indexes]
                else:
                    self._fail_back(
                        first, ERR_SERVICE_NOT_FOUND, "the far endpoint no longer exists"
                    )
                return
            ep = self._new_endpoint(first, indexes, packets)
            if ep is None:
                note = self.notes.get(indexes[0])
                if note is not None:
                    for i in indexes[1:]:
                        self.notes[i] = note
                return
        bound = ep["far_broker_instance"]
        if bound is not None and bound != first.from_broker_instance:
            for i in indexes:
                self.notes[i] = (
                    DROPPED,
                    f"conversation {first.conversation_id} is bound to broker instance {bound} "
                    f"here, not to {first.from_broker_instance}",
                )
            return
        handle = ep["conversation_handle"]
        self.validation = {}
        ep_held = held.setdefault(handle, {})
        expected = ep["receive_sequence"]
        state = ep["state"]
        start_state = state
        failure: tuple[int, str] | None = None
        for i in indexes:
            p = packets[i]
            if p.seq < expected or p.seq in ep_held:
                self.answers.append(p.answer(ACK, self.me))  # a duplicate: acknowledge again
                continue
            if state in ("ER", "CD"):
                self.answers.append(p.answer(ACK, self.me))
                continue
            failure = self._check(ep, p)
            if failure is not None:
                self._fail_back(p, *failure)
                break
            if p.seq > expected:
                self._enqueue(ep, p, STATUS_NOT_COMPLETE)
                ep_held[p.seq] = p.message_type
                self.answers.append(p.answer(ACK, self.me))
                continue
            state = self._arrive(ep, p, state)
            expected += 1
            self.answers.append(p.answer(ACK, self.me))
            while expected in ep_held:
                promoted_type = ep_held.pop(expected)
                m = s.message
                self.conn.execute(
                    update(m)
                    .where(m.c.conversation_handle == handle)
                    .where(m.c.message_sequence_number == expected)
                    .where(m.c.status == STATUS_NOT_COMPLETE)
                    .values(status=STATUS_READY)
                )
                state = _next_state(state, promoted_type)
                expected += 1
        values: dict[str, Any] = {}
        if expected != ep["receive_sequence"]:
            values["receive_sequence"] = expected
        if failure is not None:
            if values:
                self._update_endpoint(handle, values, ep)
            self._fail(ep, *failure)
            return
        if state != start_state:
            values["state"] = state
            if state in ("ER", "CD"):
                values["timer_due_at"] = None
            if state == "CD":
                values["closed_at"] = self.now
            if state == "ER":
                self.conn.execute(
                    delete(s.transmission_queue).where(
                        s.transmission_queue.c.conversation_handle == handle
                    )
                )
        if values:
            self._update_endpoint(handle, values, ep)

    def _update_endpoint(
        self, handle: uuid.UUID, values: dict[str, Any], ep: dict[str, Any]
    ) -> None:
        if ep.get("_new"):
            ep.update(values)  # inserted with these values at the end
        elif set(values) == {"receive_sequence"}:
            self.sequences.append(
                {"conversation_handle": handle, "receive_sequence": values["receive_sequence"]}
            )
        else:
            e = s.conversation_endpoint
            self.conn.execute(update(e).where(e.c.conversation_handle == handle).values(**values))
        ep.update(values)

    def _arrive(self, ep: dict[str, Any], p: Packet, state: str) -> str:
        """An in-order message: into the queue (unless this side has ended), and the state it
        leads to."""
        if state in SENDABLE_STATES or state == "DI":
            self._enqueue(ep, p, STATUS_READY)
        return _next_state(state, p.message_type)

    def _enqueue(self, ep: dict[str, Any], p: Packet, status: int) -> None:
        validation = self.validation.get(p.seq, p.validation)
        self.new_messages.append(self._row(ep, p.message_type, p.seq, validation, p.body, status))

    def _row(
        self,
        ep: dict[str, Any],
        message_type: str,
        seq: int,
        validation: str,
        body: bytes | None,
        status: int = STATUS_READY,
    ) -> dict[str, Any]:
        return {
            "queue_id": ep["queue_id"],
            "conversation_group_id": ep["conversation_group_id"],
            "conversation_handle": ep["conversation_handle"],
            "message_sequence_number": seq,
            "status": status,
            "priority": ep["priority"],
            "precedence": precedence(message_type),
            "service_name": ep["service_name"],
            "service_contract_name": ep["contract_name"],
            "message_type_name": message_type,
            "validation": validation,
            "message_body": body,
            "enqueued_at": self.now,
        }

    def _check(self, ep: dict[str, Any], p: Packet) -> tuple[int, str] | None:
        """Whether this broker accepts the message: its type in the contract, sent by the right
        side, and a body that its type here validates."""
        return self._check_in(ep["contract_name"], p)

    def _check_in(self, contract: str, p: Packet) -> tuple[int, str] | None:
        if p.message_type in SYSTEM_MESSAGE_TYPES:
            return None
        try:
            sent_by, validation, schema_ = contract_rule(
                self.b, self.conn, contract, p.message_type
            )
        except BrokerError as exc:
            return ERR_MESSAGE_INVALID, f"at broker instance {self.me}: {exc}"
        side = "initiator" if p.from_initiator else "target"
        if sent_by not in (side, "any"):
            return (
                ERR_MESSAGE_INVALID,
                f"contract {contract!r} lets only the {sent_by} send message type "
                f"{p.message_type!r}",
            )
        try:
            validate_body(p.message_type, validation, schema_, p.body)
        except (MessageValidationError, ContractViolation) as exc:
            return ERR_MESSAGE_INVALID, f"discarded at broker instance {self.me}: {exc}"
        # RECEIVE shows how this broker validated the body.
        self.validation[p.seq] = VALIDATION_CODES[validation]
        return None

    def _new_endpoint(
        self, first: Packet, indexes: list[int], packets: Sequence[Packet]
    ) -> dict[str, Any] | None:
        """The target endpoint a dialog's first message to arrive here creates."""
        hosted = hosted_services(self.b, self.conn).get(first.to_service)
        if hosted is None:
            self.notes[indexes[0]] = (
                DROPPED,
                f"service {first.to_service!r} is not hosted by broker instance {self.me}",
            )
            return None
        queue_id, queue_name = hosted.queue_id, hosted.queue_name
        if not hosted.accepts(first.contract):
            self._fail_back(
                first,
                ERR_CONTRACT_NOT_SUPPORTED,
                f"service {first.to_service!r} does not accept contract {first.contract!r}",
            )
            return None
        if not hosted.queue_status:
            self.notes[indexes[0]] = (
                DROPPED,
                f"the queue {queue_name!r} of service {first.to_service!r} is disabled",
            )
            return None
        if first.seq == 0:
            # A dialog whose first message is refused leaves nothing behind here.
            failure = self._check_in(first.contract, first)
            if failure is not None:
                self._fail_back(first, *failure)
                for i in indexes[1:]:
                    self.notes[i] = (DROPPED, "an earlier message of its conversation was refused")
                return None
        handle, group = uuid.uuid4(), uuid.uuid4()
        prio = priority_for(self.b, self.conn, first.contract, first.to_service, first.from_service)
        ep = {
            "conversation_handle": handle,
            "conversation_id": first.conversation_id,
            "is_initiator": not first.from_initiator,
            "conversation_group_id": group,
            "queue_id": queue_id,
            "service_name": first.to_service,
            "far_service": first.from_service,
            "far_broker_instance": first.from_broker_instance,
            "far_handle": None,
            "contract_name": first.contract,
            "state": "CO",
            "priority": prio,
            "lifetime": first.lifetime,
            "send_sequence": 0,
            "receive_sequence": 0,
            "created_at": self.now,
        }
        self.new_groups.append({"conversation_group_id": group, "queue_id": queue_id})
        self.new_endpoints.append(ep)
        ep["_new"] = True
        return ep

    def _fail_back(self, p: Packet, code: int, description: str) -> None:
        log.warning("%s refused: %s", p.describe(), description)
        self.answers.append(p.answer(NOTICE, self.me, code, description))


def apply_answers(
    broker: Broker, conn: Connection, me: str, answers: Sequence[Packet]
) -> tuple[int, int]:
    """A sender applies what far brokers answered it, in the caller's transaction:
    acknowledgments take messages out of the transmission queue (and bind the conversation to
    the broker that answered first), Error notices fail the conversation. Returns the counts
    of (acknowledgments, notices)."""
    _Taker(broker, conn, me, [], {}).run(answers, list(range(len(answers))))
    acks = sum(1 for a in answers if a.kind == ACK)
    return acks, sum(1 for a in answers if a.kind == NOTICE)


def _next_state(state: str, message_type: str) -> str:
    """The state an endpoint goes to when an EndDialog or Error arrives in order."""
    if message_type == END_DIALOG:
        if state == "DO":
            return "CD"
        if state in SENDABLE_STATES:
            return "DI"
    elif message_type == ERROR:
        return "CD" if state in ("DO", "CD") else "ER"
    return state


def fail_endpoint(
    conn: Connection, ep: dict[str, Any], code: int, description: str, now: datetime
) -> None:
    """The conversation failed: this side gets an Error message and goes to ER; whatever it
    still had to send is dropped."""
    if ep["state"] in ("ER", "CD"):
        return
    e = s.conversation_endpoint
    handle = ep["conversation_handle"]
    conn.execute(
        insert_message(
            queue_id=ep["queue_id"],
            group_id=ep["conversation_group_id"],
            handle=handle,
            seq=ep["receive_sequence"],
            priority=ep["priority"],
            service_name=ep["service_name"],
            contract=ep["contract_name"],
            message_type=ERROR,
            validation="X",
            body=error_body(code, description),
            now=now,
        )
    )
    conn.execute(
        update(e).where(e.c.conversation_handle == handle).values(state="ER", timer_due_at=None)
    )
    conn.execute(
        delete(s.transmission_queue).where(s.transmission_queue.c.conversation_handle == handle)
    )
    ep["state"] = "ER"
    log.warning("conversation %s failed: %s", handle, description)


# ---------------------------------------------------------------------------------------------
# Forwarding
# ---------------------------------------------------------------------------------------------

_memory_transit: dict[str, list[dict[str, Any]]] = defaultdict(list)
_memory_lock = threading.Lock()
_memory_ids = itertools.count(1)


class Forwarder:
    """A forwarding broker passing on packets it is not the destination of."""

    def __init__(self, broker: Broker, settings: _Settings) -> None:
        self.b = broker
        self.settings = settings

    def forward(
        self, packets: Sequence[Packet], indexes: list[int], out: Outcome, depth: int
    ) -> None:
        now = utcnow()
        with self.b.engine.connect() as conn:
            routes = routes_of(self.b, conn)
        groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
        onward: dict[int, Packet] = {}
        held_as: dict[int, Packet] = {}
        for i in indexes:
            p = packets[i]
            reason = self._discard_reason(p, now)
            if reason is not None:
                out.discarded += 1
                out.notes[i] = (DROPPED, reason)
                log.warning(
                    "forwarder %s discarded %s: %s", self.settings.instance_id, p.describe(), reason
                )
                if p.kind == MESSAGE:
                    code = ERR_HOPS_EXCEEDED if "hops" in reason else ERR_LIFETIME_EXPIRED
                    out.answers.append(p.answer(NOTICE, self.settings.instance_id, code, reason))
                continue
            decision = routing.route_conversation(
                routes,
                p.to_service,
                p.to_broker_instance,
                dialog_id=p.conversation_id,
                now=now,
                local_services=[],
            )
            if decision.kind != "remote":
                out.discarded += 1
                out.notes[i] = (
                    DROPPED,
                    f"forwarder {self.settings.instance_id} has no route for {p.to_service!r}: "
                    f"{decision.reason}",
                )
                continue
            held_as[i] = p
            onward[i] = replace(
                p,
                hops=p.hops + 1,
                to_broker_instance=p.to_broker_instance or decision.broker_instance,
            )
            groups[decision.addresses].append(i)
        for addresses, idx in groups.items():
            batch = [onward[i] for i in idx]
            result, failures = Transport(self.b).push_any(addresses, batch, depth + 1)
            if result is None:
                reason = "; ".join(failures)
                # Held as it arrived: the hop is counted again when it is passed on.
                hold(self.b, [held_as[i] for i in idx], now, f"next hop unreachable: {reason}")
                for i in idx:
                    out.notes[i] = (HELD, f"held in transit by a forwarder: {reason}")
                continue
            out.forwarded += sum(1 for p in batch if p.kind == MESSAGE)
            out.discarded += result.discarded
            out.answers.extend(result.answers)
            for j, note in result.notes.items():
                out.notes[idx[j]] = note

    def _discard_reason(self, p: Packet, now: datetime) -> str | None:
        if routing.hops_exceeded(p.hops):
            return (
                f"{p.describe()} was forwarded {p.hops} times (more than {routing.MAX_HOPS} hops): "
                "a routing loop?"
            )
        if routing.lifetime_over(aware(p.lifetime), now):
            return f"{p.describe()} outlived its conversation's lifetime in transit"
        return None


def hold(broker: Broker, packets: Sequence[Packet], now: datetime, reason: str) -> None:
    """Keep packets a forwarder cannot pass on yet (non-durable)."""
    rows = [
        {
            "kind": p.kind,
            "conversation_id": p.conversation_id,
            "from_initiator": p.from_initiator,
            "from_service_name": p.from_service,
            "from_broker_instance": p.from_broker_instance,
            "to_service_name": p.to_service,
            "to_broker_instance": p.to_broker_instance,
            "service_contract_name": p.contract,
            "message_type_name": p.message_type,
            "message_sequence_number": p.seq,
            "validation": p.validation,
            "message_body": p.body,
            "lifetime": p.lifetime,
            "hops": p.hops,
            "error_code": p.error_code,
            "error_description": p.error_description,
            "enqueued_at": now,
            "transmission_status": reason,
            "attempts": 1,
            "next_attempt_at": now + RETRY_BASE,
        }
        for p in packets
    ]
    if broker.dialect == "postgresql":
        with broker.engine.begin() as conn:
            conn.execute(insert(s.transit), rows)
    else:
        with _memory_lock:
            store = _memory_transit[_key(broker)]
            for row in rows:
                row["id"] = next(_memory_ids)
                store.append(row)
    broker.note_due(now + RETRY_BASE)


def _key(broker: Broker) -> str:
    return broker.engine.url.render_as_string(hide_password=False)


def _packet_of_transit(r: Any) -> Packet:
    return Packet(
        r["kind"],
        r["conversation_id"],
        r["from_initiator"],
        r["from_service_name"],
        r["from_broker_instance"],
        r["to_service_name"],
        r["to_broker_instance"],
        r["message_sequence_number"],
        contract=r["service_contract_name"],
        message_type=r["message_type_name"],
        validation=r["validation"],
        body=r["message_body"],
        lifetime=aware(r["lifetime"]),
        hops=r["hops"],
        error_code=r["error_code"],
        error_description=r["error_description"],
    )


def in_transit(broker: Broker) -> list[TransitRow]:
    """What a forwarding broker holds (see :meth:`Broker.in_transit`)."""
    if broker.dialect == "postgresql":
        with broker.engine.connect() as conn:
            rows = [
                dict(r._mapping) for r in conn.execute(select(s.transit).order_by(s.transit.c.id))
            ]
    else:
        with _memory_lock:
            rows = [dict(r) for r in _memory_transit.get(_key(broker), [])]
    return [
        TransitRow(
            id=r["id"],
            kind=r["kind"],
            conversation_id=r["conversation_id"],
            from_service_name=r["from_service_name"],
            to_service_name=r["to_service_name"],
            to_broker_instance=r["to_broker_instance"],
            message_type_name=r["message_type_name"],
            message_sequence_number=r["message_sequence_number"],
            hops=r["hops"],
            enqueued_at=aware(r["enqueued_at"]),  # type: ignore[arg-type]
            transmission_status=r["transmission_status"],
            attempts=r["attempts"],
            next_attempt_at=aware(r["next_attempt_at"]),  # type: ignore[arg-type]
        )
        for r in rows
    ]


def backoff(attempts: int) -> timedelta:
    """Delay before attempt number ``attempts + 1``: 1 s doubling up to a minute."""
    return min(RETRY_BASE * 2 ** max(attempts - 1, 0), RETRY_CAP)


# ---------------------------------------------------------------------------------------------
# The sending side
# ---------------------------------------------------------------------------------------------


class Transport:
    """Moves this broker's transmission queue (and, forwarding, its messages in transit)."""

    #: messages per push to a far broker (one transaction there)
    BATCH = 500

    def __init__(self, broker: Broker) -> None:
        self.b = broker

    def after_push(self, address: str, sent: int) -> None:
        """Called after a far broker committed a batch of ``sent`` messages and before this
        broker records the acknowledgments (an instrumentation point; crash tests use it)."""

    # -- pushing -------------------------------------------------------------------------------
    def push(self, address: str, packets: Sequence[Packet], depth: int = 0) -> Outcome:
        """Hand ``packets`` to the broker at ``address``; raises :class:`Unreachable`."""
        try:
            peer = resolve(self.b, address)
        except DBAPIError as exc:
            raise Unreachable(f"{address}: {_first_line(exc)}") from exc
        try:
            outcome = Inbound(peer).accept(packets, depth=depth)
        except Unreachable as exc:
            raise Unreachable(f"cannot deliver to {address}: {exc}") from exc
        except DBAPIError as exc:
            raise Unreachable(f"cannot deliver to {address}: {_first_line(exc)}") from exc
        self.after_push(address, len(packets))
        return outcome

    def push_any(
        self, addresses: Iterable[str], packets: Sequence[Packet], depth: int = 0
    ) -> tuple[Outcome | None, list[str]]:
        """Try the addresses in order (alternatives: mirror, several routes to one broker) until
        one takes the batch. Returns its outcome (None if none could) and the failures."""
        failures: list[str] = []
        for address in addresses:
            if depth > routing.MAX_HOPS + 1:
                failures.append("too deep a chain of forwarders")
                break
            try:
                return self.push(address, packets, depth), failures
            except Unreachable as exc:
                failures.append(str(exc))
                log.info("%s", exc)
        return None, failures

    # -- the delivery pass ---------------------------------------------------------------------
    def deliver(
        self, max_messages: int | None = None, *, retry_now: bool = False
    ) -> DeliveryReport:
        counts: dict[str, int] = defaultdict(int)
        budget = max_messages
        after: list[Any] = []
        while budget is None or budget > 0:
            n = self._transmission_batch(
                self.BATCH if budget is None else min(self.BATCH, budget), retry_now, counts, after
            )
            if n == 0:
                break
            if budget is not None:
                budget -= n
        self._transit_pass(retry_now, counts)
        dynamic.answer_requests(self.b)
        unreachable = counts.pop(_UNREACHABLE, 0)
        report = DeliveryReport(**counts)
        metrics.incr(metrics.TRANSPORT_FAILED, unreachable)
        metrics.incr(metrics.DELIVERY_FAILED, report.failed)
        return report

    def _transmission_batch(
        self, limit: int, retry_now: bool, counts: dict[str, int], after: list[Any]
    ) -> int:
        """Take up to ``limit`` due messages (none taken before in this pass), deliver them;
        returns how many were taken."""
        b = self.b
        t, e = s.transmission_queue, s.conversation_endpoint
        now = utcnow()
        stmt = (
            select(
                t,
                e.c.state,
                e.c.far_broker_instance.label("bound_instance"),
                e.c.service_name.label("ep_service"),
            )
            .join(e, e.c.conversation_handle == t.c.conversation_handle)
            .order_by(t.c.conversation_handle, t.c.message_sequence_number)
            .limit(limit)
        )
        if not retry_now:
            stmt = stmt.where(t.c.next_attempt_at <= now)
        if after:
            # Keyset: each batch starts where the last one ended (rows it could not deliver stay).
            stmt = stmt.where(
                tuple_(t.c.conversation_handle, t.c.message_sequence_number) > tuple_(*after)
            )
        if b.dialect == "postgresql":
            stmt = stmt.with_for_update(of=t, skip_locked=True)
        with b.engine.connect() as conn:
            rows = conn.execute(stmt).all()
            if not rows:
                conn.rollback()
                return 0
            after[:] = [rows[-1].conversation_handle, rows[-1].message_sequence_number]
            me = b.instance_id_on(conn)
            plan = self._plan(conn, list(rows), me, now)
            if b.dialect != "postgresql":
                # SQLite: no lock is held while far brokers are called; results are written in
                # one write transaction afterwards (a duplicate push is harmless).
                conn.rollback()
            results = self._send(plan)
            self._record(conn, plan, results, me, now, counts)
            conn.commit()
        dynamic.request_routes(self.b, plan["missing"])
        return len(rows)

    def _plan(self, conn: Connection, rows: list[Any], me: str, now: datetime) -> dict[str, Any]:
        """Route each conversation: local ones, remote ones by address, delayed ones."""
        routes = routes_of(self.b, conn)
        hosted = hosted_services(self.b, conn)
        by_handle: dict[uuid.UUID, list[Any]] = defaultdict(list)
        for r in rows:
            by_handle[r.conversation_handle].append(r)
        local: list[uuid.UUID] = []
        delayed: dict[uuid.UUID, str] = {}
        remote: dict[tuple[str, ...], list[Packet]] = defaultdict(list)
        packet_rows: dict[tuple[uuid.UUID, int], Any] = {}
        missing: set[str] = set()
        for handle, msgs in by_handle.items():
            first = msgs[0]
            asked = first.bound_instance
            service = first.to_service_name
            decision = routing.delivery_decision(
                routes,
                service,
                asked,
                dialog_id=first.conversation_id,
                me=me,
                now=now,
                hosted=list(hosted),
                dynamic_routing=dynamic.present(routes, service, now)
                and (service in missing or not dynamic.pending(conn, service, now)),
            )
            if decision.kind == "local":
                local.append(handle)
                continue
            if decision.kind == "delayed":
                if decision.step == 4:
                    missing.add(service)
                delayed[handle] = decision.reason + " (the conversation is delayed and retried)"
                continue
            target = asked or decision.broker_instance
            for r in msgs:
                p = Packet(
                    MESSAGE,
                    r.conversation_id,
                    r.is_initiator,
                    r.from_service_name,
                    me,
                    r.to_service_name,
                    target,
                    r.message_sequence_number,
                    contract=r.service_contract_name,
                    message_type=r.message_type_name,
                    validation=r.validation,
                    body=r.message_body,
                    lifetime=aware(r.lifetime),
                )
                remote[decision.addresses].append(p)
                packet_rows[(r.conversation_id, r.message_sequence_number)] = r
        return {
            "missing": missing,
            "rows": by_handle,
            "local": local,
            "delayed": delayed,
            "remote": remote,
            "packet_rows": packet_rows,
        }

    def _send(self, plan: dict[str, Any]) -> list[tuple[list[Packet], Outcome | None, str]]:
        results: list[tuple[list[Packet], Outcome | None, str]] = []
        for addresses, packets in plan["remote"].items():
            for start in range(0, len(packets), self.BATCH):
                batch = packets[start : start + self.BATCH]
                outcome, failures = self.push_any(addresses, batch)
                if outcome is not None:
                    # Dropped by the first broker that answered: try the alternatives for those.
                    dropped = [j for j, (kind, _) in outcome.notes.items() if kind == DROPPED]
                    if dropped and len(addresses) > 1:
                        retry = [batch[j] for j in dropped]
                        alt, _ = self.push_any(addresses[1:], retry)
                        if alt is not None:
                            outcome.answers.extend(alt.answers)
                            for j in dropped:
                                outcome.notes.pop(j, None)
                            for k, note in alt.notes.items():
                                outcome.notes[dropped[k]] = note
                results.append((batch, outcome, "; ".join(failures)))
        return results

    def _record(
        self,
        conn: Connection,
        plan: dict[str, Any],
        results: list[tuple[list[Packet], Outcome | None, str]],
        me: str,
        now: datetime,
        counts: dict[str, int],
    ) -> None:
        from airflow_broker.duework import DueWork

        t = s.transmission_queue
        work = DueWork(self.b, conn)
        for handle in plan["local"]:
            went = work.flush_conversation(handle, now)
            counts["delivered"] += went
            counts["delayed"] += len(plan["rows"][handle]) - went
        waiting: list[tuple[Any, str]] = []
        for handle, reason in plan["delayed"].items():
            waiting += [(r, reason) for r in plan["rows"][handle]]
        answers_for_me: list[Packet] = []
        relay: list[Packet] = []
        for batch, outcome, failure in results:
            if outcome is None:
                counts[_UNREACHABLE] += len(batch)  # the broker.transport_failed metric
                waiting += [
                    (plan["packet_rows"][(p.conversation_id, p.seq)], failure) for p in batch
                ]
                continue
            answered = {
                (a.conversation_id, a.seq) for a in outcome.answers if a.to_broker_instance == me
            }
            for j, p in enumerate(batch):
                if (p.conversation_id, p.seq) in answered:
                    continue
                _kind, reason = outcome.notes.get(
                    j, (HELD, "sent; waiting for the final destination's acknowledgment")
                )
                waiting.append((plan["packet_rows"][(p.conversation_id, p.seq)], reason))
            for a in outcome.answers:
                (answers_for_me if a.to_broker_instance == me else relay).append(a)
        if answers_for_me:
            acks, notices = apply_answers(self.b, conn, me, answers_for_me)
            counts["acknowledged"] += acks
            counts["delivered"] += acks
            counts["failed"] += notices
        bulk.update_rows(
            conn,
            t,
            "id",
            [
                {
                    "id": r.id,
                    "attempts": r.attempts + 1,
                    "transmission_status": reason,
                    "next_attempt_at": now + backoff(r.attempts + 1),
                }
                for r, reason in waiting
            ],
        )
        counts["delayed"] += len(waiting)
        if waiting:
            self.b.note_due(now + RETRY_BASE)
        if relay:
            self._relay(relay, counts)

    def _relay(self, answers: list[Packet], counts: dict[str, int]) -> None:
        """Answers for other brokers (this one forwards): pass them on like any packet."""
        outcome = Inbound(self.b).accept(answers)
        counts["forwarded"] += outcome.forwarded
        counts["discarded"] += outcome.discarded

    def _transit_pass(self, retry_now: bool, counts: dict[str, int]) -> None:
        """A forwarder's held packets: try their next hop again."""
        b = self.b
        now = utcnow()
        if b.dialect == "postgresql":
            tr = s.transit
            with b.engine.begin() as conn:
                stmt = (
                    select(tr).order_by(tr.c.id).limit(self.BATCH).with_for_update(skip_locked=True)
                )
                if not retry_now:
                    stmt = stmt.where(tr.c.next_attempt_at <= now)
                rows = [dict(r._mapping) for r in conn.execute(stmt)]
                if not rows:
                    return
                conn.execute(delete(tr).where(tr.c.id.in_([r["id"] for r in rows])))
        else:
            with _memory_lock:
                store = _memory_transit.get(_key(b), [])
                rows = [
                    r
                    for r in store
                    if retry_now or aware(r["next_attempt_at"]) <= now  # type: ignore[operator]
                ]
                if not rows:
                    return
                taken = {id(r) for r in rows}
                store[:] = [r for r in store if id(r) not in taken]
        packets = [_packet_of_transit(r) for r in rows]
        outcome = Inbound(b).accept(packets)
        counts["forwarded"] += outcome.forwarded
        counts["discarded"] += outcome.discarded
        if outcome.answers:
            # Answers for the senders of what was just forwarded: relay them on the way back.
            self._relay(outcome.answers, counts)


__all__ = [
    "DeliveryReport",
    "Inbound",
    "Packet",
    "Transport",
    "Unreachable",
    "apply_answers",
    "env_name",
    "in_transit",
    "resolve",
]
