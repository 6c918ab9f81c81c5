"""Behind PgBouncer in transaction mode: what needs a server session, and what finds the pooler.

The engine's ordinary tests run through a PgBouncer too (``make test`` runs the PostgreSQL
subset with ``BROKER_TEST_VIA_PGBOUNCER=1``); the tests here are the ones that only mean
something behind a pooler: the broker finds it on its own, a killed reader whose server process
lives on in the pool still has its attempt counted, a waiting RECEIVE polls instead of LISTEN
(or LISTENs on ``listen_url``), the transmitter's one-run-at-a-time lock holds across clients
and goes with a killed holder, no session setting leaks to the pool's other clients, and the
schema migrates through it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import (
    NOTE,
    SUPPLIER_QUEUE,
    begin,
    declare_pair,
    receive,
    rollbacks_after_reaping,
    send,
)
from sqlalchemy import make_url, text
from support.pgbouncer import PgBouncer

from airflow_broker import Broker
from airflow_broker.activation.transmitter import transmitter_lock, transmitter_running

pytestmark = pytest.mark.postgres

MP = multiprocessing.get_context("forkserver")


@pytest.fixture
def small_pool() -> Iterator[PgBouncer]:
    """A PgBouncer whose pool has two server connections: a session setting left on either
    would reach the next client of that pool."""
    from conftest import _admin_url

    admin = _admin_url()
    bouncer = PgBouncer(admin.host or "127.0.0.1", admin.port or 5432, pool_size=2).start()
    yield bouncer
    bouncer.stop()


def _names(direct_url: str) -> str:
    database = make_url(direct_url).database
    assert database
    return database


@pytest.fixture
def urls(pgbouncer: PgBouncer, postgres_server) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """(through PgBouncer, direct) URLs of one fresh migrated broker database."""
    name = _names(postgres_server.create_database())
    return pgbouncer.url(name), postgres_server.direct_url_for(name)


def test_the_broker_finds_the_pooler_on_its_own_and_says_so_once(
    urls: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    pooled_url, direct_url = urls
    caplog.set_level(logging.INFO, logger="airflow_broker")
    through, straight = Broker.connect(pooled_url), Broker.connect(direct_url)
    try:
        assert through.adapter.pooled is True  # type: ignore[union-attr]
        assert straight.adapter.pooled is False  # type: ignore[union-attr]
        for _ in range(3):
            with through.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        said = [r.getMessage() for r in caplog.records if "connection pooler" in r.getMessage()]
        assert len(said) == 1, said
        assert "poll" in said[0] and "listen_url" in said[0]
        # The override wins over what the ends of the connection say.
        forced = Broker.connect(direct_url, pooled=True)
        try:
            assert forced.adapter.pooled is True  # type: ignore[union-attr]
        finally:
            forced.dispose()
    finally:
        through.dispose()
        straight.dispose()


def test_every_dialog_verb_in_one_transaction_after_another_through_the_pooler(
    urls: tuple[str, str],
) -> None:
    """Replies, END CONVERSATION, END WITH ERROR and timers: the statements each prepared on
    whatever server process its transaction got (DuplicatePreparedStatement, before)."""
    pooled_url, _ = urls
    brokers = [Broker.connect(pooled_url) for _ in range(3)]
    try:
        declare_pair(brokers[0])
        for round_no in range(4):
            for b in brokers:
                h = begin(b)
                send(b, h, NOTE, f"{round_no}".encode())
                with b.transaction() as tx:
                    (m,) = tx.receive(SUPPLIER_QUEUE, conversation_handle=None, top=1)
                    tx.begin_conversation_timer(m.conversation_handle, 3600)
                    tx.send(m.conversation_handle, NOTE, b"reply")
                    tx.end_conversation(
                        m.conversation_handle,
                        error_code=7 if round_no % 2 else None,
                        error_description="refused" if round_no % 2 else None,
                    )
        assert brokers[0].check() == []
    finally:
        for b in brokers:
            b.dispose()


def _receive_twice_then_die(url: str, queue: str, pipe: Any) -> None:
    """Commit one RECEIVE, wait for the parent's word, then RECEIVE again and die at once, on
    one client connection (a reader's loop)."""
    broker = Broker.connect(url, pool_use_lifo=True)
    with broker.transaction() as tx:
        assert tx.receive(queue, top=1)
    pipe.send("committed")
    assert pipe.recv() == "go"
    with broker.transaction() as tx:
        if tx.receive(queue, top=1):
            os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


def test_a_killed_reader_is_counted_though_the_server_process_it_ran_on_before_lives_on(
    postgres_server,  # type: ignore[no-untyped-def]
) -> None:
    """Behind the pooler a client's transactions run on whichever server process is free. A
    reader whose earlier transaction ran on server process X, and whose last one runs on Y,
    dies: X lives on, serving another client. Whether the reader is alive cannot be read from
    a server process; the lease's advisory lock, gone with the transaction, tells the reaper.
    (The pool hands out its most recently used server process first: the blocker below gets
    X, the reader's next transaction another.)"""
    from conftest import _admin_url

    admin = _admin_url()
    bouncer = PgBouncer(admin.host or "127.0.0.1", admin.port or 5432, pool_size=3).start()
    name = _names(postgres_server.create_database())
    url = bouncer.url(name)
    broker = Broker.connect(url)
    try:
        declare_pair(broker)
        send(broker, begin(broker), NOTE, b"1", b"2")
        broker.dispose()  # no connection of this process in the pool while the reader works
        parent, child = MP.Pipe()
        proc = MP.Process(target=_receive_twice_then_die, args=(url, SUPPLIER_QUEUE, child))
        proc.start()
        assert parent.poll(60) and parent.recv() == "committed"
        conninfo = make_url(url).set(drivername="postgresql").render_as_string(False)
        with psycopg.connect(conninfo) as blocker:
            blocker.execute("SELECT 1")  # in a transaction: holds its server process
            parent.send("go")
            proc.join(60)
            assert proc.exitcode == -signal.SIGKILL, f"the reader ended with {proc.exitcode}"
            assert rollbacks_after_reaping(broker, SUPPLIER_QUEUE, 1, timeout=15) == 1
            blocker.rollback()
        (m,) = receive(broker, SUPPLIER_QUEUE)
        assert m.message_body == b"2" and m.receive_count == 2
    finally:
        broker.dispose()
        bouncer.stop()


def test_a_waiting_receive_behind_the_pooler_polls_and_wakes_soon(
    urls: tuple[str, str],
) -> None:
    pooled_url, _ = urls
    broker = Broker.connect(pooled_url)
    try:
        declare_pair(broker)
        h = begin(broker)
        threading.Timer(0.6, lambda: send(broker, h, NOTE, b"late")).start()
        started = time.monotonic()
        with broker.transaction() as tx:
            got = tx.receive(SUPPLIER_QUEUE, wait_seconds=10)
        took = time.monotonic() - started
        assert [m.message_body for m in got] == [b"late"]
        assert took < 3.0, f"woke after {took:.1f}s of a 10 s wait"
        assert not broker.adapter.listens  # type: ignore[union-attr]
    finally:
        broker.dispose()


def test_with_listen_url_a_waiting_receive_listens_on_the_direct_connection(
    urls: tuple[str, str],
) -> None:
    pooled_url, direct_url = urls
    broker = Broker.connect(pooled_url, listen_url=direct_url)
    watcher = Broker.connect(direct_url)
    try:
        declare_pair(broker)
        h = begin(broker)
        assert broker.adapter.listens  # type: ignore[union-attr]
        seen: list[str] = []

        def look_then_send() -> None:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not seen:
                with watcher.engine.connect() as conn:
                    seen.extend(
                        conn.execute(
                            text(
                                "SELECT query FROM pg_stat_activity WHERE query LIKE 'LISTEN%'"
                                " AND datname = current_database()"
                            )
                        ).scalars()
                    )
                time.sleep(0.05)
            send(broker, h, NOTE, b"woken")

        threading.Thread(target=look_then_send).start()
        with broker.transaction() as tx:
            got = tx.receive(SUPPLIER_QUEUE, wait_seconds=10)
        assert [m.message_body for m in got] == [b"woken"]
        assert seen and seen[0].startswith('LISTEN "airflow_broker_q'), seen
    finally:
        broker.dispose()
        watcher.dispose()


def _hold_transmitter_lock(url: str, pipe: object) -> None:
    broker = Broker.connect(url)
    with transmitter_lock(broker) as got:
        pipe.send(got)  # type: ignore[attr-defined]
        time.sleep(300)


def test_the_transmitter_lock_holds_across_clients_and_goes_with_a_killed_holder(
    urls: tuple[str, str],
) -> None:
    """A session advisory lock behind the pooler would stay with a server process the pool
    goes on using (and its unlock could reach another one): the lock is held by a transaction
    that ends when its client does."""
    pooled_url, _ = urls
    a, b = Broker.connect(pooled_url), Broker.connect(pooled_url)
    try:
        with transmitter_lock(a) as got_a:
            assert got_a
            with transmitter_lock(b) as got_b:
                assert not got_b
            assert transmitter_running(b)
        with transmitter_lock(b) as got_b:
            assert got_b
        assert not transmitter_running(a)
        parent, child = MP.Pipe()
        proc = MP.Process(target=_hold_transmitter_lock, args=(pooled_url, child))
        proc.start()
        try:
            assert parent.poll(60) and parent.recv() is True
            with transmitter_lock(a) as got_a:
                assert not got_a
        finally:
            proc.kill()
            proc.join(30)
        deadline = time.monotonic() + 15
        while True:
            with transmitter_lock(a) as got_a:
                if got_a:
                    break
            assert time.monotonic() < deadline, "the killed holder's lock was never released"
            time.sleep(0.2)
    finally:
        a.dispose()
        b.dispose()


def test_no_session_setting_reaches_the_pools_other_clients(
    small_pool: PgBouncer,
    postgres_server,  # type: ignore[no-untyped-def]
) -> None:
    """The receive lease's side connection turns synchronous_commit off on a direct connection;
    behind a pooler that would stay on a server process other clients' commits then use."""
    name = _names(postgres_server.create_database())
    url = small_pool.url(name)
    broker = Broker.connect(url)
    try:
        declare_pair(broker)
        h = begin(broker)
        send(broker, h, NOTE, *[str(i).encode() for i in range(20)])
        for _ in range(20):
            with broker.transaction() as tx:
                assert tx.receive(SUPPLIER_QUEUE, top=1)
        broker.adapter._side.sync()  # type: ignore[union-attr]
        conninfo = make_url(url).set(drivername="postgresql").render_as_string(False)
        # Two clients in transactions at once hold both of the pool's server processes.
        with psycopg.connect(conninfo) as one, psycopg.connect(conninfo) as two:
            settings = {
                conn.execute("SELECT current_setting('synchronous_commit')").fetchone()[0]  # type: ignore[index]
                for conn in (one, two)
            }
            pids = {conn.execute("SELECT pg_backend_pid()").fetchone()[0] for conn in (one, two)}  # type: ignore[index]
        assert len(pids) == 2
        assert settings == {"on"}
    finally:
        broker.dispose()


def _prepared_on_each_server_process(url: str, *, deallocate: bool = False) -> list[set[str]]:
    """The names of the statements prepared on each of a two-process pool's server processes
    (two clients in transactions at once hold both); ``deallocate``: then drop them all."""
    conninfo = make_url(url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(conninfo) as one, psycopg.connect(conninfo) as two:
        names = [
            {row[0] for row in conn.execute("SELECT name FROM pg_prepared_statements")}
            for conn in (one, two)
        ]
        if deallocate:
            for conn in (one, two):
                conn.execute("DEALLOCATE ALL")
    return names


def test_receive_s_claim_is_prepared_on_the_server_process_that_runs_it(
    small_pool: PgBouncer,
    postgres_server,  # type: ignore[no-untyped-def]
) -> None:
    """Behind a pooler the claim is still prepared (planning it costs more than running it):
    on whichever server process a transaction gets, where that process does not have it yet,
    and again where it was lost (another client's DEALLOCATE ALL)."""
    name = _names(postgres_server.create_database())
    url = small_pool.url(name)
    broker = Broker.connect(url)
    try:
        declare_pair(broker)
        send(broker, begin(broker), NOTE, *[str(i).encode() for i in range(40)])
        got: list[bytes] = []

        def receive_some(n: int) -> None:
            for _ in range(n):
                with broker.transaction() as tx:
                    got.extend(m.message_body for m in tx.receive(SUPPLIER_QUEUE, top=1))

        receive_some(20)
        claims = set().union(*_prepared_on_each_server_process(url, deallocate=True))
        assert any(n.startswith("broker_") for n in claims), claims
        assert set().union(*_prepared_on_each_server_process(url)) == set()
        receive_some(20)
        assert got == [str(i).encode() for i in range(40)]
        assert set().union(*_prepared_on_each_server_process(url)) == claims
    finally:
        broker.dispose()


def test_the_schema_migrates_through_the_pooler(
    pgbouncer: PgBouncer,
    postgres_server,  # type: ignore[no-untyped-def]
) -> None:
    name = _names(postgres_server.create_database(migrated=False))
    broker = Broker.connect(pgbouncer.url(name))
    try:
        broker.migrate()
        broker.migrate()  # idempotent, as every start of a deployment runs it
        declare_pair(broker)
        send(broker, begin(broker), NOTE, b"after migrate")
        assert [m.message_body for m in receive(broker, SUPPLIER_QUEUE)] == [b"after migrate"]
    finally:
        broker.dispose()
