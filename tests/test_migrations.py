"""Migrations: ``migrate()`` is idempotent, and every Alembic revision leads to the schema of
``schema.metadata.create_all``, on SQLite and on PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import Connection

from airflow_broker import Broker
from airflow_broker.storage.migrations import VERSION_TABLE, alembic_config
from airflow_broker.storage.schema import exists_on, metadata


def fresh_urls(broker_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> list[str]:
    """Two empty databases on the engine of ``broker_url``."""
    if broker_url.startswith("sqlite"):
        return [f"sqlite:///{tmp_path / 'steps.db'}", f"sqlite:///{tmp_path / 'fresh.db'}"]
    make: Callable[..., str] = request.getfixturevalue("make_pg_database")
    return [make(migrated=False), make(migrated=False)]


def revisions() -> list[str]:
    """Every revision, base first."""
    script = ScriptDirectory.from_config(alembic_config())
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def metadata_diffs(conn: Connection) -> list[Any]:
    def ours(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        # Alembic's version table is not part of the metadata; a constraint made on another
        # engine only (ddl_if: the endpoint's foreign key to its group, SQLite only) is not
        # expected here.
        if type_ == "table" and name == VERSION_TABLE:
            return False
        return reflected or exists_on(obj, conn.dialect.name)

    context = MigrationContext.configure(conn, opts={"include_object": ours, "compare_type": True})
    return list(compare_metadata(context, metadata))


def _plain(value: Any) -> Any:
    """Reflected values made comparable (SQL expressions and types as strings)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def reflect(url: str) -> dict[str, Any]:
    """Tables, columns, keys, indexes and constraints of the broker tables, as plain data."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            insp = inspect(conn)
            tables = sorted(t for t in insp.get_table_names() if t.startswith("broker_"))
            snapshot: dict[str, Any] = {}
            for table in tables:
                columns = insp.get_columns(table)
                snapshot[table] = _plain(
                    {
                        "columns": [
                            {
                                "name": c["name"],
                                "type": str(c["type"]),
                                "nullable": c["nullable"],
                                "default": c.get("default"),
                                "comment": c.get("comment"),
                            }
                            for c in columns
                        ],
                        "pk": insp.get_pk_constraint(table),
                        "fks": sorted(
                            insp.get_foreign_keys(table), key=lambda fk: str(fk.get("name"))
                        ),
                        "indexes": sorted(insp.get_indexes(table), key=lambda ix: str(ix["name"])),
                        "uniques": sorted(
                            insp.get_unique_constraints(table), key=lambda uq: str(uq["name"])
                        ),
                        "checks": sorted(
                            insp.get_check_constraints(table), key=lambda ck: str(ck["name"])
                        ),
                    }
                )
            if conn.dialect.name == "postgresql":
                # UNLOGGED tables (relpersistence 'u') and storage parameters (the endpoint
                # table's fillfactor) must come out of both paths alike.
                rows = conn.execute(
                    text(
                        "SELECT relname, relpersistence, reloptions FROM pg_class "
                        "WHERE relkind = 'r' AND relname LIKE 'broker\\_%' ORDER BY relname"
                    )
                ).all()
                snapshot["__persistence__"] = {r[0]: r[1] for r in rows}
                snapshot["__storage__"] = {r[0]: r[2] for r in rows if r[2]}
                for table in tables:
                    snapshot[table]["comment"] = insp.get_table_comment(table).get("text")
            return snapshot
    finally:
        engine.dispose()


def upgrade_step_by_step(url: str) -> list[str]:
    """Apply every revision one at a time; returns the version recorded after each step."""
    engine = create_engine(url)
    recorded: list[str] = []
    try:
        for revision in revisions():
            with engine.begin() as conn:
                command.upgrade(alembic_config(conn), revision)
            with engine.connect() as conn:
                recorded.append(
                    conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar_one()
                )
    finally:
        engine.dispose()
    return recorded


def create_all(url: str) -> None:
    engine = create_engine(url)
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()


# --------------------------------------------------------------------------- migrate()


def test_migrate_is_idempotent(broker: Broker) -> None:
    broker.create_queue("kept")
    catalog = broker.catalog()
    instance_id = broker.instance_id
    broker.migrate()
    broker.migrate()
    assert broker.catalog() == catalog
    assert broker.instance_id == instance_id
    assert "kept" in broker.catalog().queues


def test_instance_id_is_a_stable_uuid_string(broker: Broker, broker_url: str) -> None:
    instance_id = broker.instance_id
    assert isinstance(instance_id, str)
    assert str(uuid.UUID(instance_id)) == instance_id
    again = Broker.connect(broker_url)
    try:
        assert again.instance_id == instance_id
        again.migrate()
        assert again.instance_id == instance_id
    finally:
        again.dispose()


def test_instance_ids_differ_between_databases(
    tmp_path: Path, make_pg_database: Callable[..., str]
) -> None:
    ids = []
    for url in (
        f"sqlite:///{tmp_path / 'a.db'}",
        f"sqlite:///{tmp_path / 'b.db'}",
        make_pg_database(migrated=False),
        make_pg_database(migrated=False),
    ):
        b = Broker.connect(url)
        try:
            b.migrate()
            ids.append(b.instance_id)
        finally:
            b.dispose()
    assert len(set(ids)) == 4


# ------------------------------------------------------------------ revisions vs create_all


def test_revisions_form_one_line() -> None:
    script = ScriptDirectory.from_config(alembic_config())
    assert len(script.get_heads()) == 1
    assert len(script.get_bases()) == 1
    assert revisions()[-1] == script.get_current_head()


def test_every_revision_step_gives_the_create_all_schema(
    broker_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    steps_url, fresh_url = fresh_urls(broker_url, tmp_path, request)
    assert upgrade_step_by_step(steps_url) == revisions()
    create_all(fresh_url)
    migrated = reflect(steps_url)
    fresh = reflect(fresh_url)
    assert sorted(migrated) == sorted(fresh)
    assert migrated == fresh
    # And Broker.migrate() (the conftest databases) lands on the same schema.
    assert reflect(broker_url) == fresh
    if broker_url.startswith("postgresql"):
        # Every SEND updates its endpoint row: half of each page is left for the next version.
        assert fresh["__storage__"] == {"broker_conversation_endpoint": ["fillfactor=50"]}


def test_every_revision_step_leaves_no_autogenerate_diff(
    broker_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    steps_url, _ = fresh_urls(broker_url, tmp_path, request)
    upgrade_step_by_step(steps_url)
    engine = create_engine(steps_url)
    try:
        with engine.connect() as conn:
            assert metadata_diffs(conn) == []
    finally:
        engine.dispose()


def test_create_all_matches_metadata(
    broker_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The comparison itself must be clean on a create_all database, or it proves nothing."""
    _, fresh_url = fresh_urls(broker_url, tmp_path, request)
    create_all(fresh_url)
    engine = create_engine(fresh_url)
    try:
        with engine.connect() as conn:
            assert metadata_diffs(conn) == []
    finally:
        engine.dispose()


def test_downgrade_step_by_step_removes_every_broker_table(
    broker_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, _ = fresh_urls(broker_url, tmp_path, request)
    upgrade_step_by_step(url)
    engine = create_engine(url)
    try:
        for revision in [*reversed(revisions()[:-1]), "base"]:
            with engine.begin() as conn:
                command.downgrade(alembic_config(conn), revision)
        with engine.connect() as conn:
            left = [t for t in inspect(conn).get_table_names() if t.startswith("broker_")]
        assert left == []
    finally:
        engine.dispose()
