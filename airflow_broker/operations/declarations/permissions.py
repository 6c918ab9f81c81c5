"""The ``permissions`` section of a declarations file: SEND and RECEIVE granted to (or revoked
from) database roles (:mod:`airflow_broker.security.permissions`; PostgreSQL only).

Each entry names one permission and one or several roles::

    permissions:
      - send: //po/Supplier          # GRANT SEND ON SERVICE //po/Supplier TO clerk
        to: clerk
      - receive: supplier_q          # GRANT RECEIVE ON supplier_q TO each role
        to: [supplier_reader, auditor]
      - send: //po/Legacy            # REVOKE SEND ON SERVICE //po/Legacy FROM clerk
        from: clerk

As for every other object, what the file does not name is left alone: a grant goes only when an
entry says ``from:``. A grant that is held already, or a revoke of one that is not, is
unchanged. The services and queues named must be declared in the file or exist; the roles must
exist in the database when the file is applied (else nothing of it is).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import yaml

from airflow_broker.messaging.objects import Catalog
from airflow_broker.operations.declarations.model import (
    _NULL,
    Declarations,
    PermissionChange,
    PermissionDecl,
    Problem,
)
from airflow_broker.operations.declarations.reader import _describe, _line, _Reader, _suggest

#: The keys of an entry: one of the permissions, one of the directions.
KEYS: Final = ("send", "receive", "to", "from")
#: Longest role name (PostgreSQL's NAMEDATALEN - 1).
MAX_ROLE: Final = 63
_PERMISSION: Final = {"send": "SEND", "receive": "RECEIVE"}
_SECTION: Final = {"SEND": "services", "RECEIVE": "queues"}


def parse_section(r: _Reader, node: yaml.Node | None) -> tuple[PermissionDecl, ...]:
    """The entries of ``permissions:`` (None: the file has no such section), one per role."""
    if node is None:
        return ()
    out: list[PermissionDecl] = []
    seen: dict[tuple[str, str, str], int] = {}
    for index, item in enumerate(r.sequence(node, "permissions")):
        what = f"permission #{index + 1}"
        entries = r.mapping(item, what, allowed=KEYS)
        if not entries:
            continue
        kinds = [k for k in ("send", "receive") if k in entries]
        ways = [k for k in ("to", "from") if k in entries]
        if len(kinds) != 1:
            r.problem(item, f"{what}: give one of send: SERVICE or receive: QUEUE")
        if len(ways) != 1:
            r.problem(item, f"{what}: give to: ROLE (grant) or from: ROLE (revoke), one of them")
        if len(kinds) != 1 or len(ways) != 1:
            continue
        permission = _PERMISSION[kinds[0]]
        name = r.string(entries[kinds[0]], f"{what}: {kinds[0]}")
        what = f"permission {permission} on {name!r}" if name else what
        for role_node, role in _roles(r, entries[ways[0]], f"{what}: {ways[0]}"):
            key = (permission, name, role)
            if key in seen:
                r.problem(
                    role_node,
                    f"{what}: role {role!r} is named twice (first on line {seen[key]})",
                )
                continue
            seen[key] = _line(role_node)
            out.append(PermissionDecl(permission, name, role, ways[0] == "to", _line(role_node)))
    return tuple(out)


def _roles(r: _Reader, node: yaml.Node, what: str) -> list[tuple[yaml.Node, str]]:
    """A role name, or a list of them."""
    nodes = list(node.value) if isinstance(node, yaml.SequenceNode) else [node]
    if isinstance(node, yaml.SequenceNode) and not nodes:
        r.problem(node, f"{what} must name at least one role, not an empty list")
    if isinstance(node, yaml.ScalarNode) and node.tag == _NULL:
        r.problem(node, f"{what} must be a role's name or a list of them, not {_describe(node)}")
        return []
    out = []
    for n in nodes:
        role = r.string(n, f"{what}: role", max_length=MAX_ROLE)
        if role:
            out.append((n, role))
    return out


def plan(
    decls: Declarations,
    catalog: Catalog,
    granted: Iterable[tuple[str, str, str]] | None,
) -> tuple[tuple[PermissionChange, ...], list[Problem]]:
    """The grants and revokes to make, given what is granted now (``(permission, object,
    role)``); ``granted`` None: the database has no roles (SQLite), every entry is a problem."""
    if not decls.permissions:
        return (), []
    problems: list[Problem] = []
    if granted is None:
        first = decls.permissions[0]
        problems.append(
            Problem(
                first.line,
                "permissions are granted to database roles and need PostgreSQL: this broker "
                "is on SQLite, where every connection may do everything",
            )
        )
        return (), problems
    held = set(granted)
    changes: list[PermissionChange] = []
    for decl in decls.permissions:
        section = _SECTION[decl.permission]
        existing = catalog.services if section == "services" else catalog.queues
        known = [*decls.declared.get(section, ()), *existing]
        key = (decl.permission, decl.object_name, decl.role)
        if decl.object_name not in known:
            kind = "service" if section == "services" else "queue"
            problems.append(
                Problem(
                    decl.line,
                    f"{decl.describe()}: {kind} {decl.object_name!r} is declared neither in this "
                    f"file nor in the database{_suggest(decl.object_name, known)}",
                )
            )
            continue
        changes.append(PermissionChange(decl, (key in held) != decl.grant))
    return tuple(changes), problems


__all__ = ["KEYS", "MAX_ROLE", "parse_section", "plan"]
