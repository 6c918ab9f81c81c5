"""conversation endpoints leave room on their pages for the next version of each row

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-26 15:20:00

Every SEND writes a new version of its endpoint row (the send sequence number). PostgreSQL
keeps such an update on the row's own page (a HOT update: no new index entries, and the old
version is pruned by the next access) only when that page has room for the new version. At the
default fillfactor of 100 the pages are full, so a transaction that sends more than once on the
same conversations wrote almost every version to another page, with an entry in each of the
table's five indexes: measured with ten SENDs to the same 100 dialogs per transaction, 46 of
10,000 updates stayed on their page (1,260 bytes of WAL a message). With half of every page
free, 6,000 to 8,000 of 10,000 do (880 bytes a message), and the table stays a tenth smaller.
A table that grew that way also slows every later SEND, whose rows then lie one to a page
(measured on a broker loaded with 300,000 messages: a batched round's SENDs 0.28-0.36 s with
the table compacted, 0.42-0.44 s without).

Pages written from now on keep the room; existing ones get it as VACUUM FULL or CLUSTER
rewrites the table, which this migration does not do (it would lock the table). PostgreSQL only.
"""

from __future__ import annotations

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

TABLE = "broker_conversation_endpoint"
#: Half of each page left free for the rows' next versions (see the module's text).
FILLFACTOR = 50


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"ALTER TABLE {TABLE} SET (fillfactor = {FILLFACTOR})")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"ALTER TABLE {TABLE} RESET (fillfactor)")
