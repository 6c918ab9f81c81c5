"""failure handling per conversation: receive counts, backoff, dead-lettering, leases, dedupe

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 11:00:00

- ``broker_queue`` gains ``retry_delay``, ``retry_delay_max``, ``max_receives`` and
  ``dead_letter_queue`` (all NULL: Service Broker's disable-after-five rule, as before);
- ``broker_message`` gains ``receive_count`` (hand-outs that did not remove it),
  ``lease_token`` and ``dead_letter`` (where a dead-lettered message came from, JSON);
- ``broker_conversation_group`` gains ``held_until`` and ``lease_token``: a group held without
  a transaction, by a lease or by a failed attempt's backoff;
- ``broker_receive_lease`` gains ``held``: the messages a receiving transaction took;
- new tables ``broker_lease`` (leases for long handlers) and ``broker_dedupe`` (idempotent SEND,
  BEGIN DIALOG and END CONVERSATION).

Every new column is nullable or has a constant default: on PostgreSQL adding them rewrites no
table, however deep the queues.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


#: The columns this revision adds, in the order it adds them.
COLUMNS = (
    ("broker_queue", "retry_delay"),
    ("broker_queue", "retry_delay_max"),
    ("broker_queue", "max_receives"),
    ("broker_queue", "dead_letter_queue"),
    ("broker_message", "receive_count"),
    ("broker_message", "lease_token"),
    ("broker_message", "dead_letter"),
    ("broker_conversation_group", "held_until"),
    ("broker_conversation_group", "lease_token"),
    ("broker_receive_lease", "held"),
)


def upgrade() -> None:
    with op.batch_alter_table("broker_queue") as b:
        b.add_column(sa.Column("retry_delay", sa.Float(), nullable=True))
        b.add_column(sa.Column("retry_delay_max", sa.Float(), nullable=True))
        b.add_column(sa.Column("max_receives", sa.Integer(), nullable=True))
        b.add_column(sa.Column("dead_letter_queue", sa.String(length=256), nullable=True))
    with op.batch_alter_table("broker_message") as b:
        b.add_column(
            sa.Column("receive_count", sa.Integer(), server_default=sa.text("0"), nullable=False)
        )
        b.add_column(sa.Column("lease_token", sa.Uuid(), nullable=True))
        b.add_column(sa.Column("dead_letter", sa.Text(), nullable=True))
    with op.batch_alter_table("broker_conversation_group") as b:
        b.add_column(sa.Column("held_until", sa.DateTime(timezone=True), nullable=True))
        b.add_column(sa.Column("lease_token", sa.Uuid(), nullable=True))
    with op.batch_alter_table("broker_receive_lease") as b:
        b.add_column(sa.Column("held", sa.Text(), nullable=True))
    op.create_table(
        "broker_lease",
        sa.Column("token", sa.Uuid(), nullable=False),
        sa.Column("queue_id", sa.Integer(), nullable=False),
        sa.Column("conversation_group_id", sa.Uuid(), nullable=False),
        sa.Column("leased_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("token", name=op.f("pk_broker_lease")),
        comment="Messages handed out without an open transaction, until completed or given back.",
    )
    op.create_index(op.f("ix_broker_lease_expires_at"), "broker_lease", ["expires_at"])
    op.create_table(
        "broker_dedupe",
        sa.Column("scope", sa.String(length=300), nullable=False),
        sa.Column("dedupe_key", sa.String(length=512), nullable=False),
        sa.Column("conversation_handle", sa.Uuid(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("scope", "dedupe_key", name=op.f("pk_broker_dedupe")),
        comment="Keys of idempotent SEND, BEGIN DIALOG and END CONVERSATION.",
    )
    op.create_index(
        op.f("ix_broker_dedupe_conversation_handle"), "broker_dedupe", ["conversation_handle"]
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_broker_dedupe_conversation_handle"), table_name="broker_dedupe")
    op.drop_table("broker_dedupe")
    op.drop_index(op.f("ix_broker_lease_expires_at"), table_name="broker_lease")
    op.drop_table("broker_lease")
    # Plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35): a batch "move and copy" would drop
    # broker_queue, which other tables reference, and fail with foreign keys on.
    for table, column in COLUMNS[::-1]:
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
