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
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, TypeVar

from sqlalchemy import (
    Row,
    create_engine,
    delete,
    exists,
    func,
    insert,
    make_url,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.pool import StaticPool

from airflow_broker import queries
from airflow_broker import schema as s
from airflow_broker.activation import Activation
from airflow_broker.constants import (
    AUTO_CREATED_LOCAL,
    DEFAULT,
    DIALOG_TIMER,
    END_DIALOG,
    ERR_CONTRACT_NOT_SUPPORTED,
    ERR_LIFETIME_EXPIRED,
    ERR_SERVICE_NOT_FOUND,
    ERROR,
    POISON_THRESHOLD,
    PRECEDENCE_ERROR,
    PRECEDENCE_NORMAL,
    PRECEDENCE_TIMER,
    SENDABLE_STATES,
    SENT_BY,
    STATUS_READY,
    STATUS_RETAINED_SENT,
    SYSTEM_MESSAGE_TYPES,
)
from airflow_broker.engines import Lease, PostgresAdapter, SqliteAdapter, adapter_for, utcnow
from airflow_broker.errors import (
    BrokerError,
    ContractViolation,
    ConversationEnded,
    InvalidDefinition,
    ObjectExists,
    QueueDisabled,
    UnknownObject,
)
from airflow_broker.objects import (
    BrokerEvent,
    Catalog,
    ContractDef,
    ConversationEndpoint,
    Message,
    MessageTypeDef,
    PriorityDef,
    QueueDef,
    QueueStatus,
    RouteDef,
    ServiceDef,
    TransmissionRow,
    error_body,
)
from airflow_broker.validation import (
    VALIDATION_CODES,
    check_definition,
    encode_body,
    validate_body,
)

log = logging.getLogger("airflow_broker")

T = TypeVar("T")
_UNSET: Any = object()

#: How often (at most) RECEIVE runs the due-work step itself, per Broker object.
DUE_WORK_INTERVAL = 0.1
#: How long cached definitions (contract rules, priorities) may be used before re-reading.
DEFINITION_CACHE_SECONDS = 1.0
#: Longest single sleep of a waiting RECEIVE: bounds how late a due timer is noticed.
MAX_WAIT_SLICE = 0.5
#: Closed endpoints are kept this long (duplicate detection, as Service Broker does), then purged.
CLOSED_ENDPOINT_RETENTION = timedelta(minutes=30)
#: First retry delay of a transmission that could not go; doubles per attempt up to the cap.
RETRY_BASE = timedelta(seconds=1)
RETRY_CAP = timedelta(seconds=60)

Handle = uuid.UUID | str


def _uuid(value: Any, what: str) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except (ValueError, AttributeError, TypeError):
        raise InvalidDefinition(f"{what} {value!r} is not a UUID") from None


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidDefinition(f"{what} name must be a non-empty string, not {value!r}")
    if len(value) > 256:
        raise InvalidDefinition(f"{what} name {value[:40]!r}... is longer than 256 characters")
    return value


def _precedence(message_type: str) -> int:
    if message_type == DIALOG_TIMER:
        return PRECEDENCE_TIMER
    if message_type == ERROR:
        return PRECEDENCE_ERROR
    return PRECEDENCE_NORMAL


@dataclass(frozen=True, slots=True)
class DueReport:
    """What one pass of :meth:`Broker.run_due` did."""

    timers_fired: int = 0
    lifetimes_expired: int = 0
    rollbacks_counted: int = 0
    queues_disabled: int = 0
    transmissions_delivered: int = 0
    endpoints_purged: int = 0


# ---------------------------------------------------------------------------------------------
# Definitions
# ---------------------------------------------------------------------------------------------


class Definitions:
    """CREATE / ALTER / DROP of broker objects, all inside one transaction.

    Obtained from :meth:`Broker.definitions`; the same verbs on :class:`Broker` each run in a
    transaction of their own.
    """

    def __init__(self, broker: Broker, conn: Connection) -> None:
        self._broker = broker
        self._conn = conn

    # -- helpers -------------------------------------------------------------------------------
    def _exists(self, table: Any, column: Any, value: Any) -> bool:
        return self._conn.execute(select(column).where(column == value)).first() is not None

    def _require(self, table: Any, column: Any, value: str, what: str) -> None:
        if not self._exists(table, column, value):
            raise UnknownObject(f"{what} {value!r} does not exist in this broker")

    def _refuse_existing(self, table: Any, column: Any, value: str, what: str) -> None:
        if self._exists(table, column, value):
            raise ObjectExists(f"{what} {value!r} already exists")

    def _queue_row(self, name: str) -> Row[Any]:
        row = self._conn.execute(select(s.queue).where(s.queue.c.name == name)).first()
        if row is None:
            raise UnknownObject(f"queue {name!r} does not exist in this broker")
        return row

    # -- message types -------------------------------------------------------------------------
    def create_message_type(
        self, name: str, validation: str = "none", json_schema: dict[str, Any] | None = None
    ) -> None:
        """CREATE MESSAGE TYPE. ``validation``: none, empty, json, json_schema, well_formed_xml."""
        _name(name, "message type")
        if name in SYSTEM_MESSAGE_TYPES:
            raise InvalidDefinition(f"message type {name!r} is a system message type")
        check_definition(name, validation, json_schema)
        self._refuse_existing(s.message_type, s.message_type.c.name, name, "message type")
        self._conn.execute(
            insert(s.message_type).values(
                name=name, validation=validation, json_schema=json_schema, created_at=utcnow()
            )
        )

    def drop_message_type(self, name: str) -> None:
        self._require(s.message_type, s.message_type.c.name, name, "message type")
        if name == DEFAULT:
            raise InvalidDefinition(
                f"message type {DEFAULT!r} is a system object and cannot be dropped"
            )
        users = (
            self._conn.execute(
                select(s.contract_message.c.contract_name).where(
                    s.contract_message.c.message_type_name == name
                )
            )
            .scalars()
            .all()
        )
        if users:
            raise InvalidDefinition(
                f"message type {name!r} is used by contract(s) {', '.join(sorted(users))}; "
                "drop those first"
            )
        self._conn.execute(delete(s.message_type).where(s.message_type.c.name == name))

    # -- contracts -----------------------------------------------------------------------------
    def create_contract(self, name: str, message_types: dict[str, str]) -> None:
        """CREATE CONTRACT: ``{message_type: "initiator" | "target" | "any"}``."""
        _name(name, "contract")
        if not isinstance(message_types, dict) or not message_types:
            raise InvalidDefinition(
                f"contract {name!r} needs at least one message type, as "
                "{message_type: 'initiator' | 'target' | 'any'}"
            )
        for mt, sent_by in message_types.items():
            if sent_by not in SENT_BY:
                raise InvalidDefinition(
                    f"contract {name!r}: message type {mt!r} is sent by {sent_by!r}; "
                    f"expected one of {', '.join(SENT_BY)}"
                )
            if mt in SYSTEM_MESSAGE_TYPES:
                raise InvalidDefinition(
                    f"contract {name!r}: system message type {mt!r} cannot be part of a contract"
                )
        if not any(v in ("initiator", "any") for v in message_types.values()):
            raise InvalidDefinition(
                f"contract {name!r} has no message type the initiator may send, so no dialog "
                "could ever start on it"
            )
        self._refuse_existing(s.contract, s.contract.c.name, name, "contract")
        known = set(
            self._conn.execute(
                select(s.message_type.c.name).where(s.message_type.c.name.in_(list(message_types)))
            ).scalars()
        )
        missing = sorted(set(message_types) - known)
        if missing:
            raise UnknownObject(
                f"contract {name!r} names message type(s) that do not exist: {', '.join(missing)}"
            )
        self._conn.execute(insert(s.contract).values(name=name, created_at=utcnow()))
        self._conn.execute(
            insert(s.contract_message),
            [
                {"contract_name": name, "message_type_name": mt, "sent_by": sent_by}
                for mt, sent_by in message_types.items()
            ],
        )

    def drop_contract(self, name: str) -> None:
        self._require(s.contract, s.contract.c.name, name, "contract")
        if name == DEFAULT:
            raise InvalidDefinition(
                f"contract {DEFAULT!r} is a system object and cannot be dropped"
            )
        users = (
            self._conn.execute(
                select(s.service_contract.c.service_name).where(
                    s.service_contract.c.contract_name == name
                )
            )
            .scalars()
            .all()
        )
        if users:
            raise InvalidDefinition(
                f"contract {name!r} is used by service(s) {', '.join(sorted(users))}; "
                "drop or alter those first"
            )
        self._conn.execute(delete(s.contract).where(s.contract.c.name == name))

    # -- queues --------------------------------------------------------------------------------
    def create_queue(
        self,
        name: str,
        status: bool = True,
        retention: bool = False,
        poison_message_handling: bool = True,
        activation: Activation | dict[str, Any] | None = None,
    ) -> None:
        """CREATE QUEUE."""
        _name(name, "queue")
        for flag, value in (
            ("status", status),
            ("retention", retention),
            ("poison_message_handling", poison_message_handling),
        ):
            if not isinstance(value, bool):
                raise InvalidDefinition(
                    f"queue {name!r}: {flag} must be True or False, not {value!r}"
                )
        act = Activation.from_value(activation)
        self._refuse_existing(s.queue, s.queue.c.name, name, "queue")
        now = utcnow()
        self._conn.execute(
            insert(s.queue).values(
                name=name,
                status=status,
                retention=retention,
                poison_message_handling=poison_message_handling,
                activation=act.to_dict() if act else None,
                rollback_count=0,
                created_at=now,
                modified_at=now,
            )
        )

    def alter_queue(
        self,
        name: str,
        status: bool | None = None,
        retention: bool | None = None,
        poison_message_handling: bool | None = None,
        activation: Activation | dict[str, Any] | None = _UNSET,
    ) -> None:
        """ALTER QUEUE. Re-enabling a queue (``status=True``) also resets its rollback count
        and lets messages that waited for it in the transmission queue go on the next due pass."""
        row = self._queue_row(name)
        values: dict[str, Any] = {"modified_at": utcnow()}
        for flag, value in (
            ("status", status),
            ("retention", retention),
            ("poison_message_handling", poison_message_handling),
        ):
            if value is not None:
                if not isinstance(value, bool):
                    raise InvalidDefinition(
                        f"queue {name!r}: {flag} must be True or False, not {value!r}"
                    )
                values[flag] = value
        if activation is not _UNSET:
            act = Activation.from_value(activation)
            values["activation"] = act.to_dict() if act else None
        if status is True:
            values["rollback_count"] = 0
        self._conn.execute(
            update(s.queue).where(s.queue.c.queue_id == row.queue_id).values(**values)
        )
        if status is True and not row.status:
            self._broker._event(
                self._conn, "queue_enabled", name, "queue re-enabled by ALTER QUEUE"
            )
            self._conn.execute(
                update(s.transmission_queue)
                .where(
                    s.transmission_queue.c.to_service_name.in_(
                        select(s.service.c.name).where(s.service.c.queue_id == row.queue_id)
                    )
                )
                .values(next_attempt_at=values["modified_at"])
            )
            log.info("queue %r re-enabled", name)
        elif status is False and row.status:
            self._broker._event(self._conn, "queue_disabled", name, "queue disabled by ALTER QUEUE")

    def drop_queue(self, name: str) -> None:
        row = self._queue_row(name)
        users = (
            self._conn.execute(select(s.service.c.name).where(s.service.c.queue_id == row.queue_id))
            .scalars()
            .all()
        )
        if users:
            raise InvalidDefinition(
                f"queue {name!r} is used by service(s) {', '.join(sorted(users))}; drop those first"
            )
        self._conn.execute(delete(s.queue).where(s.queue.c.queue_id == row.queue_id))

    # -- services ------------------------------------------------------------------------------
    def create_service(self, name: str, queue: str, contracts: Sequence[str] = ()) -> None:
        """CREATE SERVICE on ``queue``; ``contracts`` are those it accepts as a target."""
        _name(name, "service")
        if isinstance(contracts, str):
            contracts = [contracts]
        self._refuse_existing(s.service, s.service.c.name, name, "service")
        qrow = self._queue_row(queue)
        wanted = list(dict.fromkeys(contracts))
        known = set(
            self._conn.execute(
                select(s.contract.c.name).where(s.contract.c.name.in_(wanted))
            ).scalars()
        )
        missing = [c for c in wanted if c not in known]
        if missing:
            raise UnknownObject(
                f"service {name!r} names contract(s) that do not exist: {', '.join(missing)}"
            )
        self._conn.execute(
            insert(s.service).values(name=name, queue_id=qrow.queue_id, created_at=utcnow())
        )
        if wanted:
            self._conn.execute(
                insert(s.service_contract),
                [{"service_name": name, "contract_name": c} for c in wanted],
            )

    def drop_service(self, name: str) -> None:
        """DROP SERVICE: its conversations go with it, as in Service Broker."""
        self._require(s.service, s.service.c.name, name, "service")
        self._conn.execute(
            delete(s.conversation_endpoint).where(s.conversation_endpoint.c.service_name == name)
        )
        self._conn.execute(delete(s.service).where(s.service.c.name == name))

    # -- routes --------------------------------------------------------------------------------
    def create_route(
        self,
        name: str,
        service_name: str | None = None,
        broker_instance: str | None = None,
        address: str = "LOCAL",
        mirror_address: str | None = None,
        lifetime_seconds: int | None = None,
    ) -> None:
        """CREATE ROUTE. ``address``: ``LOCAL``, ``TRANSPORT`` or ``broker://NAME`` (a logical
        broker name, resolved to a connection when delivering; no credentials here)."""
        _name(name, "route")
        if service_name is not None:
            _name(service_name, "route service")
        if broker_instance is not None:
            _uuid(broker_instance, f"route {name!r}: broker_instance")
            broker_instance = str(uuid.UUID(str(broker_instance)))
        _check_address(name, address, "address")
        if mirror_address is not None:
            _check_address(name, mirror_address, "mirror_address")
            if not address.startswith("broker://") or not mirror_address.startswith("broker://"):
                raise InvalidDefinition(
                    f"route {name!r}: a mirror_address goes with a broker:// address only"
                )
            if broker_instance is None:
                raise InvalidDefinition(f"route {name!r}: a mirror_address needs broker_instance")
        expires_at = None
        if lifetime_seconds is not None:
            if not isinstance(lifetime_seconds, int) or lifetime_seconds <= 0:
                raise InvalidDefinition(
                    f"route {name!r}: lifetime_seconds must be a positive whole number"
                )
            expires_at = utcnow() + timedelta(seconds=lifetime_seconds)
        self._refuse_existing(s.route, s.route.c.name, name, "route")
        self._conn.execute(
            insert(s.route).values(
                name=name,
                service_name=service_name,
                broker_instance=broker_instance,
                address=address,
                mirror_address=mirror_address,
                expires_at=expires_at,
                created_at=utcnow(),
            )
        )

    def drop_route(self, name: str) -> None:
        self._require(s.route, s.route.c.name, name, "route")
        self._conn.execute(delete(s.route).where(s.route.c.name == name))

    # -- priorities ----------------------------------------------------------------------------
    def create_priority(
        self,
        name: str,
        contract: str | None = None,
        local_service: str | None = None,
        remote_service: str | None = None,
        priority: int = 5,
    ) -> None:
        """CREATE BROKER PRIORITY: conversations matching get ``priority`` (1-10, default 5)."""
        _name(name, "priority")
        if not isinstance(priority, int) or isinstance(priority, bool) or not 1 <= priority <= 10:
            raise InvalidDefinition(f"priority {name!r}: priority must be 1..10, not {priority!r}")
        if contract is not None:
            self._require(s.contract, s.contract.c.name, contract, "contract")
        if local_service is not None:
            self._require(s.service, s.service.c.name, local_service, "service")
        self._refuse_existing(s.priority, s.priority.c.name, name, "priority")
        self._conn.execute(
            insert(s.priority).values(
                name=name,
                contract_name=contract,
                local_service=local_service,
                remote_service=remote_service,
                priority=priority,
            )
        )

    def drop_priority(self, name: str) -> None:
        self._require(s.priority, s.priority.c.name, name, "priority")
        self._conn.execute(delete(s.priority).where(s.priority.c.name == name))

    # -- settings ------------------------------------------------------------------------------
    def configure(self, *, forwarding: bool | None = None) -> None:
        """Broker-wide settings (``forwarding``: pass on messages for services not hosted here)."""
        if forwarding is not None:
            self._conn.execute(update(s.broker_instance).values(forwarding=bool(forwarding)))


def _check_address(route: str, address: Any, what: str) -> None:
    if not isinstance(address, str) or not (
        address in ("LOCAL", "TRANSPORT")
        or (address.startswith("broker://") and len(address) > len("broker://"))
    ):
        raise InvalidDefinition(
            f"route {route!r}: {what} {address!r} must be LOCAL, TRANSPORT or broker://NAME"
        )


# ---------------------------------------------------------------------------------------------
# Broker
# ---------------------------------------------------------------------------------------------


class Broker:
    """One broker database: the catalog of broker objects and the conversations in it.

    :param engine: a SQLAlchemy engine on PostgreSQL (psycopg 3) or SQLite.
    :param resolver: logical broker name -> URL or :class:`Broker`, used to reach other brokers
        named by routes (``broker://NAME``).
    """

    def __init__(self, engine: Engine, *, resolver: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.dialect: str = engine.dialect.name
        self.adapter: PostgresAdapter | SqliteAdapter = adapter_for(engine)
        self.resolver = dict(resolver or {})
        self._instance_id: str | None = None
        self._cache: dict[Any, tuple[float, Any]] = {}
        self._cache_lock = threading.Lock()
        self._last_due = 0.0

    @classmethod
    def connect(
        cls, url: str, *, resolver: dict[str, Any] | None = None, **engine_kwargs: Any
    ) -> Broker:
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
            engine_kwargs.setdefault("pool_pre_ping", True)
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
        from alembic import command

        from airflow_broker.migrations import alembic_config

        with self.engine.begin() as conn:
            if self.dialect == "postgresql":
                # Serialize concurrent migrations of this database (a key of our own).
                conn.execute(text("SELECT pg_advisory_xact_lock(727170000, 1)"))
            command.upgrade(alembic_config(conn), "head")
            now = utcnow()
            if conn.execute(select(s.broker_instance.c.id)).first() is None:
                conn.execute(
                    insert(s.broker_instance).values(
                        id=1, instance_id=str(uuid.uuid4()), forwarding=False, created_at=now
                    )
                )
            if (
                conn.execute(
                    select(s.message_type.c.name).where(s.message_type.c.name == DEFAULT)
                ).first()
                is None
            ):
                conn.execute(
                    insert(s.message_type).values(name=DEFAULT, validation="none", created_at=now)
                )
            if (
                conn.execute(select(s.contract.c.name).where(s.contract.c.name == DEFAULT)).first()
                is None
            ):
                conn.execute(insert(s.contract).values(name=DEFAULT, created_at=now))
                conn.execute(
                    insert(s.contract_message).values(
                        contract_name=DEFAULT, message_type_name=DEFAULT, sent_by="any"
                    )
                )
            if (
                conn.execute(
                    select(s.route.c.name).where(s.route.c.name == AUTO_CREATED_LOCAL)
                ).first()
                is None
            ):
                conn.execute(
                    insert(s.route).values(name=AUTO_CREATED_LOCAL, address="LOCAL", created_at=now)
                )
        self._invalidate()

    @property
    def instance_id(self) -> str:
        """This broker database's id (a UUID string), stable for the life of the database."""
        if self._instance_id is None:
            with self.engine.connect() as conn:
                self._instance_on(conn)
        assert self._instance_id is not None
        return self._instance_id

    def _instance_on(self, conn: Connection) -> str:
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
            self._invalidate()

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
        activation: Activation | dict[str, Any] | None = _UNSET,
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

    def configure(self, *, forwarding: bool | None = None) -> None:
        """Broker-wide settings (see :meth:`Definitions.configure`)."""
        self._define("configure", forwarding=forwarding)

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
            report = _DueWork(self, conn).run(utcnow(), purge=True)
        self._last_due = time.monotonic()
        return report

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
                        _aware(r.expires_at),
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
            oldest = _aware(r.oldest)
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
                    enqueued_at=_aware(r.enqueued_at),  # type: ignore[arg-type]
                    transmission_status=r.transmission_status,
                    attempts=r.attempts,
                    next_attempt_at=_aware(r.next_attempt_at),
                )
                for r in conn.execute(stmt)
            ]

    def events(self, limit: int = 100) -> list[BrokerEvent]:
        """The most recent things the broker did on its own, newest first."""
        e = s.event
        with self.engine.connect() as conn:
            return [
                BrokerEvent(r.id, _aware(r.occurred_at), r.event, r.object_name, r.detail)  # type: ignore[arg-type]
                for r in conn.execute(select(e).order_by(e.c.id.desc()).limit(limit))
            ]

    # -- internals -----------------------------------------------------------------------------
    def _invalidate(self) -> None:
        with self._cache_lock:
            self._cache.clear()

    def _cached(self, key: Any, load: Callable[[], T]) -> T:
        now = time.monotonic()
        with self._cache_lock:
            hit = self._cache.get(key)
        if hit is not None and now - hit[0] < DEFINITION_CACHE_SECONDS:
            return hit[1]
        value = load()
        with self._cache_lock:
            self._cache[key] = (now, value)
        return value

    def _event(self, conn: Connection, event: str, object_name: str, detail: str) -> None:
        conn.execute(
            insert(s.event).values(
                occurred_at=utcnow(), event=event, object_name=object_name, detail=detail
            )
        )

    def _record_rollbacks(self, conn: Connection, queue_ids: Iterable[int]) -> tuple[int, int]:
        """Count rolled-back receiving transactions; disable queues that reach the threshold.

        Returns (rollbacks counted, queues disabled)."""
        counted = disabled = 0
        for queue_id, n in sorted(Counter(queue_ids).items()):
            row = conn.execute(
                update(s.queue)
                .where(
                    s.queue.c.queue_id == queue_id,
                    s.queue.c.poison_message_handling.is_(True),
                    s.queue.c.status.is_(True),
                )
                .values(rollback_count=s.queue.c.rollback_count + n)
                .returning(s.queue.c.name, s.queue.c.rollback_count)
            ).first()
            if row is None:
                continue
            counted += n
            if row.rollback_count >= POISON_THRESHOLD:
                conn.execute(
                    update(s.queue)
                    .where(s.queue.c.queue_id == queue_id)
                    .values(status=False, rollback_count=0, modified_at=utcnow())
                )
                detail = (
                    f"queue {row.name!r} disabled by poison message handling after "
                    f"{row.rollback_count} consecutive rolled-back receiving transactions; "
                    "fix the reader, then alter_queue(status=True)"
                )
                self._event(conn, "queue_disabled", row.name, detail)
                log.error(detail)
                disabled += 1
            else:
                log.warning(
                    "a transaction that received from queue %r rolled back (%d of %d before the "
                    "queue is disabled)",
                    row.name,
                    row.rollback_count,
                    POISON_THRESHOLD,
                )
        return counted, disabled


