"""The broker's core tables, in SQLAlchemy Core (the package `storage.schema` re-exports them).

One :class:`~sqlalchemy.MetaData` with a naming convention, so that constraint names are the same
on every engine and Alembic can compare a migrated database with a fresh ``create_all``. Every
table is prefixed ``broker_``: in production they sit in the same PostgreSQL database as Airflow's
own metadata and must never collide with it.

Timestamps are timezone-aware UTC. Names of broker objects are up to 256 characters, as in
Service Broker (service names are often URIs).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    Text,
    Uuid,
    text,
)
from sqlalchemy import event as sa_event
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import DDL, CreateTable

from airflow_broker.storage.endpoint_locks import FUNCTIONS as SEND_FUNCTIONS

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

NAME = String(256)
# SQLite only auto-increments an INTEGER PRIMARY KEY (the rowid alias), never a BIGINT one.
BigId = BigInteger().with_variant(Integer(), "sqlite")
Timestamp = DateTime(timezone=True)


@compiles(CreateTable, "postgresql")
def _create_unlogged(create: CreateTable, compiler: Any, **kw: Any) -> str:
    """Tables marked ``info={"unlogged": True}`` hold nothing that must survive a server crash."""
    sql: str = compiler.visit_create_table(create, **kw)
    if create.element.info.get("unlogged"):
        sql = sql.replace("CREATE TABLE", "CREATE UNLOGGED TABLE", 1)
    return sql


broker_instance = Table(
    "broker_instance",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("instance_id", String(36), nullable=False),
    Column("forwarding", Boolean, nullable=False, server_default=text("false")),
    Column("created_at", Timestamp, nullable=False),
    # False when this database says it is not the principal of a mirrored pair: deliveries to it
    # are refused, so senders use the route's mirror address (PostgreSQL: also while in recovery).
    Column("principal", Boolean, nullable=False, server_default=text("true")),
    # Where the database was when its identity was recorded (storage.identity): a restored,
    # cloned or copied one no longer matches and refuses delivery until reset-identity; NULL: new.
    Column("fingerprint", Text, nullable=True),
    comment="One row: this broker database's identity (service_broker_guid) and settings.",
)

message_type = Table(
    "broker_message_type",
    metadata,
    Column("name", NAME, primary_key=True),
    Column("validation", String(20), nullable=False),
    Column("json_schema", JSON, nullable=True),
    Column("created_at", Timestamp, nullable=False),
    # The XSD text of validation 'xml_schema' (migration 0031).
    Column("xml_schema", Text, nullable=True),
)

contract = Table(
    "broker_contract",
    metadata,
    Column("name", NAME, primary_key=True),
    Column("created_at", Timestamp, nullable=False),
)

contract_message = Table(
    "broker_contract_message",
    metadata,
    Column(
        "contract_name",
        NAME,
        ForeignKey("broker_contract.name", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("message_type_name", NAME, ForeignKey("broker_message_type.name"), nullable=False),
    Column("sent_by", String(10), nullable=False),
    PrimaryKeyConstraint("contract_name", "message_type_name"),
)

queue = Table(
    "broker_queue",
    metadata,
    Column("queue_id", Integer, primary_key=True, autoincrement=True),
    Column("name", NAME, nullable=False, unique=True),
    Column("status", Boolean, nullable=False),
    Column("retention", Boolean, nullable=False),
    Column("poison_message_handling", Boolean, nullable=False),
    Column("activation", JSON, nullable=True),
    Column("rollback_count", Integer, nullable=False, server_default=text("0")),
    Column("created_at", Timestamp, nullable=False),
    Column("modified_at", Timestamp, nullable=False),
    # Failure handling per conversation (all None: Service Broker's disable-after-five rule).
    Column("retry_delay", Float, nullable=True),
    Column("retry_delay_max", Float, nullable=True),
    Column("max_receives", Integer, nullable=True),
    Column("dead_letter_queue", NAME, nullable=True),
)

service = Table(
    "broker_service",
    metadata,
    Column("name", NAME, primary_key=True),
    Column("queue_id", Integer, ForeignKey("broker_queue.queue_id"), nullable=False),
    Column("created_at", Timestamp, nullable=False),
)

service_contract = Table(
    "broker_service_contract",
    metadata,
    Column(
        "service_name", NAME, ForeignKey("broker_service.name", ondelete="CASCADE"), nullable=False
    ),
    Column("contract_name", NAME, ForeignKey("broker_contract.name"), nullable=False),
    PrimaryKeyConstraint("service_name", "contract_name"),
)

route = Table(
    "broker_route",
    metadata,
    Column("name", NAME, primary_key=True),
    Column("service_name", NAME, nullable=True),
    Column("broker_instance", String(36), nullable=True),
    Column("address", String(512), nullable=False),
    Column("mirror_address", String(512), nullable=True),
    Column("expires_at", Timestamp, nullable=True),
    Column("created_at", Timestamp, nullable=False),
)

priority = Table(
    "broker_priority",
    metadata,
    Column("name", NAME, primary_key=True),
    Column("contract_name", NAME, nullable=True),
    Column("local_service", NAME, nullable=True),
    Column("remote_service", NAME, nullable=True),
    Column("priority", SmallInteger, nullable=False),
)

conversation_group = Table(
    "broker_conversation_group",
    metadata,
    Column("conversation_group_id", Uuid, primary_key=True),
    Column(
        "queue_id",
        Integer,
        ForeignKey("broker_queue.queue_id", ondelete="CASCADE"),
        nullable=False,
        index=True,
    ),
    # Held without a transaction: by a lease, or until held_until after a failed attempt.
    Column("held_until", Timestamp, nullable=True),
    Column("lease_token", Uuid, nullable=True),
    comment="The unit of locking: RECEIVE locks one row here until its transaction ends.",
)

conversation_endpoint = Table(
    "broker_conversation_endpoint",
    metadata,
    Column("conversation_handle", Uuid, primary_key=True),
    Column("conversation_id", Uuid, nullable=False),
    Column("is_initiator", Boolean, nullable=False),
    Column("conversation_group_id", Uuid, nullable=False, index=True),
    Column("queue_id", Integer, nullable=False),
    Column("service_name", NAME, nullable=False),
    Column("far_service", NAME, nullable=False),
    Column("far_broker_instance", String(36), nullable=True),
    Column("far_handle", Uuid, nullable=True),
    Column("contract_name", NAME, nullable=False),
    Column("state", String(2), nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("lifetime", Timestamp, nullable=True),
    Column("timer_due_at", Timestamp, nullable=True),
    Column("send_sequence", BigInteger, nullable=False, server_default=text("0")),
    Column("receive_sequence", BigInteger, nullable=False, server_default=text("0")),
    Column("created_at", Timestamp, nullable=False),
    Column("closed_at", Timestamp, nullable=True),
    # BEGIN DIALOG ... WITH ENCRYPTION: leaves this broker only under dialog security.
    Column("encryption", Boolean, nullable=True),
    Index(
        "uq_broker_conversation_endpoint_conversation_id_is_initiator",
        "conversation_id",
        "is_initiator",
        unique=True,
    ),
    Index(
        "ix_broker_conversation_endpoint_timer_due_at",
        "timer_due_at",
        postgresql_where=text("timer_due_at IS NOT NULL"),
        sqlite_where=text("timer_due_at IS NOT NULL"),
    ),
    Index(
        "ix_broker_conversation_endpoint_lifetime",
        "lifetime",
        postgresql_where=text("lifetime IS NOT NULL AND state NOT IN ('ER', 'CD')"),
        sqlite_where=text("lifetime IS NOT NULL AND state NOT IN ('ER', 'CD')"),
    ),
    # SQLite only: on PostgreSQL the engine locks the group instead (see migration 0021).
    ForeignKeyConstraint(
        ["conversation_group_id"],
        ["broker_conversation_group.conversation_group_id"],
        ondelete="CASCADE",
    ).ddl_if(dialect="sqlite"),
    postgresql_with={"fillfactor": 50},  # room for every SEND's new version (migration 0019)
)

message = Table(
    "broker_message",
    metadata,
    Column("queuing_order", BigId, primary_key=True, autoincrement=True),
    # No foreign keys on the hottest table (their checks were a fifth of a batched SEND's time):
    # the engine deletes a queue's or an endpoint's messages wherever it deletes the owner.
    Column("queue_id", Integer, nullable=False),
    Column("conversation_group_id", Uuid, nullable=False),
    Column("conversation_handle", Uuid, nullable=False, index=True),
    Column("message_sequence_number", BigInteger, nullable=False),
    Column("status", SmallInteger, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("precedence", SmallInteger, nullable=False),
    Column("service_name", NAME, nullable=False),
    Column("service_contract_name", NAME, nullable=False),
    Column("message_type_name", NAME, nullable=False),
    Column("validation", String(1), nullable=False),
    Column("message_body", LargeBinary, nullable=True),
    Column("enqueued_at", Timestamp, nullable=False),
    # Failed hand-outs (a lease counts its own at once); dead_letter: JSON, on dead-letter queues.
    Column("receive_count", Integer, nullable=False, server_default=text("0")),
    Column("lease_token", Uuid, nullable=True),
    Column("dead_letter", Text, nullable=True),
    comment="The contents of every queue.",
)

transmission_queue = Table(
    "broker_transmission_queue",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column(
        "conversation_handle",
        Uuid,
        ForeignKey("broker_conversation_endpoint.conversation_handle", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("conversation_id", Uuid, nullable=False),
    Column("is_initiator", Boolean, nullable=False),
    Column("from_service_name", NAME, nullable=False),
    Column("from_broker_instance", String(36), nullable=False),
    Column("to_service_name", NAME, nullable=False),
    Column("to_broker_instance", String(36), nullable=True),
    Column("service_contract_name", NAME, nullable=False),
    Column("message_type_name", NAME, nullable=False),
    Column("message_sequence_number", BigInteger, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("validation", String(1), nullable=False),
    Column("message_body", LargeBinary, nullable=True),
    Column("lifetime", Timestamp, nullable=True),
    Column("enqueued_at", Timestamp, nullable=False),
    Column("transmission_status", Text, nullable=False, server_default=text("''")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("next_attempt_at", Timestamp, nullable=True),
    # message_body is sealed under the dialog's session key (dialog security).
    Column("sealed", Boolean, nullable=True),
    Index("ix_broker_transmission_queue_next_attempt_at", "next_attempt_at"),
    # A dialog's waiting messages, and one of them by sequence number: acknowledgments take
    # rows out by (handle, sequence), which without the second column was a scan of the whole
    # queue for every batch (migration 0017).
    Index(
        "ix_broker_transmission_queue_handle_sequence",
        "conversation_handle",
        "message_sequence_number",
    ),
    comment="Messages waiting to leave for a service this broker does not host (or cannot reach).",
)

event = Table(
    "broker_event",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("occurred_at", Timestamp, nullable=False),
    Column("event", String(64), nullable=False),
    Column("object_name", NAME, nullable=False),
    Column("detail", Text, nullable=False),
    Index("ix_broker_event_occurred_at", "occurred_at"),
    comment="What the broker did on its own: queues disabled by poison handling, and so on.",
)

# RECEIVE picks the highest-priority, oldest ready message whose group is not locked ...
Index(
    "ix_broker_message_ready",
    message.c.queue_id,
    message.c.priority.desc(),
    message.c.queuing_order,
    postgresql_where=text("status = 1"),
    sqlite_where=text("status = 1"),
)
# ... then takes the ready messages of that one group, in the order RECEIVE returns them. The
# queue leads, so that a claim that finds the groups of the oldest messages locked can walk the
# queue's groups with ready messages one by one (migration 0018).
Index(
    "ix_broker_message_group",
    message.c.queue_id,
    message.c.conversation_group_id,
    message.c.priority.desc(),
    message.c.precedence,
    message.c.conversation_handle,
    message.c.message_sequence_number,
    postgresql_where=text("status = 1"),
    sqlite_where=text("status = 1"),
)

# Waiting readers LISTEN on their queue's channel; PostgreSQL notifies it from a trigger
# (migration 0002), so every writer of ready messages wakes them.
_NOTIFY_FUNCTION = DDL(
    """
