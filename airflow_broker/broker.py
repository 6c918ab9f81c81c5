"""The broker: object definitions, dialogs, SEND / RECEIVE / END CONVERSATION, due work.

:class:`Broker` is one broker database (one Service Broker instance). Definitions (message types,
contracts, queues, services, routes, priorities) each run in a transaction of their own, or
several in one through :meth:`Broker.definitions`. Messaging runs inside a
:class:`Transaction`, which commits on leaving its ``with`` block and rolls back on an exception:
messages received in a transaction that rolls back go back on their queue, and the rollback
counts towards poison-message handling.

Everything here is plain SQLAlchemy Core and runs without Airflow.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import (
    create_engine,
    func,
    insert,
    make_url,
    select,
    text,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.pool import StaticPool

from airflow_broker import dynamic
from airflow_broker import schema as s
from airflow_broker.activation import Activation
from airflow_broker.arguments import UNSET
from airflow_broker.constants import (
    AUTO_CREATED_LOCAL,
    DEFAULT,
    STATUS_READY,
)
from airflow_broker.definitions import Definitions
from airflow_broker.duework import DueReport, DueWork
from airflow_broker.engines import PostgresAdapter, SqliteAdapter, adapter_for, aware, utcnow
from airflow_broker.errors import (
    BrokerError,
    InvalidDefinition,
)
from airflow_broker.objects import (
    BrokerEvent,
    Catalog,
    ContractDef,
    MessageTypeDef,
    PriorityDef,
    QueueDef,
    QueueStatus,
    RouteDef,
    ServiceDef,
    TransitRow,
    TransmissionRow,
    TransmissionSummary,
)
from airflow_broker.transaction import Transaction
from airflow_broker.transport import DeliveryReport

log = logging.getLogger("airflow_broker")

T = TypeVar("T")

#: Turns the NAME of a route address ``broker://NAME`` into a URL or a Broker: a mapping, or a
#: callable returning None for names it does not know (then AIRFLOW_BROKER_ADDRESS_<NAME>).
Resolver = Mapping[str, "str | Broker"] | Callable[[str], "str | Broker | None"]

#: How long cached definitions (contract rules, priorities) may be used before re-reading.
DEFINITION_CACHE_SECONDS = 1.0

# ---------------------------------------------------------------------------------------------
# Broker
# ---------------------------------------------------------------------------------------------


def _insert_missing(conn: Connection, key: Any, value: Any, **values: Any) -> bool:
    """Insert the row whose ``key`` column is ``value`` unless it exists; True if inserted."""
    if conn.execute(select(key).where(key == value)).first() is not None:
        return False
    conn.execute(insert(key.table).values({key.name: value, **values}))
    return True


def migrate_on(conn: Connection) -> None:
    """Create or upgrade the broker tables on ``conn``, inside its transaction, then insert the
    broker's identity and system objects that are missing. :meth:`Broker.migrate` runs this on
    a connection of its own; Airflow's DB manager on the metadata database's session."""
    from alembic import command

    from airflow_broker.migrations import alembic_config

    if conn.dialect.name == "postgresql":
        # Serialize concurrent migrations of this database (a key of our own).
        conn.execute(text("SELECT pg_advisory_xact_lock(727170000, 1)"))
    command.upgrade(alembic_config(conn), "head")
    now = utcnow()
    _insert_missing(
        conn,
        s.broker_instance.c.id,
        1,
        instance_id=str(uuid.uuid4()),
        forwarding=False,
        created_at=now,
    )
    # The system contracts: DEFAULT, and dynamic routing's MissingRoute notice.
    for contract, message_type, sent_by in (
        (DEFAULT, DEFAULT, "any"),
        (dynamic.BROKER_CONFIGURATION_NOTICE, dynamic.MISSING_ROUTE, "initiator"),
    ):
        _insert_missing(
            conn, s.message_type.c.name, message_type, validation="none", created_at=now
        )
        if _insert_missing(conn, s.contract.c.name, contract, created_at=now):
            conn.execute(
                insert(s.contract_message).values(
                    contract_name=contract, message_type_name=message_type, sent_by=sent_by
                )
            )
    _insert_missing(conn, s.route.c.name, AUTO_CREATED_LOCAL, address="LOCAL", created_at=now)


class Broker:
    """One broker database: the catalog of broker objects and the conversations in it.

    :param engine: a SQLAlchemy engine on PostgreSQL (psycopg 3) or SQLite.
    :param resolver: logical broker name -> URL or :class:`Broker` (a mapping or a callable),
        used to reach other brokers named by routes (``broker://NAME``); names it does not know
        are looked up in the environment as ``AIRFLOW_BROKER_ADDRESS_<NAME>``.
    """

    def __init__(self, engine: Engine, *, resolver: Resolver | None = None) -> None:
        self.engine = engine
        self.dialect: str = engine.dialect.name
        self.adapter: PostgresAdapter | SqliteAdapter = adapter_for(engine)
        #: logical broker name -> URL or Broker (a mapping or a callable); see transport.resolve
        self.resolver: Resolver | None = resolver
        self._instance_id: str | None = None
        self._cache: dict[Any, tuple[float, Any]] = {}
        self._cache_lock = threading.Lock()
        #: monotonic time of the next due-work step RECEIVE should take (see Transaction)
        self.next_due_work = 0.0
        #: monotonic time of this process's next queue-depth sampling look (see sampling)
        self.next_depth_sample = 0.0

    @classmethod
    def connect(cls, url: str, *, resolver: Resolver | None = None, **engine_kwargs: Any) -> Broker:
        """Open the broker database at ``url`` (``sqlite:///broker.db``,
        ``postgresql+psycopg://user@host/db``; ``postgresql://`` means psycopg 3)."""
        parsed = make_url(url)
        if parsed.drivername in ("postgresql", "postgres"):
            parsed = parsed.set(drivername="postgresql+psycopg")
        if parsed.get_backend_name() == "sqlite":
            if parsed.database in (None, "", ":memory:"):
                engine_kwargs.setdefault("poolclass", StaticPool)
                engine_kwargs.setdefault("connect_args", {"check_same_thread": False})
            else:
                engine_kwargs.setdefault("pool_size", 8)
                engine_kwargs.setdefault("max_overflow", 16)
        else:
            engine_kwargs.setdefault("pool_size", 5)
            engine_kwargs.setdefault("max_overflow", 10)
        return cls(create_engine(parsed, **engine_kwargs), resolver=resolver)

    def __repr__(self) -> str:
        return f"Broker({self.engine.url.render_as_string(hide_password=True)!r})"

    def dispose(self) -> None:
        """Close every connection this broker holds."""
        self.adapter.dispose()
        self.engine.dispose()

    # -- schema --------------------------------------------------------------------------------
    def migrate(self) -> None:
        """Create or upgrade the broker tables, then this broker's identity and system objects.

        Idempotent, and safe to run from several processes at once.
        """
        with self.engine.begin() as conn:
            migrate_on(conn)
        self.invalidate_definitions()

    @property
    def instance_id(self) -> str:
        """This broker database's id (a UUID string), stable for the life of the database."""
        if self._instance_id is None:
            with self.engine.connect() as conn:
                self.instance_id_on(conn)
        assert self._instance_id is not None
        return self._instance_id

    def instance_id_on(self, conn: Connection) -> str:
        """The instance id, read on ``conn`` the first time (inside a SQLite write transaction a
        second connection would wait for this one's lock)."""
        if self._instance_id is None:
            try:
                value = conn.execute(select(s.broker_instance.c.instance_id)).scalar()
            except (OperationalError, ProgrammingError) as exc:
                if "broker_instance" not in str(exc.orig):
                    raise
                raise BrokerError(
                    f"{self!r} has no broker tables: run Broker.migrate() "
                    "(or `airflow-broker migrate`)"
                ) from exc
            if value is None:
                raise BrokerError(f"{self!r} is not migrated: run Broker.migrate()")
            self._instance_id = str(value)
        return self._instance_id

    # -- definitions ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def definitions(self) -> Iterator[Definitions]:
        """Several CREATE / ALTER / DROP in one transaction: all or nothing."""
        try:
            with self.engine.begin() as conn:
                yield Definitions(self, conn)
        except IntegrityError as exc:
            raise InvalidDefinition(f"definition refused by the database: {exc.orig}") from exc
        finally:
            self.invalidate_definitions()

    def _define(self, verb: str, *args: Any, **kwargs: Any) -> None:
        with self.definitions() as d:
            getattr(d, verb)(*args, **kwargs)

    def create_message_type(
        self, name: str, validation: str = "none", json_schema: dict[str, Any] | None = None
    ) -> None:
        """CREATE MESSAGE TYPE (see :meth:`Definitions.create_message_type`)."""
        self._define("create_message_type", name, validation, json_schema)

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
    ) -> None:
        """CREATE QUEUE (see :meth:`Definitions.create_queue`)."""
        self._define("create_queue", name, status, retention, poison_message_handling, activation)

    def alter_queue(
        self,
        name: str,
        status: bool | None = None,
        retention: bool | None = None,
        poison_message_handling: bool | None = None,
        activation: Activation | dict[str, Any] | None = UNSET,
    ) -> None:
        """ALTER QUEUE (see :meth:`Definitions.alter_queue`)."""
        self._define("alter_queue", name, status, retention, poison_message_handling, activation)

    def create_service(self, name: str, queue: str, contracts: Sequence[str] = ()) -> None:
        """CREATE SERVICE (see :meth:`Definitions.create_service`)."""
        self._define("create_service", name, queue, contracts)

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

    def drop_message_type(self, name: str) -> None:
        self._define("drop_message_type", name)

    def drop_contract(self, name: str) -> None:
        self._define("drop_contract", name)

    def drop_queue(self, name: str) -> None:
        self._define("drop_queue", name)

    def drop_service(self, name: str) -> None:
        self._define("drop_service", name)

    def drop_route(self, name: str) -> None:
        self._define("drop_route", name)

    def drop_priority(self, name: str) -> None:
        self._define("drop_priority", name)

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
        from airflow_broker.transport import Transport

        return Transport(self).deliver(max_messages, retry_now=retry_now)

    def resolve(self, address: str) -> Broker:
        """The broker a ``broker://NAME`` address names, through this broker's resolver."""
        from airflow_broker.transport import resolve

        return resolve(self, address)

    def in_transit(self) -> list[TransitRow]:
        """Messages this forwarding broker holds until their next hop can take them."""
        from airflow_broker.transport import in_transit

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
        from airflow_broker import ddr

        ddr.create_routing_service(self, name, queue, classifier, mode)

    def run_routing_service(self, name: str, max_messages: int | None = None) -> int:
        """One pass of the data-dependent routing service ``name`` over its queue; returns how
        many messages it handled."""
        from airflow_broker import ddr

        return ddr.run_routing_service(self, name, max_messages)

    # -- messaging -----------------------------------------------------------------------------
    def transaction(self) -> Transaction:
        """A messaging transaction: ``with broker.transaction() as tx: ...``."""
        return Transaction(self)

    def run_due(self) -> DueReport:
        """Fire due conversation timers, expire lifetimes, count the rollbacks of readers that
        died holding messages, retry waiting local transmissions and purge old closed endpoints.

        RECEIVE does this too as it polls; call this from a scheduler or the activation monitor
        so that timers fire on queues nobody is reading."""
        with self.engine.begin() as conn:
            work = DueWork(self, conn)
            report = work.run(utcnow(), purge=True)
        if work.next_due is not None:
            self.note_due(work.next_due)
        return report

    def note_due(self, at: datetime) -> None:
        """Something falls due at ``at`` (a timer, a lifetime, a retry): make sure RECEIVE's
        due-work step in this process runs by then."""
        delay = max((at - utcnow()).total_seconds(), 0.0)
        self.next_due_work = min(self.next_due_work, time.monotonic() + delay)

    # -- observation ---------------------------------------------------------------------------
    def catalog(self) -> Catalog:
        """Every object declared in this broker."""
        with self.engine.connect() as conn:
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
                    r.name: ServiceDef(
                        r.name, qnames[r.queue_id], tuple(svc_contracts.get(r.name, ()))
                    )
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

    def queue_status(self) -> list[QueueStatus]:
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
        with self.engine.connect() as conn:
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

    def transmission_summary(self) -> list[TransmissionSummary]:
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
        with self.engine.connect() as conn:
            return [
                TransmissionSummary(
                    r.to_service_name,
                    r.transmission_status,
                    r.n,
                    aware(r.oldest),  # type: ignore[arg-type]
                )
                for r in conn.execute(stmt)
            ]

    def transmission_queue(self, limit: int | None = None) -> list[TransmissionRow]:
        """Messages waiting to leave, oldest first, each with why it has not gone yet."""
        t = s.transmission_queue
        stmt = select(t).order_by(t.c.id)
        if limit is not None:
            stmt = stmt.limit(limit)
        with self.engine.connect() as conn:
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

    def events(self, limit: int = 100) -> list[BrokerEvent]:
        """The most recent things the broker did on its own, newest first."""
        e = s.event
        with self.engine.connect() as conn:
            return [
                BrokerEvent(r.id, aware(r.occurred_at), r.event, r.object_name, r.detail)  # type: ignore[arg-type]
                for r in conn.execute(select(e).order_by(e.c.id.desc()).limit(limit))
            ]

    # -- internals -----------------------------------------------------------------------------
    def invalidate_definitions(self) -> None:
        """Forget cached definitions (done after every definition change through this Broker)."""
        with self._cache_lock:
            self._cache.clear()

    def cached_definition(self, key: Any, load: Callable[[], T]) -> T:
        now = time.monotonic()
        with self._cache_lock:
            hit = self._cache.get(key)
        if hit is not None and now - hit[0] < DEFINITION_CACHE_SECONDS:
            return hit[1]
        value = load()
        with self._cache_lock:
            self._cache[key] = (now, value)
        return value


__all__ = ["Broker", "Definitions", "DueReport", "Transaction", "migrate_on"]
