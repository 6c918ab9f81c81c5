"""LISTEN connections come back after the server ends them (issue 43).

The Airflow triggers' listeners (``provider/triggers/activation.py``, shared by the activation,
transmission and conversation triggers) and the in-process ActivationRunner's monitor hold a
LISTEN connection each. When the server ends it (``pg_terminate_backend``; a restart, here a
database refusing new connections for a while), the listener must connect again within
``LISTEN_RECONNECT_SECONDS``, LISTEN on its channel again, and have its waiters look at the queue
again (what was notified while it was away is lost), with one warning per loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import BUYER, CONTRACT, ORDER, SUPPLIER, SUPPLIER_QUEUE, declare_pair
from sqlalchemy import make_url, select

from airflow_broker import Broker
from airflow_broker.activation.runner import LISTEN_RECONNECT_SECONDS, ActivationRunner
from airflow_broker.provider.compat import TriggerEvent
from airflow_broker.provider.triggers import activation as trigger_module
from airflow_broker.provider.triggers.activation import QueueActivationTrigger, QueueWaiter
from airflow_broker.storage import schema
from airflow_broker.storage.adapters import channel

pytestmark = [pytest.mark.postgres, pytest.mark.direct_connection]

CONN_ID = "broker_listen_test"
#: Far longer than the test waits: only a NOTIFY, or the listener's wake-up after it listens
#: again, can wake a waiter in time.
LONG_POLL = 120.0
#: The runner's longest wait (its stop() waits for the current one to end).
RUNNER_POLL = 2.0
#: On top of the retry interval: a connection, a LISTEN and a look on a loaded 2-core machine.
MARGIN = 6.0
#: How long the database refuses new connections after the listener lost its own: the
#: listener's first attempts (at once, and one interval later) fail.
OUTAGE = LISTEN_RECONNECT_SECONDS + 0.5


def _libpq(url: str, database: str | None = None) -> str:
    u = make_url(url)
    if database is not None:
        u = u.set(database=database)
    return u.set(drivername="postgresql").render_as_string(hide_password=False)


class Server:
    """The test database as an operator sees it from outside: who LISTENs, end a backend,
    refuse new connections for a while (as a restarting server does)."""

    def __init__(self, url: str) -> None:
        self.dbname = make_url(url).database
        self.conn = psycopg.connect(_libpq(url), autocommit=True)
        self.admin = psycopg.connect(_libpq(url, "postgres"), autocommit=True)

    def listeners(self, ch: str) -> list[int]:
        """The server processes LISTENing on channel ``ch`` (their last statement)."""
        rows = self.conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND query = %s AND pid <> pg_backend_pid()",
            (f'LISTEN "{ch}"',),
        ).fetchall()
        return [r[0] for r in rows]

    def terminate(self, pids: list[int]) -> None:
        for pid in pids:
            self.conn.execute("SELECT pg_terminate_backend(%s)", (pid,))

    def refuse_connections(self, refuse: bool) -> None:
        allow = "false" if refuse else "true"
        self.admin.execute(f'ALTER DATABASE "{self.dbname}" ALLOW_CONNECTIONS {allow}')

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.refuse_connections(False)
        self.conn.close()
        self.admin.close()


@pytest.fixture
def server(pg_url: str) -> Iterator[Server]:
    s = Server(pg_url)
    yield s
    s.close()


@pytest.fixture
def broker(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    conn = json.dumps({"conn_type": "broker", "extra": {"url": pg_url}})
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", conn)
    b = Broker.connect(pg_url)
    declare_pair(b)
    yield b
    b.dispose()


def send_order(broker: Broker) -> None:
    with broker.transaction() as tx:
        handle = tx.begin_dialog(BUYER, SUPPLIER, contract=CONTRACT)
        tx.send(handle, message_type=ORDER, body={"line": 1})


def queue_id(broker: Broker) -> int:
    with broker.read_connection() as conn:
        return int(
            conn.execute(
                select(schema.queue.c.queue_id).where(schema.queue.c.name == SUPPLIER_QUEUE)
            ).scalar_one()
        )


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout:.1f} s"
        time.sleep(0.02)


async def eventually(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout:.1f} s"
        await asyncio.sleep(0.02)


def losses(caplog: pytest.LogCaptureFixture, ch: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and ch in r.getMessage() and "LISTEN" in r.getMessage()
    ]


# ------------------------------------------------------------------------- the triggers' listener


def test_a_waiter_wakes_and_a_new_backend_listens_after_pg_terminate_backend(
    broker: Broker, server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    ch = channel(queue_id(broker))

    async def scenario() -> None:
        waiter = QueueWaiter(broker, queue_id(broker), poll_interval=LONG_POLL)
        await waiter.open()
        try:
            [old] = await asyncio.to_thread(server.listeners, ch)
            waiter.clear()
            wait = asyncio.create_task(waiter.wait())
            await asyncio.to_thread(server.terminate, [old])
            # The listener connects again by itself, LISTENs, and wakes the waiter to look.
            began = time.monotonic()
            await asyncio.wait_for(wait, LISTEN_RECONNECT_SECONDS + MARGIN)
            await eventually(
                lambda: server.listeners(ch) not in ([], [old]),
                LISTEN_RECONNECT_SECONDS + MARGIN - (time.monotonic() - began),
                "a new backend LISTENing",
            )
            [new] = await asyncio.to_thread(server.listeners, ch)
            assert new != old
            # ... and it hears the next SEND at once.
            waiter.clear()
            wait = asyncio.create_task(waiter.wait())
            await asyncio.to_thread(send_order, broker)
            await asyncio.wait_for(wait, MARGIN)
        finally:
            await waiter.close()

    with caplog.at_level(logging.INFO, logger="airflow_broker"):
        asyncio.run(scenario())
    [warning] = losses(caplog, ch)  # once per loss, naming the channel and the error
    assert "terminat" in warning or "closed" in warning


def test_the_activation_trigger_fires_for_a_send_after_the_server_came_back(
    broker: Broker, server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """The server ends the LISTEN connection and refuses new ones for a while (a restart);
    a SEND after it is back fires the trigger within the retry interval, not a poll later."""
    ch = channel(queue_id(broker))

    async def scenario() -> None:
        trigger = QueueActivationTrigger(
            queue=SUPPLIER_QUEUE, broker_conn_id=CONN_ID, poll_interval=LONG_POLL
        )
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def run() -> None:
            async for event in trigger.run():
                assert isinstance(event, TriggerEvent)
                await events.put(event.payload)

        task = asyncio.create_task(run())
        try:
            await eventually(lambda: server.listeners(ch) != [], MARGIN, "the trigger LISTENing")
            await asyncio.sleep(0.2)  # its first look is done: it waits
            [old] = await asyncio.to_thread(server.listeners, ch)
            await asyncio.to_thread(server.refuse_connections, True)
            try:
                await asyncio.to_thread(server.terminate, [old])
                await asyncio.sleep(OUTAGE)
            finally:
                await asyncio.to_thread(server.refuse_connections, False)
            await asyncio.to_thread(send_order, broker)
            event = await asyncio.wait_for(events.get(), LISTEN_RECONNECT_SECONDS + MARGIN)
            assert event["depth"] == 1
            [new] = await asyncio.to_thread(server.listeners, ch)
            assert new != old
            [listener] = trigger_module._listeners[asyncio.get_running_loop()].values()
            assert listener.reconnects == 1 and listener.refs == 1
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await trigger.cleanup()

    with caplog.at_level(logging.INFO, logger="airflow_broker"):
        asyncio.run(scenario())
    assert len(losses(caplog, ch)) == 1  # not one per failed attempt


# ------------------------------------------------------------------------- the in-process runner


@pytest.mark.parametrize("outage", [0.0, OUTAGE], ids=["terminated", "refused_a_while"])
def test_the_runner_listens_again_and_reads_what_was_sent(
    broker: Broker, server: Server, caplog: pytest.LogCaptureFixture, outage: float
) -> None:
    ch = channel(queue_id(broker))
    read = threading.Event()

    def handle(tx: Any, messages: Any) -> None:
        read.set()

    # The runner's stop() waits out its current wait: a short poll_interval. Its reconnection is
    # timed from the loss, which its wait notices at once, not from poll_interval.
    runner = ActivationRunner(broker, SUPPLIER_QUEUE, handle, poll_interval=RUNNER_POLL)
    with caplog.at_level(logging.INFO, logger="airflow_broker"), runner:
        wait_until(lambda: server.listeners(ch) != [], MARGIN, "the runner LISTENing")
        [old] = server.listeners(ch)
        if outage:
            server.refuse_connections(True)
        try:
            server.terminate([old])
            time.sleep(outage)
        finally:
            server.refuse_connections(False)
        began = time.monotonic()
        wait_until(
            lambda: server.listeners(ch) not in ([], [old]),
            LISTEN_RECONNECT_SECONDS + MARGIN,
            "a new backend LISTENing",
        )
        assert time.monotonic() - began < LISTEN_RECONNECT_SECONDS + MARGIN
        send_order(broker)
        assert read.wait(MARGIN), "the runner did not read the message sent after the loss"
    assert len(losses(caplog, ch)) == 1  # once per loss, naming the channel
