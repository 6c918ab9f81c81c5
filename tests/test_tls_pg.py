"""TLS to broker databases: a postgres connection's libpq extras (``sslmode``, ``sslrootcert``,
...) reach the driver, through BrokerHook and through the resolver of ``broker://NAME``.

The server is a private cluster of this module (``support.tls_cluster``): ``ssl=on``, a
certificate signed by a CA made for the run, and ``hostssl`` lines only in ``pg_hba.conf``, so a
connection without TLS is refused. The shared test server is never reconfigured. Connections
come from ``AIRFLOW_CONN_<ID>`` environment variables, as in ``test_airflow_hook.py``.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import make_url, text
from sqlalchemy.exc import OperationalError
from support.tls_cluster import TlsCluster, start_tls_cluster

from airflow_broker import Broker
from airflow_broker.hooks import connections
from airflow_broker.hooks.broker import BrokerConnectionError, BrokerHook
from airflow_broker.hooks.connections import LIBPQ_EXTRAS, connection_url
from airflow_broker.storage.context import BrokerContext
from airflow_broker.transport import env_name, resolve
from airflow_broker.transport.resolve import CONNECT_TIMEOUT

pytestmark = [pytest.mark.postgres, pytest.mark.xdist_group("tls")]

CONN_ID = "tls_db"


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[TlsCluster]:
    cluster = start_tls_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def tls_database(tls_cluster: TlsCluster) -> str:
    """A fresh database on the TLS cluster."""
    return tls_cluster.create_database(f"broker_tls_{uuid.uuid4().hex[:12]}")


@pytest.fixture(autouse=True)
def _fresh_connection_cache() -> Iterator[None]:
    connections._cache.clear()
    yield
    connections._cache.clear()


def set_connection(
    monkeypatch: pytest.MonkeyPatch, cluster: TlsCluster, database: str, **extra: Any
) -> None:
    """Airflow connection :data:`CONN_ID` (type postgres) to ``database`` on the cluster."""
    fields = {
        "conn_type": "postgres",
        "host": cluster.host,
        "port": cluster.port,
        "login": cluster.user,
        "schema": database,
        "extra": extra,
    }
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", json.dumps(fields))


def ssl_in_use(broker: BrokerContext) -> bool:
    with broker.engine.connect() as conn:
        return bool(
            conn.execute(text("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")).scalar()
        )


def set_up_receiver(broker: Broker) -> None:
    broker.migrate()
    broker.create_queue("q")
    broker.create_service("//svc/West", queue="q", contracts=["DEFAULT"])


def receive_texts(broker: Broker) -> list[str | None]:
    with broker.transaction() as tx:
        return [m.text() for m in tx.receive("q")]


# --------------------------------------------------------------------------------------------
# the hook


def test_the_hook_reaches_a_tls_only_server_with_verify_full(
    monkeypatch: pytest.MonkeyPatch, tls_cluster: TlsCluster, tls_database: str
) -> None:
    set_connection(
        monkeypatch,
        tls_cluster,
        tls_database,
        sslmode="verify-full",
        sslrootcert=str(tls_cluster.ca_file),
    )
    hook = BrokerHook(CONN_ID)
    try:
        broker = hook.get_broker()
        query = broker.engine.url.query
        assert (query["sslmode"], query["sslrootcert"]) == ("verify-full", str(tls_cluster.ca_file))
        set_up_receiver(broker)
        broker.create_service("//svc/East", queue="q")
        with broker.transaction() as tx:
            handle = tx.begin_dialog("//svc/East", "//svc/West", encryption=False)
            tx.send(handle, body="over TLS")
        assert receive_texts(broker) == ["over TLS"]
        assert ssl_in_use(broker)
        assert hook.test_connection()[0]
    finally:
        hook.close()


def test_without_tls_the_hook_says_the_server_wants_it(
    monkeypatch: pytest.MonkeyPatch, tls_cluster: TlsCluster, tls_database: str
) -> None:
    """libpq's default (``prefer``) would use TLS here; ``disable`` is a connection without."""
    set_connection(monkeypatch, tls_cluster, tls_database, sslmode="disable")
    hook = BrokerHook(CONN_ID)
    with pytest.raises(BrokerConnectionError) as raised:
        hook.get_broker()
    message = str(raised.value)
    assert message.startswith(
        f"broker connection {CONN_ID!r}: the server accepts only TLS connections: set sslmode "
        "(require, verify-ca or verify-full) and sslrootcert in the connection's extra"
    )
    assert "no pg_hba.conf entry" in message  # the server's own words follow
    assert isinstance(raised.value, ConnectionError)
    assert isinstance(raised.value.__cause__, OperationalError)  # raised from, not swallowed
    ok, shown = hook.test_connection()  # the connection form's Test button
    assert not ok
    assert "the server accepts only TLS connections" in shown


@pytest.mark.parametrize(
    ("ca", "says"),
    [
        ("wrong", "the server's certificate cannot be verified (certificate verify failed)"),
        ("missing", "the CA certificate cannot be read: set sslrootcert"),
    ],
)
def test_a_certificate_that_cannot_be_verified_is_named(
    monkeypatch: pytest.MonkeyPatch,
    tls_cluster: TlsCluster,
    tls_database: str,
    tmp_path: Path,
    ca: str,
    says: str,
) -> None:
    rootcert = tls_cluster.wrong_ca_file if ca == "wrong" else tmp_path / "no-such-ca.crt"
    set_connection(
        monkeypatch, tls_cluster, tls_database, sslmode="verify-full", sslrootcert=str(rootcert)
    )
    with pytest.raises(BrokerConnectionError) as raised:
        BrokerHook(CONN_ID).get_broker()
    assert str(raised.value).startswith(f"broker connection {CONN_ID!r}: {says}")


