"""activation: monitor cursors and queue readers

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 09:00:00

The activation monitor (trigger, sensor, in-process runner) keeps its cursor per queue and monitor
in ``broker_activation``, and the readers it started and that run in ``broker_activation_reader``,
so that a restarted triggerer neither fires twice for the same messages nor forgets readers.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "broker_activation",
        sa.Column("queue_id", sa.Integer(), nullable=False),
        sa.Column("monitor_key", sa.String(length=256), nullable=False),
        sa.Column("cursor", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("fires", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("fired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_depth", sa.Integer(), nullable=True),
        sa.Column("observed_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["queue_id"],
            ["broker_queue.queue_id"],
            name=op.f("fk_broker_activation_queue_id_broker_queue"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("queue_id", "monitor_key", name=op.f("pk_broker_activation")),
        comment=(
            "Activation monitors (seed 004): per queue and monitor, the cursor and depth it last "
            "acted on, kept in the database so that a restarted triggerer does not fire again."
        ),
    )
    op.create_table(
        "broker_activation_reader",
        sa.Column("reader_id", sa.Uuid(), nullable=False),
        sa.Column("queue_id", sa.Integer(), nullable=False),
        sa.Column("monitor_key", sa.String(length=256), nullable=True),
        sa.Column("cursor", sa.BigInteger(), nullable=True),
        sa.Column("fired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.Column("label", sa.String(length=256), nullable=True),
        sa.ForeignKeyConstraint(
            ["queue_id"],
            ["broker_queue.queue_id"],
            name=op.f("fk_broker_activation_reader_queue_id_broker_queue"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("reader_id", name=op.f("pk_broker_activation_reader")),
        comment=(
            "Queue readers: started by a monitor and not yet running, running (heartbeat_at), "
            "or finished (outcome: drained, failed, refused, expired, lost)."
        ),
    )
    op.create_index(
        op.f("ix_broker_activation_reader_queue_id"),
        "broker_activation_reader",
        ["queue_id"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(
        op.f("ix_broker_activation_reader_queue_id"), table_name="broker_activation_reader"
    )
    op.drop_table("broker_activation_reader")
    op.drop_table("broker_activation")
