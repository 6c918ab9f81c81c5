"""queue depth history

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07 09:00:00

``broker_queue_sample`` keeps each queue's depth (ready messages) as sampled by the processes that
already run periodically (activation monitors, triggers, the in-process runner, the monitoring
API), at most once per interval, for the queue's depth-history chart and the ``queue_depth``
metric. Keyed by queue and time; old samples are deleted in bounded batches.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "broker_queue_sample",
        sa.Column("queue_id", sa.Integer(), nullable=False),
        sa.Column("sampled_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["queue_id"],
            ["broker_queue.queue_id"],
            name=op.f("fk_broker_queue_sample_queue_id_broker_queue"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("queue_id", "sampled_at", name=op.f("pk_broker_queue_sample")),
        comment=(
            "Queue depth history: one row per queue and sampling pass (at most one pass per "
            "interval across processes); rows older than the retention are deleted in batches."
        ),
    )
    op.create_index(
        op.f("ix_broker_queue_sample_sampled_at"),
        "broker_queue_sample",
        ["sampled_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_broker_queue_sample_sampled_at"), table_name="broker_queue_sample")
    op.drop_table("broker_queue_sample")
