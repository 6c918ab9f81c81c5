"""Upgrade with messages in flight (issue 42): a broker database built at an old revision and
holding live state written as the code of that time wrote it (open conversations, waiting
messages, timers, a lifetime, receive leases, transmission rows, definitions) is upgraded to the
newest schema, and all of it carries on under today's API. See ``tests/upgrade_state.py``.

Old revisions: 0001 (the first) and 0010 (the last before failure handling, 0011, and security,
0012). Both engines; PostgreSQL is required (the ``postgres_server`` fixture fails when it does
not answer). The upgrade runs through ``Broker.migrate()``, and through ``airflow db migrate``
(the DB manager) where the broker tables live in Airflow's metadata database.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

# The checks live in a helper module: pytest rewrites its asserts too (their messages).
pytest.register_assert_rewrite("upgrade_state")

from upgrade_state import (  # noqa: E402
    OldState,
    build_at,
    check_carries_on,
    fill,
    head_revision,
    version_of,
)

from airflow_broker import Broker  # noqa: E402

#: The first revision, and the last one before failure handling (0011) and security (0012).
OLD_REVISIONS = ("0001", "0010")


def two_databases(
    engine: str, tmp_path: Path, make_pg_database: Callable[..., str]
) -> tuple[str, str]:
    """An empty database to build at an old revision, and a migrated far broker database."""
    if engine == "sqlite":
        near, far = f"sqlite:///{tmp_path / 'near.db'}", f"sqlite:///{tmp_path / 'far.db'}"
    else:
        near, far = make_pg_database(migrated=False), make_pg_database(migrated=False)
    return near, far


def far_instance_id(far_url: str) -> str:
    far = Broker.connect(far_url)
    try:
        far.migrate()
        return far.instance_id
    finally:
        far.dispose()


def build_old_broker(url: str, revision: str, far_url: str) -> OldState:
    build_at(url, revision)
    return fill(url, revision, far_instance_id(far_url))


@pytest.mark.parametrize("revision", OLD_REVISIONS)
@pytest.mark.parametrize("engine", ["sqlite", "postgres"])
def test_broker_upgraded_with_messages_in_flight_carries_on(
    engine: str, revision: str, tmp_path: Path, make_pg_database: Callable[..., str]
) -> None:
    near, far = two_databases(engine, tmp_path, make_pg_database)
    old = build_old_broker(near, revision, far)
    assert old.dialect == ("sqlite" if engine == "sqlite" else "postgresql")
    check_carries_on(near, far, old)


@pytest.mark.slow
@pytest.mark.postgres
def test_airflow_db_migrate_upgrades_a_metadata_database_with_messages_in_flight(
    tmp_path: Path, make_pg_database: Callable[..., str]
) -> None:
    """The broker tables at 0010 in Airflow's metadata database (PostgreSQL), holding live
    state; ``airflow db migrate`` creates Airflow's tables and upgrades the broker's, with no
    ``Broker.migrate()`` after it."""
    from test_dbmanager import airflow  # imports Airflow: only this test pays for it

    metadata, far = make_pg_database(migrated=False), make_pg_database(migrated=False)
    old = build_old_broker(metadata, "0010", far)
    home = tmp_path / "airflow"
    home.mkdir()
    done = airflow(home, metadata, "db", "migrate")
    assert "Migrated the broker tables" in done.stdout + done.stderr
    assert version_of(metadata) == head_revision()
    check_carries_on(metadata, far, old, migrate=False)
