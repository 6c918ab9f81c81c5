"""broker_prepare: RECEIVE's claim is prepared on each server process behind a pooler

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-28 23:00:00

Behind a pooler in transaction mode (PgBouncer) a connection's prepared statements do not last
between transactions, and the broker wrote RECEIVE's claim whole, so the server planned it on
every RECEIVE; planning the claim costs more than running it. ``broker_prepare(name,
parameter_types, statement)`` (:data:`airflow_broker.storage.prepared.PREPARE_FUNCTION`) prepares
a statement on the server process that runs it unless that process has it already; the claim's
query calls it first, then EXECUTEs the statement. No table changes. PostgreSQL only. The
function is created from the module, as it is when this runs; a later change of it comes with
a migration of its own.
"""

from __future__ import annotations

from alembic import op

from airflow_broker.storage.prepared import DROP_PREPARE_FUNCTION, PREPARE_FUNCTION

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(PREPARE_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(DROP_PREPARE_FUNCTION)
