"""receive-lease keys are 63-bit numbers

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-26 08:00:00

A receiving transaction's lease row is now written without waiting for the server's answer
(:class:`~airflow_broker.storage.adapters.PostgresAdapter`), so a key that clashes with a live
lease can no longer be noticed and replaced in time. Keys drawn from 63 bits make a clash
negligible (the 31 bits before made one likely within a busy broker's lifetime). PostgreSQL
only: SQLite keeps its leases in files. Both tables are UNLOGGED and hold only transactions in
flight; the downgrade empties them before narrowing the column.
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

TABLES = ("broker_receive_lease", "broker_receive_commit")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        op.execute(f"ALTER TABLE {table} ALTER COLUMN lease_key TYPE bigint")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        op.execute(f"DELETE FROM {table}")
        op.execute(f"ALTER TABLE {table} ALTER COLUMN lease_key TYPE integer")
