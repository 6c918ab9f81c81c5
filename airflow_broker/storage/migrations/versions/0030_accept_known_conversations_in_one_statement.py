"""a far broker takes a delivery batch's known conversations in one statement

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-07 16:30:00

``broker_accept_plain`` (see :mod:`airflow_broker.storage.accept_function`) takes the
conversations of a delivery batch that this broker already has an endpoint for, in clear and of
types taken whatever the body: their endpoints locked, their messages queued, their receive
sequence numbers raised, in one round trip that commits on its own. No table changes.
PostgreSQL only; a sender that finds the function missing (a far broker not yet upgraded) takes
the general accept.
"""

from __future__ import annotations

from alembic import op

from airflow_broker.storage.accept_function import (
    ACCEPT_PLAIN_FUNCTION,
    DROP_ACCEPT_PLAIN_FUNCTION,
)

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(ACCEPT_PLAIN_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(DROP_ACCEPT_PLAIN_FUNCTION)
