"""the transmitter's activation and alerts: broker_transmitter, broker_alert, a transmit NOTIFY

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25 08:30:00

``broker_transmitter`` (one row) records when a watcher last started a transmitter run and when
a run last started and finished, so that watchers (two triggerers, or a restarted one) start one
run at a time and start the next as soon as the last one ended.

``broker_alert`` holds the alerts a watcher has raised and that still hold (a queue disabled by
poison handling, a target service whose transmissions wait too long), so that each episode
alerts once, whichever triggerer looks.

On PostgreSQL every statement that queues messages to leave this database notifies the channel
``airflow_broker_transmit``, so the transmitter's trigger (LISTENing there) starts a run at
commit instead of at its next poll. One notification per statement, whatever the rows; PostgreSQL
folds a transaction's duplicates into one.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

FUNCTION = """
CREATE OR REPLACE FUNCTION broker_notify_transmitter() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('airflow_broker_transmit', '');
    RETURN NULL;
END
$$
"""
TRIGGER = (
    "CREATE TRIGGER broker_transmission_queue_notify AFTER INSERT ON broker_transmission_queue "
    "FOR EACH STATEMENT EXECUTE FUNCTION broker_notify_transmitter()"
)


def upgrade() -> None:
    op.create_table(
        "broker_transmitter",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("fires", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("fired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_broker_transmitter")),
        comment=(
            "The transmitter's activation (one row): when a watcher last started a run, and when "
            "a run last started and finished; a watcher fires again once the run it started ended."
        ),
    )
    op.create_table(
        "broker_alert",
        sa.Column("watcher", sa.String(length=256), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("object_name", sa.String(length=256), nullable=False),
        sa.Column("fired_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("watcher", "kind", "object_name", name=op.f("pk_broker_alert")),
        comment=(
            "Alerts a watcher has raised and that still hold (a queue disabled by poison "
            "handling, a target service whose transmissions wait too long); the row goes when "
            "the condition ends, so the next episode alerts again."
        ),
    )
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite watchers poll
    op.execute(FUNCTION)
    op.execute(TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "DROP TRIGGER IF EXISTS broker_transmission_queue_notify ON broker_transmission_queue"
        )
        op.execute("DROP FUNCTION IF EXISTS broker_notify_transmitter()")
    op.drop_table("broker_alert")
    op.drop_table("broker_transmitter")
