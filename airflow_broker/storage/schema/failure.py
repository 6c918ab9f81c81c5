"""Tables of failure handling per conversation: leases for long handlers, idempotency keys."""

from __future__ import annotations

from sqlalchemy import Column, Integer, PrimaryKeyConstraint, String, Table, Uuid

from airflow_broker.storage.schema.core import Timestamp, metadata

lease = Table(
    "broker_lease",
    metadata,
    Column("token", Uuid, primary_key=True),
    Column("queue_id", Integer, nullable=False),
    Column("conversation_group_id", Uuid, nullable=False),
    Column("leased_at", Timestamp, nullable=False),
    Column("expires_at", Timestamp, nullable=False, index=True),
    comment="Messages handed out without an open transaction, until completed or given back.",
)

dedupe = Table(
    "broker_dedupe",
    metadata,
    # "c:<conversation handle>" for SEND and END, "s:<initiator service>" for BEGIN DIALOG.
    Column("scope", String(300), nullable=False),
    Column("dedupe_key", String(512), nullable=False),
    Column("conversation_handle", Uuid, nullable=False, index=True),
    Column("created_at", Timestamp, nullable=False),
    PrimaryKeyConstraint("scope", "dedupe_key"),
    comment="Keys of idempotent SEND, BEGIN DIALOG and END CONVERSATION.",
)
