"""identity after a copy: where the database was when its broker instance id was recorded

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24 09:00:00

``broker_instance.fingerprint`` records the physical place of the database (PostgreSQL: the
cluster's system identifier and the database's oid; SQLite: the file's real path), so that a
restored, cloned or copied database, which carries the same instance id, is told from the
original (:mod:`airflow_broker.storage.identity`). A database upgraded by this revision is taken
to be the original: its current fingerprint is recorded. A fresh database has no
``broker_instance`` row yet when this runs; ``migrate()`` records the fingerprint with the row.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from airflow_broker.storage.identity import physical_fingerprint

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("broker_instance", sa.Column("fingerprint", sa.Text(), nullable=True))
    bind = op.get_bind()
    bind.execute(
        sa.text("UPDATE broker_instance SET fingerprint = :fingerprint"),
        {"fingerprint": physical_fingerprint(bind)},
    )


def downgrade() -> None:
    op.drop_column("broker_instance", "fingerprint")
