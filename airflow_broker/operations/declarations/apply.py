"""Step 3, :func:`apply_plan`: the changes in dependency order in one ``definitions()``
transaction; :func:`apply_declarations` runs the three steps on a broker.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_broker.messaging.definitions import Activation, Definitions, define
from airflow_broker.operations.declarations.model import (
    QUEUE_LATE_SETTINGS,
    BindingDecl,
    CertificateDecl,
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
from airflow_broker.security.permissions import permissions as permission_store

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
                decl.name,
                validation=decl.validation,
                json_schema=decl.json_schema,
                xml_schema=decl.xml_schema,
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
        elif isinstance(decl, CertificateDecl):
            if decl.pem is None:
                d.create_certificate(
                    decl.name, owner=decl.owner, subject=decl.subject, expires_at=decl.expires_at
                )
            else:
                d.import_certificate(
                    decl.name, decl.pem, owner=decl.owner, private_key_pem=decl.private_key_pem
                )
        elif isinstance(decl, BindingDecl):
            d.create_remote_service_binding(
                decl.name,
                service=decl.service,
                certificate=decl.certificate,
                anonymous=decl.anonymous,
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
    for grant in p.permissions:
        if grant.changed:
            _PERMISSION_VERBS[grant.decl.permission, grant.decl.grant](
                d, grant.decl.object_name, grant.decl.role
            )


#: The verb of each permission entry: (permission, grant?) -> Definitions' method.
_PERMISSION_VERBS: dict[tuple[str, bool], Callable[[Definitions, str, str], bool]] = {
    ("SEND", True): Definitions.grant_send,
    ("SEND", False): Definitions.revoke_send,
    ("RECEIVE", True): Definitions.grant_receive,
    ("RECEIVE", False): Definitions.revoke_receive,
}


#: The ALTER verb of each section whose changes the plan gives as arguments.
_ALTER = {
    "message_types": "alter_message_type",
    "services": "alter_service",
    "routes": "alter_route",
    "priorities": "alter_priority",
    "remote_service_bindings": "alter_remote_service_binding",
}


def _alter(d: Definitions, section: str, name: str, arguments: dict[str, Any]) -> None:
    getattr(d, _ALTER[section])(name, **arguments)


def _with_activation(settings: dict[str, Any]) -> dict[str, Any]:
    if settings.get("activation") is not None:
        settings["activation"] = Activation(**settings["activation"])
    return settings


def granted_now(broker: BrokerContext) -> list[tuple[str, str, str]] | None:
    """The permissions held now, as :func:`~.plan.plan` takes them (None on SQLite)."""
    if broker.dialect != "postgresql":
        return None
    with broker.engine.connect() as conn:
        return [(p.permission, p.object_name, p.grantee) for p in permission_store(conn)]


def apply_declarations(
    broker: BrokerContext, text: str, name: str, *, base_dir: Path | None = None
) -> list[str]:
    """Make ``broker`` match the declarations file ``text`` (the ``airflow-broker apply``
    format), in one transaction; returns what changed (nothing when it already matches).

    :param name: how problems name the file (``FILE:LINE: message``).
    :param base_dir: where files the declarations name are read from (certificates' PEM).
    """
    decls, problems = parse(text, base_dir=base_dir)
    if problems:
        raise DeclarationsInvalid(name, problems)
    granted = granted_now(broker) if decls.permissions else ()
    the_plan, problems = plan(decls, catalog(broker), granted=granted)
    if problems:
        raise DeclarationsInvalid(name, problems)
    changes = [c.describe() for c in the_plan.changes if c.action != "unchanged"]
    changes += [p.describe() for p in the_plan.permissions if p.changed]
    if the_plan.has_changes:
        with define(broker) as d:
            apply_plan(the_plan, d)
    return changes
