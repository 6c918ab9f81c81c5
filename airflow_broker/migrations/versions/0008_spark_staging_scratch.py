"""spark staging as scratch: unlogged (PostgreSQL), no indexes, a commit partition per row

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 19:30:00

The Spark routing job writes every message it routes once into ``broker_spark_staging`` and reads
it back once, whole, when it commits (:mod:`airflow_broker.spark.commit`). Its two indexes cost
that write more than they saved the commit's scans, and its rows need no write-ahead log: a
crash of the server empties an unlogged table, and the messages are still in the source's
transmission queue until the far broker has committed them (the next run stages them again).
``part`` spreads the commit over parallel transactions, each for the conversations of one part.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_broker_spark_staging_source", table_name="broker_spark_staging")
    op.drop_index("ix_broker_spark_staging_run", table_name="broker_spark_staging")
    with op.batch_alter_table("broker_spark_staging") as batch:
        batch.add_column(
            sa.Column("part", sa.SmallInteger(), nullable=False, server_default=sa.text("0"))
        )
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE broker_spark_staging SET UNLOGGED")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE broker_spark_staging SET LOGGED")
    with op.batch_alter_table("broker_spark_staging") as batch:
        batch.drop_column("part")
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
