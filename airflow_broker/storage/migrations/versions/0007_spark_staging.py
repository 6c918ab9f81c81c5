"""spark staging: what the Spark routing job wrote for this broker and has not committed yet

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 11:00:00

The Spark routing job (``airflow_broker.spark``) writes the messages it routed to a far broker
into that broker's ``broker_spark_staging`` with JDBC, then commits them into queues in one
transaction there (exactly once, by sequence numbers) and deletes them.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
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
        comment=(
            "Messages the Spark routing job wrote for this broker and has not committed yet: "
            "the commit moves them into queues (exactly once, by sequence numbers) and deletes "
            "them."
        ),
    )
    op.create_index(
        "ix_broker_spark_staging_run",
        "broker_spark_staging",
        ["run_id", "conversation_id", "from_initiator", "seq"],
    )
    op.create_index(
        "ix_broker_spark_staging_source",
        "broker_spark_staging",
        ["source_instance", "run_id"],
    )


def downgrade() -> None:
    op.drop_index("ix_broker_spark_staging_source", table_name="broker_spark_staging")
    op.drop_index("ix_broker_spark_staging_run", table_name="broker_spark_staging")
    op.drop_table("broker_spark_staging")
