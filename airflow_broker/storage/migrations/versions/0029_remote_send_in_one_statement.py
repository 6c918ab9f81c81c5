"""a SEND to a service of another broker is one statement

Revision ID: 0029
Revises: 0028
Create Date: 2026-11-29 13:00:00

``broker_send_one`` and ``broker_send_many`` (see :mod:`airflow_broker.storage.endpoint_locks`)
are created again: when the conversations' far sides live in another broker (known since its
first answer) and the dialogs are in clear (no session key, and for an initiator neither
ENCRYPTION nor a remote service binding for its far service), they advance the senders'
sequence numbers and write the messages into the transmission queue themselves, where before
they wrote nothing and the general path took five statements. No table changes. PostgreSQL
only.
"""

from __future__ import annotations

from alembic import op

from airflow_broker.storage.endpoint_locks import SEND_MANY_FUNCTION, SEND_ONE_FUNCTION

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(SEND_ONE_FUNCTION)
    op.execute(SEND_MANY_FUNCTION)


def downgrade() -> None:
    """Nothing to undo: the tables are those of 0028, which the function reads as they are."""
