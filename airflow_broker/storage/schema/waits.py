"""One cause, one wait: the causes transmission-queue rows wait for together, and the column
of ``broker_transmission_queue`` that points at one (migration 0028)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    Integer,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)

from airflow_broker.storage.schema.core import BigId, Timestamp, metadata, transmission_queue

# The wait a transmission-queue row shares with others held up by the same cause; its
# next_attempt_at is then NULL: the wait's next attempt is theirs. Few rows have one: the index
# holds only those.
transmission_queue.append_column(Column("wait_id", BigInteger, nullable=True))
Index(
    "ix_broker_transmission_queue_wait_id_id",
    transmission_queue.c.wait_id,
    transmission_queue.c.id,
    postgresql_where=text("wait_id IS NOT NULL"),
    sqlite_where=text("wait_id IS NOT NULL"),
)

transmission_wait = Table(
    "broker_transmission_wait",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    # route | security | address | far | copy (airflow_broker.storage.waits)
    Column("kind", String(16), nullable=False),
    # the far service (route, security) or the far broker's address (address, far)
    Column("destination", Text, nullable=False),
    # what else tells the cause apart: the broker instance asked for (route), the local
    # service (security), the far broker's reason (far); '' for none
    Column("detail", Text, nullable=False, server_default=text("''")),
    Column("reason", Text, nullable=False, server_default=text("''")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    # its rows' next attempt, one dialog's (a probe) for all of them
    Column("next_attempt_at", Timestamp, nullable=False),
    # when the delivery pass that last tried it (counted as one attempt) started
    Column("tried_at", Timestamp, nullable=True),
    Column("since", Timestamp, nullable=False),
    UniqueConstraint("kind", "destination", "detail"),
    comment=(
        "Causes transmission-queue rows wait for together (no route, dialog security missing, "
        "a far broker unreachable...): one backoff per cause, one dialog tried for all."
    ),
)

__all__ = ["transmission_wait"]
