"""initial broker schema

Revision ID: 0001
Revises:
Create Date: 2026-11-22 01:58:54.268607
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "broker_contract",
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_broker_contract")),
    )
    op.create_table(
        "broker_event",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("event", sa.String(length=64), nullable=False),
        sa.Column("object_name", sa.String(length=256), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_broker_event")),
        comment="What the broker did on its own: queues disabled by poison handling, and so on.",
    )
    op.create_index("ix_broker_event_occurred_at", "broker_event", ["occurred_at"], unique=False)
    op.create_table(
        "broker_instance",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("instance_id", sa.String(length=36), nullable=False),
        sa.Column("forwarding", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_broker_instance")),
        comment="One row: this broker database's identity (service_broker_guid) and settings.",
    )
    op.create_table(
        "broker_message_type",
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("validation", sa.String(length=20), nullable=False),
        sa.Column("json_schema", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_broker_message_type")),
    )
    op.create_table(
        "broker_priority",
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("contract_name", sa.String(length=256), nullable=True),
        sa.Column("local_service", sa.String(length=256), nullable=True),
        sa.Column("remote_service", sa.String(length=256), nullable=True),
        sa.Column("priority", sa.SmallInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_broker_priority")),
    )
    op.create_table(
        "broker_queue",
        sa.Column("queue_id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("status", sa.Boolean(), nullable=False),
        sa.Column("retention", sa.Boolean(), nullable=False),
        sa.Column("poison_message_handling", sa.Boolean(), nullable=False),
        sa.Column("activation", sa.JSON(), nullable=True),
        sa.Column("rollback_count", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("modified_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("queue_id", name=op.f("pk_broker_queue")),
        sa.UniqueConstraint("name", name=op.f("uq_broker_queue_name")),
    )
    op.create_table(
        "broker_receive_lease",
        sa.Column("lease_key", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("queue_id", sa.Integer(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("backend_start", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("lease_key", name=op.f("pk_broker_receive_lease")),
        comment="One row per open transaction that has received messages (PostgreSQL), written outside that transaction and deleted by its commit. A row whose server backend (pid) is gone belongs to a reader that died holding messages: poison handling counts it as a rollback.",
        info={"unlogged": True},
    )
    op.create_table(
        "broker_route",
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("service_name", sa.String(length=256), nullable=True),
        sa.Column("broker_instance", sa.String(length=36), nullable=True),
        sa.Column("address", sa.String(length=512), nullable=False),
        sa.Column("mirror_address", sa.String(length=512), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_broker_route")),
    )
    op.create_table(
        "broker_contract_message",
        sa.Column("contract_name", sa.String(length=256), nullable=False),
        sa.Column("message_type_name", sa.String(length=256), nullable=False),
        sa.Column("sent_by", sa.String(length=10), nullable=False),
        sa.ForeignKeyConstraint(
            ["contract_name"],
            ["broker_contract.name"],
            name=op.f("fk_broker_contract_message_contract_name_broker_contract"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["message_type_name"],
            ["broker_message_type.name"],
            name=op.f("fk_broker_contract_message_message_type_name_broker_message_type"),
        ),
        sa.PrimaryKeyConstraint(
            "contract_name", "message_type_name", name=op.f("pk_broker_contract_message")
        ),
    )
    op.create_table(
        "broker_conversation_group",
        sa.Column("conversation_group_id", sa.Uuid(), nullable=False),
        sa.Column("queue_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["queue_id"],
            ["broker_queue.queue_id"],
            name=op.f("fk_broker_conversation_group_queue_id_broker_queue"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("conversation_group_id", name=op.f("pk_broker_conversation_group")),
        comment="The unit of locking: RECEIVE locks one row here until its transaction ends.",
    )
    op.create_index(
        op.f("ix_broker_conversation_group_queue_id"),
        "broker_conversation_group",
        ["queue_id"],
        unique=False,
    )
    op.create_table(
        "broker_service",
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("queue_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["queue_id"],
            ["broker_queue.queue_id"],
            name=op.f("fk_broker_service_queue_id_broker_queue"),
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_broker_service")),
    )
    op.create_table(
        "broker_conversation_endpoint",
        sa.Column("conversation_handle", sa.Uuid(), nullable=False),
        sa.Column("conversation_id", sa.Uuid(), nullable=False),
        sa.Column("is_initiator", sa.Boolean(), nullable=False),
        sa.Column("conversation_group_id", sa.Uuid(), nullable=False),
        sa.Column("queue_id", sa.Integer(), nullable=False),
        sa.Column("service_name", sa.String(length=256), nullable=False),
        sa.Column("far_service", sa.String(length=256), nullable=False),
        sa.Column("far_broker_instance", sa.String(length=36), nullable=True),
        sa.Column("far_handle", sa.Uuid(), nullable=True),
        sa.Column("contract_name", sa.String(length=256), nullable=False),
        sa.Column("state", sa.String(length=2), nullable=False),
        sa.Column("priority", sa.SmallInteger(), nullable=False),
        sa.Column("lifetime", sa.DateTime(timezone=True), nullable=True),
        sa.Column("timer_due_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("send_sequence", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("receive_sequence", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["conversation_group_id"],
            ["broker_conversation_group.conversation_group_id"],
            name=op.f(
                "fk_broker_conversation_endpoint_conversation_group_id_broker_conversation_group"
            ),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "conversation_handle", name=op.f("pk_broker_conversation_endpoint")
        ),
    )
    op.create_index(
        op.f("ix_broker_conversation_endpoint_conversation_group_id"),
        "broker_conversation_endpoint",
        ["conversation_group_id"],
        unique=False,
    )
    op.create_index(
        "ix_broker_conversation_endpoint_lifetime",
        "broker_conversation_endpoint",
        ["lifetime"],
        unique=False,
        postgresql_where=sa.text("lifetime IS NOT NULL AND state NOT IN ('ER', 'CD')"),
        sqlite_where=sa.text("lifetime IS NOT NULL AND state NOT IN ('ER', 'CD')"),
    )
    op.create_index(
        "ix_broker_conversation_endpoint_timer_due_at",
        "broker_conversation_endpoint",
        ["timer_due_at"],
        unique=False,
        postgresql_where=sa.text("timer_due_at IS NOT NULL"),
        sqlite_where=sa.text("timer_due_at IS NOT NULL"),
    )
    op.create_index(
        "uq_broker_conversation_endpoint_conversation_id_is_initiator",
        "broker_conversation_endpoint",
        ["conversation_id", "is_initiator"],
        unique=True,
    )
    op.create_table(
        "broker_service_contract",
        sa.Column("service_name", sa.String(length=256), nullable=False),
        sa.Column("contract_name", sa.String(length=256), nullable=False),
        sa.ForeignKeyConstraint(
            ["contract_name"],
            ["broker_contract.name"],
            name=op.f("fk_broker_service_contract_contract_name_broker_contract"),
        ),
        sa.ForeignKeyConstraint(
            ["service_name"],
            ["broker_service.name"],
            name=op.f("fk_broker_service_contract_service_name_broker_service"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "service_name", "contract_name", name=op.f("pk_broker_service_contract")
        ),
    )
    op.create_table(
        "broker_message",
        sa.Column(
            "queuing_order",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("queue_id", sa.Integer(), nullable=False),
        sa.Column("conversation_group_id", sa.Uuid(), nullable=False),
        sa.Column("conversation_handle", sa.Uuid(), nullable=False),
        sa.Column("message_sequence_number", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.SmallInteger(), nullable=False),
        sa.Column("priority", sa.SmallInteger(), nullable=False),
        sa.Column("precedence", sa.SmallInteger(), nullable=False),
        sa.Column("service_name", sa.String(length=256), nullable=False),
        sa.Column("service_contract_name", sa.String(length=256), nullable=False),
        sa.Column("message_type_name", sa.String(length=256), nullable=False),
        sa.Column("validation", sa.String(length=1), nullable=False),
        sa.Column("message_body", sa.LargeBinary(), nullable=True),
        sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("queuing_order", name=op.f("pk_broker_message")),
        comment="The contents of every queue.",
    )
    op.create_index(
        op.f("ix_broker_message_conversation_handle"),
        "broker_message",
        ["conversation_handle"],
        unique=False,
    )
    op.create_index(
        "ix_broker_message_group",
        "broker_message",
        [
            "conversation_group_id",
            sa.literal_column("priority DESC"),
            "precedence",
            "conversation_handle",
            "message_sequence_number",
        ],
        unique=False,
        postgresql_where=sa.text("status = 1"),
        sqlite_where=sa.text("status = 1"),
    )
    op.create_index(
        "ix_broker_message_ready",
        "broker_message",
        ["queue_id", sa.literal_column("priority DESC"), "queuing_order"],
        unique=False,
        postgresql_where=sa.text("status = 1"),
        sqlite_where=sa.text("status = 1"),
    )
    op.create_table(
        "broker_transmission_queue",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("conversation_handle", sa.Uuid(), nullable=False),
        sa.Column("conversation_id", sa.Uuid(), nullable=False),
        sa.Column("is_initiator", sa.Boolean(), nullable=False),
        sa.Column("from_service_name", sa.String(length=256), nullable=False),
        sa.Column("from_broker_instance", sa.String(length=36), nullable=False),
        sa.Column("to_service_name", sa.String(length=256), nullable=False),
        sa.Column("to_broker_instance", sa.String(length=36), nullable=True),
        sa.Column("service_contract_name", sa.String(length=256), nullable=False),
        sa.Column("message_type_name", sa.String(length=256), nullable=False),
        sa.Column("message_sequence_number", sa.BigInteger(), nullable=False),
        sa.Column("priority", sa.SmallInteger(), nullable=False),
        sa.Column("validation", sa.String(length=1), nullable=False),
        sa.Column("message_body", sa.LargeBinary(), nullable=True),
        sa.Column("lifetime", sa.DateTime(timezone=True), nullable=True),
        sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("transmission_status", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["conversation_handle"],
            ["broker_conversation_endpoint.conversation_handle"],
            name=op.f(
                "fk_broker_transmission_queue_conversation_handle_broker_conversation_endpoint"
            ),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_broker_transmission_queue")),
        comment="Messages waiting to leave for a service this broker does not host (or cannot reach).",
    )
    op.create_index(
        op.f("ix_broker_transmission_queue_conversation_handle"),
        "broker_transmission_queue",
        ["conversation_handle"],
        unique=False,
    )
    op.create_index(
        "ix_broker_transmission_queue_next_attempt_at",
        "broker_transmission_queue",
        ["next_attempt_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(
        "ix_broker_transmission_queue_next_attempt_at", table_name="broker_transmission_queue"
    )
    op.drop_index(
        op.f("ix_broker_transmission_queue_conversation_handle"),
        table_name="broker_transmission_queue",
    )
    op.drop_table("broker_transmission_queue")
    op.drop_index(
        "ix_broker_message_ready",
        table_name="broker_message",
        postgresql_where=sa.text("status = 1"),
        sqlite_where=sa.text("status = 1"),
    )
    op.drop_index(
        "ix_broker_message_group",
        table_name="broker_message",
        postgresql_where=sa.text("status = 1"),
        sqlite_where=sa.text("status = 1"),
    )
    op.drop_index(op.f("ix_broker_message_conversation_handle"), table_name="broker_message")
    op.drop_table("broker_message")
    op.drop_table("broker_service_contract")
    op.drop_index(
        "uq_broker_conversation_endpoint_conversation_id_is_initiator",
        table_name="broker_conversation_endpoint",
    )
    op.drop_index(
        "ix_broker_conversation_endpoint_timer_due_at",
        table_name="broker_conversation_endpoint",
        postgresql_where=sa.text("timer_due_at IS NOT NULL"),
        sqlite_where=sa.text("timer_due_at IS NOT NULL"),
    )
    op.drop_index(
        "ix_broker_conversation_endpoint_lifetime",
        table_name="broker_conversation_endpoint",
        postgresql_where=sa.text("lifetime IS NOT NULL AND state NOT IN ('ER', 'CD')"),
        sqlite_where=sa.text("lifetime IS NOT NULL AND state NOT IN ('ER', 'CD')"),
    )
    op.drop_index(
        op.f("ix_broker_conversation_endpoint_conversation_group_id"),
        table_name="broker_conversation_endpoint",
    )
    op.drop_table("broker_conversation_endpoint")
    op.drop_table("broker_service")
    op.drop_index(
        op.f("ix_broker_conversation_group_queue_id"), table_name="broker_conversation_group"
    )
    op.drop_table("broker_conversation_group")
    op.drop_table("broker_contract_message")
    op.drop_table("broker_route")
    op.drop_table("broker_receive_lease")
    op.drop_table("broker_queue")
    op.drop_table("broker_priority")
    op.drop_table("broker_message_type")
    op.drop_table("broker_instance")
    op.drop_index("ix_broker_event_occurred_at", table_name="broker_event")
    op.drop_table("broker_event")
    op.drop_table("broker_contract")
