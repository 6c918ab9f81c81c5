"""BrokerDBManager: ``airflow db migrate`` puts the broker tables, at the newest revision and
with the broker's identity and system objects, into Airflow's metadata database, so that
``Broker.connect(metadata URL)`` works with no further migrate. Run for real (``airflow`` in a
subprocess, its own AIRFLOW_HOME) on a SQLite and on a PostgreSQL metadata database; the
manager's other verbs are checked in-process on a SQLAlchemy session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, select, text
from sqlalchemy.orm import Session

from airflow_broker import DEFAULT, Broker
from airflow_broker.constants import AUTO_CREATED_LOCAL
from airflow_broker.provider.dbmanager import BrokerDBManager
from airflow_broker.storage import schema as s
from airflow_broker.storage.migrations import VERSION_TABLE, alembic_config

MANAGER = "airflow_broker.provider.dbmanager.BrokerDBManager"
AIRFLOW = str(Path(sys.executable).parent / "airflow")


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def airflow(home: Path, metadata_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``airflow ARGS`` on the metadata database ``metadata_url``, the manager configured."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_BROKER_ADDRESS_"))
    }
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=metadata_url,
        AIRFLOW__DATABASE__EXTERNAL_DB_MANAGERS=MANAGER,
    )
    if metadata_url.startswith("postgresql+psycopg"):
        # Airflow's async engine defaults to asyncpg; psycopg 3 is async too.
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC"] = metadata_url
    done = subprocess.run(
        [AIRFLOW, *args], env=env, cwd=home, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (
        f"airflow {' '.join(args)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
    return done


def assert_broker_ready(url: str) -> str:
    """The broker in ``url`` works without migrate(): identity, system objects, a dialog."""
    broker = Broker.connect(url)
    try:
        instance_id = broker.instance_id
        assert uuid.UUID(instance_id)
        catalog = broker.catalog()
        assert DEFAULT in catalog.contracts and DEFAULT in catalog.message_types
        assert AUTO_CREATED_LOCAL in catalog.routes
        with broker.engine.connect() as conn:
            assert conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar() == (
                head_revision()
            )
        broker.create_queue("q")
        broker.create_service("//svc/A", queue="q", contracts=[DEFAULT])
        with broker.transaction() as tx:
            h = tx.begin_dialog("//svc/A", "//svc/A")
            tx.send(h, body={"hello": "airflow db migrate"})
        with broker.transaction() as tx:
            (m,) = tx.receive("q")
        assert m.json() == {"hello": "airflow db migrate"}
        return instance_id
    finally:
        broker.dispose()


@pytest.mark.slow
def test_airflow_db_migrate_creates_the_broker_in_a_sqlite_metadata_db(tmp_path: Path) -> None:
    home = tmp_path / "airflow"
    home.mkdir()
    url = f"sqlite:///{home / 'airflow.db'}"
    done = airflow(home, url, "db", "migrate")
    assert "Migrated the broker tables" in done.stdout + done.stderr
    engine = create_engine(url)
    tables = set(inspect(engine).get_table_names())
    engine.dispose()
    assert {"dag_run", "task_instance"} <= tables  # Airflow's own, beside ours
    assert set(s.metadata.tables) <= tables
    instance_id = assert_broker_ready(url)
    # Migrating again keeps the broker (same identity, its objects) and is at head already.
    airflow(home, url, "db", "migrate")
    again = Broker.connect(url)
    assert again.instance_id == instance_id
    assert "q" in again.catalog().queues
    again.dispose()
    airflow(home, url, "db", "check-migrations", "-t", "5")


@pytest.mark.slow
@pytest.mark.postgres
def test_airflow_db_migrate_creates_the_broker_in_a_postgres_metadata_db(
    tmp_path: Path, make_pg_database: Callable[..., str]
) -> None:
    url = make_pg_database(migrated=False)
    home = tmp_path / "airflow"
    home.mkdir()
    airflow(home, url, "db", "migrate")
    assert_broker_ready(url)
    engine = create_engine(url)
    with engine.connect() as conn:
        triggers = set(
            conn.execute(
                text("SELECT tgname FROM pg_trigger WHERE tgname LIKE 'broker_message_notify%'")
            ).scalars()
        )
        assert conn.execute(text("SELECT count(*) FROM dag_run")).scalar() == 0
    engine.dispose()
    # What only the migrations make (no create_all): the NOTIFY trigger of waiting readers.
    assert triggers == {"broker_message_notify_insert", "broker_message_notify_update"}


@pytest.mark.slow
def test_airflow_db_reset_drops_and_recreates_the_broker(tmp_path: Path) -> None:
    home = tmp_path / "airflow"
    home.mkdir()
    url = f"sqlite:///{home / 'airflow.db'}"
    airflow(home, url, "db", "migrate")
    before = assert_broker_ready(url)
    airflow(home, url, "db", "reset", "--yes")
    after = Broker.connect(url)
    try:
        assert after.instance_id != before  # a new broker: the old tables were dropped
        assert "q" not in after.catalog().queues
    finally:
        after.dispose()


# --------------------------------------------------------------------------------------------
# in-process, on a session


@pytest.fixture(params=["sqlite", "postgres"])
def session(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Session]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'metadata.db'}"
    else:
        url = request.getfixturevalue("make_pg_database")(migrated=False)
    engine = create_engine(url)
    with Session(bind=engine) as sess:
        yield sess
    engine.dispose()


def test_manager_upgrades_checks_downgrades_and_drops(session: Session) -> None:
    manager = BrokerDBManager(session)
    assert not manager.check_migration()
    manager.initdb()
    assert manager.check_migration()
    assert manager.get_current_revision() == head_revision()
    bind = session.get_bind()
    with bind.connect() as conn:
        row = conn.execute(select(s.broker_instance.c.instance_id)).one()
    assert uuid.UUID(row.instance_id)
    manager.upgradedb()  # idempotent
    with bind.connect() as conn:
        assert conn.execute(select(s.broker_instance.c.instance_id)).scalar() == row.instance_id

    manager.downgrade("0001")
    assert manager.get_current_revision() == "0001"
    assert not manager.check_migration()
    manager.upgradedb(to_revision="0002")  # an intermediate revision: tables only
    assert manager.get_current_revision() == "0002"
    manager.upgradedb()
    assert manager.check_migration()

    session.rollback()  # as `airflow db reset` does: the drop runs on a connection of its own
    with bind.begin() as conn:
        manager.drop_tables(conn)
    remaining = set(inspect(bind).get_table_names())
    assert not [t for t in remaining if t.startswith("broker_")]
    assert VERSION_TABLE not in remaining


def test_manager_refuses_offline_sql(session: Session) -> None:
    with pytest.raises(ValueError, match="cannot print migration SQL"):
        BrokerDBManager(session).upgradedb(show_sql_only=True)


def test_manager_passes_airflow_validation() -> None:
    from airflow.utils.db_manager import RunDBManager

    RunDBManager._validate(BrokerDBManager)
    assert BrokerDBManager.version_table_name == "alembic_version_broker"
    assert BrokerDBManager.metadata is s.metadata
    assert Path(BrokerDBManager.migration_dir, "env.py").exists()


def test_provider_registers_the_manager() -> None:
    from airflow.providers_manager import ProvidersManager

    from airflow_broker.provider.compat import PROVIDER_DB_MANAGERS
    from airflow_broker.provider.info import get_provider_info

    assert get_provider_info()["db-managers"] == [MANAGER]
    if PROVIDER_DB_MANAGERS:
        assert MANAGER in ProvidersManager().db_managers
    else:  # Airflow 3.1 reads no provider's managers: [database] external_db_managers names it
        assert not hasattr(ProvidersManager(), "db_managers")
    json.dumps(BrokerDBManager.revision_heads_map)
