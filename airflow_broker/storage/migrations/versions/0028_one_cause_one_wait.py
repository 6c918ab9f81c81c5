"""one cause, one wait: transmission-queue rows held up by one cause wait together

Revision ID: 0028
Revises: 0027
Create Date: 2026-11-29 09:00:00

Thousands of dialogs waiting for the same thing (no route to a service, no remote service
binding for an encrypted dialog, a far broker that does not answer) each kept a backoff of
their own, so some were always due and the transmitter kept starting runs that delivered
nothing. ``broker_transmission_wait`` holds one row per cause (kind, destination, detail) with
one backoff; the rows that wait for it point at it (``wait_id``) and have no next attempt of
their own. A delivery pass tries one dialog of a cause that falls due for all of them
(:mod:`airflow_broker.transport.causes`); a definition that can cure it wakes them at once
(:mod:`airflow_broker.storage.waits`).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None

TABLE = "broker_transmission_queue"
WAIT_ID = "ix_broker_transmission_queue_wait_id_id"


def upgrade() -> None:
    op.create_table(
        "broker_transmission_wait",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("detail", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("reason", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tried_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_broker_transmission_wait")),
        sa.UniqueConstraint(
            "kind",
            "destination",
            "detail",
            name=op.f("uq_broker_transmission_wait_kind_destination_detail"),
        ),
        comment=(
            "Causes transmission-queue rows wait for together (no route, dialog security "
            "missing, a far broker unreachable...): one backoff per cause, one dialog tried for "
            "all."
        ),
    )
    op.add_column(TABLE, sa.Column("wait_id", sa.BigInteger(), nullable=True))
    op.create_index(
        WAIT_ID,
        TABLE,
        ["wait_id", "id"],
        postgresql_where=sa.text("wait_id IS NOT NULL"),
        sqlite_where=sa.text("wait_id IS NOT NULL"),
    )


def downgrade() -> None:
    # Rows that waited together are due again, each on its own.
    op.execute(
        "UPDATE broker_transmission_queue SET next_attempt_at = CURRENT_TIMESTAMP "
        "WHERE next_attempt_at IS NULL"
    )
    op.drop_index(WAIT_ID, table_name=TABLE)
    with op.batch_alter_table(TABLE) as batch:
        batch.drop_column("wait_id")
    op.drop_table("broker_transmission_wait")
