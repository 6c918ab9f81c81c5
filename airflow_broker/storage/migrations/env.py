"""Alembic environment: runs on the connection ``Broker.migrate()`` (or the DB manager) hands in."""

from __future__ import annotations

from alembic import context

from airflow_broker.storage import client_schema
from airflow_broker.storage.migrations import VERSION_TABLE
from airflow_broker.storage.schema import exists_on, metadata


def _include_object(dialect):
    def include(obj, name, type_, reflected, compare_to):
        # The broker shares its database with Airflow: never look at tables that are not ours.
        if type_ == "table":
            return name.startswith("broker_")
        # A constraint of the metadata made on another engine only (ddl_if).
        return reflected or exists_on(obj, dialect)

    return include


def run_migrations_online() -> None:
    connection = context.config.attributes["connection"]
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        include_object=_include_object(connection.dialect.name),
        render_as_batch=connection.dialect.name == "sqlite",
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        # The client roles' views (derived state) would keep a column from changing; migrate_on
        # creates them again for the new tables (storage.client_schema).
        client_schema.drop(connection)
        context.run_migrations()


run_migrations_online()
