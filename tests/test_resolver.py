"""How ``broker://NAME`` becomes a connection: the broker's resolver, then
``AIRFLOW_BROKER_ADDRESS_<NAME>``, then the Airflow connection whose id is NAME."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from airflow_broker import Broker
from airflow_broker.hooks import connections
from airflow_broker.hooks.connections import connection_url
from airflow_broker.transport import Unreachable, env_name, resolve


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    connections._cache.clear()
    yield
    connections._cache.clear()


def _pair(tmp_path: Path, resolver: object = None) -> tuple[Broker, str]:
    east_url = f"sqlite:///{tmp_path / 'east.db'}"
    west_url = f"sqlite:///{tmp_path / 'west.db'}"
    for url in (east_url, west_url):
        b = Broker.connect(url)
        b.migrate()
        b.dispose()
    west = Broker.connect(west_url)
    west.create_queue("q")
    west.create_service("//svc/West", queue="q", contracts=["DEFAULT"])
    west.dispose()
    east = Broker.connect(east_url, resolver=resolver)  # type: ignore[arg-type]
    east.create_queue("q")
    east.create_service("//svc/East", queue="q")
    east.create_route("to_west", service_name="//svc/West", address="broker://west")
    return east, west_url


def _send_and_deliver(east: Broker, west_url: str) -> int:
    with east.transaction() as tx:
        h = tx.begin_dialog("//svc/East", "//svc/West", encryption=False)
        tx.send(h, body="hello")
    report = east.deliver()
    west = Broker.connect(west_url)
    with west.transaction() as tx:
        got = [m.text() for m in tx.receive("q")]
    west.dispose()
    assert got == ["hello"]
    return report.delivered


def test_env_name_is_upper_case_with_underscores() -> None:
    assert env_name("west-2.eu") == "AIRFLOW_BROKER_ADDRESS_WEST_2_EU"


def test_a_callable_resolver_is_asked(tmp_path: Path) -> None:
    asked: list[str] = []
    urls: dict[str, str] = {}

    def resolver(name: str) -> str | None:
        asked.append(name)
        return urls.get(name)

    east, west_url = _pair(tmp_path, resolver)
    urls["west"] = west_url  # looked up when delivering, not when connecting
    assert _send_and_deliver(east, west_url) == 1
    assert "west" in asked


def test_the_environment_names_the_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    east, west_url = _pair(tmp_path)
    monkeypatch.setenv("AIRFLOW_BROKER_ADDRESS_WEST", west_url)
    assert _send_and_deliver(east, west_url) == 1


AIRFLOW_PROGRAM = """
import sys
import airflow.sdk  # inside Airflow: a task, the triggerer...
from airflow_broker import Broker

east_url, west_url = sys.argv[1], sys.argv[2]
east = Broker.connect(east_url)
with east.transaction() as tx:
    h = tx.begin_dialog("//svc/East", "//svc/West", encryption=False)
    tx.send(h, body="hello")
print(east.deliver().delivered)
"""


def test_inside_airflow_an_airflow_connection_names_the_address(tmp_path: Path) -> None:
    """In a process that runs Airflow (here: one that imported it, in a subprocess so that
    Airflow's logging set-up stays out of this test run), broker://west is the Airflow
    connection with id "west" (given by Airflow's environment secrets backend)."""
    east, west_url = _pair(tmp_path)
    east_url = east.engine.url.render_as_string(hide_password=False)
    east.dispose()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_BROKER_ADDRESS_")}
    env["AIRFLOW_CONN_WEST"] = json.dumps(
        {"conn_type": "sqlite", "host": west_url.removeprefix("sqlite:///")}
    )
    done = subprocess.run(
        [sys.executable, "-c", AIRFLOW_PROGRAM, east_url, west_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "1"
    west = Broker.connect(west_url)
    with west.transaction() as tx:
        assert [m.text() for m in tx.receive("q")] == ["hello"]
    west.dispose()


def test_outside_airflow_airflow_connections_are_not_consulted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    east, _ = _pair(tmp_path)
    monkeypatch.delenv("AIRFLOW_BROKER_ADDRESS_WEST", raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_WEST", json.dumps({"conn_type": "sqlite", "host": "x"}))
    monkeypatch.delitem(sys.modules, "airflow", raising=False)  # this process is no Airflow
    with pytest.raises(Unreachable, match="no connection for broker://west"):
        resolve(east, "broker://west")


def test_an_unknown_name_waits_with_a_reason_that_says_where_to_put_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    east, _ = _pair(tmp_path)
    monkeypatch.delenv("AIRFLOW_BROKER_ADDRESS_WEST", raising=False)
    monkeypatch.delenv("AIRFLOW_CONN_WEST", raising=False)
    with pytest.raises(Unreachable, match="AIRFLOW_BROKER_ADDRESS_WEST"):
        resolve(east, "broker://west")
    with east.transaction() as tx:
        h = tx.begin_dialog("//svc/East", "//svc/West", encryption=False)
        tx.send(h, body="hello")
    report = east.deliver()
    assert (report.delivered, report.delayed) == (0, 1)
    (row,) = east.transmission_queue()
    assert "broker://west" in row.transmission_status
    assert "connection with id 'west'" in row.transmission_status


def _conn(**kw: object) -> SimpleNamespace:
    base = {
        "conn_id": "c",
        "conn_type": "postgres",
        "host": None,
        "port": None,
        "schema": None,
        "login": None,
        "password": None,
        "extra_dejson": {},
    }
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    ("conn", "url"),
    [
        (
            _conn(host="db", port=5432, schema="broker", login="app", password="s3cret"),
            "postgresql+psycopg://app:s3cret@db:5432/broker",
        ),
        (_conn(conn_type="broker", host="db", schema="b"), "postgresql+psycopg://db/b"),
        (_conn(conn_type="sqlite", host="/data/broker.db"), "sqlite:////data/broker.db"),
        (
            _conn(conn_type="generic", extra_dejson={"url": "sqlite:///x.db"}),
            "sqlite:///x.db",
        ),
    ],
)
def test_connection_url_from_an_airflow_connection(conn: SimpleNamespace, url: str) -> None:
    assert connection_url(conn) == url


def test_a_connection_of_another_type_is_refused_with_what_would_do() -> None:
    with pytest.raises(ValueError, match="postgres, sqlite or broker"):
        connection_url(_conn(conn_type="http", host="x"))
