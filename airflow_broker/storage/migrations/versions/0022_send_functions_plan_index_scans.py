"""the SEND functions plan their statements with sequential scans off

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-28 15:00:00

``broker_send_one`` and ``broker_send_many`` (:mod:`airflow_broker.storage.endpoint_locks`)
keep one generic plan per session, made on their first call and made again only when the
statistics of a table they read change. Made while ``broker_transmission_queue`` was small (as
it is until a far broker falls behind), the plan's check that a conversation has nothing
waiting to leave was a sequential scan of that queue: with 20,000 messages waiting, every local
SEND took 1.6 ms instead of 0.6, until the next ANALYZE. The functions now run with
``enable_seqscan = off`` (set and restored by the server around each call, so the caller's own
setting is untouched), and plan index scans whatever the tables' sizes. No table changes.
PostgreSQL only.
"""

from __future__ import annotations

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

#: The SEND functions, by signature.
SIGNATURES = (
    "broker_send_one(uuid, varchar, smallint, varchar, bytea, timestamptz, boolean)",
    "broker_send_many(uuid[], varchar, smallint, varchar, bytea, timestamptz, boolean)",
)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for signature in SIGNATURES:
        op.execute(f"ALTER FUNCTION {signature} SET enable_seqscan = off")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for signature in SIGNATURES:
        op.execute(f"ALTER FUNCTION {signature} RESET enable_seqscan")
