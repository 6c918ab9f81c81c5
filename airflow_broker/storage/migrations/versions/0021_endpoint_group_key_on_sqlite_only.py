"""PostgreSQL: drop the foreign key from a conversation endpoint to its group

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-27 20:40:00

The key from ``broker_conversation_endpoint.conversation_group_id`` to its conversation group
runs, for every endpoint row written, a query that finds and locks the group row (``FOR KEY
SHARE``). A delivery batch of 50 new dialogs writes its endpoints in 2 ms, 70% of it those checks,
on the far broker's side, the pass's longest stage: without the key a delivery pass of 10,000
messages in 1,000 new dialogs takes 0.329-0.362 s against 0.373-0.409 s with it (medians of 8 to
14 alternating rounds, three runs).

The engine keeps the invariant itself, as it does for the queue's messages (which have no
key to their endpoints): a new endpoint's group is created in the same transaction, or (BEGIN
DIALOG related to a conversation or a group, MOVE CONVERSATION) locked as the key's check locked
it; a group is removed only once it is empty, under its own lock and read again under it; and
``Broker.check()`` finds and repairs an endpoint without its group. SQLite keeps the key: one
writer at a time, and its check costs nothing measurable there (rebuilding the table to drop it
would also fire its cascades).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

TABLE = "broker_conversation_endpoint"
GROUPS = "broker_conversation_group"
#: The key's name as the naming convention made it (truncated to PostgreSQL's 63 characters).
NAME = "fk_broker_conversation_endpoint_conversation_group_id_b_e1f4"


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    for fk in sa.inspect(bind).get_foreign_keys(TABLE):
        if fk["referred_table"] == GROUPS:
            op.drop_constraint(fk["name"] or NAME, TABLE, type_="foreignkey")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.create_foreign_key(
        NAME,
        TABLE,
        GROUPS,
        ["conversation_group_id"],
        ["conversation_group_id"],
        ondelete="CASCADE",
    )
