"""SEND's fast path as server-side functions that lock the far endpoint in memory

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25 20:10:00

On PostgreSQL, ``broker_send_one`` and ``broker_send_many`` (see
:mod:`airflow_broker.storage.endpoint_locks`): SEND's one-statement fast path, with the far
endpoint locked by a shared advisory lock (or ``FOR KEY SHARE`` past the transaction's budget)
and read after the lock in a statement of its own. Removers take the advisory lock exclusive as
well as the row ``FOR UPDATE``. No table changes. The functions are created from the module, as
it is when this runs; a later change of them comes with a migration of its own that creates
them again.
"""

from __future__ import annotations

from alembic import op

from airflow_broker.storage.endpoint_locks import DROP_FUNCTIONS, FUNCTIONS

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for ddl in FUNCTIONS:
        op.execute(ddl)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for ddl in DROP_FUNCTIONS:
        op.execute(ddl)
