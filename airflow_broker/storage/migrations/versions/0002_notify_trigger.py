"""wake waiting readers from the database: a NOTIFY trigger on broker_message (PostgreSQL)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 03:15:00

Every statement that adds ready messages notifies the channel of each queue it touched, so a
RECEIVE waiting on that queue wakes at commit, whoever wrote the rows (a SEND, the due-work
pass, a delivery from another broker, a Spark job writing through JDBC). PostgreSQL folds
duplicate notifications of one transaction into one.
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

FUNCTION = """
CREATE OR REPLACE FUNCTION broker_notify_queues() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('airflow_broker_q' || q.queue_id, '')
    FROM (SELECT DISTINCT queue_id FROM broker_new_rows WHERE status = 1) AS q;
    RETURN NULL;
END
$$
"""
TRIGGERS = (
    "CREATE TRIGGER broker_message_notify_insert AFTER INSERT ON broker_message "
    "REFERENCING NEW TABLE AS broker_new_rows "
    "FOR EACH STATEMENT EXECUTE FUNCTION broker_notify_queues()",
    "CREATE TRIGGER broker_message_notify_update AFTER UPDATE ON broker_message "
    "REFERENCING NEW TABLE AS broker_new_rows "
    "FOR EACH STATEMENT EXECUTE FUNCTION broker_notify_queues()",
)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite waiters watch PRAGMA data_version instead
    op.execute(FUNCTION)
    for trigger in TRIGGERS:
        op.execute(trigger)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER IF EXISTS broker_message_notify_update ON broker_message")
    op.execute("DROP TRIGGER IF EXISTS broker_message_notify_insert ON broker_message")
    op.execute("DROP FUNCTION IF EXISTS broker_notify_queues()")
