"""a SEND committed in the round trip that runs it

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-26 23:00:00

``Broker.send`` SENDs in a transaction of its own (as a SEND outside BEGIN TRANSACTION does).
On PostgreSQL it sends ``BEGIN; <the fast-path SEND>; COMMIT`` as one query, which may commit
only if the SEND reached every conversation it names: the fast path writes nothing for a
conversation it does not handle (and ``broker_send_many`` skips one another transaction
changed meanwhile), and those go by the general path, in the same transaction. The function
``broker_sent_all`` (:data:`airflow_broker.messaging.fast_send.SENT_ALL_FUNCTION`) raises
when they are not all sent, so that the COMMIT in the same query never runs; the caller then
rolls back and SENDs the usual way. No table changes. PostgreSQL only.
"""

from __future__ import annotations

from alembic import op

from airflow_broker.messaging.fast_send import SENT_ALL_FUNCTION

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(SENT_ALL_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION IF EXISTS broker_sent_all(bigint, integer)")
