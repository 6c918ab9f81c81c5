"""routing between brokers: transit (forwarding), principal flag, data-dependent routing

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 05:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "broker_instance",
        sa.Column("principal", sa.Boolean(), server_default=sa.text("true"), nullable=False),
    )
    op.create_table(
        "broker_transit",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("kind", sa.String(length=1), nullable=False),
        sa.Column("conversation_id", sa.Uuid(), nullable=False),
        sa.Column("from_initiator", sa.Boolean(), nullable=False),
        sa.Column("from_service_name", sa.String(length=256), nullable=False),
        sa.Column("from_broker_instance", sa.String(length=36), nullable=False),
        sa.Column("to_service_name", sa.String(length=256), nullable=False),
        sa.Column("to_broker_instance", sa.String(length=36), nullable=True),
        sa.Column("service_contract_name", sa.String(length=256), nullable=False),
        sa.Column("message_type_name", sa.String(length=256), nullable=False),
        sa.Column("message_sequence_number", sa.BigInteger(), nullable=False),
        sa.Column("validation", sa.String(length=1), nullable=False),
        sa.Column("message_body", sa.LargeBinary(), nullable=True),
        sa.Column("lifetime", sa.DateTime(timezone=True), nullable=True),
        sa.Column("hops", sa.SmallInteger(), nullable=False),
        sa.Column("error_code", sa.Integer(), nullable=True),
        sa.Column("error_description", sa.Text(), nullable=True),
        sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("transmission_status", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_broker_transit")),
        comment=(
            "Messages a forwarding broker holds while the next hop cannot take them. Not durable on "
            "purpose (seed 002): the sender keeps every message until its final destination "
            "acknowledges it, so what a crash loses here is sent again."
        ),
        info={"unlogged": True},
    )
    op.create_table(
        "broker_routing_service",
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("mode", sa.String(length=10), nullable=False),
        sa.Column("classifier", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["name"],
            ["broker_service.name"],
            name=op.f("fk_broker_routing_service_name_broker_service"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_broker_routing_service")),
        comment="Data-dependent routing services (seed 000): their mode and classifier.",
    )
    op.create_table(
        "broker_resolved_conversation",
        sa.Column("inbound_handle", sa.Uuid(), nullable=False),
        sa.Column("outbound_handle", sa.Uuid(), nullable=False),
        sa.Column("routing_service", sa.String(length=256), nullable=False),
        sa.Column("target_service", sa.String(length=256), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("inbound_handle", name=op.f("pk_broker_resolved_conversation")),
        sa.UniqueConstraint(
            "outbound_handle", name=op.f("uq_broker_resolved_conversation_outbound_handle")
        ),
        comment="Seed 000's resolved_conversations: which outbound dialog carries an inbound one.",
    )
    op.create_index(
        op.f("ix_broker_resolved_conversation_routing_service"),
        "broker_resolved_conversation",
        ["routing_service"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(
        op.f("ix_broker_resolved_conversation_routing_service"),
        table_name="broker_resolved_conversation",
    )
    op.drop_table("broker_resolved_conversation")
    op.drop_table("broker_routing_service")
    op.drop_table("broker_transit")
    op.drop_column("broker_instance", "principal")
