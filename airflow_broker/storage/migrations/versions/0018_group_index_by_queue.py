"""the ready messages' group index leads with the queue

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-26 11:00:00

A claim that finds every group of the oldest ready messages locked (more readers than busy
conversation groups) used to walk on through the whole queue, trying the same few locked groups
once per message: 65 ms for an empty claim over 10,000 ready messages in 4 locked groups, and
every idle reader ran it on every wake-up. The claim now walks the queue's groups instead, one
index descent per group, which needs the group index to lead with the queue. It serves the
look-ups of one group's messages as before (they name the queue too).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

TABLE = "broker_message"
NAME = "ix_broker_message_group"
READY: dict[str, Any] = {
    "postgresql_where": sa.text("status = 1"),
    "sqlite_where": sa.text("status = 1"),
}
ORDER: list[Any] = [
    "conversation_group_id",
    sa.literal_column("priority DESC"),
    "precedence",
    "conversation_handle",
    "message_sequence_number",
]


def upgrade() -> None:
    op.drop_index(NAME, table_name=TABLE, **READY)
    op.create_index(NAME, TABLE, ["queue_id", *ORDER], unique=False, **READY)


def downgrade() -> None:
    op.drop_index(NAME, table_name=TABLE, **READY)
    op.create_index(NAME, TABLE, ORDER, unique=False, **READY)
