"""Fixtures shared by every test.

``broker`` is parametrized over both engines: every API test runs on SQLite and on PostgreSQL.
PostgreSQL is required, never skipped: ``BROKER_TEST_POSTGRES_URL`` names the server
(default ``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``); a missing server fails the
run. Each test gets a fresh database cloned from a migrated template (``CREATE DATABASE ...
TEMPLATE``), which costs a few milliseconds instead of a migration.

With ``BROKER_TEST_VIA_PGBOUNCER=1`` each test process starts a PgBouncer in transaction mode
(tests/support/pgbouncer.py) and every test database's URL leads through it; databases are still
created and dropped on the server directly. ``make test`` runs the PostgreSQL-facing files that
way a second time (see the Makefile).
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from helpers import Recorder
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool
from support.pgbouncer import PgBouncer

from airflow_broker import Broker
from airflow_broker.storage.identity import record_fingerprint

if TYPE_CHECKING:
    from transport_procs import Net

POSTGRES_URL = os.environ.get(
    "BROKER_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
TEMPLATE_DB = f"broker_test_template_{os.getpid()}"
VIA_PGBOUNCER = os.environ.get("BROKER_TEST_VIA_PGBOUNCER", "") not in ("", "0")


@pytest.fixture(autouse=True)
def _close_peer_brokers() -> Iterator[None]:
    """Peers that deliveries opened by URL are shared by the process (closed when idle for
    PEER_IDLE_SECONDS, 300 s); a test run opens hundreds of short-lived databases, so each test
    closes the ones it opened (else the server's max_connections is reached late in a run)."""
    yield
    from airflow_broker.transport.resolve import close_peers

    close_peers()


def new_instance_id(url: str) -> None:
    """A copy of a migrated database becomes a broker instance of its own, as a fresh
    migrate() makes it (with the fingerprint of where it is: not a copy of the template)."""
    engine = create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE broker_instance SET instance_id = :id"), {"id": str(uuid.uuid4())}
        )
        record_fingerprint(conn)
    engine.dispose()


def same_instance_elsewhere(url: str) -> None:
    """A copy that is the same broker instance (a mirror, as a physical standby would be, which
    carries its original's fingerprint): where it is is recorded, as `reset-identity --keep`
    does, so that it is not taken for a restored or cloned copy."""
    engine = create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        record_fingerprint(conn)
    engine.dispose()


def _admin_url() -> URL:
    url = make_url(POSTGRES_URL)
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    return url


