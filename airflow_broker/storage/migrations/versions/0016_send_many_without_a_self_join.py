"""broker_send_many inserts what its UPDATE returns

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26 09:00:00

``broker_send_many`` (see :mod:`airflow_broker.storage.endpoint_locks`) is created again: its
INSERT took the far side's columns by joining the UPDATE's result back to the candidates, a
nested loop over both (the planner takes a CTE for one row) that was a third of a SEND on 100
conversations and grew with the square of their number. The UPDATE now returns those columns.
No table changes.
"""

from __future__ import annotations

from alembic import op

from airflow_broker.storage.endpoint_locks import SEND_MANY_FUNCTION

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(SEND_MANY_FUNCTION)


def downgrade() -> None:
    """Nothing to undo: the function before this one did the same, only slower."""
