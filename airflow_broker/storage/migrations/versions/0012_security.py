"""security: permissions, dialog security, the delivery inbox

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25 14:40:00

- new tables ``broker_permission`` (SEND and RECEIVE granted to database roles),
  ``broker_certificate``, ``broker_remote_service_binding`` and ``broker_dialog_key`` (dialog
  security), ``broker_inbox`` and ``broker_inbox_answer`` (delivery by a peer that may only
  deliver; a batch pushed there wakes the transmitter);
- ``broker_conversation_endpoint`` gains ``encryption``, ``broker_transmission_queue``
  ``sealed``, and ``broker_transit`` ``sealed`` and ``handshake`` (all nullable: no rewrite);
- on PostgreSQL, row-level security on the inbox tables: a pusher writes batches under its own
  role name only and reads only the answers to its own batches.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

COLUMNS = (
    ("broker_conversation_endpoint", "encryption"),
    ("broker_transmission_queue", "sealed"),
    ("broker_transit", "sealed"),
    ("broker_transit", "handshake"),
)

TS = sa.DateTime(timezone=True)
NAME = sa.String(length=256)
ROLE = sa.String(length=63)


def upgrade() -> None:
    with op.batch_alter_table("broker_conversation_endpoint") as b:
        b.add_column(sa.Column("encryption", sa.Boolean(), nullable=True))
    with op.batch_alter_table("broker_transmission_queue") as b:
        b.add_column(sa.Column("sealed", sa.Boolean(), nullable=True))
    with op.batch_alter_table("broker_transit") as b:
        b.add_column(sa.Column("sealed", sa.Boolean(), nullable=True))
        b.add_column(sa.Column("handshake", sa.LargeBinary(), nullable=True))
    op.create_table(
        "broker_permission",
        sa.Column("permission", sa.String(length=10), nullable=False),
        sa.Column("object_name", NAME, nullable=False),
        sa.Column("grantee", ROLE, nullable=False),
        sa.Column("granted_at", TS, nullable=False),
        sa.PrimaryKeyConstraint(
            "permission", "object_name", "grantee", name=op.f("pk_broker_permission")
        ),
        comment="SEND on services and RECEIVE on queues, granted to database roles.",
    )
    op.create_table(
        "broker_certificate",
        sa.Column("name", NAME, nullable=False),
        sa.Column("owner", NAME, nullable=False),
        sa.Column("subject", sa.Text(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("pem", sa.Text(), nullable=False),
        sa.Column("private_key", sa.LargeBinary(), nullable=True),
        sa.Column("not_before", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_broker_certificate")),
        sa.UniqueConstraint("fingerprint", name=op.f("uq_broker_certificate_fingerprint")),
        comment="Certificates of dialog security (X.509, PEM).",
    )
    op.create_index(op.f("ix_broker_certificate_owner"), "broker_certificate", ["owner"])
    op.create_table(
        "broker_remote_service_binding",
        sa.Column("name", NAME, nullable=False),
        sa.Column("service", NAME, nullable=False),
        sa.Column("certificate", NAME, nullable=False),
        sa.Column("anonymous", sa.Boolean(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["certificate"],
            ["broker_certificate.name"],
            name=op.f("fk_broker_remote_service_binding_certificate_broker_certificate"),
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_broker_remote_service_binding")),
        sa.UniqueConstraint("service", name=op.f("uq_broker_remote_service_binding_service")),
        comment="The certificate a far service is reached with (CREATE REMOTE SERVICE BINDING).",
    )
    op.create_table(
        "broker_dialog_key",
        sa.Column("conversation_handle", sa.Uuid(), nullable=False),
        sa.Column("session_key", sa.LargeBinary(), nullable=False),
        sa.Column("handshake", sa.LargeBinary(), nullable=True),
        sa.Column("local_certificate", NAME, nullable=True),
        sa.Column("remote_certificate", NAME, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["conversation_handle"],
            ["broker_conversation_endpoint.conversation_handle"],
            name=op.f("fk_broker_dialog_key_conversation_handle_broker_conversation_endpoint"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("conversation_handle", name=op.f("pk_broker_dialog_key")),
        comment="Session keys of secure dialogs, one per endpoint.",
    )
    op.create_table(
        "broker_inbox",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("pushed_by", ROLE, nullable=False),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.Column("packets", sa.LargeBinary(), nullable=False),
        sa.Column("pushed_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_broker_inbox")),
        comment="Batches pushed by peers that may only deliver, waiting for this broker to accept.",
    )
    op.create_table(
        "broker_inbox_answer",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("pushed_by", ROLE, nullable=False),
        sa.Column("inbox_id", sa.BigInteger(), nullable=False),
        sa.Column("answers", sa.LargeBinary(), nullable=False),
        sa.Column("answered_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_broker_inbox_answer")),
        comment=(
            "What this broker answered to batches from its inbox, for their pusher to collect."
        ),
    )
    op.create_index(op.f("ix_broker_inbox_answer_pushed_by"), "broker_inbox_answer", ["pushed_by"])
    if op.get_bind().dialect.name == "postgresql":
        # The owner (who runs migrations and the broker) is not subject to these policies;
        # roles given the delivery right are (operations.security grants them the tables).
        op.execute("ALTER TABLE broker_inbox ENABLE ROW LEVEL SECURITY")
        op.execute(
            "CREATE POLICY broker_inbox_push ON broker_inbox FOR INSERT "
            "WITH CHECK (pushed_by = current_user)"
        )
        op.execute("ALTER TABLE broker_inbox_answer ENABLE ROW LEVEL SECURITY")
        op.execute(
            "CREATE POLICY broker_inbox_answer_own ON broker_inbox_answer "
            "USING (pushed_by = current_user)"
        )
        # A batch in the inbox wakes the transmitter (0010's function), which accepts it.
        op.execute(
            "CREATE TRIGGER broker_inbox_notify AFTER INSERT ON broker_inbox "
            "FOR EACH STATEMENT EXECUTE FUNCTION broker_notify_transmitter()"
        )


def downgrade() -> None:
    op.drop_index(op.f("ix_broker_inbox_answer_pushed_by"), table_name="broker_inbox_answer")
    op.drop_table("broker_inbox_answer")
    op.drop_table("broker_inbox")
    op.drop_table("broker_dialog_key")
    op.drop_table("broker_remote_service_binding")
    op.drop_index(op.f("ix_broker_certificate_owner"), table_name="broker_certificate")
    op.drop_table("broker_certificate")
    op.drop_table("broker_permission")
    for table, column in COLUMNS[::-1]:
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
