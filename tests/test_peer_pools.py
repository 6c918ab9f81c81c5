"""Peer brokers' pools are closed when idle, and at most MAX_PEERS are kept (issue 43).

``transport.resolve`` caches a BrokerContext (an engine and its pool) per far broker URL. A peer
not used for ``PEER_IDLE_SECONDS`` has its connections closed (its next use connects again);
beyond ``MAX_PEERS`` the least recently used is closed and forgotten. A connection in use is
never closed under its user: it is closed when given back.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import make_url, text

from airflow_broker import Broker

# the module (``airflow_broker.transport.resolve`` is also the name of its function)
peers = importlib.import_module("airflow_broker.transport.resolve")

pytestmark = pytest.mark.direct_connection  # counts the server's connections of each database

#: the idle period the tests shorten PEER_IDLE_SECONDS to
IDLE = 0.5
#: how long the closer thread may take beyond it, on a loaded machine
MARGIN = 10.0


@pytest.fixture(autouse=True)
def _short_idle(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(peers, "PEER_IDLE_SECONDS", IDLE)
    yield
    peers.close_peers()


def wait_until(condition: Callable[[], bool], what: str, timeout: float = IDLE + MARGIN) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.1f} s"
        time.sleep(0.02)


def server_connections(url: str) -> int | None:
    """The server's connections to ``url``'s database (None for SQLite)."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        return None
    admin = u.set(drivername="postgresql", database="postgres")
    with psycopg.connect(admin.render_as_string(hide_password=False), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (u.database,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def idle_in_pool(broker: Any) -> int:
    return int(broker.engine.pool.checkedin())


def use(broker: Any) -> None:
    with broker.engine.connect() as conn:
        assert conn.execute(text("SELECT 1")).scalar() == 1


def east_and_wests(new_db: Callable[[str], str], *names: str) -> tuple[Broker, dict[str, str]]:
    urls = {name: new_db(name) for name in names}
    east = Broker.connect(new_db("east"), resolver=urls)
    return east, urls


# ---------------------------------------------------------------------------------- idle peers


def test_an_idle_peer_is_closed_and_reconnects_when_used_again(
    new_db: Callable[[str], str],
) -> None:
    east, urls = east_and_wests(new_db, "west")
    west_url = urls["west"]
    west = Broker.connect(west_url)
    west.create_queue("q")
    west.create_service("//svc/West", queue="q", contracts=["DEFAULT"])
    west.dispose()
    east.create_queue("q")
    east.create_service("//svc/East", queue="q")
    east.create_route("to_west", service_name="//svc/West", address="broker://west")

    def send_and_deliver(body: str) -> None:
        with east.transaction() as tx:
            tx.send(tx.begin_dialog("//svc/East", "//svc/West", encryption=False), body=body)
        assert east.deliver().delivered == 1

    try:
        send_and_deliver("one")
        peer = peers.resolve(east, "broker://west")
        assert idle_in_pool(peer) >= 1  # the delivery left its connection in the pool
        if (n := server_connections(west_url)) is not None:
            assert n >= 1
        # Not used for the idle period: its pool's connections are closed.
        wait_until(lambda: idle_in_pool(peer) == 0, "the idle peer's pool closed")
        if server_connections(west_url) is not None:
            wait_until(lambda: server_connections(west_url) == 0, "its server connections gone")
        # Used again, the same peer connects again and works.
        send_and_deliver("two")
        assert peers.resolve(east, "broker://west") is peer
        west = Broker.connect(west_url)
        got: list[str | None] = []
        for _ in range(2):  # two dialogs: a RECEIVE each
            with west.transaction() as tx:
                got += [m.text() for m in tx.receive("q")]
        west.dispose()
        assert sorted(got, key=str) == ["one", "two"]
        # ... and is closed again once idle.
        wait_until(lambda: idle_in_pool(peer) == 0, "the peer's pool closed again")
    finally:
        east.dispose()


def test_a_connection_in_use_is_not_closed(new_db: Callable[[str], str]) -> None:
    east, urls = east_and_wests(new_db, "west")
    try:
        peer = peers.resolve(east, "broker://west")
        use(peer)  # a connection made, given back
        with peer.engine.connect() as held:
            held.execute(text("SELECT 1"))
            time.sleep(IDLE * 4)  # far past the idle period, the connection checked out
            assert held.execute(text("SELECT 2")).scalar() == 2
            assert peer.engine.pool.checkedout() == 1
            if (n := server_connections(urls["west"])) is not None:
                assert n >= 1
        wait_until(lambda: idle_in_pool(peer) == 0, "the peer closed once given back")
    finally:
        east.dispose()


# ---------------------------------------------------------------------------------- MAX_PEERS


def test_beyond_max_peers_the_least_recently_used_is_closed_and_forgotten(
    new_db: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peers, "PEER_IDLE_SECONDS", 3600.0)  # only the bound closes here
    monkeypatch.setattr(peers, "MAX_PEERS", 2)
    east, urls = east_and_wests(new_db, "w1", "w2", "w3")
    try:
        w1 = peers.resolve(east, "broker://w1")
        w2 = peers.resolve(east, "broker://w2")
        use(w1)
        use(w2)
        use(w1)  # w2 is now the least recently used
        w3 = peers.resolve(east, "broker://w3")
        use(w3)
        assert set(peers._peers) == {urls["w1"], urls["w3"]}
        assert idle_in_pool(w2) == 0  # closed
        if server_connections(urls["w2"]) is not None:
            wait_until(lambda: server_connections(urls["w2"]) == 0, "w2's server connections")
        assert idle_in_pool(w1) >= 1 and idle_in_pool(w3) >= 1  # kept, connections and all
        # Asked again, w2 is opened anew (w1 is the oldest now: it goes) and works.
        again = peers.resolve(east, "broker://w2")
        assert again is not w2
        use(again)
        assert set(peers._peers) == {urls["w3"], urls["w2"]}
        assert idle_in_pool(w1) == 0
    finally:
        east.dispose()


def test_an_evicted_peer_in_use_keeps_its_connection_until_given_back(
    new_db: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peers, "PEER_IDLE_SECONDS", 3600.0)
    monkeypatch.setattr(peers, "MAX_PEERS", 1)
    east, urls = east_and_wests(new_db, "w1", "w2")
    try:
        w1 = peers.resolve(east, "broker://w1")
        with w1.engine.connect() as held:
            held.execute(text("SELECT 1"))
            use(peers.resolve(east, "broker://w2"))  # w1 is evicted while in use
            assert list(peers._peers) == [urls["w2"]]
            assert held.execute(text("SELECT 2")).scalar() == 2  # still works
            if (n := server_connections(urls["w1"])) is not None:
                assert n == 1
        # Given back, it is closed rather than kept in a pool nobody uses.
        if server_connections(urls["w1"]) is not None:
            wait_until(lambda: server_connections(urls["w1"]) == 0, "w1's last connection")
        assert idle_in_pool(w1) == 0
    finally:
        east.dispose()


def test_the_bounds_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """AIRFLOW_BROKER_PEER_IDLE_SECONDS and AIRFLOW_BROKER_MAX_PEERS, read at import; a value
    that is no positive number leaves the default."""
    monkeypatch.setenv("AIRFLOW_BROKER_PEER_IDLE_SECONDS", "42.5")
    assert peers._env_number("AIRFLOW_BROKER_PEER_IDLE_SECONDS", 300.0, float) == 42.5
    monkeypatch.setenv("AIRFLOW_BROKER_MAX_PEERS", "zero")
    assert peers._env_number("AIRFLOW_BROKER_MAX_PEERS", 32, int) == 32
    monkeypatch.setenv("AIRFLOW_BROKER_MAX_PEERS", "0")
    assert peers._env_number("AIRFLOW_BROKER_MAX_PEERS", 32, int) == 32
