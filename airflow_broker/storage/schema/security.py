"""Tables of security (seed 004): permissions granted to database roles, certificates and remote
service bindings (dialog security), the session keys of secure dialogs, and the inbox through
which a peer that may only deliver hands its batches over.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ForeignKey,
    Integer,
    LargeBinary,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    Uuid,
)

from airflow_broker.storage.schema.core import NAME, BigId, Timestamp, metadata

#: A PostgreSQL role name (NAMEDATALEN - 1).
ROLE = String(63)

permission = Table(
    "broker_permission",
    metadata,
    # "SEND" (object: a service) or "RECEIVE" (object: a queue).
    Column("permission", String(10), nullable=False),
    Column("object_name", NAME, nullable=False),
    Column("grantee", ROLE, nullable=False),
    Column("granted_at", Timestamp, nullable=False),
    PrimaryKeyConstraint("permission", "object_name", "grantee"),
    comment="SEND on services and RECEIVE on queues, granted to database roles.",
)

certificate = Table(
    "broker_certificate",
    metadata,
    Column("name", NAME, primary_key=True),
    # The service this certificate speaks for: a local one (with its private key) or a far one.
    Column("owner", NAME, nullable=False, index=True),
    Column("subject", Text, nullable=False),
    # SHA-256 of the certificate's DER, hex.
    Column("fingerprint", String(64), nullable=False, unique=True),
    Column("pem", Text, nullable=False),
    # The private key (PKCS #8 DER) sealed under the master key; None: a public certificate.
    Column("private_key", LargeBinary, nullable=True),
    Column("not_before", Timestamp, nullable=False),
    Column("expires_at", Timestamp, nullable=False),
    Column("created_at", Timestamp, nullable=False),
    comment="Certificates of dialog security (X.509, PEM).",
)

remote_service_binding = Table(
    "broker_remote_service_binding",
    metadata,
    Column("name", NAME, primary_key=True),
    Column("service", NAME, nullable=False, unique=True),
    Column("certificate", NAME, ForeignKey("broker_certificate.name"), nullable=False),
    Column("anonymous", Boolean, nullable=False),
    Column("created_at", Timestamp, nullable=False),
    comment="The certificate a far service is reached with (CREATE REMOTE SERVICE BINDING).",
)

dialog_key = Table(
    "broker_dialog_key",
    metadata,
    Column(
        "conversation_handle",
        Uuid,
        ForeignKey("broker_conversation_endpoint.conversation_handle", ondelete="CASCADE"),
        primary_key=True,
    ),
    # The dialog's session key, sealed under the master key.
    Column("session_key", LargeBinary, nullable=False),
    # Initiator: the signed key exchange its messages carry until the target acknowledges one.
    Column("handshake", LargeBinary, nullable=True),
    Column("local_certificate", NAME, nullable=True),
    Column("remote_certificate", NAME, nullable=True),
    Column("created_at", Timestamp, nullable=False),
    comment="Session keys of secure dialogs, one per endpoint.",
)

inbox = Table(
    "broker_inbox",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    # The role that pushed the batch (PostgreSQL checks it is the pusher's own name).
    Column("pushed_by", ROLE, nullable=False),
    Column("depth", Integer, nullable=False),
    # The packets, serialized (transport.wire).
    Column("packets", LargeBinary, nullable=False),
    Column("pushed_at", Timestamp, nullable=False),
    comment="Batches pushed by peers that may only deliver, waiting for this broker to accept.",
)

inbox_answer = Table(
    "broker_inbox_answer",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("pushed_by", ROLE, nullable=False, index=True),
    Column("inbox_id", BigInteger, nullable=False),
    # Acknowledgments, Error notices and per-packet notes, serialized (transport.wire).
    Column("answers", LargeBinary, nullable=False),
    Column("answered_at", Timestamp, nullable=False),
    comment="What this broker answered to batches from its inbox, for their pusher to collect.",
)