# --------------------------------------------------------------------------------------------
# the resolver: broker://tls_db through the Airflow connection


def test_a_route_reaches_the_tls_broker_through_the_airflow_connection(
    monkeypatch: pytest.MonkeyPatch, tls_cluster: TlsCluster, tls_database: str, tmp_path: Path
) -> None:
    set_connection(
        monkeypatch,
        tls_cluster,
        tls_database,
        sslmode="verify-full",
        sslrootcert=str(tls_cluster.ca_file),
        connect_timeout=7,
        application_name="airflow-broker-tls-test",
    )
    monkeypatch.delenv(env_name(CONN_ID), raising=False)
    url = connections.airflow_connection_url(CONN_ID)
    assert url is not None
    query = make_url(url).query
    assert (query["sslmode"], query["sslrootcert"]) == ("verify-full", str(tls_cluster.ca_file))

    west = Broker.connect(url)
    set_up_receiver(west)
    east_url = f"sqlite:///{tmp_path / 'east.db'}"
    east = Broker.connect(east_url)
    east.migrate()
    east.create_queue("q")
    east.create_service("//svc/East", queue="q")
    east.create_route("to_west", service_name="//svc/West", address=f"broker://{CONN_ID}")
    try:
        peer = resolve(east, f"broker://{CONN_ID}")
        assert peer.engine.url == make_url(url)
        assert ssl_in_use(peer)
        with peer.engine.connect() as conn:
            params = conn.connection.driver_connection.info.get_parameters()  # type: ignore[union-attr]
        # the URL's own connect_timeout wins over the resolver's default
        assert params["connect_timeout"] == "7" != str(CONNECT_TIMEOUT)
        assert params["application_name"] == "airflow-broker-tls-test"

        with east.transaction() as tx:
            handle = tx.begin_dialog("//svc/East", "//svc/West", encryption=False)
            tx.send(handle, body="routed over TLS")
        assert east.deliver().delivered == 1
        assert receive_texts(west) == ["routed over TLS"]
    finally:
        east.dispose()
        west.dispose()


# --------------------------------------------------------------------------------------------
# connection -> URL (no server)


def _conn(extra: dict[str, Any], conn_type: str = "postgres") -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(
        conn_id="c",
        conn_type=conn_type,
        host="db.example",
        port=5432,
        schema="broker",
        login="app",
        password=None,
        extra_dejson=extra,
    )


@pytest.mark.parametrize("conn_type", ["postgres", "broker"])
def test_libpq_extras_become_query_parameters(
    conn_type: str, caplog: pytest.LogCaptureFixture
) -> None:
    extra = {
        "sslmode": "verify-full",
        "sslrootcert": "/etc/ssl/broker ca.crt",
        "sslcert": "/etc/ssl/client.crt",
        "sslkey": "/etc/ssl/client.key",
        "keepalives": True,
        "sslsni": False,
        "connect_timeout": 10,
        "application_name": "",  # empty: left out
        "options": "-c statement_timeout=5000",
        "cursor": "dictcursor",  # the Airflow postgres provider's, not libpq's
        "iam": True,
        "target_session_attrs": None,
    }
    with caplog.at_level(logging.DEBUG, logger="airflow_broker"):
        url = make_url(connection_url(_conn(extra, conn_type)))
    assert url.drivername == "postgresql+psycopg"
    assert dict(url.query) == {
        "sslmode": "verify-full",
        "sslrootcert": "/etc/ssl/broker ca.crt",
        "sslcert": "/etc/ssl/client.crt",
        "sslkey": "/etc/ssl/client.key",
        "keepalives": "1",
        "sslsni": "0",
        "connect_timeout": "10",
        "options": "-c statement_timeout=5000",
    }
    ignored = " ".join(r.getMessage() for r in caplog.records)
    assert "'cursor' is no libpq parameter" in ignored
    assert "'iam' is no libpq parameter" in ignored
    # what SQLAlchemy hands to psycopg.connect
    _args, kwargs = url.get_dialect()().create_connect_args(url)
    assert kwargs["sslmode"] == "verify-full"
    assert kwargs["sslrootcert"] == "/etc/ssl/broker ca.crt"


def test_the_url_extra_still_wins_over_libpq_extras() -> None:
    conn = _conn({"url": "postgresql+psycopg://x@h/d?sslmode=require", "sslmode": "disable"})
    assert connection_url(conn) == "postgresql+psycopg://x@h/d?sslmode=require"


def test_the_documented_libpq_extras_are_the_tls_ones_and_the_usual() -> None:
    tls = {"sslmode", "sslrootcert", "sslcert", "sslkey", "sslpassword", "sslcrl", "sslcrldir"}
    assert tls | {"sslsni", "ssl_min_protocol_version", "connect_timeout"} <= LIBPQ_EXTRAS
    assert "url" not in LIBPQ_EXTRAS
