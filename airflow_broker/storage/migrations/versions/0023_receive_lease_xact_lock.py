"""a receive lease is alive while its transaction holds an advisory lock on the lease's key

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-28 19:00:00

A receiving transaction's lease row said which server process (``pid``, ``backend_start``) ran
it, and a row whose process had left ``pg_stat_activity`` without a commit marker was a reader
that died holding messages. Behind a pooler in transaction mode (PgBouncer) that test fails: the
server process outlives the client, and serves the next one. Now RECEIVE's statement takes a
transaction-level advisory lock on the lease's key, released with the transaction's row locks
however it ends (a killed client's included), and the reaper tests that lock. Rows written this
way say so in ``xact_lock``; rows from before (readers still running the previous release
during an upgrade) keep the server-process test. The tables are UNLOGGED and hold only
transactions in flight.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


OLD_COMMENT = (
    "One row per open transaction that has received messages (PostgreSQL), written outside "
    "that transaction and deleted by its commit. A row whose server backend (pid) is gone "
    "belongs to a reader that died holding messages: poison handling counts it as a rollback."
)
NEW_COMMENT = (
    "One row per open receiving transaction (PostgreSQL), deleted by its commit. With its lock "
    "on lease_key free and no commit marker, its reader died holding messages (a rollback)."
)


def upgrade() -> None:
    op.add_column(
        "broker_receive_lease",
        sa.Column("xact_lock", sa.Boolean(), nullable=False, server_default=sa.text("false")),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.create_table_comment("broker_receive_lease", NEW_COMMENT, existing_comment=OLD_COMMENT)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.create_table_comment("broker_receive_lease", OLD_COMMENT, existing_comment=NEW_COMMENT)
    op.drop_column("broker_receive_lease", "xact_lock")