class PostgresServer:
    """Creates and drops throw-away databases on the test server; with ``pgbouncer`` the URLs it
    hands out lead through that pooler."""

    def __init__(self, pgbouncer: PgBouncer | None = None) -> None:
        self.admin_url = _admin_url()
        self._admin = create_engine(self.admin_url, isolation_level="AUTOCOMMIT", pool_size=1)
        self._template_ready = False
        self._created: list[str] = []
        self.pgbouncer = pgbouncer

    def check(self) -> None:
        try:
            with self._admin.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:  # pragma: no cover - the message is the point
            raise RuntimeError(
                f"PostgreSQL is required by the test suite and did not answer at "
                f"{self.admin_url.render_as_string(hide_password=True)}: {exc}. Start it, or set "
                f"BROKER_TEST_POSTGRES_URL (the README's `make test` starts the local one)."
            ) from exc

    def url_for(self, dbname: str) -> str:
        """The URL tests use for ``dbname``: through the PgBouncer when there is one."""
        if self.pgbouncer is not None:
            return self.pgbouncer.url(dbname, self.admin_url.username or "postgres")
        return self.direct_url_for(dbname)

    def direct_url_for(self, dbname: str) -> str:
        """``dbname`` on the server itself, past any pooler."""
        return self.admin_url.set(database=dbname).render_as_string(hide_password=False)

    def _drop(self, conn, dbname: str) -> None:  # type: ignore[no-untyped-def]
        conn.execute(text(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'))

    def template(self) -> str:
        if not self._template_ready:
            with self._admin.connect() as conn:
                self._drop(conn, TEMPLATE_DB)
                conn.execute(text(f'CREATE DATABASE "{TEMPLATE_DB}"'))
            # Directly: a pooler would keep server connections to the template open, and
            # CREATE DATABASE ... TEMPLATE refuses a source with other sessions.
            b = Broker.connect(self.direct_url_for(TEMPLATE_DB))
            b.migrate()
            b.dispose()
            self._template_ready = True
        return TEMPLATE_DB

    def create_database(
        self,
        *,
        migrated: bool = True,
        name: str | None = None,
        copy_of: str | None = None,
        mirror: bool = True,
    ) -> str:
        """A fresh database: migrated (a clone of the template, given a broker instance id of
        its own), empty, or ``copy_of`` another test database's URL (same instance id: a
        mirror of it; with ``mirror=False`` a plain clone, which the broker detects as a copy
        of another database)."""
        dbname = name or f"broker_test_{uuid.uuid4().hex[:12]}"
        source = make_url(copy_of).database if copy_of else self.template() if migrated else None
        with self._admin.connect() as conn:
            self._drop(conn, dbname)
            if source is not None:
                if copy_of:
                    # CREATE DATABASE ... TEMPLATE needs the source to have no other sessions.
                    conn.execute(
                        text(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE datname = :db AND pid <> pg_backend_pid()"
                        ),
                        {"db": source},
                    )
                conn.execute(text(f'CREATE DATABASE "{dbname}" TEMPLATE "{source}"'))
            else:
                conn.execute(text(f'CREATE DATABASE "{dbname}"'))
        self._created.append(dbname)
        url = self.url_for(dbname)
        if migrated and not copy_of:
            new_instance_id(url)
        elif copy_of and mirror:
            same_instance_elsewhere(url)
        return url

    def drop_all(self) -> None:
        with self._admin.connect() as conn:
            for dbname in [*self._created, TEMPLATE_DB]:
                self._drop(conn, dbname)
        self._admin.dispose()


@pytest.fixture(scope="session")
def pgbouncer() -> Iterator[PgBouncer]:
    """A PgBouncer in transaction mode in front of the test server, for this test process."""
    admin = _admin_url()
    bouncer = PgBouncer(admin.host or "127.0.0.1", admin.port or 5432).start()
    yield bouncer
    bouncer.stop()


@pytest.fixture(scope="session")
def postgres_server(request: pytest.FixtureRequest) -> Iterator[PostgresServer]:
    bouncer = request.getfixturevalue("pgbouncer") if VIA_PGBOUNCER else None
    server = PostgresServer(bouncer)
    server.check()
    yield server
    if bouncer is not None:
        bouncer.stop()  # its server connections first: DROP DATABASE would end each of them
    server.drop_all()


@pytest.fixture(params=["sqlite", "postgres"])
def broker_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URL of a fresh, migrated broker database on each engine."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'broker.db'}"
        b = Broker.connect(url)
        b.migrate()
        b.dispose()
        yield url
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        yield server.create_database()


@pytest.fixture
def broker(broker_url: str) -> Iterator[Broker]:
    """A migrated :class:`Broker` on a fresh database, SQLite or PostgreSQL."""
    b = Broker.connect(broker_url)
    yield b
    b.dispose()


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> str:
    """A fresh, migrated PostgreSQL broker database (for PostgreSQL-only tests)."""
    return postgres_server.create_database()


@pytest.fixture
def pg_broker(pg_url: str) -> Iterator[Broker]:
    b = Broker.connect(pg_url)
    yield b
    b.dispose()


@pytest.fixture
def make_pg_database(postgres_server: PostgresServer) -> Callable[..., str]:
    """Factory of further fresh PostgreSQL databases: ``make_pg_database(migrated=False)``."""
    return postgres_server.create_database


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """One local SparkSession per test process, with Debian's JDBC drivers (required: the
    README's `make test` installs them with tests/support/ensure_spark.py)."""
    from pyspark.sql import SparkSession

    from airflow_broker.spark.jdbc import DEBIAN_JARS

    missing = [jar for jar in DEBIAN_JARS if not Path(jar).exists()]
    if missing:
        pytest.fail(
            f"the JDBC drivers {missing} are missing: run tests/support/ensure_spark.py "
            "(apt-get install libpostgresql-jdbc-java libxerial-sqlite-jdbc-java)"
        )
    # Python workers run this interpreter, the one airflow_broker is installed in.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (
        SparkSession.builder.master("local[2]")
        .appName("airflow-broker tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.jars", ",".join(DEBIAN_JARS))
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


# -- networks of broker databases (transport and Spark tests) --


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One migrated SQLite file; each test database is a copy with an instance id of its own
    (a migration per database would cost more than most of these tests)."""
    path = tmp_path_factory.mktemp("transport_template") / "template.db"
    b = Broker.connect(f"sqlite:///{path}")
    b.migrate()
    b.dispose()
    return path


@pytest.fixture(params=["sqlite", "postgres"])
def new_db(
    request: pytest.FixtureRequest, tmp_path: Path, sqlite_template: Path
) -> Callable[[str], str]:
    """Factory of fresh, migrated broker databases (SQLite files or PostgreSQL databases), each
    its own broker instance: ``new_db(name) -> url``."""
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        return lambda name: server.create_database()

    def make(name: str) -> str:
        path = tmp_path / f"{name}.db"
        shutil.copyfile(sqlite_template, path)
        url = f"sqlite:///{path}"
        new_instance_id(url)
        return url

    return make


@pytest.fixture
def network(new_db: Callable[[str], str]) -> Iterator[Callable[..., Net]]:
    """``network("a", "b", unreachable=["g1"])``: a database per name, all connected with one
    resolver in which the ``unreachable`` names lead to a server that does not answer."""
    from transport_procs import connect_all

    nets: list[Net] = []

    def build(*names: str, unreachable: tuple[str, ...] = ()) -> Net:
        net = connect_all({name: new_db(name) for name in names}, unreachable)
        nets.append(net)
        return net

    yield build
    for net in nets:
        net.close()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    """A :class:`helpers.Recorder` as the metrics sink for one test."""
    from airflow_broker import metrics

    r = Recorder()
    previous = metrics.install(r)
    try:
        yield r
    finally:
        metrics.install(previous)
