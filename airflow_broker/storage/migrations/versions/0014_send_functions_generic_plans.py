"""SEND's functions keep one generic plan per statement

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25 23:30:00

``broker_send_one`` and ``broker_send_many`` are created again with
``SET plan_cache_mode = force_generic_plan`` (see :mod:`airflow_broker.storage.endpoint_locks`):
the server otherwise planned their write statement anew on every call. No table changes.
"""

from __future__ import annotations

from alembic import op

from airflow_broker.storage.endpoint_locks import FUNCTIONS

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for ddl in FUNCTIONS:
        op.execute(ddl)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for name in ("broker_send_one", "broker_send_many"):
        args = "uuid" if name == "broker_send_one" else "uuid[]"
        op.execute(
            f"ALTER FUNCTION {name}({args}, varchar, smallint, varchar, bytea, timestamptz, "
            "boolean) RESET plan_cache_mode"
        )
