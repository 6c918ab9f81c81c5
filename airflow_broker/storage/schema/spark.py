"""The Spark routing job's scratch tables (migrations 0007 and 0008): what a run staged in this
broker and has not committed yet (:mod:`airflow_broker.spark.commit`). Unlogged on PostgreSQL,
without keys or indexes.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Table,
    Uuid,
)

from airflow_broker.storage.schema.core import NAME, metadata

spark_staged_conversation = Table(
    "broker_spark_staged_conversation",
    metadata,
    # One run of the Spark routing job (airflow_broker.spark.job) from one source broker.
    Column("run_id", String(32), nullable=False),
    Column("source_instance", String(36), nullable=False),
    Column("conversation_id", Uuid, nullable=False),
    Column("from_initiator", Boolean, nullable=False),
    Column("source_handle", Uuid, nullable=False),
    Column("from_service", NAME, nullable=False),
    Column("to_service", NAME, nullable=False),
    Column("to_broker_instance", String(36), nullable=True),
    Column("contract", NAME, nullable=False),
    Column("lifetime_epoch", Float, nullable=True),
    Column("hops", Integer, nullable=False),
    # Which of the commit's parallel transactions takes the conversation.
    Column("part", SmallInteger, nullable=False),
    # Scratch, as broker_spark_staging: no key (retried tasks write twice), no index, unlogged.
    info={"unlogged": True},
    comment=(
        "What every staged message of a conversation shares (where it comes from, where it "
        "goes, its contract and lifetime), once per conversation and direction and run."
    ),
)

spark_staging = Table(
    "broker_spark_staging",
    metadata,
    Column("run_id", String(32), nullable=False),
    Column("conversation_id", Uuid, nullable=False),
    Column("from_initiator", Boolean, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("message_type", NAME, nullable=False),
    Column("validation", String(1), nullable=False),
    Column("message_body", LargeBinary, nullable=True),
    Column("part", SmallInteger, nullable=False),
    # Only what differs between a conversation's messages (the rest is written once per
    # conversation). No key, no index: a retried Spark task may write twice, and the commit
    # notices. UNLOGGED: a server crash empties it, and the source still has the messages.
    info={"unlogged": True},
    comment=(
        "Messages the Spark routing job wrote for this broker and has not committed yet: the "
        "commit moves them into queues (exactly once, by sequence numbers) and deletes them."
    ),
)
