"""BEGIN DIALOG's writes, held by the transaction until its next statement.

A BEGIN DIALOG writes two rows (the conversation group and the initiator endpoint), and BEGIN
CONVERSATION TIMER on the new dialog one more update of the endpoint. Written at once, as they
were, each dialog took six statements (the service and the contract read, the group and the
endpoint inserted, the endpoint read and updated by the timer): 400 dialogs a second with a
timer, against 9,000 messages a second for batched SEND. Now BEGIN DIALOG checks what it is
given against the definitions cached for the broker (:mod:`~airflow_broker.messaging.lookups`,
read again when a name is not found there) and keeps the rows in memory; a timer on such a
dialog is set in its kept row. The rows are written when the transaction next touches the
database (any statement, through ``Transaction.connection``: a SEND, a RECEIVE, a look at the
conversation, the application's own statements on ``tx.connection``) or commits, all in one
go (a COPY per table on PostgreSQL), after one statement that reads the services again: a
service dropped meanwhile by another process fails the write with :class:`UnknownObject`, as
BEGIN DIALOG did when it read the service itself, and one moved to another queue has its new
dialogs' new groups written on the queue it is on now.

What the database sees is what it saw before, in the same order with respect to everything
else the transaction does; only fewer round trips carry it.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from airflow_broker.errors import InvalidDefinition, UnknownObject
from airflow_broker.storage import bulk
from airflow_broker.storage import schema as s


class PendingBegins:
    """The groups and endpoints of this transaction's BEGIN DIALOGs not written yet."""

    __slots__ = ("endpoints", "groups", "new_group_of")

    def __init__(self) -> None:
        #: endpoint rows by handle, in the order they were begun
        self.endpoints: dict[uuid.UUID, dict[str, Any]] = {}
        #: new conversation group rows, in the order they were begun
        self.groups: list[dict[str, Any]] = []
        #: the handles whose group is new (written here), by group
        self.new_group_of: dict[uuid.UUID, dict[str, Any]] = {}

    def __bool__(self) -> bool:
        return bool(self.endpoints)

    def add(self, endpoint: dict[str, Any], *, new_group: bool) -> None:
        if new_group:
            group = {
                "conversation_group_id": endpoint["conversation_group_id"],
                "queue_id": endpoint["queue_id"],
            }
            self.groups.append(group)
            self.new_group_of[group["conversation_group_id"]] = group
        self.endpoints[endpoint["conversation_handle"]] = endpoint

    def set_timer(self, handle: uuid.UUID, due: datetime) -> bool:
        """BEGIN CONVERSATION TIMER on a dialog begun here and not written yet: True when it
        was one (its row now has the timer), else False (the endpoint is in the database)."""
        row = self.endpoints.get(handle)
        if row is None:
            return False
        row["timer_due_at"] = due
        return True

    def write(self, conn: Connection) -> None:
        """Write the rows on ``conn`` (groups first: on SQLite an endpoint's key refers to
        its group), after reading the services again (see the module's text)."""
        svc = s.service
        names = sorted({r["service_name"] for r in self.endpoints.values()})
        queues = dict(
            conn.execute(
                select(svc.c.name, svc.c.queue_id).where(
                    bulk.any_of(svc.c.name, names, conn.dialect.name)
                )
            ).all()
        )
        for row in self.endpoints.values():
            queue_id = queues.get(row["service_name"])
            if queue_id is None:
                raise UnknownObject(
                    f"service {row['service_name']!r} is not a local service of this broker "
                    f"(dropped before conversation {row['conversation_handle']} was written)"
                )
            if queue_id != row["queue_id"]:
                group = self.new_group_of.get(row["conversation_group_id"])
                if group is None:
                    raise InvalidDefinition(
                        f"service {row['service_name']!r} moved to another queue than the "
                        f"conversation group {row['conversation_group_id']} that conversation "
                        f"{row['conversation_handle']} was to join"
                    )
                group["queue_id"] = queue_id
                row["queue_id"] = queue_id
        bulk.insert_rows(conn, s.conversation_group, self.groups)
        bulk.insert_rows(conn, s.conversation_endpoint, list(self.endpoints.values()))


__all__ = ["PendingBegins"]
