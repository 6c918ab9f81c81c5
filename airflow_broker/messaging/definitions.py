"""CREATE / ALTER / DROP of message types, contracts, queues, services, routes and priorities.

:func:`define` opens the one transaction a batch of definitions runs in; :class:`Activation` is a
queue's ``ACTIVATION (...)`` clause (what :mod:`airflow_broker.activation` acts on). Services are
:mod:`~airflow_broker.messaging.service_definitions` (ALTER and DROP SERVICE act on the service's
conversations), routes and priorities :mod:`~airflow_broker.messaging.route_definitions`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from airflow_broker.constants import DEFAULT, SENT_BY, SYSTEM_MESSAGE_TYPES
from airflow_broker.errors import InvalidDefinition, UnknownObject
from airflow_broker.messaging import failure
from airflow_broker.messaging.arguments import UNSET, as_name
from airflow_broker.messaging.events import record_event
from airflow_broker.messaging.permission_definitions import PermissionDefinitions
from airflow_broker.messaging.route_definitions import RouteDefinitions, check_address
from airflow_broker.messaging.security_definitions import SecurityDefinitions
from airflow_broker.messaging.service_definitions import ServiceDefinitions
from airflow_broker.messaging.validation import check_definition
from airflow_broker.security import permissions
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


class Definitions(ServiceDefinitions, RouteDefinitions, SecurityDefinitions, PermissionDefinitions):
    """CREATE / ALTER / DROP of broker objects, all inside one transaction.

    Obtained from :meth:`Broker.definitions`; the same verbs on :class:`Broker` each run in a
    transaction of their own. Message types, contracts, queues and the broker's settings are
    here; services in :class:`~airflow_broker.messaging.service_definitions.ServiceDefinitions`,
    routes and priorities in
    :class:`~airflow_broker.messaging.route_definitions.RouteDefinitions`, certificates and
    remote service bindings in
    :class:`~airflow_broker.messaging.security_definitions.SecurityDefinitions`, permissions
    in :class:`~airflow_broker.messaging.permission_definitions.PermissionDefinitions`.
    """

    # -- message types -------------------------------------------------------------------------
    def create_message_type(
        self,
        name: str,
        validation: str = "none",
        json_schema: dict[str, Any] | None = None,
        xml_schema: str | None = None,
    ) -> None:
        """CREATE MESSAGE TYPE. ``validation``: none, empty, json, json_schema, well_formed_xml,
        xml_schema. ``json_schema`` (a JSON Schema, a dict) goes with ``validation="json_schema"``
        only, ``xml_schema`` (the text of an XSD 1.0 schema, ``<xs:schema ...>``) with
        ``validation="xml_schema"`` only; an invalid schema is refused here."""
        as_name(name, "message type")
        if name in SYSTEM_MESSAGE_TYPES:
            raise InvalidDefinition(f"message type {name!r} is a system message type")
        check_definition(name, validation, json_schema, xml_schema)
        self._refuse_existing(s.message_type, s.message_type.c.name, name, "message type")
        self._conn.execute(
            insert(s.message_type).values(
                name=name,
                validation=validation,
                json_schema=json_schema,
                xml_schema=xml_schema,
                created_at=utcnow(),
            )
        )

    def alter_message_type(
        self,
        name: str,
        *,
        validation: str,
        json_schema: dict[str, Any] | None = None,
        xml_schema: str | None = None,
    ) -> None:
        """ALTER MESSAGE TYPE ... VALIDATION: messages sent from now on are validated by the new
        definition (``json_schema`` goes with ``validation="json_schema"`` only, ``xml_schema``
        with ``validation="xml_schema"`` only); messages already sent keep what they were
        checked against. Turning validation off in production and on in development is the
        usual reason (seed 004)."""
        self._require(s.message_type, s.message_type.c.name, name, "message type")
        if name == DEFAULT:
            raise InvalidDefinition(
                f"message type {DEFAULT!r} is a system object and cannot be altered"
            )
        check_definition(name, validation, json_schema, xml_schema)
        self._conn.execute(
            update(s.message_type)
            .where(s.message_type.c.name == name)
            .values(validation=validation, json_schema=json_schema, xml_schema=xml_schema)
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
        *,
        retry_delay: float | None = None,
        retry_delay_max: float | None = None,
        max_receives: int | None = None,
        dead_letter_queue: str | None = None,
    ) -> None:
        """CREATE QUEUE, with failure handling per conversation (all off by default: Service
        Broker's rule, five rolled-back receives in a row disable the queue).

        :param retry_delay: after a failed attempt, the conversation group waits this many
            seconds before its messages are handed out again, doubling per attempt
        :param retry_delay_max: ... up to this many seconds
        :param max_receives: a message handed out this many times without being processed
            dead-letters its conversation (ended WITH ERROR ``DEAD_LETTERED``, its messages moved
            to ``dead_letter_queue``); the queue is then never disabled by poison handling
        :param dead_letter_queue: the queue that receives them (an ordinary queue, required
            with ``max_receives``)
        """
        as_name(name, "queue")
        options = self._failure_options(
            name,
            {
                "retry_delay": retry_delay,
                "retry_delay_max": retry_delay_max,
                "max_receives": max_receives,
                "dead_letter_queue": dead_letter_queue,
            },
            {},
        )
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
                **options,
            )
        )

    def _failure_options(
        self, name: str, given: dict[str, Any], current: dict[str, Any]
    ) -> dict[str, Any]:
        """Checked failure-handling options of queue ``name`` (``given`` over ``current``)."""
        values = failure.check_options(name, given)
        failure.check_combination(name, {**current, **values})
        dlq = values.get("dead_letter_queue")
        if dlq is not None:
            found = self._conn.execute(
                select(s.queue.c.dead_letter_queue).where(s.queue.c.name == dlq)
            ).first()
            if found is None:
                raise UnknownObject(
                    f"queue {name!r}: dead_letter_queue {dlq!r} does not exist in this broker"
                )
        return values

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
        """ALTER QUEUE. Re-enabling a queue (``status=True``) also resets its rollback count
        and lets messages that waited for it in the transmission queue go on the next due pass.
        The failure-handling options (see :meth:`create_queue`) change when given; None turns
        one off."""
        row = self._queue_row(name)
        given = {
            k: v
            for k, v in (
                ("retry_delay", retry_delay),
                ("retry_delay_max", retry_delay_max),
                ("max_receives", max_receives),
                ("dead_letter_queue", dead_letter_queue),
            )
            if v is not UNSET
        }
        current = {k: getattr(row, k) for k in failure.OPTIONS}
        values: dict[str, Any] = {"modified_at": utcnow()}
        values.update(self._failure_options(name, given, current))
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
                .values(next_attempt_at=values["modified_at"], wait_id=None)  # out of any cause
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
        self._refuse_if_used(
            f"queue {name!r}",
            select(s.queue.c.name).where(s.queue.c.dead_letter_queue == name),
            "queue(s) as their dead_letter_queue",
        )
        self._conn.execute(delete(s.message).where(s.message.c.queue_id == row.queue_id))
        # Dead-lettered conversations (closed) live in the queue they were moved to.
        e = s.conversation_endpoint
        self._conn.execute(delete(e).where(e.c.queue_id == row.queue_id))
        self._conn.execute(delete(s.queue).where(s.queue.c.queue_id == row.queue_id))
        permissions.forget_object(self._conn, permissions.RECEIVE, name)

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


__all__ = ["Activation", "Definitions", "check_address", "define"]
