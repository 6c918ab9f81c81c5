"""Step 3, :func:`apply_plan`: the changes in dependency order in one ``definitions()``
transaction; :func:`apply_declarations` runs the three steps on a broker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_broker.messaging.definitions import Activation, Definitions, define
from airflow_broker.operations.declarations.model import (
    QUEUE_LATE_SETTINGS,
    ContractDecl,
    DeclarationsInvalid,
    MessageTypeDecl,
    Plan,
    QueueDecl,
    RouteDecl,
    ServiceDecl,
)
from airflow_broker.operations.declarations.parse import parse
from airflow_broker.operations.declarations.plan import plan
from airflow_broker.operations.observation import catalog

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext


def apply_plan(p: Plan, d: Definitions) -> None:
    """Run every change of the plan through ``d`` (one ``broker.definitions()`` transaction): a
    CREATE for each new object, the object's ALTER for each that differs."""
    late: list[tuple[str, dict[str, Any]]] = []
    for change in p.changes:
        if change.action == "unchanged":
            continue
        decl = change.decl
        if change.action == "alter" and not isinstance(decl, QueueDecl):
            _alter(d, change.section, decl.name, change.arguments)
        elif isinstance(decl, MessageTypeDecl):
            d.create_message_type(
                decl.name, validation=decl.validation, json_schema=decl.json_schema
            )
        elif isinstance(decl, ContractDecl):
            d.create_contract(decl.name, dict(decl.message_types))
        elif isinstance(decl, QueueDecl):
            # A dead-letter queue may be declared further down: those settings come last.
            settings = decl.create_settings() if change.action == "create" else dict(decl.settings)
            deferred: dict[str, Any] = {
                k: settings.pop(k) for k in QUEUE_LATE_SETTINGS if k in settings
            }
            if change.action == "create":
                d.create_queue(decl.name, **_with_activation(settings))
            else:
                d.alter_queue(decl.name, **_with_activation(settings))
            if any(v is not None for v in deferred.values()) or (
                deferred and change.action != "create"
            ):
                late.append((decl.name, deferred))
        elif isinstance(decl, ServiceDecl):
            d.create_service(decl.name, queue=decl.queue, contracts=list(decl.contracts))
        elif isinstance(decl, RouteDecl):
            d.create_route(
                decl.name,
                service_name=decl.service_name,
                broker_instance=decl.broker_instance,
                address=decl.address,
                mirror_address=decl.mirror_address,
                lifetime_seconds=decl.lifetime_seconds,
            )
        else:
            d.create_priority(
                decl.name,
                contract=decl.contract,
                local_service=decl.local_service,
                remote_service=decl.remote_service,
                priority=decl.priority,
            )
    for name, deferred in late:
        d.alter_queue(name, **deferred)
    changed = {s.name: s.new for s in p.settings if s.changed}
    if changed:
        d.configure(**changed)


#: The ALTER verb of each section whose changes the plan gives as arguments.
_ALTER = {
    "message_types": "alter_message_type",
    "services": "alter_service",
    "routes": "alter_route",
    "priorities": "alter_priority",
}


def _alter(d: Definitions, section: str, name: str, arguments: dict[str, Any]) -> None:
    getattr(d, _ALTER[section])(name, **arguments)


def _with_activation(settings: dict[str, Any]) -> dict[str, Any]:
    if settings.get("activation") is not None:
        settings["activation"] = Activation(**settings["activation"])
    return settings


def apply_declarations(broker: BrokerContext, text: str, name: str) -> list[str]:
    """Make ``broker`` match the declarations file ``text`` (the ``airflow-broker apply``
    format), in one transaction; returns what changed (nothing when it already matches).

    :param name: how problems name the file (``FILE:LINE: message``).
    """
    decls, problems = parse(text)
    if problems:
        raise DeclarationsInvalid(name, problems)
    the_plan, problems = plan(decls, catalog(broker))
    if problems:
        raise DeclarationsInvalid(name, problems)
    changes = [c.describe() for c in the_plan.changes if c.action != "unchanged"]
    if the_plan.has_changes:
        with define(broker) as d:
            apply_plan(the_plan, d)
    return changes
