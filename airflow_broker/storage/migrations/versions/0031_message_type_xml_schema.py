"""message types validated against an XML Schema: ``broker_message_type.xml_schema``

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-07 19:40:00

``broker_message_type`` gains ``xml_schema``, the text of the XSD that bodies of a message type
with validation ``xml_schema`` must be valid against (seed 004's VALID_XML WITH SCHEMA
COLLECTION). NULL for every other validation, and for every message type that exists: nothing
is rewritten. Downgraded, a message type with validation ``xml_schema`` keeps
``well_formed_xml``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("broker_message_type", sa.Column("xml_schema", sa.Text(), nullable=True))


def downgrade() -> None:
    # The schema goes: a type validated against one keeps the check the older revision knows.
    op.execute(
        "UPDATE broker_message_type SET validation = 'well_formed_xml' "
        "WHERE validation = 'xml_schema'"
    )
    # Plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35): a batch "move and copy" would drop
    # broker_message_type, which broker_contract_message references.
    op.execute("ALTER TABLE broker_message_type DROP COLUMN xml_schema")
