"""run_due() finds old closed endpoints through an index

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-29 08:00:00

Every pass of the due work (every reader, trigger and transmitter runs one about once a second)
looks for endpoints closed (CD) longer than the retention, to purge them. Without an index that
was a scan of every endpoint: 10^6 open conversations made an idle ``run_due()`` cost 177 ms.
A partial index of the closed endpoints by ``closed_at`` makes it a descent into what is closed.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

TABLE = "broker_conversation_endpoint"
CLOSED_AT = "ix_broker_conversation_endpoint_closed_at"


def upgrade() -> None:
    op.create_index(
        CLOSED_AT,
        TABLE,
        ["closed_at"],
        postgresql_where=sa.text("state = 'CD'"),
        sqlite_where=sa.text("state = 'CD'"),
    )


def downgrade() -> None:
    op.drop_index(CLOSED_AT, table_name=TABLE)
