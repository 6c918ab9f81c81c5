"""PostgreSQL: a delivery batch's rows taken in the round trip that begins its transaction.

A batch's first statement locks its due rows of the transmission queue (``FOR UPDATE SKIP
LOCKED``) with what the plan needs of their endpoints. Through SQLAlchemy it cost two round
trips (psycopg sends BEGIN on its own) and about as much client time again: a third of a pass
that delivers one message. Here it goes through :mod:`airflow_broker.storage.direct`, BEGIN in
the same query, written whole with its values so that the server plans it for them, as before
(how many rows are due decides the best plan). The rows are :class:`TakenRow` tuples, read by
name and by position as SQLAlchemy's rows were.
"""

from __future__ import annotations

import uuid
from collections import namedtuple
from datetime import datetime
from functools import lru_cache
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.engine import Connection

from airflow_broker.storage import direct
from airflow_broker.storage import schema as s
from airflow_broker.transport.batch_rows import BATCH_COLUMNS

#: A batch row's columns: the transmission queue's (:data:`BATCH_COLUMNS`, in that order), the
#: endpoint's and the dialog security flags.
TAKE_COLUMNS = (
    *BATCH_COLUMNS,
    "bound_instance",
    "encryption",
    "send_sequence",
    "keyed",
    "bound_service",
    "wait_id",
)
TakenRow = namedtuple("TakenRow", TAKE_COLUMNS)  # type: ignore[misc]

#: No keyset; after a row (handle, sequence number); after a conversation (handle).
FROM_START, AFTER_ROW, AFTER_CONVERSATION = 0, 1, 2


@lru_cache(maxsize=8)
def _statement(retry_now: bool, keyset: int) -> direct.Prepared:
    where: list[str] = []
    types: list[str] = []

    def param(sql_type: str) -> str:
        types.append(sql_type)
        return f"${len(types)}"

    if not retry_now:
        where.append(f"t.next_attempt_at <= {param('timestamptz')}")
    if keyset == AFTER_CONVERSATION:
        where.append(f"t.conversation_handle > {param('uuid')}")
    elif keyset == AFTER_ROW:
        h, n = param("uuid"), param("bigint")
        where.append(f"(t.conversation_handle, t.message_sequence_number) > ({h}, {n})")
    limit = param("integer")
    columns = ", ".join(f"t.{c}" for c in BATCH_COLUMNS)
    sql = (
        f"SELECT {columns}, e.far_broker_instance, e.encryption, e.send_sequence, "
        "k.conversation_handle IS NOT NULL, "
        "t.to_service_name IN (SELECT service FROM broker_remote_service_binding), t.wait_id "
        "FROM broker_transmission_queue t "
        "JOIN broker_conversation_endpoint e ON e.conversation_handle = t.conversation_handle "
        "LEFT OUTER JOIN broker_dialog_key k ON k.conversation_handle = t.conversation_handle "
        f"WHERE {' AND '.join(where) or 'true'} "
        "ORDER BY t.conversation_handle, t.message_sequence_number "
        f"LIMIT {limit} FOR UPDATE OF t SKIP LOCKED"
    )
    return direct.Prepared(sql, types, planned_each_run=True)


def take_rows(
    conn: Connection, now: datetime, limit: int, retry_now: bool, after: list[Any]
) -> list[TakenRow]:
    """Up to ``limit`` due rows (all rows with ``retry_now``) after the keyset ``after`` ([]:
    from the start; [handle, sequence number, closed]: after that row, or after that whole
    conversation when closed), locked in ``conn``'s transaction (begun here), in handle and
    sequence order."""
    args: list[Any] = [] if retry_now else [now]
    keyset = FROM_START
    if after:
        handle, seq, closed = after
        keyset = AFTER_CONVERSATION if closed else AFTER_ROW
        args += [_uuid(handle)] if closed else [_uuid(handle), seq]
    args.append(limit)
    return [TakenRow(*r) for r in direct.execute(conn, _statement(retry_now, keyset), args)]


def _uuid(value: Any) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


def due_select(dialect: str, now: datetime, retry_now: bool) -> Select[Any]:
    """The due rows of the transmission queue (all of them with ``retry_now``) in handle and
    sequence order, with what a batch's plan needs of their endpoints: the statement of
    :meth:`.Transport._take` on SQLite, and of a full batch's rest on PostgreSQL (where
    :func:`take_rows` is its first statement)."""
    t, e, k = s.transmission_queue, s.conversation_endpoint, s.dialog_key
    stmt = (
        select(
            # first, in this order: batch_rows reads them by position
            *(t.c[c] for c in BATCH_COLUMNS),
            e.c.far_broker_instance.label("bound_instance"),
            e.c.encryption,
            e.c.send_sequence,
            # dialog security, for the plan (dialogs.for_sending_many): whether the dialog has
            # a key, and whether its far service has a remote service binding here
            k.c.conversation_handle.is_not(None).label("keyed"),
            t.c.to_service_name.in_(select(s.remote_service_binding.c.service)).label(
                "bound_service"
            ),
            t.c.wait_id,  # the cause it waited for (.causes), or None
        )
        .join(e, e.c.conversation_handle == t.c.conversation_handle)
        .outerjoin(k, k.c.conversation_handle == t.c.conversation_handle)
        .order_by(t.c.conversation_handle, t.c.message_sequence_number)
    )
    if not retry_now:
        stmt = stmt.where(t.c.next_attempt_at <= now)
    if dialect == "postgresql":
        stmt = stmt.with_for_update(of=t, skip_locked=True)
    return stmt


__all__ = ["TAKE_COLUMNS", "TakenRow", "due_select", "take_rows"]
