"""Permissions: SEND on a service and RECEIVE on a queue, granted to database roles (seed 004),
enforced by PostgreSQL itself.

A role granted only these, connecting with its own credentials, may begin dialogs to and SEND
to the services granted, RECEIVE (lease, peek) from the queues granted, and nothing else: it has
no right on the broker's tables, only on the views of :mod:`airflow_broker.storage.client_schema`,
which show and take the rows its grants allow (computed in every statement, so a revoke counts
from the next one). The engine notices it runs as such a role (:mod:`airflow_broker.storage.roles`)
and works through the views with the same statements; before each verb it checks the grants
itself, once per transaction, to say precisely what is refused (:class:`PermissionDenied`: "role
'clerk' has no SEND permission on service '//po/Supplier'"). The broker's owner (and a
single-role deployment) is never checked: it uses the tables as before.

What a grant allows, as Service Broker checks it:

- SEND on service S: BEGIN DIALOG to S (from any local service), SEND and END CONVERSATION on
  the dialogs to S, and what a SEND does along the way (the target's endpoint, its messages);
- RECEIVE on queue Q: RECEIVE, GET CONVERSATION GROUP, leases and peek on Q, and SEND (replies),
  END CONVERSATION, timers and MOVE on the conversations whose endpoint is on Q; failure handling
  of Q (receive counts, disabling Q, dead-lettering into Q's dead-letter queue).

Grants are rows of ``broker_permission``; granting a role its first one grants it the client
schema, revoking its last takes the schema away. Dropping a service or a queue drops its
permissions. SQLite has no roles: a grant there is refused.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection

from airflow_broker.errors import InvalidDefinition, PermissionDenied, UnknownObject
from airflow_broker.storage import client_schema
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow
from airflow_broker.storage.roles import CLIENT_SCHEMA

log = logging.getLogger("airflow_broker")

SEND = "SEND"
RECEIVE = "RECEIVE"
#: What each permission is granted on.
OBJECT_KIND = {SEND: "service", RECEIVE: "queue"}
#: The lock migrate takes (storage.migrate): a grant never runs while the client schema is rebuilt.
_MIGRATION_LOCK = "SELECT pg_advisory_xact_lock(727170000, 1)"


@dataclass(frozen=True, slots=True)
class Permission:
    """One grant: ``permission`` (SEND or RECEIVE) on ``object_name`` (a service or a queue)
    to database role ``grantee``."""

    permission: str
    object_name: str
    grantee: str
    granted_at: datetime


def denied(role: str, permission: str, name: str) -> str:
    """The message of a refusal: ``role 'clerk' has no SEND permission on service 'x'``."""
    return f"role {role!r} has no {permission} permission on {OBJECT_KIND[permission]} {name!r}"


# -- granting ---------------------------------------------------------------------------------
def _check_target(conn: Connection, permission: str, name: str, role: str, verb: str) -> None:
    if permission not in OBJECT_KIND:
        raise InvalidDefinition(f"permission must be SEND or RECEIVE, not {permission!r}")
    kind = OBJECT_KIND[permission]
    if conn.dialect.name != "postgresql":
        raise InvalidDefinition(
            f"cannot {verb} {permission} on {kind} {name!r} to role {role!r}: permissions are "
            "granted to database roles and need PostgreSQL (this broker is on SQLite, where "
            "every connection may do everything)"
        )
    if not isinstance(role, str) or not role:
        raise InvalidDefinition(f"a role must be a database role's name, not {role!r}")
    column = s.service.c.name if permission == SEND else s.queue.c.name
    if conn.execute(select(column).where(column == name)).first() is None:
        raise UnknownObject(f"{kind} {name!r} does not exist in this broker")
    if conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first() is None:
        p = s.permission
        held = select(p.c.grantee).where(p.c.grantee == role, p.c.object_name == name)
        if verb != "revoke" or conn.execute(held).first() is None:
            raise UnknownObject(f"database role {role!r} does not exist (CREATE ROLE it first)")
        # A role dropped since it was granted: its grants can still be revoked.
    if not client_schema.exists(conn):
        raise InvalidDefinition(
            f"cannot {verb} permissions: this database has no schema {CLIENT_SCHEMA} yet; "
            "run Broker.migrate() (or `airflow-broker migrate`) first"
        )
    conn.execute(text(_MIGRATION_LOCK))


def grant(conn: Connection, permission: str, name: str, role: str) -> bool:
    """GRANT ``permission`` on ``name`` TO ``role`` inside ``conn``'s transaction; False when it
    was granted already."""
    _check_target(conn, permission, name, role, "grant")
    p = s.permission
    added = conn.execute(
        pg_insert(p)
        .values(permission=permission, object_name=name, grantee=role, granted_at=utcnow())
        .on_conflict_do_nothing()
        .returning(p.c.grantee)
    ).first()
    client_schema.grant_client(conn, role)
    if added is not None:
        log.info("granted %s on %s %r to role %r", permission, OBJECT_KIND[permission], name, role)
    return added is not None


def revoke(conn: Connection, permission: str, name: str, role: str) -> bool:
    """REVOKE ``permission`` on ``name`` FROM ``role``; False when it was not granted. A role
    left with no permission loses the client schema."""
    _check_target(conn, permission, name, role, "revoke")
    p = s.permission
    gone = conn.execute(
        delete(p).where(p.c.permission == permission, p.c.object_name == name, p.c.grantee == role)
    ).rowcount
    _release_roles(conn, [role])
    if gone:
        log.info(
            "revoked %s on %s %r from role %r", permission, OBJECT_KIND[permission], name, role
        )
    return bool(gone)


def _release_roles(conn: Connection, roles: Iterable[str]) -> None:
    """Take the client schema away from those of ``roles`` that hold no permission any more."""
    p = s.permission
    for role in sorted(set(roles)):
        if conn.execute(select(p.c.grantee).where(p.c.grantee == role)).first() is not None:
            continue
        known = conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role})
        if known.first() is not None and client_schema.exists(conn):
            client_schema.revoke_client(conn, role)


def forget_object(conn: Connection, permission: str, name: str) -> None:
    """DROP SERVICE / DROP QUEUE: its permissions go with it (PostgreSQL; nothing on SQLite)."""
    if conn.dialect.name != "postgresql":
        return
    p = s.permission
    where = (p.c.permission == permission, p.c.object_name == name)
    roles = list(conn.execute(select(p.c.grantee).where(*where)).scalars())
    if roles:
        conn.execute(delete(p).where(*where))
        _release_roles(conn, roles)


def permissions(conn: Connection) -> list[Permission]:
    """Every grant, by object and role ([] on SQLite)."""
    if conn.dialect.name != "postgresql":
        return []
    p = s.permission
    rows = conn.execute(select(p).order_by(p.c.permission, p.c.object_name, p.c.grantee))
    return [
        Permission(r.permission, r.object_name, r.grantee, aware(r.granted_at))  # type: ignore[arg-type]
        for r in rows
    ]


# -- the engine's checks, for a client role ---------------------------------------------------
@dataclass(frozen=True, slots=True)
class Grants:
    """What client role ``role`` holds (its own grants and its roles'), read once per
    transaction."""

    role: str
    send: frozenset[str]
    receive: frozenset[str]
    #: ids of the queues in ``receive``
    receive_ids: frozenset[int]
    #: False: the role holds no permission at all (nor the client schema)
    usable: bool = True

    def refuse(self, what: str) -> PermissionDenied:
        """The refusal of a role that holds no permission at all (it cannot even see names)."""
        return PermissionDenied(
            f"role {self.role!r} holds no permission in this broker (neither SEND on a service "
            f"nor RECEIVE on a queue): {what}"
        )

    def require_send(self, service: str) -> None:
        if service not in self.send:
            raise PermissionDenied(denied(self.role, SEND, service))

    def require_receive(self, queue: str) -> None:
        if queue not in self.receive:
            raise PermissionDenied(denied(self.role, RECEIVE, queue))

    def may_send_on(self, queue_id: int, far_service: str) -> bool:
        """Whether the role may SEND on (and END) a conversation whose endpoint here is on
        queue ``queue_id`` and goes to ``far_service``: it RECEIVEs from that queue (replies)
        or may SEND to that service."""
        return queue_id in self.receive_ids or far_service in self.send


_USAGE = text(
    "SELECT coalesce(has_schema_privilege(to_regnamespace(:s), 'USAGE'), false)"
).bindparams(s=CLIENT_SCHEMA)
#: On a client role's connection these names are its views: its own grants, the queues.
_GRANTS = text(
    "SELECT p.permission, p.object_name, q.queue_id FROM broker_permission p "
    "LEFT JOIN broker_queue q ON p.permission = 'RECEIVE' AND q.name = p.object_name"
)


def grants_of(conn: Connection, role: str) -> Grants:
    """The grants of client role ``role``, read on its connection ``conn``."""
    send: set[str] = set()
    receive: set[str] = set()
    ids: set[int] = set()
    usable = bool(conn.execute(_USAGE).scalar_one())
    if usable:
        for permission, name, queue_id in conn.execute(_GRANTS):
            if permission == SEND:
                send.add(name)
            elif permission == RECEIVE:
                receive.add(name)
                if queue_id is not None:
                    ids.add(int(queue_id))
    return Grants(role, frozenset(send), frozenset(receive), frozenset(ids), usable)


def require_conversations(conn: Connection, grants: Grants, handles: Iterable[uuid.UUID]) -> None:
    """The role may SEND on (END, set a timer on) each of ``handles``: else PermissionDenied
    naming the conversation's far service (UnknownObject for a handle that does not exist)."""
    wanted = list(handles)
    if not grants.usable:
        raise grants.refuse(f"it may not SEND on conversation {wanted[0]}")
    e = s.conversation_endpoint
    seen = {
        r.conversation_handle: r
        for r in conn.execute(
            select(e.c.conversation_handle, e.c.queue_id, e.c.far_service).where(
                e.c.conversation_handle.in_(wanted)
            )
        )
    }
    for h in wanted:
        row = seen.get(h)
        if row is not None and grants.may_send_on(row.queue_id, row.far_service):
            continue
        far = row.far_service if row is not None else _far_service(conn, h)
        if far is None:
            raise UnknownObject(f"conversation handle {h} does not exist in this broker")
        raise PermissionDenied(denied(grants.role, SEND, far))


def _far_service(conn: Connection, handle: uuid.UUID) -> Any:
    return conn.execute(
        text(f"SELECT {CLIENT_SCHEMA}.broker_far_service(:h)"), {"h": handle}
    ).scalar()


def require_queue_id(conn: Connection, grants: Grants, queue_id: int) -> None:
    """The role may RECEIVE from the queue whose id is ``queue_id`` (MOVE CONVERSATION)."""
    if not grants.usable:
        raise grants.refuse(f"it may not RECEIVE from queue {queue_id}")
    if queue_id not in grants.receive_ids:
        name = conn.execute(select(s.queue.c.name).where(s.queue.c.queue_id == queue_id)).scalar()
        raise PermissionDenied(denied(grants.role, RECEIVE, str(name)))


def refuse_lease(conn: Connection, role: str, token: uuid.UUID) -> None:
    """A lease the role cannot see: PermissionDenied if it exists (on a queue the role may not
    RECEIVE from); nothing if it does not (the caller says it is no longer held)."""
    grants = grants_of(conn, role)
    if not grants.usable:
        raise grants.refuse(f"it may not use lease {token}")
    queue = conn.execute(
        text(f"SELECT {CLIENT_SCHEMA}.broker_lease_queue(:t)"), {"t": token}
    ).scalar()
    if queue is not None:
        raise PermissionDenied(denied(role, RECEIVE, queue))


def discard_messages(conn: Connection, handle: uuid.UUID) -> None:
    """END CONVERSATION by a role that may send on ``handle`` but not RECEIVE from its queue:
    the conversation's messages there go, as for everyone (the view does not show them)."""
    conn.execute(text(f"SELECT {CLIENT_SCHEMA}.broker_discard_messages(:h)"), {"h": handle})


__all__ = [
    "OBJECT_KIND",
    "RECEIVE",
    "SEND",
    "Grants",
    "Permission",
    "denied",
    "discard_messages",
    "forget_object",
    "grant",
    "grants_of",
    "permissions",
    "refuse_lease",
    "require_conversations",
    "require_queue_id",
    "revoke",
]
