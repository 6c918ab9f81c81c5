"""a RECEIVE counts a dead reader of its queue before it hands messages out

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-29 02:00:00

A reader killed holding messages released its row locks at once, and the reaper counted its
attempt only at the next due-work pass: a RECEIVE in between took the messages with the attempt
uncounted (one hand-out more than ``max_receives``), and a group's backoff after a rollback
could be passed by a reader polling at that instant. Now a receive lease row is written by
``broker_write_receive_lease`` (:data:`airflow_broker.storage.receive_leases.WRITE_FUNCTION`)
before RECEIVE hands messages out; it refuses while a dead reader of the queue is uncounted,
and RECEIVE counts that reader first. A committing transaction deletes its lease rows itself
(no commit marker), so a queue's rows are those of its open transactions, found through the new
index. PostgreSQL's function is created from the module, as it is when this runs; a later
change of it comes with a migration of its own. The table is UNLOGGED and holds only
transactions in flight.
"""

from __future__ import annotations

from alembic import op

from airflow_broker.storage.receive_leases import DROP_WRITE_FUNCTION, WRITE_FUNCTION

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


#: (table, comment before, comment after)
COMMENTS = (
    (
        "broker_receive_lease",
        "One row per open receiving transaction (PostgreSQL), deleted by its commit. With its lock "
        "on lease_key free and no commit marker, its reader died holding messages (a rollback).",
        "One row per open receiving transaction (PostgreSQL), deleted by its commit. With its lock "
        "on lease_key free, its reader ended without committing: a failed attempt to count.",
    ),
    (
        "broker_receive_commit",
        "Leases whose receiving transaction committed (written inside that transaction).",
        "Leases whose receiving transaction committed (written by versions before 0025).",
    ),
)


def upgrade() -> None:
    op.create_index("ix_broker_receive_lease_queue_id", "broker_receive_lease", ["queue_id"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(WRITE_FUNCTION)
        for table, before, after in COMMENTS:
            op.create_table_comment(table, after, existing_comment=before)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table, before, after in COMMENTS:
            op.create_table_comment(table, before, existing_comment=after)
        op.execute(DROP_WRITE_FUNCTION)
    op.drop_index("ix_broker_receive_lease_queue_id", table_name="broker_receive_lease")
