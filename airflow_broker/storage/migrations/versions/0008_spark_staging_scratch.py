"""spark staging as scratch: unlogged, no indexes, per-conversation columns once per conversation

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 19:30:00

The Spark routing job writes every message it routes once into ``broker_spark_staging`` and reads
it back once, whole, when it commits (:mod:`airflow_broker.spark.commit`). Its two indexes cost
that write more than they saved the commit's scans, and its rows need no write-ahead log: a
crash of the server empties an unlogged table, and the messages are still in the source's
transmission queue until the far broker has committed them (the next run stages them again).
What every message of a conversation shares moves to ``broker_spark_staged_conversation``,
written once per conversation; ``part`` spreads the commit over parallel transactions.

Staged rows are never the only copy of a message, so the table is dropped and created anew in
its new shape (a run in flight across the upgrade stages its messages again).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

STAGING_COMMENT = (
    "Messages the Spark routing job wrote for this broker and has not committed yet: the commit "
    "moves them into queues (exactly once, by sequence numbers) and deletes them."
)


def upgrade() -> None:
    op.drop_table("broker_spark_staging")
    op.create_table(
        "broker_spark_staged_conversation",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("source_instance", sa.String(length=36), nullable=False),
        sa.Column("conversation_id", sa.Uuid(), nullable=False),
        sa.Column("from_initiator", sa.Boolean(), nullable=False),
        sa.Column("source_handle", sa.Uuid(), nullable=False),
        sa.Column("from_service", sa.String(length=256), nullable=False),
        sa.Column("to_service", sa.String(length=256), nullable=False),
        sa.Column("to_broker_instance", sa.String(length=36), nullable=True),
        sa.Column("contract", sa.String(length=256), nullable=False),
        sa.Column("lifetime_epoch", sa.Float(), nullable=True),
        sa.Column("hops", sa.Integer(), nullable=False),
        sa.Column("part", sa.SmallInteger(), nullable=False),
        info={"unlogged": True},
        comment=(
            "What every staged message of a conversation shares (where it comes from, where it "
            "goes, its contract and lifetime), once per conversation and direction and run."
        ),
    )
    op.create_table(
        "broker_spark_staging",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("conversation_id", sa.Uuid(), nullable=False),
        sa.Column("from_initiator", sa.Boolean(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("message_type", sa.String(length=256), nullable=False),
        sa.Column("validation", sa.String(length=1), nullable=False),
        sa.Column("message_body", sa.LargeBinary(), nullable=True),
        sa.Column("part", sa.SmallInteger(), nullable=False),
        info={"unlogged": True},
        comment=STAGING_COMMENT,
    )


def downgrade() -> None:
    op.drop_table("broker_spark_staging")
    op.drop_table("broker_spark_staged_conversation")
    op.create_table(
        "broker_spark_staging",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("source_instance", sa.String(length=36), nullable=False),
        sa.Column("source_handle", sa.Uuid(), nullable=False),
        sa.Column("conversation_id", sa.Uuid(), nullable=False),
        sa.Column("from_initiator", sa.Boolean(), nullable=False),
        sa.Column("from_service", sa.String(length=256), nullable=False),
        sa.Column("to_service", sa.String(length=256), nullable=False),
        sa.Column("to_broker_instance", sa.String(length=36), nullable=True),
        sa.Column("contract", sa.String(length=256), nullable=False),
        sa.Column("message_type", sa.String(length=256), nullable=False),
        sa.Column("validation", sa.String(length=1), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("message_body", sa.LargeBinary(), nullable=True),
        sa.Column("lifetime_epoch", sa.Float(), nullable=True),
        sa.Column("hops", sa.Integer(), nullable=False),
        comment=STAGING_COMMENT,
    )
    op.create_index(
        "ix_broker_spark_staging_run",
        "broker_spark_staging",
        ["run_id", "conversation_id", "from_initiator", "seq"],
    )
    op.create_index(
        "ix_broker_spark_staging_source", "broker_spark_staging", ["source_instance", "run_id"]
    )
