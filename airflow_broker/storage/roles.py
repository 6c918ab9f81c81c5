"""Which database role the engine runs as on PostgreSQL: the broker's owner, or a client role.

The owner (the role that migrated the broker tables, or any role that may read them) runs every
statement against the tables, as it always has. A *client role* is one that may not read the
tables (``has_table_privilege`` on ``broker_instance`` says no): it was granted SEND on some
services and RECEIVE on some queues (:mod:`airflow_broker.security.permissions`), and PostgreSQL
lets it reach only the views of schema :data:`CLIENT_SCHEMA`, each named like the table it shows
(:mod:`airflow_broker.storage.client_schema`). The engine's statements are the same for both: a
client role's connections have :data:`CLIENT_SCHEMA` first on their ``search_path``, so
``broker_message`` means the view.

Which one it is is asked once per engine, on its first connection to a migrated database; the
owner's later connections pay nothing, a client role's pay one ``set_config`` when they open
(never per statement).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("airflow_broker")

#: The schema of the views a client role works through.
CLIENT_SCHEMA = "broker_client"

#: (current_user, search_path, may it read the broker tables: None when there are none yet)
_WHO = (
    "SELECT current_user, current_setting('search_path'), "
    "has_table_privilege(to_regclass('broker_instance'), 'SELECT')"
)
_SET_PATH = "SELECT set_config('search_path', %s, false)"


class RoleSession:
    """Who an engine's connections are, decided on its first connection to a migrated database
    (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._decided = False
        #: the client role's name; None for the owner (or while undecided)
        self.client: str | None = None
        self._search_path: str | None = None

    def on_connect(self, dbapi_conn: Any, _record: Any = None) -> None:
        """SQLAlchemy's ``connect`` event (and :meth:`on_raw_connect` for connections outside
        the pool): decide once, then put :data:`CLIENT_SCHEMA` first for a client role."""
        if self._decided and self.client is None:
            return  # the owner: nothing, ever again
        autocommit = dbapi_conn.autocommit
        dbapi_conn.autocommit = True
        try:
            if not self._decided:
                self._decide(dbapi_conn)
            if self._search_path is not None:
                dbapi_conn.execute(_SET_PATH, (self._search_path,))
        finally:
            dbapi_conn.autocommit = autocommit

    def on_raw_connect(self, raw_conn: Any) -> None:
        """A connection of the adapter's own (receive leases, LISTEN): the same search path."""
        if self._search_path is not None:
            raw_conn.execute(_SET_PATH, (self._search_path,))

    def _decide(self, dbapi_conn: Any) -> None:
        row = dbapi_conn.execute(_WHO).fetchone()
        role, path, may_read = row[0], row[1], row[2]
        with self._lock:
            if self._decided:
                return
            if may_read is None:
                return  # not migrated yet: ask again on the next new connection
            if not may_read:
                self.client = str(role)
                self._search_path = f"{CLIENT_SCHEMA}, {path}" if path else CLIENT_SCHEMA
                log.debug(
                    "connected as role %r, which may not use the broker tables: working through "
                    "the views of schema %s (what it was granted)",
                    role,
                    CLIENT_SCHEMA,
                )
            self._decided = True


__all__ = ["CLIENT_SCHEMA", "RoleSession"]
