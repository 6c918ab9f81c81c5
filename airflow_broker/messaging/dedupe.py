"""Keys of idempotent SEND, BEGIN DIALOG and END CONVERSATION (table ``broker_dedupe``).

A verb called with a ``dedupe_key`` first claims the key in its scope, inside the caller's
transaction: ``INSERT ... ON CONFLICT DO NOTHING`` (PostgreSQL) or ``INSERT OR IGNORE``
(SQLite). A key already there means the verb ran and committed before: it does nothing (BEGIN
DIALOG returns the handle it recorded). Two transactions claiming one key at once queue up on
the primary key; the second sees the first's row once it commits, and claims the key itself
when the first rolls back (the row goes with it). SEND and END CONVERSATION hold the
conversation's endpoint lock before they claim (the lock order is unchanged: a key of
conversation X is only ever claimed under X's lock, so it is never waited for).

Scopes: ``c:<conversation handle>`` for SEND and END CONVERSATION, ``s:<initiator service>``
for BEGIN DIALOG. Rows go when their conversation's endpoint is gone
(:func:`delete_orphans`, from housekeeping).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import delete, exists, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection

from airflow_broker.errors import InvalidDefinition
from airflow_broker.storage import schema as s

#: The longest key (the column's length).
MAX_KEY_LENGTH = 512


def check_key(key: Any) -> str:
    """``key`` if it is a usable dedupe key, else :class:`InvalidDefinition` saying why."""
    if not isinstance(key, str):
        raise InvalidDefinition(
            f"dedupe_key must be a string, not {type(key).__name__} {key!r}"[:200]
        )
    if not key:
        raise InvalidDefinition("dedupe_key must not be empty (give None for no key)")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidDefinition(
            f"dedupe_key {key[:40]!r}... is {len(key)} characters long; "
            f"at most {MAX_KEY_LENGTH} are allowed"
        )
    return key


def conversation_scope(handle: uuid.UUID) -> str:
    """The scope of SEND and END CONVERSATION keys: one conversation."""
    return f"c:{handle}"


def service_scope(service: str) -> str:
    """The scope of BEGIN DIALOG keys: the initiating service."""
    return f"s:{service}"


def _insert(dialect: str) -> Any:
    return (pg_insert if dialect == "postgresql" else sqlite_insert)(s.dedupe)


def claim(
    conn: Connection,
    dialect: str,
    key: str,
    rows: Sequence[tuple[str, uuid.UUID]],
    now: datetime,
) -> set[str]:
    """Claim ``key`` in each scope of ``rows`` (``(scope, conversation handle)``) in one
    statement; returns the scopes claimed now (the others hold the key already)."""
    stmt = (
        _insert(dialect)
        .values(
            [
                {
                    "scope": scope,
                    "dedupe_key": key,
                    "conversation_handle": handle,
                    "created_at": now,
                }
                for scope, handle in rows
            ]
        )
        .on_conflict_do_nothing(index_elements=["scope", "dedupe_key"])
        .returning(s.dedupe.c.scope)
    )
    return set(conn.execute(stmt).scalars())


def recorded(conn: Connection, scope: str, key: str) -> uuid.UUID | None:
    """The conversation handle recorded with ``key`` in ``scope``, if the key is there."""
    d = s.dedupe
    return conn.execute(
        select(d.c.conversation_handle).where(d.c.scope == scope, d.c.dedupe_key == key)
    ).scalar()


def release(conn: Connection, key: str, scopes: Sequence[str]) -> None:
    """Give back keys claimed in this transaction (the verb failed after claiming them)."""
    if scopes:
        d = s.dedupe
        conn.execute(delete(d).where(d.c.dedupe_key == key, d.c.scope.in_(list(scopes))))


def delete_orphans(conn: Connection, created_before: datetime) -> int:
    """Remove the keys created before ``created_before`` whose conversation's endpoint no longer
    exists (purged, or removed WITH CLEANUP), in one statement; returns how many went."""
    d, e = s.dedupe, s.conversation_endpoint
    result = conn.execute(
        delete(d).where(
            d.c.created_at < created_before,
            ~exists().where(e.c.conversation_handle == d.c.conversation_handle),
        )
    )
    return result.rowcount or 0


__all__ = [
    "MAX_KEY_LENGTH",
    "check_key",
    "claim",
    "conversation_scope",
    "delete_orphans",
    "recorded",
    "release",
    "service_scope",
]
