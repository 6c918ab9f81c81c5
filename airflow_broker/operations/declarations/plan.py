"""Step 2, :func:`plan`: the declarations against the database's catalog and settings; what
cannot resolve or change in place is a problem, the rest a change.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal

import airflow_broker.operations.declarations.permissions as permissions
import airflow_broker.operations.declarations.security as security
from airflow_broker.constants import DEFAULT
from airflow_broker.messaging.definitions import Activation
from airflow_broker.messaging.objects import Catalog
from airflow_broker.operations.declarations.model import (
    KIND,
    SECTIONS,
    Action,
    BindingDecl,
    CertificateDecl,
    Change,
    ContractDecl,
    Decl,
    Declarations,
    MessageTypeDecl,
    Plan,
    Problem,
    QueueDecl,
    RouteDecl,
    ServiceDecl,
    SettingChange,
)
from airflow_broker.operations.declarations.reader import _suggest


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, (tuple, list, set, frozenset)):
        return "[" + ", ".join(sorted(str(v) for v in value)) + "]"
    if isinstance(value, str) and "\n" in value:  # an XML schema: one line of the plan
        return " ".join(value.split())
    return str(value)


def _diff(pairs: Iterable[tuple[str, Any, Any]]) -> tuple[str, ...]:
    return tuple(f"{key}: {_show(old)} -> {_show(new)}" for key, old, new in pairs if old != new)


def _same_instance(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is b
    try:
        return uuid.UUID(a) == uuid.UUID(b)
    except ValueError:
        return a == b


def plan(
    decls: Declarations,
    catalog: Catalog,
    *,
    now: datetime | None = None,
    settings: Mapping[str, bool] | None = None,
    granted: Iterable[tuple[str, str, str]] | None = (),
) -> tuple[Plan, list[Problem]]:
    """Compare the declarations with the database. Returns the plan and the problems found.

    ``settings`` are the broker's current settings (``forwarding``, ``principal``: the columns of
    ``broker_instance``); a setting the file gives and ``settings`` lacks is planned as a change
    from ``unknown``. ``granted``: the permissions held now, ``(permission, object, role)``
    (``Broker.permissions()``); None on SQLite, where a ``permissions`` entry is a problem.

    Problems: references that resolve neither in the file nor in the database, and contracts
    that exist with a different definition (conversations begun on a contract depend on its
    rules, and Service Broker has no ALTER CONTRACT), or a ``DEFAULT`` message type that does.
    Every other object that exists with a different definition is altered in place by its
    ALTER verb, in what differs: a queue in the keys the file gives (ALTER QUEUE); a message
    type's validation (ALTER MESSAGE TYPE: messages sent from then on); a service's queue,
    which its conversations move to, and its contracts (ALTER SERVICE); a route's fields (ALTER
    ROUTE); a priority's (ALTER BROKER PRIORITY: conversations begun from then on); a remote
    service binding's certificate and anonymity (ALTER REMOTE SERVICE BINDING). Certificates, like
    contracts, cannot change in place (see :mod:`.security` for what else is checked of them).
    """
    now = now or datetime.now(UTC)
    problems: list[Problem] = []
    existing: dict[str, Mapping[str, Any]] = {
        "message_types": catalog.message_types,
        "contracts": catalog.contracts,
        "queues": catalog.queues,
        "services": catalog.services,
        "routes": catalog.routes,
        "priorities": catalog.priorities,
        "certificates": catalog.certificates,
        "remote_service_bindings": catalog.remote_service_bindings,
    }

    for section, name, ref in decls.refs:
        known = [*decls.declared.get(ref.section, ()), *existing[ref.section]]
        if ref.name in known:
            continue
        problems.append(
            Problem(
                ref.line,
                f"{KIND[section]} {name!r}: {ref.key} {ref.name!r} is declared "
                f"neither in this file nor in the database{_suggest(ref.name, known)}",
            )
        )

    problems.extend(security.plan_problems(decls, catalog, now))
    permission_changes, permission_problems = permissions.plan(decls, catalog, granted)
    problems.extend(permission_problems)

    current_settings = settings or {}
    setting_changes = tuple(
        SettingChange(key, current_settings.get(key), value)
        for key, value in decls.settings.items()
    )

    changes: list[Change] = []
    for section in SECTIONS:
        for decl in decls.section(section):
            current = existing[section].get(decl.name)
            if current is None:
                changes.append(Change(section, decl, "create"))
                continue
            action, differences, arguments = _compare(decl, current, now)
            kind = KIND[section]
            if action == "refuse":
                problems.append(
                    Problem(
                        decl.line,
                        f"{kind} {decl.name!r} already exists with a different definition "
                        f"({'; '.join(differences)}, database -> file); a {kind} cannot be "
                        "changed in place: drop it first or declare the new one under another name",
                    )
                )
                continue
            if action == "alter" and section == "message_types" and decl.name == DEFAULT:
                problems.append(
                    Problem(
                        decl.line,
                        f"{kind} {DEFAULT!r} is a system object and cannot be altered "
                        f"({'; '.join(differences)}, database -> file)",
                    )
                )
                continue
            changes.append(Change(section, decl, action, differences, arguments))
    return Plan(tuple(changes), setting_changes, permission_changes), problems


Compared = tuple[Action | Literal["refuse"], tuple[str, ...], dict[str, Any]]


def _compare(decl: Decl, current: Any, now: datetime) -> Compared:
    """What differs between ``decl`` and the database's ``current``, and the arguments of the
    ALTER verb that makes them equal."""
    if isinstance(decl, CertificateDecl | BindingDecl):
        return security.compare(decl, current)
    if isinstance(decl, MessageTypeDecl):
        differences = _diff(
            [
                ("validation", current.validation, decl.validation),
                ("json_schema", current.json_schema or None, decl.json_schema),
                ("xml_schema", current.xml_schema or None, decl.xml_schema),
            ]
        )
        return _altered(
            differences,
            {
                "validation": decl.validation,
                "json_schema": decl.json_schema,
                "xml_schema": decl.xml_schema,
            },
        )
    if isinstance(decl, ContractDecl):
        differences = _diff([("message_types", dict(current.message_types), decl.message_types)])
        return ("refuse" if differences else "unchanged"), differences, {}
    if isinstance(decl, ServiceDecl):
        have, want = frozenset(current.contracts), frozenset(decl.contracts)
        differences = _diff([("queue", current.queue, decl.queue), ("contracts", have, want)])
        arguments: dict[str, Any] = {}
        if current.queue != decl.queue:
            arguments["queue"] = decl.queue
        if want - have:
            arguments["add_contracts"] = sorted(want - have)
        if have - want:
            arguments["drop_contracts"] = sorted(have - want)
        return _altered(differences, arguments)
    if isinstance(decl, QueueDecl):
        pairs: list[tuple[str, Any, Any]] = []
        for key, wanted in decl.settings.items():
            had = getattr(current, key)
            if key == "activation" and had is not None and wanted is not None:
                # Name the activation settings that differ, not the whole clause.
                had = {**Activation().to_dict(), **dict(had)}
                pairs.extend((f"activation.{k}", had.get(k), v) for k, v in wanted.items())
            else:
                pairs.append((key, had, wanted))
        differences = _diff(pairs)
        return ("alter" if differences else "unchanged"), differences, {}
    if isinstance(decl, RouteDecl):
        return _compare_route(decl, current, now)
    fields = [
        ("contract", current.contract, decl.contract),
        ("local_service", current.local_service, decl.local_service),
        ("remote_service", current.remote_service, decl.remote_service),
        ("priority", current.priority, decl.priority),
    ]
    return _altered(_diff(fields), {key: new for key, old, new in fields if old != new})


def _compare_route(decl: RouteDecl, current: Any, now: datetime) -> Compared:
    fields = [
        ("service_name", current.service_name, decl.service_name),
        ("address", current.address, decl.address),
        ("mirror_address", current.mirror_address, decl.mirror_address),
    ]
    differences = list(_diff(fields))
    arguments: dict[str, Any] = {key: new for key, old, new in fields if old != new}
    if not _same_instance(current.broker_instance, decl.broker_instance):
        differences.append(
            f"broker_instance: {_show(current.broker_instance)} -> {_show(decl.broker_instance)}"
        )
        arguments["broker_instance"] = decl.broker_instance
    # The lifetime counts from the apply that created the route: applying the file again
    # neither renews nor shortens it, unless it has run out (then it is renewed from now).
    expires_at: datetime | None = current.expires_at
    if expires_at is not None and expires_at.tzinfo is None:
        expires_at = expires_at.replace(tzinfo=UTC)
    lifetime: str | None = None
    if decl.lifetime_seconds is None and expires_at is not None:
        lifetime = f"expires {expires_at.isoformat()} -> none"
    elif decl.lifetime_seconds is not None and expires_at is None:
        lifetime = f"none -> {decl.lifetime_seconds} seconds"
    elif decl.lifetime_seconds is not None and expires_at is not None and expires_at <= now:
        lifetime = f"expired {expires_at.isoformat()} -> {decl.lifetime_seconds} seconds"
    if lifetime is not None:
        differences.append(f"lifetime: {lifetime}")
        arguments["lifetime_seconds"] = decl.lifetime_seconds
    return _altered(tuple(differences), arguments)


def _altered(differences: tuple[str, ...], arguments: dict[str, Any]) -> Compared:
    if not differences:
        return "unchanged", (), {}
    return "alter", differences, arguments
