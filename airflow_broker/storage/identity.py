"""Whether this broker database is still the one its instance id was given to.

Each broker database is one broker instance, named by the id in ``broker_instance``. A backup
restored elsewhere, a PostgreSQL database cloned (``CREATE DATABASE ... TEMPLATE``, ``pg_dump`` and
restore into another database) or a SQLite file copied carries that id along: two databases then
answer to one instance id, and delivery between brokers would mix their conversations up. SQL
Server meets this by disabling Service Broker in a restored or attached database until an operator
chooses ``NEW_BROKER``, ``ERROR_BROKER_CONVERSATIONS`` or ``ENABLE_BROKER``; this module does the
detection half of that.

Beside the instance id, ``broker_instance.fingerprint`` records where the database physically is:

- PostgreSQL: the cluster's ``system_identifier`` (``pg_control_system()``, when this role may
  call it) and the database's oid. Every ``CREATE DATABASE`` (a clone or the target of a restore)
  gets a new oid; a cluster initialized elsewhere gets a new system identifier. A physical copy of
  the whole cluster (a streaming standby, ``pg_basebackup``) keeps both: it is the same broker, as
  a mirror is.
- SQLite: the database file's real path (``PRAGMA database_list``, symbolic links resolved). A copy
  at another path reads as a copy; a backup copied back over the original path does not.

:func:`identity_status` compares the recorded fingerprint with the current one;
:func:`copy_refusal` is what delivery (both ways) asks before it moves anything between
databases. What an operator does about a copy is :mod:`airflow_broker.operations.identity`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from sqlalchemy import select, text, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError, ProgrammingError

from airflow_broker.errors import BrokerError
from airflow_broker.storage import schema as s

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

#: The choices an operator has once a copy is detected (``Broker.reset_identity(mode)``).
MODES: Final = ("new_broker", "error_conversations", "keep")

#: How the refusal names the operator's commands.
COMMANDS: Final = (
    "`airflow-broker reset-identity --new-broker` (this database is a copy: give it a new "
    "broker instance id and end its conversations with other brokers with an error), "
    "`--error-conversations` (keep the id, end every conversation with an error) or `--keep` "
    "(the same broker, moved: record where it is now); Broker.reset_identity(mode) in code"
)

_CACHE_KEY: Final = ("identity", "copy_refusal")


def physical_fingerprint(conn: Connection) -> str:
    """Where the database ``conn`` is connected to physically is, as text:
    ``postgresql:system_identifier=...;database_oid=...`` or ``sqlite:path=/real/path.db``.

    On PostgreSQL ``system_identifier`` is left out when this role may not call
    ``pg_control_system()`` (some managed servers revoke it): the oid alone still tells a clone
    or a restore into another database on the same server."""
    if conn.dialect.name == "postgresql":
        oid, allowed = conn.execute(
            text(
                "SELECT d.oid, CASE WHEN to_regprocedure('pg_catalog.pg_control_system()') IS NULL "
                "THEN false ELSE has_function_privilege("
                "to_regprocedure('pg_catalog.pg_control_system()'), 'EXECUTE') END "
                "FROM pg_catalog.pg_database d WHERE d.datname = current_database()"
            )
        ).one()
        fields = [f"database_oid={oid}"]
        if allowed:
            system = conn.execute(
                text("SELECT system_identifier FROM pg_catalog.pg_control_system()")
            ).scalar()
            fields.insert(0, f"system_identifier={system}")
        return "postgresql:" + ";".join(fields)
    if conn.dialect.name == "sqlite":
        path = ""
        for row in conn.exec_driver_sql("PRAGMA database_list"):
            if row[1] == "main":
                path = row[2] or ""
        return f"sqlite:path={os.path.realpath(path) if path else ':memory:'}"
    raise BrokerError(f"no physical fingerprint for a {conn.dialect.name} database")


def _fields(fingerprint: str) -> dict[tuple[str, str], str]:
    dialect, _, rest = fingerprint.partition(":")
    # A path may hold any character: SQLite's one field is the whole remainder.
    parts = [rest] if dialect == "sqlite" else rest.split(";")
    fields = {}
    for part in parts:
        key, _, value = part.partition("=")
        fields[(dialect, key)] = value
    return fields


def same_place(recorded: str, current: str) -> bool:
    """Whether two fingerprints name the same physical database: every field both have agrees
    (a role that may not read the system identifier still compares the oid), and they have one
    at least."""
    a, b = _fields(recorded), _fields(current)
    shared = a.keys() & b.keys()
    return bool(shared) and all(a[k] == b[k] for k in shared)


def record_fingerprint(conn: Connection, *, only_if_missing: bool = False) -> str:
    """Record where this database is now as the place of its identity; returns the fingerprint.
    With ``only_if_missing``, a fingerprint already recorded is kept (``migrate()`` on a copy
    must not hide that it is one)."""
    fingerprint = physical_fingerprint(conn)
    bi = s.broker_instance
    stmt = update(bi).values(fingerprint=fingerprint)
    if only_if_missing:
        stmt = stmt.where(bi.c.fingerprint.is_(None))
    conn.execute(stmt)
    return fingerprint


@dataclass(frozen=True, slots=True)
class IdentityStatus:
    """Whether this broker database is still where its identity was recorded.

    :ivar database: the database's URL, without its password.
    :ivar instance_id: the broker instance id the database holds.
    :ivar recorded_fingerprint: where the identity was recorded (None: never recorded, e.g. a
        database whose tables were not made by ``migrate()``; then nothing is refused).
    :ivar current_fingerprint: where the database is now.
    """

    database: str
    instance_id: str
    recorded_fingerprint: str | None
    current_fingerprint: str

    @property
    def copied(self) -> bool:
        """True when the database is not where its identity was recorded: restored, cloned,
        copied or moved. Delivery to and from other brokers is refused until an operator runs
        ``reset-identity``."""
        return self.recorded_fingerprint is not None and not same_place(
            self.recorded_fingerprint, self.current_fingerprint
        )

    @property
    def reason(self) -> str | None:
        """Why delivery is refused (None when it is not), naming the database and the
        commands that decide."""
        if not self.copied:
            return None
        return (
            f"copy detected: broker database {self.database} (broker instance "
            f"{self.instance_id}) is not where its identity was recorded "
            f"({self.recorded_fingerprint}; now {self.current_fingerprint}): it was restored, "
            "cloned, copied or moved. Delivery between it and other brokers is refused until "
            f"an operator runs {COMMANDS}"
        )


def identity_status(broker: BrokerContext, conn: Connection | None = None) -> IdentityStatus:
    """This broker database's :class:`IdentityStatus`, read now (on ``conn`` if given)."""
    if conn is None:
        with broker.engine.connect() as own:
            return identity_status(broker, own)
    bi = s.broker_instance
    try:
        row = conn.execute(select(bi.c.instance_id, bi.c.fingerprint)).first()
    except (OperationalError, ProgrammingError) as exc:
        if "broker_instance" not in str(exc.orig):
            raise
        raise BrokerError(
            f"{broker!r} has no broker tables (or older ones): run Broker.migrate() "
            "(or `airflow-broker migrate`)"
        ) from exc
    if row is None:
        raise BrokerError(f"{broker!r} is not migrated: run Broker.migrate()")
    return IdentityStatus(
        database=broker.engine.url.render_as_string(hide_password=True),
        instance_id=str(row.instance_id),
        recorded_fingerprint=row.fingerprint,
        current_fingerprint=physical_fingerprint(conn),
    )


def copy_refusal(broker: BrokerContext, conn: Connection | None = None) -> str | None:
    """Why this database may not deliver to or accept from other brokers (a copy was
    detected), or None. Read at most once a second per broker object (the definition cache),
    so a reset in another process is noticed within the second."""
    return broker.cached_definition(_CACHE_KEY, lambda: identity_status(broker, conn).reason)


__all__ = [
    "COMMANDS",
    "MODES",
    "IdentityStatus",
    "copy_refusal",
    "identity_status",
    "physical_fingerprint",
    "record_fingerprint",
    "same_place",
]