CREATE OR REPLACE FUNCTION broker_notify_queues() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('airflow_broker_q' || q.queue_id, '')
    FROM (SELECT DISTINCT queue_id FROM broker_new_rows WHERE status = 1) AS q;
    RETURN NULL;
END
$$
"""
)
sa_event.listen(message, "after_create", _NOTIFY_FUNCTION.execute_if(dialect="postgresql"))
# SEND's fast path as functions that lock the far endpoint in memory (migration 0013).
for _ddl in SEND_FUNCTIONS:
    sa_event.listen(message, "after_create", DDL(_ddl).execute_if(dialect="postgresql"))
for _op in ("INSERT", "UPDATE"):
    sa_event.listen(
        message,
        "after_create",
        DDL(
            f"CREATE TRIGGER broker_message_notify_{_op.lower()} AFTER {_op} ON broker_message "
            "REFERENCING NEW TABLE AS broker_new_rows "
            "FOR EACH STATEMENT EXECUTE FUNCTION broker_notify_queues()"
        ).execute_if(dialect="postgresql"),
    )

receive_lease = Table(
    "broker_receive_lease",
    metadata,
    Column("lease_key", BigId, primary_key=True, autoincrement=False),
    Column("queue_id", Integer, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("backend_start", Timestamp, nullable=True),
    Column("started_at", Timestamp, nullable=False),
    Column("held", Text, nullable=True),  # queuing_order of each message taken (JSON)
    Column("xact_lock", Boolean, nullable=False, server_default=text("false")),  # see comment
    Index("ix_broker_receive_lease_queue_id", "queue_id"),  # RECEIVE's look for dead readers
    info={"unlogged": True},
    comment=(
        "One row per open receiving transaction (PostgreSQL), deleted by its commit. With its lock "
        "on lease_key free, its reader ended without committing: a failed attempt to count."
    ),
)

receive_commit = Table(
    "broker_receive_commit",
    metadata,
    Column("lease_key", BigId, primary_key=True, autoincrement=False),
    info={"unlogged": True},
    comment="Leases whose receiving transaction committed (written by versions before 0025).",
)


transit = Table(
    "broker_transit",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("kind", String(1), nullable=False),
    Column("conversation_id", Uuid, nullable=False),
    Column("from_initiator", Boolean, nullable=False),
    Column("from_service_name", NAME, nullable=False),
    Column("from_broker_instance", String(36), nullable=False),
    Column("to_service_name", NAME, nullable=False),
    Column("to_broker_instance", String(36), nullable=True),
    Column("service_contract_name", NAME, nullable=False),
    Column("message_type_name", NAME, nullable=False),
    Column("message_sequence_number", BigInteger, nullable=False),
    Column("validation", String(1), nullable=False),
    Column("message_body", LargeBinary, nullable=True),
    Column("lifetime", Timestamp, nullable=True),
    Column("hops", SmallInteger, nullable=False),
    Column("error_code", Integer, nullable=True),
    Column("error_description", Text, nullable=True),
    Column("enqueued_at", Timestamp, nullable=False),
    Column("transmission_status", Text, nullable=False, server_default=text("''")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("next_attempt_at", Timestamp, nullable=False),
    Column("sealed", Boolean, nullable=True),
    Column("handshake", LargeBinary, nullable=True),
    info={"unlogged": True},
    comment=(
        "Messages a forwarding broker holds while the next hop cannot take them. Not durable on "
        "purpose (seed 002): the sender keeps every message until its final destination "
        "acknowledges it, so what a crash loses here is sent again."
    ),
)

routing_service = Table(
    "broker_routing_service",
    metadata,
    Column("name", NAME, ForeignKey("broker_service.name", ondelete="CASCADE"), primary_key=True),
    Column("mode", String(10), nullable=False),
    Column("classifier", Text, nullable=False),
    Column("created_at", Timestamp, nullable=False),
    comment="Data-dependent routing services (seed 000): their mode and classifier.",
)

resolved_conversation = Table(
    "broker_resolved_conversation",
    metadata,
    Column("inbound_handle", Uuid, primary_key=True),
    Column("outbound_handle", Uuid, nullable=False, unique=True),
    Column("routing_service", NAME, nullable=False, index=True),
    Column("target_service", NAME, nullable=False),
    Column("created_at", Timestamp, nullable=False),
    comment="Seed 000's resolved_conversations: which outbound dialog carries an inbound one.",
)

activation_monitor = Table(
    "broker_activation",
    metadata,
    Column(
        "queue_id",
        Integer,
        ForeignKey("broker_queue.queue_id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("monitor_key", NAME, nullable=False),
    # The highest queuing_order seen at the last firing (a compare-and-set with fires).
    Column("cursor", BigInteger, nullable=False, server_default=text("0")),
    Column("fires", BigInteger, nullable=False, server_default=text("0")),
    Column("fired_at", Timestamp, nullable=True),
    # The depth sampled at observed_at: "the queue keeps growing" compares with it.
    Column("last_depth", Integer, nullable=True),
    Column("observed_at", Timestamp, nullable=True),
    PrimaryKeyConstraint("queue_id", "monitor_key"),
    comment=(
        "Activation monitors (seed 004): per queue and monitor, the cursor and depth it last "
        "acted on, kept in the database so that a restarted triggerer does not fire again."
    ),
)

transmitter = Table(
    "broker_transmitter",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),  # always 1
    # Firing is a compare-and-set on fires, so two watchers never start two runs for one wake.
    Column("fires", BigInteger, nullable=False, server_default=text("0")),
    Column("fired_at", Timestamp, nullable=True),
    Column("started_at", Timestamp, nullable=True),
    Column("finished_at", Timestamp, nullable=True),
    comment=(
        "The transmitter's activation (one row): when a watcher last started a run, and when "
        "a run last started and finished; a watcher fires again once the run it started ended."
    ),
)

alert = Table(
    "broker_alert",
    metadata,
    Column("watcher", NAME, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("object_name", NAME, nullable=False),
    Column("fired_at", Timestamp, nullable=False),
    PrimaryKeyConstraint("watcher", "kind", "object_name"),
    comment=(
        "Alerts a watcher has raised and that still hold (a queue disabled by poison handling, "
        "a target service whose transmissions wait too long); the row goes when the condition "
        "ends, so the next episode alerts again."
    ),
)

activation_reader = Table(
    "broker_activation_reader",
    metadata,
    Column("reader_id", Uuid, primary_key=True),
    Column(
        "queue_id",
        Integer,
        ForeignKey("broker_queue.queue_id", ondelete="CASCADE"),
        nullable=False,
        index=True,
    ),
    # Set when a monitor fired for this reader; started_at stays empty until one claims it.
    Column("monitor_key", NAME, nullable=True),
    Column("cursor", BigInteger, nullable=True),
    Column("fired_at", Timestamp, nullable=True),
    Column("started_at", Timestamp, nullable=True),
    Column("heartbeat_at", Timestamp, nullable=True),
    Column("finished_at", Timestamp, nullable=True),
    Column("outcome", String(16), nullable=True),
    Column("label", NAME, nullable=True),
    comment=(
        "Queue readers: started by a monitor and not yet running, running (heartbeat_at), "
        "or finished (outcome: drained, failed, refused, expired, lost)."
    ),
)

queue_sample = Table(
    "broker_queue_sample",
    metadata,
    Column(
        "queue_id",
        Integer,
        ForeignKey("broker_queue.queue_id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("sampled_at", Timestamp, nullable=False),
    # Ready messages (what RECEIVE can take), as the queue list shows them.
    Column("depth", Integer, nullable=False),
    # "Samples of queue X in the last N minutes" is a range of this key.
    PrimaryKeyConstraint("queue_id", "sampled_at"),
    # The latest sample of any queue (at most one pass per interval), and retention's deletes.
    Index("ix_broker_queue_sample_sampled_at", "sampled_at"),
    comment=(
        "Queue depth history: one row per queue and sampling pass (at most one pass per "
        "interval across processes); rows older than the retention are deleted in batches."
    ),
)
