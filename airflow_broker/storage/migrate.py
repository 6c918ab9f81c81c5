"""Creating and upgrading a broker database: the Alembic migrations, then the rows every broker
needs (its instance id and where the database is, the system contracts and message types, the
AutoCreatedLocal route)."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import insert, select, text
from sqlalchemy.engine import Connection

from airflow_broker.constants import (
    AUTO_CREATED_LOCAL,
    BROKER_CONFIGURATION_NOTICE,
    DEFAULT,
    MISSING_ROUTE,
)
from airflow_broker.storage import client_schema
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow
from airflow_broker.storage.identity import record_fingerprint


def _insert_missing(conn: Connection, key: Any, value: Any, **values: Any) -> bool:
    """Insert the row whose ``key`` column is ``value`` unless it exists; True if inserted."""
    if conn.execute(select(key).where(key == value)).first() is not None:
        return False
    conn.execute(insert(key.table).values({key.name: value, **values}))
    return True


def migrate_on(conn: Connection) -> None:
    """Create or upgrade the broker tables on ``conn``, inside its transaction, then insert the
    broker's identity and system objects that are missing. :meth:`Broker.migrate` runs this on
    a connection of its own; Airflow's DB manager on the metadata database's session."""
    from alembic import command

    from airflow_broker.storage.migrations import alembic_config

    if conn.dialect.name == "postgresql":
        # Serialize concurrent migrations of this database (a key of our own).
        conn.execute(text("SELECT pg_advisory_xact_lock(727170000, 1)"))
    command.upgrade(alembic_config(conn), "head")
    now = utcnow()
    _insert_missing(
        conn,
        s.broker_instance.c.id,
        1,
        instance_id=str(uuid.uuid4()),
        forwarding=False,
        created_at=now,
    )
    # Where the identity lives (storage.identity). Never overwritten here: migrate() on a
    # restored or cloned copy must not hide that it is one (reset-identity decides).
    record_fingerprint(conn, only_if_missing=True)
    # The system contracts: DEFAULT, and dynamic routing's MissingRoute notice.
    for contract, message_type, sent_by in (
        (DEFAULT, DEFAULT, "any"),
        (BROKER_CONFIGURATION_NOTICE, MISSING_ROUTE, "initiator"),
    ):
        _insert_missing(
            conn, s.message_type.c.name, message_type, validation="none", created_at=now
        )
        if _insert_missing(conn, s.contract.c.name, contract, created_at=now):
            conn.execute(
                insert(s.contract_message).values(
                    contract_name=contract, message_type_name=message_type, sent_by=sent_by
                )
            )
    _insert_missing(conn, s.route.c.name, AUTO_CREATED_LOCAL, address="LOCAL", created_at=now)
    # PostgreSQL: the views client roles work through, for the tables as they are now (the
    # migrations dropped them), granted again to the roles holding permissions.
    client_schema.rebuild(conn)


__all__ = ["migrate_on"]
