"""receive commit markers: the claim statement marks its lease, so commit needs no extra statement

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 03:40:00

A receiving transaction on PostgreSQL inserts a marker row keyed by its lease inside the RECEIVE
statement itself; the marker becomes visible if and only if the transaction commits. The due-work
pass deletes leases that have a marker (committed) and counts, as rollbacks, leases whose server
backend is gone without one (the reader died).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "broker_receive_commit",
        sa.Column("lease_key", sa.Integer(), autoincrement=False, nullable=False),
        sa.PrimaryKeyConstraint("lease_key", name=op.f("pk_broker_receive_commit")),
        comment="Leases whose receiving transaction committed (written inside that transaction).",
        info={"unlogged": True},
    )


def downgrade() -> None:
    op.drop_table("broker_receive_commit")
