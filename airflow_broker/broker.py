"""The facade: one broker database and every verb of Service Broker on it.

:class:`Broker` is one broker database (one Service Broker instance). Definitions (message types,
contracts, queues, services, routes, priorities) each run in a transaction of their own, or
several in one through :meth:`Broker.definitions`. Messaging runs inside a
:class:`Transaction`, which commits on leaving its ``with`` block and rolls back on an exception:
messages received in a transaction that rolls back go back on their queue, and the rollback
counts towards poison-message handling.

The facade only delegates: the verbs live in the layers below (storage, routing, messaging,
transport, operations, activation), which take a
:class:`~airflow_broker.storage.context.BrokerContext`; a Broker is one. Everything here is plain
SQLAlchemy Core and runs without Airflow.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

from airflow_broker.constants import DEFAULT
from airflow_broker.messaging import fast_send, leases
from airflow_broker.messaging.arguments import UNSET, Handle
from airflow_broker.messaging.definitions import Activation, Definitions, define
from airflow_broker.messaging.duework import DueReport, run_due
from airflow_broker.messaging.leases import Lease
from airflow_broker.messaging.objects import (
    BrokerEvent,
    Catalog,
    Message,
    QueueStatus,
    TransitRow,
    TransmissionRow,
    TransmissionSummary,
)
from airflow_broker.messaging.transaction import Transaction
from airflow_broker.operations import check as consistency
from airflow_broker.operations import housekeeping, observation
from airflow_broker.operations.check import Problem
from airflow_broker.operations.identity import IdentityReset, reset_identity
from airflow_broker.security import certificates as certificate_store
from airflow_broker.security import permissions as permission_store
from airflow_broker.security.certificates import CertificateRow
from airflow_broker.security.permissions import Permission
from airflow_broker.storage.context import BrokerContext, Resolver
from airflow_broker.storage.identity import IdentityStatus, identity_status
from airflow_broker.storage.migrate import migrate_on
from airflow_broker.transport import DeliveryReport, Transport, in_transit, inbox, resolve
from airflow_broker.transport import routing_service as ddr

log = logging.getLogger("airflow_broker")


# ---------------------------------------------------------------------------------------------
# Broker
# ---------------------------------------------------------------------------------------------


class Broker(BrokerContext):
    """One broker database: the catalog of broker objects and the conversations in it.

    A :class:`~airflow_broker.storage.context.BrokerContext` (engine, adapter, resolver, instance
    id, caches) with Service Broker's verbs on top; ``Broker.connect(url)`` opens one.

    :param engine: a SQLAlchemy engine on PostgreSQL (psycopg 3) or SQLite.
    :param resolver: logical broker name -> URL or :class:`Broker` (a mapping or a callable),
        used to reach other brokers named by routes (``broker://NAME``); names it does not know
        are looked up in the environment as ``AIRFLOW_BROKER_ADDRESS_<NAME>``.
    """

    # -- schema --------------------------------------------------------------------------------
    def migrate(self) -> None:
        """Create or upgrade the broker tables, then this broker's identity and system objects.

        Idempotent, and safe to run from several processes at once.
        """
        with self.engine.begin() as conn:
            migrate_on(conn)
        self.invalidate_definitions()

    # -- identity after a copy -----------------------------------------------------------------
    def identity_status(self) -> IdentityStatus:
        """Whether this database is still where its broker identity was recorded: ``.copied``
        is True for a restored, cloned or copied database, which refuses delivery to and from
        other brokers until :meth:`reset_identity`; ``.reason`` says so, naming the database
        and the commands."""
        return identity_status(self)

    def reset_identity(self, mode: str) -> IdentityReset:
        """Decide about a copy, in one transaction: ``"new_broker"`` (a new instance id; its
        conversations with other brokers end with an Error), ``"error_conversations"`` (keep
        the id, end every conversation with an Error) or ``"keep"`` (the same broker, moved:
        record where it is now). See :mod:`airflow_broker.operations.identity`."""
        return reset_identity(self, mode)

    # -- definitions ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def definitions(self) -> Iterator[Definitions]:
        """Several CREATE / ALTER / DROP in one transaction: all or nothing."""
        with define(self) as d:
            yield d

    def _define(self, verb: str, *args: Any, **kwargs: Any) -> None:
        with self.definitions() as d:
            getattr(d, verb)(*args, **kwargs)

    def create_message_type(
        self,
        name: str,
        validation: str = "none",
        json_schema: dict[str, Any] | None = None,
        xml_schema: str | None = None,
    ) -> None:
        """CREATE MESSAGE TYPE (see :meth:`Definitions.create_message_type`)."""
        self._define("create_message_type", name, validation, json_schema, xml_schema)

    def alter_message_type(
        self,
        name: str,
        *,
        validation: str,
        json_schema: dict[str, Any] | None = None,
        xml_schema: str | None = None,
    ) -> None:
        """ALTER MESSAGE TYPE (see :meth:`Definitions.alter_message_type`)."""
        self._define(
            "alter_message_type",
            name,
            validation=validation,
            json_schema=json_schema,
            xml_schema=xml_schema,
        )

    def create_contract(self, name: str, message_types: dict[str, str]) -> None:
        """CREATE CONTRACT (see :meth:`Definitions.create_contract`)."""
        self._define("create_contract", name, message_types)

    def create_queue(
        self,
        name: str,
        status: bool = True,
        retention: bool = False,
        poison_message_handling: bool = True,
        activation: Activation | dict[str, Any] | None = None,
        *,
        retry_delay: float | None = None,
        retry_delay_max: float | None = None,
        max_receives: int | None = None,
        dead_letter_queue: str | None = None,
    ) -> None:
        """CREATE QUEUE (see :meth:`Definitions.create_queue`, failure handling included)."""
        self._define(
            "create_queue",
            name,
            status,
            retention,
            poison_message_handling,
            activation,
            retry_delay=retry_delay,
            retry_delay_max=retry_delay_max,
            max_receives=max_receives,
            dead_letter_queue=dead_letter_queue,
        )

    def alter_queue(
        self,
        name: str,
        status: bool | None = None,
        retention: bool | None = None,
        poison_message_handling: bool | None = None,
        activation: Activation | dict[str, Any] | None = UNSET,
        *,
        retry_delay: float | Any | None = UNSET,
        retry_delay_max: float | Any | None = UNSET,
        max_receives: int | Any | None = UNSET,
        dead_letter_queue: str | Any | None = UNSET,
    ) -> None:
        """ALTER QUEUE (see :meth:`Definitions.alter_queue`; a failure-handling option given
        as None is turned off)."""
        self._define(
            "alter_queue",
            name,
            status,
            retention,
            poison_message_handling,
            activation,
            retry_delay=retry_delay,
            retry_delay_max=retry_delay_max,
            max_receives=max_receives,
            dead_letter_queue=dead_letter_queue,
        )

    def create_service(self, name: str, queue: str, contracts: Sequence[str] = ()) -> None:
        """CREATE SERVICE (see :meth:`Definitions.create_service`)."""
        self._define("create_service", name, queue, contracts)

    def alter_service(
        self,
        name: str,
        *,
        queue: str | None = None,
        add_contracts: Sequence[str] = (),
        drop_contracts: Sequence[str] = (),
    ) -> None:
        """ALTER SERVICE (see :meth:`Definitions.alter_service`): another queue, which the
        service's conversations and their messages move to; contracts added or dropped."""
        self._define(
            "alter_service",
            name,
            queue=queue,
            add_contracts=add_contracts,
            drop_contracts=drop_contracts,
        )

    def create_route(
        self,
        name: str,
        service_name: str | None = None,
        broker_instance: str | None = None,
        address: str = "LOCAL",
        mirror_address: str | None = None,
        lifetime_seconds: int | None = None,
    ) -> None:
        """CREATE ROUTE (see :meth:`Definitions.create_route`)."""
        self._define(
            "create_route",
            name,
            service_name,
            broker_instance,
            address,
            mirror_address,
            lifetime_seconds,
        )

    def alter_route(
        self,
        name: str,
        *,
        service_name: str | None = UNSET,
        broker_instance: str | None = UNSET,
        address: str = UNSET,
        mirror_address: str | None = UNSET,
        lifetime_seconds: int | None = UNSET,
    ) -> None:
        """ALTER ROUTE: only the arguments given change (see :meth:`Definitions.alter_route`)."""
        self._define(
            "alter_route",
            name,
            service_name=service_name,
            broker_instance=broker_instance,
            address=address,
            mirror_address=mirror_address,
            lifetime_seconds=lifetime_seconds,
        )

    def create_priority(
        self,
        name: str,
        contract: str | None = None,
        local_service: str | None = None,
        remote_service: str | None = None,
        priority: int = 5,
    ) -> None:
        """CREATE BROKER PRIORITY (see :meth:`Definitions.create_priority`)."""
        self._define("create_priority", name, contract, local_service, remote_service, priority)

    def alter_priority(
        self,
        name: str,
        *,
        contract: str | None = UNSET,
        local_service: str | None = UNSET,
        remote_service: str | None = UNSET,
        priority: int = UNSET,
    ) -> None:
        """ALTER BROKER PRIORITY: only the arguments given change (see
        :meth:`Definitions.alter_priority`)."""
        self._define(
            "alter_priority",
            name,
            contract=contract,
            local_service=local_service,
            remote_service=remote_service,
            priority=priority,
        )

    def drop_message_type(self, name: str) -> None:
        self._define("drop_message_type", name)

    def drop_contract(self, name: str) -> None:
        self._define("drop_contract", name)

    def drop_queue(self, name: str) -> None:
        self._define("drop_queue", name)

    def drop_service(self, name: str) -> None:
        """DROP SERVICE: its open conversations end WITH ERROR first, so that their far sides
        are told (see :meth:`Definitions.drop_service`)."""
        self._define("drop_service", name)

    def drop_route(self, name: str) -> None:
        self._define("drop_route", name)

    def drop_priority(self, name: str) -> None:
        self._define("drop_priority", name)

    # -- dialog security -----------------------------------------------------------------------
    def create_certificate(
        self,
        name: str,
        *,
        owner: str,
        subject: str | None = None,
        expires_at: datetime | None = None,
    ) -> CertificateRow:
        """CREATE CERTIFICATE for local service ``owner``: a key pair, its private key sealed
        under the master key (see :meth:`Definitions.create_certificate`)."""
        with self.definitions() as d:
            return d.create_certificate(name, owner=owner, subject=subject, expires_at=expires_at)

    def import_certificate(
        self, name: str, pem: str, *, owner: str, private_key_pem: str | bytes | None = None
    ) -> CertificateRow:
        """A certificate from PEM, speaking for ``owner`` (see
        :meth:`Definitions.import_certificate`)."""
        with self.definitions() as d:
            return d.import_certificate(name, pem, owner=owner, private_key_pem=private_key_pem)

    def drop_certificate(self, name: str) -> None:
        self._define("drop_certificate", name)

    def create_remote_service_binding(
        self, name: str, *, service: str, certificate: str, anonymous: bool = False
    ) -> None:
        """CREATE REMOTE SERVICE BINDING (see :meth:`Definitions.create_remote_service_binding`)."""
        self._define(
            "create_remote_service_binding",
            name,
            service=service,
            certificate=certificate,
            anonymous=anonymous,
        )

    def alter_remote_service_binding(
        self, name: str, *, certificate: str | None = None, anonymous: bool | None = None
    ) -> None:
        """ALTER REMOTE SERVICE BINDING: a renewed certificate, or anonymity."""
        self._define(
            "alter_remote_service_binding", name, certificate=certificate, anonymous=anonymous
        )

    def drop_remote_service_binding(self, name: str) -> None:
        self._define("drop_remote_service_binding", name)

    def certificates(self, expiring_within: timedelta | None = None) -> list[CertificateRow]:
        """Every certificate (never a private key), the one ending first first; with
        ``expiring_within``, only those ending within it (expired ones included)."""
        with self.read_connection() as conn:
            return certificate_store.certificates(conn, expiring_within=expiring_within)

    def export_certificate(self, name: str) -> str:
        """The public PEM of certificate ``name`` (never its private key): what the far broker
        imports with :meth:`import_certificate` (CLI: ``certificate export``)."""
        with self.read_connection() as conn:
            return certificate_store.certificate_pem(conn, name)

    # -- permissions (PostgreSQL; see airflow_broker.security.permissions) ----------------------
    def grant_send(self, service: str, role: str) -> None:
        """GRANT SEND ON SERVICE to a database role (see :meth:`Definitions.grant_send`)."""
        self._define("grant_send", service, role)

    def grant_receive(self, queue: str, role: str) -> None:
        """GRANT RECEIVE ON a queue to a database role (see :meth:`Definitions.grant_receive`)."""
        self._define("grant_receive", queue, role)

    def revoke_send(self, service: str, role: str) -> None:
        self._define("revoke_send", service, role)

    def revoke_receive(self, queue: str, role: str) -> None:
        self._define("revoke_receive", queue, role)

    def permissions(self) -> list[Permission]:
        """Every SEND and RECEIVE granted, by permission, object and role ([] on SQLite)."""
        with self.read_connection() as conn:
            return permission_store.permissions(conn)

    def configure(self, *, forwarding: bool | None = None, principal: bool | None = None) -> None:
        """Broker-wide settings (see :meth:`Definitions.configure`)."""
        self._define("configure", forwarding=forwarding, principal=principal)

    # -- between brokers -----------------------------------------------------------------------
    def deliver(
        self, max_messages: int | None = None, *, retry_now: bool = False
    ) -> DeliveryReport:
        """One delivery pass: move due messages of the transmission queue (and, on a forwarding
        broker, messages in transit) towards their destinations, local or in other broker
        databases. Returns what happened (:class:`DeliveryReport`).

        :param max_messages: stop after about this many messages (default: all that are due).
        :param retry_now: ignore the backoff of messages that failed before and try them now.
        """
        return Transport(self).deliver(max_messages, retry_now=retry_now)

    def grant_delivery(self, role: str) -> None:
        """Let database ``role`` deliver to this broker and nothing else: push batches into its
        inbox and collect their answers (PostgreSQL; see :mod:`airflow_broker.transport.inbox`).
        A peer or forwarder whose route to this broker connects as ``role`` delivers through
        the inbox, and this broker's own delivery pass accepts what it pushed."""
        inbox.grant_delivery(self, role)

    def revoke_delivery(self, role: str) -> None:
        inbox.revoke_delivery(self, role)

    def delivery_roles(self) -> list[str]:
        """Roles that may only deliver to this broker."""
        return inbox.delivery_roles(self)

    def resolve(self, address: str) -> Broker:
        """The broker a ``broker://NAME`` address names, through this broker's resolver."""
        peer = resolve(self, address)
        if not isinstance(peer, Broker):  # a resolver entry that is a bare BrokerContext
            peer = Broker(peer.engine, resolver=peer.resolver)
        return peer

    def in_transit(self) -> list[TransitRow]:
        """Messages this forwarding broker holds until their next hop can take them."""
        return in_transit(self)

    def create_routing_service(
        self,
        name: str,
        queue: str,
        classifier: Callable[[bytes | None], str | None] | str,
        mode: str = "forward",
    ) -> None:
        """Create a data-dependent routing service (seed 000): service ``name`` on ``queue``,
        open to every contract, classifying the first message of each inbound conversation.

        :param classifier: a callable ``body -> service name`` (importable, module level),
            ``"json:$.path"`` or ``"xpath:/message/toServiceName"``.
        :param mode: ``"forward"`` (begin an outbound dialog and relay both ways) or
            ``"redirect"`` (answer the initiator with the target service and end).
        """
        ddr.create_routing_service(self, name, queue, classifier, mode)

    def run_routing_service(self, name: str, max_messages: int | None = None) -> int:
        """One pass of the data-dependent routing service ``name`` over its queue; returns how
        many messages it handled."""
        return ddr.run_routing_service(self, name, max_messages)

    # -- messaging -----------------------------------------------------------------------------
    def transaction(self) -> Transaction:
        """A messaging transaction: ``with broker.transaction() as tx: ...``."""
        return Transaction(self)

    def send(
        self,
        handles: Handle | Sequence[Handle],
        message_type: str = DEFAULT,
        body: Any = None,
        *,
        dedupe_key: str | None = None,
    ) -> None:
        """SEND in a transaction of its own, committed when this returns (a SEND outside
        BEGIN TRANSACTION): :meth:`Transaction.send`'s arguments. On PostgreSQL one round trip
        when the fast path takes every conversation (:func:`fast_send.send_committed`)."""
        if dedupe_key is None and fast_send.send_committed(self, handles, message_type, body):
            return
        with Transaction(self) as tx:
            tx.send(handles, message_type, body, dedupe_key=dedupe_key)

    def lease(
        self,
        queue: str,
        *,
        lease_seconds: float,
        top: int | None = None,
        wait_seconds: float = 0,
        conversation_group_id: Handle | None = None,
    ) -> Lease | None:
        """Take the next free conversation group's messages (up to ``top``) for a long handler
        and commit at once: the group stays held, with no open transaction, until
        ``tx.complete(lease.token)`` in a later transaction, :meth:`release`, or
        ``lease_seconds`` pass (the messages are then ready again, a failed attempt). None when
        nothing is ready within ``wait_seconds``. See :mod:`airflow_broker.messaging.leases`."""
        with self.transaction() as tx:
            return leases.take_lease(
                tx,
                queue,
                lease_seconds=lease_seconds,
                top=top,
                wait_seconds=wait_seconds,
                conversation_group_id=conversation_group_id,
            )

    def release(self, token: Handle, delay: float = 0) -> None:
        """Give a lease's messages back, ready again after ``delay`` seconds (a failed attempt).

        :raises LeaseExpired: the lease is no longer held."""
        leases.release(self, token, delay)

    def extend(self, token: Handle, seconds: float) -> datetime:
        """Hold a lease until ``seconds`` from now; returns its new expiry.

        :raises LeaseExpired: the lease is no longer held."""
        return leases.extend(self, token, seconds)

    def run_due(self) -> DueReport:
        """Fire due conversation timers, expire lifetimes, count the rollbacks of readers that
        died holding messages, retry waiting local transmissions and purge old closed endpoints.

        RECEIVE does this too as it polls; call this from a scheduler or the activation monitor
        so that timers fire on queues nobody is reading."""
        return run_due(self)

    def purge(
        self, retention: housekeeping.Retention | None = None, *, now: datetime | None = None
    ) -> housekeeping.PurgeReport:
        """Remove events, queue depth samples and closed endpoints older than ``retention``
        (defaults: 30 days, 7 days, 30 minutes); see :mod:`airflow_broker.operations.housekeeping`.
        The transmitter runs this in Airflow; ``airflow-broker purge`` from the shell."""
        return housekeeping.purge(self, retention, now=now)

    # -- consistency ---------------------------------------------------------------------------
    def check(self, repair: bool = False) -> list[Problem]:
        """A consistency check of this broker database (fsck for the broker): every impossible
        state found, as :class:`~airflow_broker.operations.check.Problem` (kind, object,
        detail); an empty list means consistent. Read-only but for one event recording the
        outcome. With ``repair``, what can be fixed without losing a message is fixed (see
        :data:`~airflow_broker.operations.check.REPAIRS`) and reported ``repaired=True``."""
        return consistency.check(self, repair=repair)

    # -- observation ---------------------------------------------------------------------------
    def catalog(self) -> Catalog:
        """Every object declared in this broker."""
        return observation.catalog(self)

    def queue_status(self) -> list[QueueStatus]:
        """Depth, oldest message and health of every queue, by name."""
        return observation.queue_status(self)

    def transmission_summary(self) -> list[TransmissionSummary]:
        """The transmission queue counted by target service and reason, most messages first."""
        return observation.transmission_summary(self)

    def transmission_queue(self, limit: int | None = None) -> list[TransmissionRow]:
        """Messages waiting to leave, oldest first, each with why it has not gone yet."""
        return observation.transmission_queue(self, limit)

    def events(self, limit: int = 100) -> list[BrokerEvent]:
        """The most recent things the broker did on its own, newest first."""
        return observation.events(self, limit)

    def peek(
        self,
        queue: str,
        *,
        top: int = 20,
        conversation_handle: uuid.UUID | str | None = None,
        offset: int = 0,
    ) -> list[Message]:
        """The messages waiting in ``queue``, without receiving or locking anything: ``top``
        of them from ``offset`` on, in the order RECEIVE would take them (priority, then
        arrival; one conversation's in sequence order). Each ``receive_count`` is how many
        times the message has been handed out so far (0 if never). See
        :func:`airflow_broker.operations.observation.peek`."""
        return observation.peek(
            self, queue, top=top, conversation_handle=conversation_handle, offset=offset
        )


__all__ = ["Broker", "Definitions", "DueReport", "Resolver", "Transaction", "migrate_on"]