def _aware(value: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes for timezone-aware columns: they are UTC."""
    if value is not None and value.tzinfo is None:
        from datetime import UTC

        return value.replace(tzinfo=UTC)
    return value


# ---------------------------------------------------------------------------------------------
# Delivery inside one broker database
# ---------------------------------------------------------------------------------------------


def _endpoint_query(dialect: str, handles: list[uuid.UUID]) -> Any:
    e = s.conversation_endpoint.alias("e")
    f = s.conversation_endpoint.alias("f")
    fq = s.queue.alias("fq")
    q = s.queue.alias("q")
    t = s.transmission_queue
    stmt = (
        select(
            e,
            q.c.retention.label("own_retention"),
            f.c.queue_id.label("far_queue_id"),
            f.c.conversation_group_id.label("far_group_id"),
            f.c.state.label("far_state"),
            f.c.priority.label("far_priority"),
            f.c.service_name.label("far_service_name"),
            fq.c.status.label("far_queue_status"),
            fq.c.name.label("far_queue_name"),
            exists().where(t.c.conversation_handle == e.c.conversation_handle).label("has_pending"),
        )
        .join(q, q.c.queue_id == e.c.queue_id)
        .outerjoin(f, f.c.conversation_handle == e.c.far_handle)
        .outerjoin(fq, fq.c.queue_id == f.c.queue_id)
        .where(e.c.conversation_handle.in_(handles))
    )
    if dialect == "postgresql":
        stmt = stmt.with_for_update(of=e)
    return stmt


class _Delivery:
    """Puts one outgoing message where it goes: the far endpoint's queue when that is in this
    database and can take it, else the transmission queue with the reason it waits."""

    def __init__(self, broker: Broker, conn: Connection, notify: set[int]) -> None:
        self.b = broker
        self.conn = conn
        self.notify = notify
        self.instance_id = broker._instance_on(conn)

    def route(
        self,
        sender: Any,
        message_type: str,
        seq: int,
        body: bytes | None,
        validation: str,
        now: datetime,
    ) -> None:
        if sender.has_pending:
            self._to_transmission(
                sender,
                message_type,
                seq,
                body,
                validation,
                now,
                "waiting behind earlier messages of this conversation",
            )
            return
        if sender.far_handle is not None:
            if sender.far_queue_id is None:
                if sender.far_broker_instance not in (None, self.instance_id):
                    self._to_transmission(
                        sender,
                        message_type,
                        seq,
                        body,
                        validation,
                        now,
                        "waiting for delivery to another broker",
                    )
                    return
                # The far endpoint was removed WITH CLEANUP: the conversation is gone there.
                self._error_back(
                    sender,
                    ERR_SERVICE_NOT_FOUND,
                    f"the far endpoint of this conversation (service "
                    f"{sender.far_service!r}) no longer exists",
                    now,
                )
                return
            if not sender.far_queue_status:
                self._to_transmission(
                    sender,
                    message_type,
                    seq,
                    body,
                    validation,
                    now,
                    f"the target queue {sender.far_queue_name!r} is disabled",
                )
                return
            self._enqueue_far(
                sender.far_queue_id,
                sender.far_group_id,
                sender.far_handle,
                sender.far_priority,
                sender.far_service_name,
                sender.contract_name,
                message_type,
                seq,
                body,
                validation,
                now,
            )
            self._far_received(sender.far_handle, seq, message_type, sender.far_state)
            return
        # First message of the dialog: find the target service in this broker.
        target = self._local_target(sender)
        if target is None:
            self._to_transmission(
                sender,
                message_type,
                seq,
                body,
                validation,
                now,
                f"no route to service {sender.far_service!r}: it is not hosted by this broker "
                "and no route reaches it yet (the conversation is delayed and retried)",
            )
            return
        if sender.contract_name not in target["contracts"]:
            self._error_back(
                sender,
                ERR_CONTRACT_NOT_SUPPORTED,
                f"service {sender.far_service!r} does not accept contract {sender.contract_name!r}",
                now,
            )
            return
        if not target["queue_status"]:
            self._to_transmission(
                sender,
                message_type,
                seq,
                body,
                validation,
                now,
                f"the target queue {target['queue_name']!r} is disabled",
            )
            return
        far = self._create_target_endpoint(sender, target, now)
        self._enqueue_far(
            target["queue_id"],
            far["group"],
            far["handle"],
            far["priority"],
            sender.far_service,
            sender.contract_name,
            message_type,
            seq,
            body,
            validation,
            now,
        )
        self._far_received(far["handle"], seq, message_type, "CO")

    def _local_target(self, sender: Any) -> dict[str, Any] | None:
        if sender.far_broker_instance not in (None, self.instance_id):
            return None
        row = self.conn.execute(
            select(s.service.c.queue_id, s.queue.c.status, s.queue.c.name)
            .join(s.queue, s.queue.c.queue_id == s.service.c.queue_id)
            .where(s.service.c.name == sender.far_service)
        ).first()
        if row is None:
            return None
        contracts = set(
            self.conn.execute(
                select(s.service_contract.c.contract_name).where(
                    s.service_contract.c.service_name == sender.far_service
                )
            ).scalars()
        )
        return {
            "queue_id": row.queue_id,
            "queue_status": row.status,
            "queue_name": row.name,
            "contracts": contracts,
        }

    def _create_target_endpoint(
        self, sender: Any, target: dict[str, Any], now: datetime
    ) -> dict[str, Any]:
        handle, group = uuid.uuid4(), uuid.uuid4()
        prio = _priority_for(
            self.b, self.conn, sender.contract_name, sender.far_service, sender.service_name
        )
        self.conn.execute(
            insert(s.conversation_group).values(
                conversation_group_id=group, queue_id=target["queue_id"]
            )
        )
        self.conn.execute(
            insert(s.conversation_endpoint).values(
                conversation_handle=handle,
                conversation_id=sender.conversation_id,
                is_initiator=not sender.is_initiator,
                conversation_group_id=group,
                queue_id=target["queue_id"],
                service_name=sender.far_service,
                far_service=sender.service_name,
                far_broker_instance=self.instance_id,
                far_handle=sender.conversation_handle,
                contract_name=sender.contract_name,
                state="CO",
                priority=prio,
                lifetime=sender.lifetime,
                send_sequence=0,
                receive_sequence=0,
                created_at=now,
            )
        )
        self.conn.execute(
            update(s.conversation_endpoint)
            .where(s.conversation_endpoint.c.conversation_handle == sender.conversation_handle)
            .values(far_handle=handle, far_broker_instance=self.instance_id)
        )
        return {"handle": handle, "group": group, "priority": prio}

    def _enqueue_far(
        self,
        queue_id: int,
        group: uuid.UUID,
        handle: uuid.UUID,
        priority: int,
        service_name: str,
        contract: str,
        message_type: str,
        seq: int,
        body: bytes | None,
        validation: str,
        now: datetime,
    ) -> None:
        self.conn.execute(
            insert(s.message).values(
                queue_id=queue_id,
                conversation_group_id=group,
                conversation_handle=handle,
                message_sequence_number=seq,
                status=STATUS_READY,
                priority=priority,
                precedence=_precedence(message_type),
                service_name=service_name,
                service_contract_name=contract,
                message_type_name=message_type,
                validation=validation,
                message_body=body,
                enqueued_at=now,
            )
        )
        self.notify.add(queue_id)

    def _far_received(
        self, far_handle: uuid.UUID, seq: int, message_type: str, far_state: str | None
    ) -> None:
        values: dict[str, Any] = {"receive_sequence": seq + 1}
        if message_type == END_DIALOG and far_state in SENDABLE_STATES:
            values["state"] = "DI"
        elif message_type == ERROR:
            values["state"] = "CD" if far_state == "DO" else "ER"
            values["timer_due_at"] = None
        self.conn.execute(
            update(s.conversation_endpoint)
            .where(s.conversation_endpoint.c.conversation_handle == far_handle)
            .values(**values)
        )

    def _to_transmission(
        self,
        sender: Any,
        message_type: str,
        seq: int,
        body: bytes | None,
        validation: str,
        now: datetime,
        reason: str,
    ) -> None:
        self.conn.execute(
            insert(s.transmission_queue).values(
                conversation_handle=sender.conversation_handle,
                conversation_id=sender.conversation_id,
                is_initiator=sender.is_initiator,
                from_service_name=sender.service_name,
                from_broker_instance=self.instance_id,
                to_service_name=sender.far_service,
                to_broker_instance=sender.far_broker_instance,
                service_contract_name=sender.contract_name,
                message_type_name=message_type,
                message_sequence_number=seq,
                priority=sender.priority,
                validation=validation,
                message_body=body,
                lifetime=sender.lifetime,
                enqueued_at=now,
                transmission_status=reason,
                attempts=0,
                next_attempt_at=now + RETRY_BASE,
            )
        )
        log.info(
            "message %d of conversation %s waits in the transmission queue: %s",
            seq,
            sender.conversation_handle,
            reason,
        )

    def _error_back(self, sender: Any, code: int, description: str, now: datetime) -> None:
        """The dialog failed at the far side: the sender gets an Error and goes to ER."""
        self.conn.execute(
            insert(s.message).values(
                queue_id=sender.queue_id,
                conversation_group_id=sender.conversation_group_id,
                conversation_handle=sender.conversation_handle,
                message_sequence_number=sender.receive_sequence,
                status=STATUS_READY,
                priority=sender.priority,
                precedence=PRECEDENCE_ERROR,
                service_name=sender.service_name,
                service_contract_name=sender.contract_name,
                message_type_name=ERROR,
                validation="X",
                message_body=error_body(code, description),
                enqueued_at=now,
            )
        )
        self.conn.execute(
            update(s.conversation_endpoint)
            .where(s.conversation_endpoint.c.conversation_handle == sender.conversation_handle)
            .values(state="ER", timer_due_at=None)
        )
        self.conn.execute(
            delete(s.transmission_queue).where(
                s.transmission_queue.c.conversation_handle == sender.conversation_handle
            )
        )
        self.notify.add(sender.queue_id)
        log.warning("conversation %s failed: %s", sender.conversation_handle, description)


def _priority_for(broker: Broker, conn: Connection, contract: str, local: str, remote: str) -> int:
    """The priority of a conversation endpoint: the most specific matching broker priority."""

    def load() -> list[Any]:
        return list(conn.execute(select(s.priority)))

    best: tuple[tuple[bool, bool, bool], int] | None = None
    for p in broker._cached("priorities", load):
        if p.contract_name not in (None, contract):
            continue
        if p.local_service not in (None, local):
            continue
        if p.remote_service not in (None, remote):
            continue
        rank = (
            p.contract_name is not None,
            p.local_service is not None,
            p.remote_service is not None,
        )
        if best is None or rank > best[0]:
            best = (rank, p.priority)
    return best[1] if best else 5


def _contract_rule(
    broker: Broker, conn: Connection, contract: str, message_type: str
) -> tuple[str, str, Any]:
    """(sent_by, validation, json_schema) of ``message_type`` in ``contract``."""

    def load() -> tuple[str, str, Any] | None:
        row = conn.execute(
            select(
                s.contract_message.c.sent_by,
                s.message_type.c.validation,
                s.message_type.c.json_schema,
            )
            .join(s.message_type, s.message_type.c.name == s.contract_message.c.message_type_name)
            .where(
                s.contract_message.c.contract_name == contract,
                s.contract_message.c.message_type_name == message_type,
            )
        ).first()
        return None if row is None else (row.sent_by, row.validation, row.json_schema)

    rule = broker._cached(("rule", contract, message_type), load)
    if rule is None:
        known = conn.execute(
            select(s.message_type.c.name).where(s.message_type.c.name == message_type)
        ).first()
        if known is None:
            raise UnknownObject(f"message type {message_type!r} does not exist in this broker")
        raise ContractViolation(
            f"message type {message_type!r} is not part of contract {contract!r}"
        )
    return rule


# ---------------------------------------------------------------------------------------------
# Due work: timers, lifetimes, dead readers, waiting local transmissions
# ---------------------------------------------------------------------------------------------


class _DueWork:
    BATCH = 500

    def __init__(self, broker: Broker, conn: Connection) -> None:
        self.b = broker
        self.conn = conn
        self.notify: set[int] = set()
        self.instance_id = broker._instance_on(conn)

    def _due_handles(self, column: Any, now: datetime, extra: Any = None) -> Any:
        e = s.conversation_endpoint
        inner = select(e.c.conversation_handle).where(column <= now)
        if extra is not None:
            inner = inner.where(extra)
        inner = inner.limit(self.BATCH)
        if self.b.dialect == "postgresql":
            inner = inner.with_for_update(skip_locked=True)
        return e.c.conversation_handle.in_(inner.scalar_subquery())

    def run(self, now: datetime, *, purge: bool = False) -> DueReport:
        timers = self._fire_timers(now)
        expired = self._expire_lifetimes(now)
        counted, disabled = self.b._record_rollbacks(
            self.conn, self.b.adapter.reap_dead_leases(self.conn)
        )
        delivered = self._retry_local_transmissions(now)
        purged = self._purge_closed(now) if purge else 0
        self.b.adapter.notify(self.conn, self.notify)
        return DueReport(timers, expired, counted, disabled, delivered, purged)

    def _fire_timers(self, now: datetime) -> int:
        e = s.conversation_endpoint
        rows = self.conn.execute(
            update(e)
            .where(self._due_handles(e.c.timer_due_at, now))
            .values(timer_due_at=None)
            .returning(
                e.c.conversation_handle,
                e.c.conversation_group_id,
                e.c.queue_id,
                e.c.service_name,
                e.c.contract_name,
                e.c.priority,
                e.c.state,
                e.c.receive_sequence,
            )
        ).all()
        fired = 0
        for r in rows:
            if r.state == "CD":
                continue
            self.conn.execute(
                insert(s.message).values(
                    queue_id=r.queue_id,
                    conversation_group_id=r.conversation_group_id,
                    conversation_handle=r.conversation_handle,
                    message_sequence_number=0,
                    status=STATUS_READY,
                    priority=r.priority,
                    precedence=PRECEDENCE_TIMER,
                    service_name=r.service_name,
                    service_contract_name=r.contract_name,
                    message_type_name=DIALOG_TIMER,
                    validation="E",
                    message_body=None,
                    enqueued_at=now,
                )
            )
            self.notify.add(r.queue_id)
            fired += 1
        return fired

    def _expire_lifetimes(self, now: datetime) -> int:
        e = s.conversation_endpoint
        rows = self.conn.execute(
            update(e)
            .where(self._due_handles(e.c.lifetime, now, e.c.state.notin_(("ER", "CD"))))
            .values(state="ER", timer_due_at=None)
            .returning(
                e.c.conversation_handle,
                e.c.conversation_group_id,
                e.c.queue_id,
                e.c.service_name,
                e.c.contract_name,
                e.c.priority,
                e.c.receive_sequence,
            )
        ).all()
        for r in rows:
            self.conn.execute(
                delete(s.transmission_queue).where(
                    s.transmission_queue.c.conversation_handle == r.conversation_handle
                )
            )
            self.conn.execute(
                insert(s.message).values(
                    queue_id=r.queue_id,
                    conversation_group_id=r.conversation_group_id,
                    conversation_handle=r.conversation_handle,
                    message_sequence_number=r.receive_sequence,
                    status=STATUS_READY,
                    priority=r.priority,
                    precedence=PRECEDENCE_ERROR,
                    service_name=r.service_name,
                    service_contract_name=r.contract_name,
                    message_type_name=ERROR,
                    validation="X",
                    message_body=error_body(
                        ERR_LIFETIME_EXPIRED, "The conversation's lifetime has expired"
                    ),
                    enqueued_at=now,
                )
            )
            self.notify.add(r.queue_id)
            log.info("conversation %s expired (lifetime reached)", r.conversation_handle)
        return len(rows)

    def _retry_local_transmissions(self, now: datetime) -> int:
        """Messages that waited for a local queue (disabled, or a service not yet created)."""
        t = s.transmission_queue
        stmt = (
            select(t.c.conversation_handle)
            .where(t.c.next_attempt_at <= now)
            .where(
                or_(t.c.to_broker_instance.is_(None), t.c.to_broker_instance == self.instance_id)
            )
            .where(t.c.to_service_name.in_(select(s.service.c.name)))
            .group_by(t.c.conversation_handle)
            .limit(self.BATCH)
        )
        handles = self.conn.execute(stmt).scalars().all()
        delivered = 0
        for handle in handles:
            delivered += self._flush_conversation(handle, now)
        return delivered

    def _flush_conversation(self, handle: uuid.UUID, now: datetime) -> int:
        t = s.transmission_queue
        pending = self.conn.execute(
            select(t).where(t.c.conversation_handle == handle).order_by(t.c.message_sequence_number)
        ).all()
        delivery = _Delivery(self.b, self.conn, self.notify)
        delivered = 0
        for msg in pending:
            sender = self.conn.execute(_endpoint_query(self.b.dialect, [handle])).first()
            if sender is None or sender.state in ("ER", "CD"):
                break
            # Take the message out first; routing it again re-queues it if it still cannot go.
            self.conn.execute(delete(t).where(t.c.id == msg.id))
            sender_now = {**sender._mapping, "has_pending": False}
            before = self.conn.execute(
                select(func.count()).select_from(t).where(t.c.conversation_handle == handle)
            ).scalar_one()
            delivery.route(
                _Obj(sender_now),
                msg.message_type_name,
                msg.message_sequence_number,
                msg.message_body,
                msg.validation,
                now,
            )
            after = self.conn.execute(
                select(func.count()).select_from(t).where(t.c.conversation_handle == handle)
            ).scalar_one()
            if after > before:
                # Still cannot go: keep the original order, back off, and stop for this dialog.
                self.conn.execute(
                    update(t)
                    .where(
                        t.c.conversation_handle == handle,
                        t.c.message_sequence_number == msg.message_sequence_number,
                    )
                    .values(
                        attempts=msg.attempts + 1,
                        enqueued_at=msg.enqueued_at,
                        next_attempt_at=now + min(RETRY_BASE * 2 ** (msg.attempts + 1), RETRY_CAP),
                    )
                )
                # The re-queued row has a new id; later rows keep theirs, and sequence numbers
                # (not ids) give the order.
                break
            delivered += 1
        return delivered

    def _purge_closed(self, now: datetime) -> int:
        e = s.conversation_endpoint
        result = self.conn.execute(
            delete(e).where(e.c.state == "CD", e.c.closed_at <= now - CLOSED_ENDPOINT_RETENTION)
        )
        g = s.conversation_group
        self.conn.execute(
            delete(g).where(
                ~exists().where(e.c.conversation_group_id == g.c.conversation_group_id),
            )
        )
        return result.rowcount or 0


class _Obj:
    """Attribute access over a mapping (a sender row with some columns replaced)."""

    def __init__(self, mapping: Any) -> None:
        self.__dict__.update(mapping)


# ---------------------------------------------------------------------------------------------
# Transaction
# ---------------------------------------------------------------------------------------------


class Transaction:
    """A messaging transaction: BEGIN DIALOG, SEND, RECEIVE, END CONVERSATION and friends.

    Use as a context manager: it commits when the block ends and rolls back when it raises.
    Messages received in a transaction that rolls back return to their queue, and the rollback
    counts towards the queue's poison-message handling. ``tx.connection`` is the SQLAlchemy
    connection of this transaction, for application state that must commit with the messages.
    """

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.connection: Connection = broker.engine.connect()
        self._notify: set[int] = set()
        self._leases: dict[int, Lease] = {}
        self._dirty = False
        self._done = False

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> Transaction:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._done:
            return
        if exc_type is None:
            self.commit()
        else:
            self.rollback()

    def commit(self) -> None:
        """Commit: SENDs become visible to readers, RECEIVEd messages are gone for good."""
        self._check_open()
        conn = self.connection
        leases = list(self._leases.values())
        adapter = self.broker.adapter
        try:
            if leases:
                adapter.leases_committing(conn, leases)
                conn.execute(
                    update(s.queue)
                    .where(
                        s.queue.c.queue_id.in_([lease.queue_id for lease in leases]),
                        s.queue.c.rollback_count > 0,
                    )
                    .values(rollback_count=0)
                )
            adapter.notify(conn, self._notify)
            conn.commit()
        except BaseException:
            self._after_rollback()
            raise
        self._done = True
        adapter.close_leases(leases)
        conn.close()

    def rollback(self) -> None:
        """Roll back: received messages return to their queue; counts toward poison handling."""
        self._check_open()
        self._after_rollback()

    def _after_rollback(self) -> None:
        conn = self.connection
        self._done = True
        try:
            conn.rollback()
            leases = list(self._leases.values())
            if leases:
                queue_ids = self.broker.adapter.forget_leases(conn, leases)
                self.broker._record_rollbacks(conn, queue_ids)
                conn.commit()
        finally:
            conn.close()

    def _check_open(self) -> None:
        if self._done:
            raise BrokerError("this broker transaction has already ended")

    def _execute(self, stmt: Any, params: Any = None) -> Any:
        self._check_open()
        return self.connection.execute(stmt, params)

    # -- lookups -------------------------------------------------------------------------------
    def _queue(self, name: str) -> Row[Any]:
        row = self._execute(
            select(
                s.queue.c.queue_id,
                s.queue.c.name,
                s.queue.c.status,
                s.queue.c.retention,
                s.queue.c.poison_message_handling,
            ).where(s.queue.c.name == name)
        ).first()
        if row is None:
            raise UnknownObject(f"queue {name!r} does not exist in this broker")
        if not row.status:
            raise QueueDisabled(
                f"queue {name!r} is disabled (status off); re-enable it with "
                f"alter_queue({name!r}, status=True) once its readers are fixed"
            )
        return row

    def _endpoint_row(self, handle: uuid.UUID) -> Any:
        row = self._execute(_endpoint_query(self.broker.dialect, [handle])).first()
        if row is None:
            raise UnknownObject(f"conversation handle {handle} does not exist in this broker")
        return row

    # -- BEGIN DIALOG --------------------------------------------------------------------------
    def begin_dialog(
        self,
        from_service: str,
        to_service: str,
        contract: str = DEFAULT,
        broker_instance: str | None = None,
        lifetime_seconds: int | None = None,
        related_conversation: Handle | None = None,
        related_conversation_group: Handle | None = None,
    ) -> uuid.UUID:
        """BEGIN DIALOG CONVERSATION from a local service; returns the conversation handle.

        The target need not be reachable yet: the first SEND waits in the transmission queue
        until a route reaches ``to_service``."""
        _name(to_service, "target service")
        if related_conversation is not None and related_conversation_group is not None:
            raise InvalidDefinition(
                "give related_conversation or related_conversation_group, not both"
            )
        if lifetime_seconds is not None and (
            not isinstance(lifetime_seconds, int | float) or lifetime_seconds <= 0
        ):
            raise InvalidDefinition(
                f"lifetime_seconds must be a positive number, not {lifetime_seconds!r}"
            )
        if broker_instance is not None:
            broker_instance = str(_uuid(broker_instance, "broker_instance"))
        svc = self._execute(
            select(s.service.c.queue_id).where(s.service.c.name == from_service)
        ).first()
        if svc is None:
            raise UnknownObject(f"service {from_service!r} is not a local service of this broker")
        if (
            self._execute(select(s.contract.c.name).where(s.contract.c.name == contract)).first()
            is None
        ):
            raise UnknownObject(f"contract {contract!r} does not exist in this broker")

        group: uuid.UUID | None = None
        new_group = True
        if related_conversation is not None:
            rel = _uuid(related_conversation, "related_conversation")
            row = self._execute(
                select(
                    s.conversation_endpoint.c.conversation_group_id,
                    s.conversation_endpoint.c.queue_id,
                ).where(s.conversation_endpoint.c.conversation_handle == rel)
            ).first()
            if row is None:
                raise UnknownObject(f"related conversation {rel} does not exist in this broker")
            if row.queue_id != svc.queue_id:
                raise InvalidDefinition(
                    f"related conversation {rel} is on another queue than service {from_service!r}"
                )
            group, new_group = row.conversation_group_id, False
        elif related_conversation_group is not None:
            group = _uuid(related_conversation_group, "related_conversation_group")
            row = self._execute(
                select(s.conversation_group.c.queue_id).where(
                    s.conversation_group.c.conversation_group_id == group
                )
            ).first()
            if row is not None:
                if row.queue_id != svc.queue_id:
                    raise InvalidDefinition(
                        f"conversation group {group} is on another queue than service "
                        f"{from_service!r}"
                    )
                new_group = False
        if group is None:
            group = uuid.uuid4()
        now = utcnow()
        handle = uuid.uuid4()
        self._dirty = True
        if new_group:
            self._execute(
                insert(s.conversation_group).values(
                    conversation_group_id=group, queue_id=svc.queue_id
                )
            )
        self._execute(
            insert(s.conversation_endpoint).values(
                conversation_handle=handle,
                conversation_id=uuid.uuid4(),
                is_initiator=True,
                conversation_group_id=group,
                queue_id=svc.queue_id,
                service_name=from_service,
                far_service=to_service,
                far_broker_instance=broker_instance,
                far_handle=None,
                contract_name=contract,
                state="SO",
                priority=_priority_for(
                    self.broker, self.connection, contract, from_service, to_service
                ),
                lifetime=now + timedelta(seconds=lifetime_seconds) if lifetime_seconds else None,
                send_sequence=0,
                receive_sequence=0,
                created_at=now,
            )
        )
        return handle

    # -- SEND ----------------------------------------------------------------------------------
    def send(
        self, handles: Handle | Sequence[Handle], message_type: str = DEFAULT, body: Any = None
    ) -> None:
        """SEND ON CONVERSATION one message on one or several conversations, atomically: either
        every conversation gets it or (on any error) none does."""
        if isinstance(handles, uuid.UUID | str):
            handle_list = [_uuid(handles, "conversation handle")]
        else:
            handle_list = [_uuid(h, "conversation handle") for h in handles]
        if not handle_list:
            raise InvalidDefinition("SEND needs at least one conversation handle")
        if len(set(handle_list)) != len(handle_list):
            raise InvalidDefinition("SEND names the same conversation handle twice")
        if message_type in SYSTEM_MESSAGE_TYPES:
            raise ContractViolation(
                f"message type {message_type!r} is a system message type: the broker sends it"
            )
        payload = encode_body(body)
        rows = {
            r.conversation_handle: r
            for r in self._execute(_endpoint_query(self.broker.dialect, handle_list))
        }
        now = utcnow()
        checked: list[tuple[Any, str]] = []
        validated: set[tuple[str, Any]] = set()
        for h in handle_list:
            row = rows.get(h)
            if row is None:
                raise UnknownObject(f"conversation handle {h} does not exist in this broker")
            self._check_sendable(row, now)
            sent_by, validation, schema_ = _contract_rule(
                self.broker, self.connection, row.contract_name, message_type
            )
            side = "initiator" if row.is_initiator else "target"
            if sent_by not in (side, "any"):
                raise ContractViolation(
                    f"contract {row.contract_name!r} lets only the {sent_by} send message type "
                    f"{message_type!r}; conversation {h} is the {side} side"
                )
            if (validation, message_type) not in validated:
                validate_body(message_type, validation, schema_, payload)
                validated.add((validation, message_type))
            checked.append((row, VALIDATION_CODES[validation]))
        self._dirty = True
        delivery = _Delivery(self.broker, self.connection, self._notify)
        e = s.conversation_endpoint
        for row, code in checked:
            seq = row.send_sequence
            self._execute(
                update(e)
                .where(e.c.conversation_handle == row.conversation_handle)
                .values(send_sequence=seq + 1, state="CO" if row.state == "SO" else row.state)
            )
            if row.own_retention:
                self._retain_sent(row, message_type, seq, payload, code, now)
            delivery.route(row, message_type, seq, payload, code, now)

    def _check_sendable(self, row: Any, now: datetime) -> None:
        lifetime = _aware(row.lifetime)
        if row.state not in SENDABLE_STATES:
            raise ConversationEnded(
                f"conversation {row.conversation_handle} is {row.state} "
                f"({_desc(row.state)}): nothing more can be sent on it"
            )
        if lifetime is not None and lifetime <= now:
            raise ConversationEnded(
                f"conversation {row.conversation_handle} has expired (lifetime ended {lifetime})"
            )

    def _retain_sent(
        self, row: Any, message_type: str, seq: int, payload: bytes | None, code: str, now: datetime
    ) -> None:
        self._execute(
            insert(s.message).values(
                queue_id=row.queue_id,
                conversation_group_id=row.conversation_group_id,
                conversation_handle=row.conversation_handle,
                message_sequence_number=seq,
                status=STATUS_RETAINED_SENT,
                priority=row.priority,
                precedence=_precedence(message_type),
                service_name=row.service_name,
                service_contract_name=row.contract_name,
                message_type_name=message_type,
                validation=code,
                message_body=payload,
                enqueued_at=now,
            )
        )

    # -- RECEIVE -------------------------------------------------------------------------------
    def receive(
        self,
        queue: str,
        top: int | None = None,
        conversation_handle: Handle | None = None,
        conversation_group: Handle | None = None,
        wait_seconds: float = 0,
    ) -> list[Message]:
        """RECEIVE from ``queue``: messages of one conversation group, whose lock this
        transaction then holds until it ends.

        :param top: at most this many messages (default: all ready messages of the group).
        :param conversation_handle: only from this conversation.
        :param conversation_group: only from this conversation group.
        :param wait_seconds: wait up to this long for messages (WAITFOR); 0 returns at once.
        """
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 1):
            raise InvalidDefinition(f"top must be a whole number >= 1, not {top!r}")
        if conversation_handle is not None and conversation_group is not None:
            raise InvalidDefinition("give conversation_handle or conversation_group, not both")
        q = self._queue(queue)
        params: dict[str, Any] = {
            "queue_id": q.queue_id,
            "top": top if top is not None else queries.no_limit(self.broker.dialect),
        }
        if conversation_handle is not None:
            params["handle"] = _uuid(conversation_handle, "conversation handle")
        if conversation_group is not None:
            params["group_id"] = _uuid(conversation_group, "conversation group")
        stmt = queries.claim_statement(
            self.broker.dialect,
            by_handle=conversation_handle is not None,
            by_group=conversation_group is not None,
            retention=q.retention,
        )
        by_handle, by_group = conversation_handle is not None, conversation_group is not None

        def claim() -> list[Any]:
            rows: list[Any] = self._execute(stmt, params).all()
            if rows or self.broker.dialect != "postgresql":
                return rows
            ready = queries.ready_exists_statement(by_handle=by_handle, by_group=by_group)
            for _ in range(queries.CLAIM_ATTEMPTS - 1):
                if self._execute(ready, params).first() is None:
                    break
                rows = self._execute(stmt, params).all()
                if rows:
                    break
            return rows

        rows = self._wait_for(q, wait_seconds, claim)
        if not rows:
            return []
        self._dirty = True
        if q.poison_message_handling and q.queue_id not in self._leases:
            self._leases[q.queue_id] = self.broker.adapter.open_lease(self.connection, q.queue_id)
        rows.sort(
            key=lambda r: (
                -r.priority,
                r.precedence,
                r.conversation_handle,
                r.message_sequence_number,
            )
        )
        return [
            Message(
                status=STATUS_READY,
                priority=r.priority,
                queuing_order=r.queuing_order,
                conversation_group_id=r.conversation_group_id,
                conversation_handle=r.conversation_handle,
                message_sequence_number=r.message_sequence_number,
                service_name=r.service_name,
                service_contract_name=r.service_contract_name,
                message_type_name=r.message_type_name,
                validation=r.validation,
                message_body=r.message_body,
            )
            for r in rows
        ]

    def get_conversation_group(self, queue: str, wait_seconds: float = 0) -> uuid.UUID | None:
        """GET CONVERSATION GROUP: lock the next group with ready messages and return its id
        (None when there is none within ``wait_seconds``)."""
        q = self._queue(queue)
        stmt = queries.lock_group_statement(self.broker.dialect)
        rows = self._wait_for(
            q, wait_seconds, lambda: self._execute(stmt, {"queue_id": q.queue_id}).all()
        )
        if not rows:
            return None
        self._dirty = True
        group: uuid.UUID = rows[0].conversation_group_id
        return group

    def _wait_for(
        self, q: Row[Any], wait_seconds: float, attempt: Callable[[], list[Any]]
    ) -> list[Any]:
        """Run ``attempt`` until it finds something or ``wait_seconds`` pass, sleeping on the
        engine's wake-up signal in between and doing due work (timers, lifetimes) as it goes."""
        if not isinstance(wait_seconds, int | float) or wait_seconds < 0:
            raise InvalidDefinition(f"wait_seconds must be >= 0, not {wait_seconds!r}")
        self._due_step(force=False)
        rows = attempt()
        if rows or wait_seconds <= 0:
            return rows
        deadline = time.monotonic() + wait_seconds
        adapter = self.broker.adapter
        state = adapter.start_wait(self.connection, q.queue_id, can_release=not self._dirty)
        try:
            while True:
                rows = attempt()
                if rows:
                    return rows
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                adapter.wait(self.connection, state, min(remaining, MAX_WAIT_SLICE))
                self._due_step(force=False)
                if self._queue_disabled(q.queue_id):
                    raise QueueDisabled(f"queue {q.name!r} was disabled while waiting")
        finally:
            adapter.end_wait(state)

    def _queue_disabled(self, queue_id: int) -> bool:
        return not self._execute(
            select(s.queue.c.status).where(s.queue.c.queue_id == queue_id)
        ).scalar()

    def _due_step(self, *, force: bool) -> None:
        b = self.broker
        now_m = time.monotonic()
        if not force and now_m - b._last_due < DUE_WORK_INTERVAL:
            return
        b._last_due = now_m
        if b.dialect == "postgresql":
            # In a short transaction of its own: a timer fires once, whatever this one does.
            with b.engine.begin() as conn:
                _DueWork(b, conn).run(utcnow())
        elif self._dirty:
            # SQLite: this transaction holds the only write lock; do it inside it.
            _DueWork(b, self.connection).run(utcnow())
        else:
            # Nothing of the caller's is in this transaction yet: commit the due work on its own,
            # so that a waiting RECEIVE that later gives the write lock back does not undo it.
            _DueWork(b, self.connection).run(utcnow())
            self.connection.commit()

    # -- END CONVERSATION ----------------------------------------------------------------------
    def end_conversation(
        self,
        handle: Handle,
        error_code: int | None = None,
        error_description: str | None = None,
        cleanup: bool = False,
    ) -> None:
        """END CONVERSATION (plain, WITH ERROR, or WITH CLEANUP)."""
        h = _uuid(handle, "conversation handle")
        if error_code is not None and cleanup:
            raise InvalidDefinition("END CONVERSATION takes WITH ERROR or WITH CLEANUP, not both")
        if error_code is not None:
            if not isinstance(error_code, int) or isinstance(error_code, bool):
                raise InvalidDefinition(f"error_code must be an integer, not {error_code!r}")
            if not isinstance(error_description, str) or not error_description:
                raise InvalidDefinition("END CONVERSATION WITH ERROR needs an error_description")
        row = self._endpoint_row(h)
        e = s.conversation_endpoint
        now = utcnow()
        self._dirty = True
        if cleanup:
            self._execute(delete(e).where(e.c.conversation_handle == h))
            log.info("conversation %s removed WITH CLEANUP", h)
            return
        if row.state in ("CD", "DO"):
            raise ConversationEnded(
                f"conversation {h} has already ended on this side ({row.state}: {_desc(row.state)})"
            )
        # Messages of this conversation still in this side's queue go with it.
        self._execute(delete(s.message).where(s.message.c.conversation_handle == h))
        closed = {"state": "CD", "closed_at": now, "timer_due_at": None}
        if error_code is not None:
            self._execute(
                delete(s.transmission_queue).where(s.transmission_queue.c.conversation_handle == h)
            )
            row = self._endpoint_row(h)
            self._execute(update(e).where(e.c.conversation_handle == h).values(**closed))
            if row.state not in ("DI", "ER") and self._far_exists(row):
                self._system_send(row, ERROR, error_body(error_code, error_description or ""), now)
            return
        if row.state in ("DI", "ER") or not self._far_exists(row):
            # The far side has ended (or errored), or was never told of this dialog.
            self._execute(update(e).where(e.c.conversation_handle == h).values(**closed))
            if row.state == "DI" and row.far_handle is not None:
                self._execute(
                    update(e)
                    .where(e.c.conversation_handle == row.far_handle, e.c.state == "DO")
                    .values(**closed)
                )
            return
        self._execute(
            update(e).where(e.c.conversation_handle == h).values(state="DO", timer_due_at=None)
        )
        self._system_send(row, END_DIALOG, None, now)

    def _far_exists(self, row: Any) -> bool:
        """Whether the far side knows of this dialog (or will: messages are on their way)."""
        return row.far_handle is not None or bool(row.has_pending) or row.send_sequence > 0

    def _system_send(self, row: Any, message_type: str, body: bytes | None, now: datetime) -> None:
        e = s.conversation_endpoint
        seq = row.send_sequence
        self._execute(
            update(e)
            .where(e.c.conversation_handle == row.conversation_handle)
            .values(send_sequence=seq + 1)
        )
        validation = "X" if body is not None else "E"
        _Delivery(self.broker, self.connection, self._notify).route(
            row, message_type, seq, body, validation, now
        )

    # -- timers, groups, endpoints -------------------------------------------------------------
    def begin_conversation_timer(self, handle: Handle, timeout_seconds: float) -> None:
        """BEGIN CONVERSATION TIMER: a DialogTimer message arrives on this side's queue after
        ``timeout_seconds``. One timer per endpoint: setting it again re-arms it."""
        h = _uuid(handle, "conversation handle")
        if (
            not isinstance(timeout_seconds, int | float)
            or isinstance(timeout_seconds, bool)
            or timeout_seconds < 0
        ):
            raise InvalidDefinition(f"timeout_seconds must be >= 0, not {timeout_seconds!r}")
        row = self._endpoint_row(h)
        if row.state in ("CD", "ER", "DO"):
            raise ConversationEnded(f"conversation {h} has ended ({row.state}): no timer on it")
        e = s.conversation_endpoint
        self._dirty = True
        self._execute(
            update(e)
            .where(e.c.conversation_handle == h)
            .values(timer_due_at=utcnow() + timedelta(seconds=timeout_seconds))
        )

    def move_conversation(self, handle: Handle, to_conversation_group: Handle) -> None:
        """MOVE CONVERSATION into another conversation group on the same queue."""
        h = _uuid(handle, "conversation handle")
        g = _uuid(to_conversation_group, "conversation group")
        row = self._endpoint_row(h)
        target = self._execute(
            select(s.conversation_group.c.queue_id).where(
                s.conversation_group.c.conversation_group_id == g
            )
        ).first()
        if target is None:
            raise UnknownObject(f"conversation group {g} does not exist in this broker")
        if target.queue_id != row.queue_id:
            raise InvalidDefinition(
                f"conversation group {g} is on another queue than conversation {h}"
            )
        if self.broker.dialect == "postgresql":
            cg = s.conversation_group
            self._execute(
                select(cg.c.conversation_group_id)
                .where(cg.c.conversation_group_id.in_([g, row.conversation_group_id]))
                .order_by(cg.c.conversation_group_id)
                .with_for_update(key_share=False, read=False)
            )
        self._dirty = True
        e = s.conversation_endpoint
        self._execute(update(e).where(e.c.conversation_handle == h).values(conversation_group_id=g))
        self._execute(
            update(s.message)
            .where(s.message.c.conversation_handle == h)
            .values(conversation_group_id=g)
        )

    def conversation(self, handle: Handle) -> ConversationEndpoint:
        """The local endpoint of a conversation."""
        h = _uuid(handle, "conversation handle")
        e = s.conversation_endpoint
        row = self._execute(
            select(e, s.queue.c.name.label("queue_name"))
            .join(s.queue, s.queue.c.queue_id == e.c.queue_id)
            .where(e.c.conversation_handle == h)
        ).first()
        if row is None:
            raise UnknownObject(f"conversation handle {h} does not exist in this broker")
        return ConversationEndpoint(
            conversation_handle=row.conversation_handle,
            conversation_id=row.conversation_id,
            conversation_group_id=row.conversation_group_id,
            is_initiator=row.is_initiator,
            service_name=row.service_name,
            far_service=row.far_service,
            far_broker_instance=row.far_broker_instance,
            contract_name=row.contract_name,
            state=row.state,
            lifetime=_aware(row.lifetime),
            send_sequence=row.send_sequence,
            receive_sequence=row.receive_sequence,
            priority=row.priority,
            queue_name=row.queue_name,
            timer_due_at=_aware(row.timer_due_at),
        )


def _desc(state: str) -> str:
    from airflow_broker.constants import STATE_DESC

    return STATE_DESC.get(state, state)


__all__ = ["Broker", "Definitions", "DueReport", "Transaction"]
