"""CREATE / ALTER / DROP of message types, contracts, queues, services, routes and priorities.

:func:`define` opens the one transaction a batch of definitions runs in; :class:`Activation` is a
queue's ``ACTIVATION (...)`` clause (what :mod:`airflow_broker.activation` acts on).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Row,
    delete,
    insert,
    select,
    update,
)
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from airflow_broker.constants import (
    DEFAULT,
    SENT_BY,
    SYSTEM_MESSAGE_TYPES,
)
from airflow_broker.errors import (
    InvalidDefinition,
    ObjectExists,
    UnknownObject,
)
from airflow_broker.messaging.arguments import UNSET, as_name, as_uuid
from airflow_broker.messaging.events import record_event
from airflow_broker.messaging.validation import (
    check_definition,
)
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")


@dataclass(frozen=True, slots=True)
class Activation:
    """A queue's activation settings (Service Broker's ``ACTIVATION (...)`` clause).

    :param status: whether the monitor starts readers at all.
    :param max_readers: the most readers that may run at once on the queue.
    :param reader: what a reader is: an Airflow DAG id (in Airflow) or ``"module:function"``
        (the in-process runner); None leaves it to whoever runs the monitor.
    """

    status: bool = True
    max_readers: int = 1
    reader: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_readers, int) or self.max_readers < 1:
            raise InvalidDefinition(
                f"activation max_readers must be a whole number >= 1, not {self.max_readers!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_value(cls, value: Activation | dict[str, Any] | None) -> Activation | None:
        if value is None or isinstance(value, Activation):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"status", "max_readers", "reader"}
            if unknown:
                raise InvalidDefinition(
                    f"activation has unknown settings {sorted(unknown)}; "
                    "known: status, max_readers, reader"
                )
            return cls(**value)
        raise InvalidDefinition(f"activation must be an Activation or a dict, not {value!r}")


# ---------------------------------------------------------------------------------------------
# Definitions
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def define(broker: BrokerContext) -> Iterator[Definitions]:
    """Several CREATE / ALTER / DROP in one transaction: all or nothing. The definition cache of
    ``broker`` is dropped afterwards, whatever happened."""
    try:
        with broker.engine.begin() as conn:
            yield Definitions(broker, conn)
    except IntegrityError as exc:
        raise InvalidDefinition(f"definition refused by the database: {exc.orig}") from exc
    finally:
        broker.invalidate_definitions()


class Definitions:
    """CREATE / ALTER / DROP of broker objects, all inside one transaction.

    Obtained from :meth:`Broker.definitions`; the same verbs on :class:`Broker` each run in a
    transaction of their own.
    """

    def __init__(self, broker: BrokerContext, conn: Connection) -> None:
        self._broker = broker
        self._conn = conn

    @property
    def connection(self) -> Connection:
        """The connection of this definitions transaction."""
        return self._conn

    # -- helpers -------------------------------------------------------------------------------
    def _exists(self, table: Any, column: Any, value: Any) -> bool:
        return self._conn.execute(select(column).where(column == value)).first() is not None

    def _require(self, table: Any, column: Any, value: str, what: str) -> None:
        if not self._exists(table, column, value):
            raise UnknownObject(f"{what} {value!r} does not exist in this broker")

    def _refuse_existing(self, table: Any, column: Any, value: str, what: str) -> None:
        if self._exists(table, column, value):
            raise ObjectExists(f"{what} {value!r} already exists")

    def _refuse_if_used(self, what: str, users: Any, kind: str) -> None:
        """DROP refuses an object that others still use, and names them."""
        names = sorted(self._conn.execute(users).scalars())
        if names:
            raise InvalidDefinition(
                f"{what} is used by {kind} {', '.join(names)}; drop or alter those first"
            )

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
        as_name(name, "message type")
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
        self._refuse_if_used(
            f"message type {name!r}",
            select(s.contract_message.c.contract_name).where(
                s.contract_message.c.message_type_name == name
            ),
            "contract(s)",
        )
        self._conn.execute(delete(s.message_type).where(s.message_type.c.name == name))

    # -- contracts -----------------------------------------------------------------------------
    def create_contract(self, name: str, message_types: dict[str, str]) -> None:
        """CREATE CONTRACT: ``{message_type: "initiator" | "target" | "any"}``."""
        as_name(name, "contract")
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
        self._refuse_if_used(
            f"contract {name!r}",
            select(s.service_contract.c.service_name).where(
                s.service_contract.c.contract_name == name
            ),
            "service(s)",
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
        as_name(name, "queue")
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
        activation: Activation | dict[str, Any] | None = UNSET,
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
        if activation is not UNSET:
            act = Activation.from_value(activation)
            values["activation"] = act.to_dict() if act else None
        if status is True:
            values["rollback_count"] = 0
        self._conn.execute(
            update(s.queue).where(s.queue.c.queue_id == row.queue_id).values(**values)
        )
        if status is True and not row.status:
            record_event(self._conn, "queue_enabled", name, "queue re-enabled by ALTER QUEUE")
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
            record_event(self._conn, "queue_disabled", name, "queue disabled by ALTER QUEUE")

    def drop_queue(self, name: str) -> None:
        row = self._queue_row(name)
        self._refuse_if_used(
            f"queue {name!r}",
            select(s.service.c.name).where(s.service.c.queue_id == row.queue_id),
            "service(s)",
        )
        self._conn.execute(delete(s.message).where(s.message.c.queue_id == row.queue_id))
        self._conn.execute(delete(s.queue).where(s.queue.c.queue_id == row.queue_id))

    # -- services ------------------------------------------------------------------------------
    def create_service(self, name: str, queue: str, contracts: Sequence[str] = ()) -> None:
        """CREATE SERVICE on ``queue``; ``contracts`` are those it accepts as a target."""
        as_name(name, "service")
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
        endpoints = select(s.conversation_endpoint.c.conversation_handle).where(
            s.conversation_endpoint.c.service_name == name
        )
        if self._conn.dialect.name == "postgresql":
            # The lock order (see airflow_broker.messaging): removers lock the endpoints first,
            # in handle order, so that writers into their queues finish before the removal.
            self._conn.execute(
                endpoints.order_by(s.conversation_endpoint.c.conversation_handle).with_for_update()
            )
        self._conn.execute(delete(s.message).where(s.message.c.conversation_handle.in_(endpoints)))
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
        as_name(name, "route")
        if service_name is not None:
            as_name(service_name, "route service")
        if broker_instance is not None:
            as_uuid(broker_instance, f"route {name!r}: broker_instance")
            broker_instance = str(uuid.UUID(str(broker_instance)))
        check_address(name, address, "address")
        if mirror_address is not None:
            check_address(name, mirror_address, "mirror_address")
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
        as_name(name, "priority")
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
    def configure(self, *, forwarding: bool | None = None, principal: bool | None = None) -> None:
        """Broker-wide settings.

        :param forwarding: pass on messages for services this broker does not host (seed 002).
        :param principal: False makes this database say it is not the principal of a mirrored
            pair: it refuses deliveries, and senders use the route's mirror address.
        """
        values: dict[str, bool] = {}
        for key, value in (("forwarding", forwarding), ("principal", principal)):
            if value is None:
                continue
            if not isinstance(value, bool):
                raise InvalidDefinition(
                    f"broker setting {key} must be true or false, not {value!r}"
                )
            values[key] = value
        if values:
            self._conn.execute(update(s.broker_instance).values(**values))


def check_address(route: str, address: Any, what: str) -> None:
    if not isinstance(address, str) or not (
        address in ("LOCAL", "TRANSPORT")
        or (address.startswith("broker://") and len(address) > len("broker://"))
    ):
        raise InvalidDefinition(
            f"route {route!r}: {what} {address!r} must be LOCAL, TRANSPORT or broker://NAME"
        )
