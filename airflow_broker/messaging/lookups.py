"""The definitions delivery reads on every message, cached briefly per broker.

Hosted services (with their queue's status), contract rules, message types and priorities
change rarely and are read on the hot path: each is kept for
:data:`~airflow_broker.storage.context.DEFINITION_CACHE_SECONDS` by
:meth:`BrokerContext.cached_definition`, and dropped after every definition change made
through the same broker.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    select,
)
from sqlalchemy.engine import Connection

from airflow_broker.errors import (
    ContractViolation,
    UnknownObject,
)
from airflow_broker.storage import schema as s

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext


@dataclass(frozen=True, slots=True)
class Hosted:
    """A service this broker hosts, as delivery sees it."""

    queue_id: int
    queue_name: str
    queue_status: bool
    contracts: frozenset[str]
    #: a data-dependent routing service: open to every contract
    router: bool

    def accepts(self, contract: str) -> bool:
        return self.router or contract in self.contracts


def hosted_services(broker: BrokerContext, conn: Connection) -> dict[str, Hosted]:
    """The services this broker hosts, by name (cached briefly; queue status included, so a
    re-enabled queue is noticed within the cache's second)."""

    def load() -> dict[str, Hosted]:
        rows = conn.execute(
            select(
                s.service.c.name,
                s.service.c.queue_id,
                s.queue.c.name.label("queue_name"),
                s.queue.c.status,
                s.routing_service.c.name.label("router"),
            )
            .join(s.queue, s.queue.c.queue_id == s.service.c.queue_id)
            .outerjoin(s.routing_service, s.routing_service.c.name == s.service.c.name)
        ).all()
        contracts: dict[str, set[str]] = defaultdict(set)
        for r in conn.execute(select(s.service_contract)):
            contracts[r.service_name].add(r.contract_name)
        return {
            r.name: Hosted(
                r.queue_id,
                r.queue_name,
                bool(r.status),
                frozenset(contracts[r.name]),
                r.router is not None,
            )
            for r in rows
        }

    return broker.cached_definition("hosted_services", load)


def local_service_queue(broker: BrokerContext, conn: Connection, name: str) -> int | None:
    """The queue id of local service ``name``, or None if there is no such service (cached
    briefly when found; a name not found is read again each time, so a service created a
    moment ago in another process is found)."""

    def load() -> int | None:
        queue_id = conn.execute(
            select(s.service.c.queue_id).where(s.service.c.name == name)
        ).scalar()
        return None if queue_id is None else int(queue_id)

    found: int | None = broker.peek_definition(("service_queue", name))
    if found is None:
        found = load()
        if found is not None:
            broker.cached_definition(("service_queue", name), lambda: found)
    return found


def contract_exists(broker: BrokerContext, conn: Connection, name: str) -> bool:
    """Whether contract ``name`` exists (the names cached briefly; read on ``conn`` when the
    cache does not have it)."""

    def load() -> frozenset[str]:
        return frozenset(conn.execute(select(s.contract.c.name)).scalars())

    if name in broker.cached_definition("contracts", load):
        return True
    found = conn.execute(select(s.contract.c.name).where(s.contract.c.name == name)).first()
    return found is not None


def priority_for(
    broker: BrokerContext, conn: Connection, contract: str, local: str, remote: str
) -> int:
    """The priority of a conversation endpoint: the most specific matching broker priority."""

    def load() -> list[Any]:
        return list(conn.execute(select(s.priority)))

    best: tuple[tuple[bool, bool, bool], int] | None = None
    for p in broker.cached_definition("priorities", load):
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


def _schema(row: Any) -> Any:
    """The schema a message type row validates bodies against: its JSON schema (a dict) for
    validation ``json_schema``, its XSD text for ``xml_schema``, else None."""
    return row.xml_schema if row.validation == "xml_schema" else row.json_schema


def message_type_def(
    broker: BrokerContext, conn: Connection, message_type: str
) -> tuple[str, Any] | None:
    """(validation, schema) of a message type, or None if there is no such type (the schema as
    :func:`~airflow_broker.messaging.validation.validate_body` takes it)."""

    def load() -> tuple[str, Any] | None:
        mt = s.message_type
        row = conn.execute(
            select(mt.c.validation, mt.c.json_schema, mt.c.xml_schema).where(
                mt.c.name == message_type
            )
        ).first()
        return None if row is None else (row.validation, _schema(row))

    return broker.cached_definition(("message_type", message_type), load)


def known_message_type_def(broker: BrokerContext, message_type: str) -> tuple[str, Any] | None:
    """:func:`message_type_def` as this process read it lately, without reading it: None when
    there is no such type, or it was not read lately."""
    value: tuple[str, Any] | None = broker.peek_definition(("message_type", message_type))
    return value


def contract_rule(
    broker: BrokerContext, conn: Connection, contract: str, message_type: str
) -> tuple[str, str, Any]:
    """(sent_by, validation, schema) of ``message_type`` in ``contract`` (the schema as
    :func:`message_type_def` gives it)."""

    def load() -> tuple[str, str, Any] | None:
        row = conn.execute(
            select(
                s.contract_message.c.sent_by,
                s.message_type.c.validation,
                s.message_type.c.json_schema,
                s.message_type.c.xml_schema,
            )
            .join(s.message_type, s.message_type.c.name == s.contract_message.c.message_type_name)
            .where(
                s.contract_message.c.contract_name == contract,
                s.contract_message.c.message_type_name == message_type,
            )
        ).first()
        return None if row is None else (row.sent_by, row.validation, _schema(row))

    rule = broker.cached_definition(("rule", contract, message_type), load)
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
