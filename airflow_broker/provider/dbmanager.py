"""BrokerDBManager: ``airflow db migrate`` creates and upgrades the broker tables in Airflow's
metadata database.

A deployment that keeps its queues on the metadata database's server, in that database, points
its ``broker_default`` connection there and lets Airflow migrate the broker tables with its own.
The provider registers this manager (``db-managers`` in its provider info); it can also be named
explicitly::

    [database]
    external_db_managers = airflow_broker.provider.dbmanager.BrokerDBManager

The broker's tables come from its Alembic migrations only (their own version table,
``alembic_version_broker``), never from ``create_all``: the migrations also create what metadata
cannot describe (PostgreSQL's NOTIFY trigger), and they insert the broker's identity and system
objects exactly as :meth:`airflow_broker.Broker.migrate` does, on the session's connection.
Only PostgreSQL and SQLite hold broker tables; on another metadata database (MySQL) the manager
logs that and does nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Not in airflow_broker.provider.compat: only `airflow db ...` commands import this module, in the
# scheduler-side Airflow that has airflow.utils (task code never does).
from airflow.utils.db_manager import BaseDBManager

from airflow_broker.broker import migrate_on
from airflow_broker.storage import schema
from airflow_broker.storage.migrations import MIGRATIONS_DIR, VERSION_TABLE, alembic_config

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy.engine import Connection

#: The metadata databases the broker's tables can live in.
SUPPORTED_DIALECTS = frozenset({"postgresql", "sqlite"})
#: What ``to_revision`` may be to mean "the newest", as Airflow and Alembic spell it.
HEAD = frozenset({"head", "heads"})


class BrokerDBManager(BaseDBManager):
    """Migrates the broker tables (``broker_*``) in Airflow's metadata database."""

    metadata = schema.metadata
    migration_dir = str(MIGRATIONS_DIR)
    #: Unused: the Alembic config is built in code
    #: (airflow_broker.storage.migrations.alembic_config).
    alembic_file = str(MIGRATIONS_DIR / "alembic.ini")
    version_table_name = VERSION_TABLE
    #: ``airflow db reset`` drops the broker tables with Airflow's (they are in its database).
    supports_table_dropping = True

    # -- Alembic on the session's connection ---------------------------------------------------
    def _connection(self) -> Connection:
        conn: Connection = self.session.connection()
        return conn

    def _supported(self, conn: Connection) -> bool:
        if conn.dialect.name in SUPPORTED_DIALECTS:
            return True
        self.log.warning(
            "The broker tables need PostgreSQL or SQLite; the metadata database is %s: "
            "BrokerDBManager leaves it alone (give the broker a database of its own through "
            "the broker_default connection)",
            conn.dialect.name,
        )
        return False

    def get_alembic_config(self) -> Config:
        """The broker's Alembic config, bound to the session's connection (its env.py runs on
        the connection it is given)."""
        return alembic_config(self._connection())

    # -- what `airflow db` calls ---------------------------------------------------------------
    def check_migration(self) -> bool:
        """True when the broker tables are at the newest revision (or cannot live here)."""
        if not self._supported(self._connection()):
            return True
        result: bool = super().check_migration()
        return result

    def initdb(self, use_migration_files: bool = False) -> None:
        """Create the broker tables: always by the migrations (see the module docstring)."""
        self.upgradedb(use_migration_files=use_migration_files)

    def create_db_from_orm(self) -> None:
        """Create the broker tables: by the migrations, as :meth:`initdb`."""
        self.upgradedb()

    def upgradedb(
        self,
        to_revision: str | None = None,
        from_revision: str | None = None,
        show_sql_only: bool = False,
        use_migration_files: bool = False,
    ) -> None:
        """Upgrade the broker tables to ``to_revision`` (default: the newest, together with the
        broker's identity and system objects, as ``Broker.migrate()``), and commit."""
        if show_sql_only:
            raise ValueError(
                "BrokerDBManager cannot print migration SQL (offline mode): the broker's "
                "migrations run on a live connection"
            )
        conn = self._connection()
        if not self._supported(conn):
            return
        self.log.info("Migrating the broker tables (%s)", self.version_table_name)
        if to_revision is None or to_revision in HEAD:
            migrate_on(conn)
        else:
            # An intermediate revision: tables only. The system rows need the newest schema and
            # come with the upgrade to head.
            from alembic import command

            command.upgrade(alembic_config(conn), to_revision)
        self.session.commit()
        self.log.info("Migrated the broker tables")

    def downgrade(
        self, to_revision: str, from_revision: str | None = None, show_sql_only: bool = False
    ) -> None:
        """Downgrade the broker tables to ``to_revision`` (``base``: none left), and commit."""
        if show_sql_only:
            raise ValueError("BrokerDBManager cannot print migration SQL (offline mode)")
        from alembic import command

        conn = self._connection()
        if not self._supported(conn):
            return
        command.downgrade(alembic_config(conn), to_revision)
        self.session.commit()

    def drop_tables(self, connection: Any) -> None:
        """Drop every broker table (and the version table) on ``connection``: the migrations'
        own downgrades, so that what ``metadata`` does not describe goes too."""
        if not self.supports_table_dropping or connection.dialect.name not in SUPPORTED_DIALECTS:
            return
        from alembic import command
        from alembic.migration import MigrationContext
        from sqlalchemy import inspect

        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
        if context.get_current_revision() is not None:
            self.log.info("Dropping the broker tables")
            command.downgrade(alembic_config(connection), "base")
        if inspect(connection).has_table(VERSION_TABLE):
            context._version.drop(connection)


__all__ = ["BrokerDBManager"]
