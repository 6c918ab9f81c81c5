"""Bounded waits on far brokers (transport/deadlines.py), piece by piece.

- a peer's own limits come off its URL (``?answer_timeout=&patience=``) and never reach libpq;
  the same URL opens a broker of its own; an Airflow connection's ``extra`` carries them;
- libpq gets the connect timeout, TCP keepalives and ``tcp_user_timeout``, the URL's own values
  winning; on a direct connection the far session gets ``statement_timeout`` and
  ``idle_in_transaction_session_timeout``;
- against a frozen server (every process SIGSTOPped: :mod:`support.frozen_cluster`): an
  operation is cut at its answer timeout, the peer is then passed over (no new connection
  either) for as long again, a deadline inside another ends before it, a connect that times out
  counts as hung, and after the thaw the peer answers again on fresh connections.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import text
from support.frozen_cluster import FrozenCluster, frozen_cluster

from airflow_broker import Broker
from airflow_broker.hooks.connections import connection_url
from airflow_broker.transport import Unreachable, deadlines
from airflow_broker.transport.resolve import close_peers, resolve

pytestmark = [pytest.mark.postgres, pytest.mark.xdist_group("hung_peer")]


def test_a_peers_limits_come_off_its_url() -> None:
    url = "postgresql+psycopg://u@h/db?answer_timeout=7&sslmode=require&patience=0.5"
    plain, limits = deadlines.split_limits(url)
    assert plain == "postgresql+psycopg://u@h/db?sslmode=require"
    assert limits == deadlines.Limits(answer_timeout=7.0, patience=0.5)
    assert limits.answer_seconds() == 7.0 and limits.patience_seconds() == 0.5
    assert deadlines.split_limits("postgresql+psycopg://u@h/db") == (
        "postgresql+psycopg://u@h/db",
        deadlines.Limits(),
    )
    assert deadlines.Limits().answer_seconds() == deadlines.ANSWER_TIMEOUT
    with pytest.raises(Unreachable, match="answer_timeout='soon' is not a positive number"):
        deadlines.split_limits("postgresql+psycopg://u@h/db?answer_timeout=soon")
    with pytest.raises(Unreachable, match="patience='0' is not a positive number"):
        deadlines.split_limits("postgresql+psycopg://u@h/db?patience=0")


def test_libpq_gets_bounds_unless_the_url_gives_its_own() -> None:
    args = deadlines.connect_args("postgresql+psycopg://u@h/db", deadlines.Limits(answer_timeout=9))
    assert args == {
        "connect_timeout": deadlines.CONNECT_TIMEOUT,
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": 9000,
    }
    own = deadlines.connect_args(
        "postgresql+psycopg://u@h/db?connect_timeout=2&keepalives_idle=60&tcp_user_timeout=1",
        deadlines.Limits(),
    )
    assert "connect_timeout" not in own and "keepalives_idle" not in own
    assert "tcp_user_timeout" not in own and own["keepalives"] == 1


def test_the_spark_executors_connections_are_bounded_too() -> None:
    from airflow_broker.spark import jdbc

    info = jdbc.conninfo("postgresql+psycopg://u@h/db?keepalives_idle=60")
    assert info.startswith("postgresql://u@h/db?")
    assert f"connect_timeout={deadlines.CONNECT_TIMEOUT}" in info and "keepalives=1" in info
    assert "keepalives_idle=60" in info and "keepalives_idle=10" not in info
    assert "tcp_user_timeout=" in info


def test_a_lane_is_busy_only_while_a_push_a_pass_gave_up_on_is_out() -> None:
    """Pushes of passes running at once go at once; only an overdue one makes the lane busy,
    until it ends."""
    import threading

    from airflow_broker.transport.lanes import Lane

    lane = Lane("broker://far")
    both = threading.Barrier(2, timeout=5)
    release = threading.Event()

    def push() -> str:
        both.wait()  # both pushes run at the same time, or this times out
        release.wait(5)
        return "done"

    first, second = lane.submit(push), lane.submit(push)
    time.sleep(0.2)
    assert lane.busy() is None  # running, but no pass stopped waiting for them
    lane.overdue(first, time.monotonic())
    why = lane.busy()
    assert why is not None and why.startswith("no answer from broker://far for")
    release.set()
    assert first.result(5) == second.result(5) == "done"
    assert lane.busy() is None
    lane.close()


def test_an_airflow_connection_carries_the_limits_and_its_broker_opens(pg_url: str) -> None:
    from sqlalchemy import make_url

    server = make_url(pg_url)
    conn = SimpleNamespace(
        conn_id="far",
        conn_type="postgres",
        host=server.host,
        port=server.port,
        schema=server.database,
        login=server.username,
        password=None,
        extra_dejson={"answer_timeout": 12, "patience": 2, "tcp_user_timeout": 4000},
    )
    url = connection_url(conn)
    assert "answer_timeout=12" in url and "patience=2" in url and "tcp_user_timeout=4000" in url
    broker = Broker.connect(url)  # the limits are not libpq's: taken off again
    try:
        with broker.engine.connect() as c:
            assert c.execute(text("SELECT 1")).scalar() == 1
    finally:
        broker.dispose()


@pytest.mark.direct_connection  # the server-side timeouts are not set behind a pooler
def test_a_peers_connections_carry_the_bounds(pg_url: str) -> None:
    source = Broker.connect(pg_url, resolver={"far": pg_url + "?answer_timeout=3&patience=1"})
    try:
        peer = resolve(source, "broker://far")
        assert deadlines.limits_of(peer) == deadlines.Limits(answer_timeout=3.0, patience=1.0)
        with peer.engine.connect() as c:
            params = c.connection.dbapi_connection.info.get_parameters()  # type: ignore[union-attr]
            assert params["keepalives"] == "1" and params["tcp_user_timeout"] == "3000"
            assert c.execute(text("SHOW statement_timeout")).scalar() == "3s"
            assert c.execute(text("SHOW idle_in_transaction_session_timeout")).scalar() == "6s"
    finally:
        close_peers()
        source.dispose()


# -- against a server that hangs -------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[FrozenCluster]:
    with frozen_cluster() as c:
        yield c


@pytest.fixture
def peer_of(cluster: FrozenCluster, pg_url: str) -> Iterator[Any]:
    name = f"far_{uuid.uuid4().hex[:8]}"
    cluster.create_database(name)
    source = Broker.connect(pg_url, resolver={"far": cluster.url(name) + "?answer_timeout=2"})
    peer = resolve(source, "broker://far")
    with peer.engine.connect() as c:  # a pooled connection, made before the hang
        c.execute(text("SELECT 1"))
    try:
        yield peer
    finally:
        cluster.thaw()
        close_peers()
        source.dispose()


def _select(peer: Any) -> Any:
    with peer.engine.connect() as c:
        return c.execute(text("SELECT 1")).scalar()


def test_an_operation_on_a_hung_peer_is_cut_at_its_answer_timeout(
    peer_of: Any, cluster: FrozenCluster
) -> None:
    cluster.freeze()
    started = time.monotonic()
    with (
        pytest.raises(Unreachable, match=r"no answer from broker://far for 2 s"),
        deadlines.answer_within(peer_of, "broker://far"),
    ):
        _select(peer_of)
    took = time.monotonic() - started
    assert 1.9 < took < 4, took
    assert deadlines.suspected(peer_of)
    reason = deadlines.hung(peer_of)
    assert reason is not None and "no answer from broker://far for 2 s" in reason
    # Passed over while hung: at once, and no new connection is even tried.
    started = time.monotonic()
    with (
        pytest.raises(Unreachable, match="no answer from broker://far"),
        deadlines.answer_within(peer_of, "broker://far"),
    ):
        _select(peer_of)
    with pytest.raises(Exception, match="not connecting again yet"):
        _select(peer_of)
    assert time.monotonic() - started < 1
    cluster.thaw()
    time.sleep(2.1)  # the hung window is the answer timeout
    with deadlines.answer_within(peer_of, "broker://far"):
        assert _select(peer_of) == 1  # the cut connections were thrown away: fresh ones
    assert not deadlines.suspected(peer_of) and deadlines.hung(peer_of) is None


def test_a_deadline_inside_another_ends_before_it(peer_of: Any, cluster: FrozenCluster) -> None:
    cluster.freeze()
    started = time.monotonic()
    with (
        pytest.raises(Unreachable) as caught,
        deadlines.answer_within(peer_of, "broker://far", seconds=3),
        deadlines.answer_within(peer_of, "broker://far", seconds=30),
    ):
        _select(peer_of)
    took = time.monotonic() - started
    # The inner one got at most 80% of what the outer one had left.
    assert took < 3, took
    # The inner deadline struck; the outer one saw its Unreachable go by.
    assert "no answer from broker://far for 2.4 s" in str(caught.value)


def test_a_connection_attempt_that_times_out_counts_as_hung(
    cluster: FrozenCluster, pg_url: str
) -> None:
    name = f"far_{uuid.uuid4().hex[:8]}"
    cluster.create_database(name)
    far = cluster.url(name) + "?connect_timeout=1"
    source = Broker.connect(pg_url, resolver={"far": far})
    try:
        peer = resolve(source, "broker://far")
        cluster.freeze()  # no connection made before: the first one is never answered
        started = time.monotonic()
        with (
            pytest.raises(Unreachable, match=r"no answer from broker://far for 1 s \(connecting\)"),
            deadlines.answer_within(peer, "broker://far"),
        ):
            _select(peer)
        assert time.monotonic() - started < 3
        assert deadlines.hung(peer) is not None
    finally:
        cluster.thaw()
        close_peers()
        source.dispose()
