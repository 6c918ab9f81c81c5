"""On SQLite, reads neither wait for nor hold up a RECEIVE (issue 43).

A RECEIVE transaction holds SQLite's one write lock until it commits. Reads (peek, queue status,
the monitoring views the Airflow page shows) run on ``BrokerContext.read_connection()``, whose
transactions begin DEFERRED: in WAL mode they read the last committed state at once. Before,
every transaction began IMMEDIATE and a peek waited for the RECEIVE up to busy_timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    BUYER,
    CONTRACT,
    NOTE,
    SUPPLIER,
    SUPPLIER_QUEUE,
    begin,
    declare_pair,
    receive,
    send,
)
from sqlalchemy import event

from airflow_broker import Broker
from airflow_broker.operations import monitoring

#: busy_timeout of the test's connections: a read that still waits for the writer fails with
#: "database is locked" after this long instead of the engine's 60 s.
BUSY_TIMEOUT_MS = 5000
#: a read must answer well within this (it takes milliseconds)
PROMPT_SECONDS = 2.0


@pytest.fixture
def sqlite_broker(tmp_path: Path) -> Iterator[Broker]:
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    b = Broker.connect(url)

    @event.listens_for(b.engine, "connect")
    def _shorter_busy_timeout(dbapi_conn: Any, _record: Any) -> None:
        # runs after the adapter's own connect hook (registered first), overriding its 60 s
        dbapi_conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")

    b.migrate()
    declare_pair(b)
    yield b
    b.dispose()


def _bodies(messages: Any) -> list[bytes | None]:
    return [m.message_body for m in messages]


def _depth(broker: Broker) -> int:
    (status,) = [q for q in broker.queue_status() if q.name == SUPPLIER_QUEUE]
    return status.depth


#: reads the Airflow page, the CLI and the API do, each returning something comparable
READS: dict[str, Callable[[Broker], Any]] = {
    "peek": lambda b: _bodies(b.peek(SUPPLIER_QUEUE)),
    "queue_status": _depth,
    "catalog": lambda b: sorted(b.catalog().queues),
    "transmission_queue": lambda b: len(b.transmission_queue()),
    "events": lambda b: len(b.events()),
    "monitoring.overview": lambda b: monitoring.overview(b) is not None,
    "monitoring.queues": lambda b: {q.name: q.depth for q in monitoring.queues(b)}[SUPPLIER_QUEUE],
    "monitoring.queue": lambda b: monitoring.queue(b, SUPPLIER_QUEUE) is not None,
    "monitoring.waiting_messages": lambda b: (
        monitoring.waiting_messages(b, SUPPLIER_QUEUE).page.total
    ),
    "monitoring.conversations": lambda b: monitoring.conversations(b).total,
    "monitoring.transmission_queue": lambda b: monitoring.transmission_queue(b).page.total,
    "monitoring.events": lambda b: monitoring.events(b).total,
}


def _timed(pool: ThreadPoolExecutor, read: Callable[[Broker], Any], broker: Broker) -> Any:
    began = time.monotonic()
    value = pool.submit(read, broker).result(timeout=BUSY_TIMEOUT_MS / 1000 + 10)
    took = time.monotonic() - began
    assert took < PROMPT_SECONDS, f"the read waited {took:.2f} s for the RECEIVE's write lock"
    return value


def test_peek_and_queue_status_answer_at_once_with_the_committed_state(
    sqlite_broker: Broker,
) -> None:
    b = sqlite_broker
    send(b, begin(b), NOTE, b"a1", b"a2")
    send(b, begin(b), NOTE, b"b1")
    with ThreadPoolExecutor(max_workers=1) as pool:
        with b.transaction() as tx:
            held = tx.receive(SUPPLIER_QUEUE)
            assert _bodies(held) == [b"a1", b"a2"]
            # not committed either: a message sent in the same transaction
            tx.send(
                tx.begin_dialog(BUYER, SUPPLIER, contract=CONTRACT), message_type=NOTE, body=b"c1"
            )
            # Another connection sees what was committed: a1 and a2 still wait, c1 not yet.
            assert _timed(pool, READS["peek"], b) == [b"a1", b"a2", b"b1"]
            assert _timed(pool, READS["queue_status"], b) == 3
            mine = _timed(
                pool,
                lambda br: _bodies(
                    br.peek(SUPPLIER_QUEUE, conversation_handle=held[0].conversation_handle)
                ),
                b,
            )
            assert mine == [b"a1", b"a2"]
        # the RECEIVE committed: the reads see it
        assert _timed(pool, READS["peek"], b) == [b"b1", b"c1"]
        assert _timed(pool, READS["queue_status"], b) == 2


@pytest.mark.parametrize("name", sorted(READS))
def test_the_pages_reads_do_not_wait_for_a_receive(sqlite_broker: Broker, name: str) -> None:
    b = sqlite_broker
    send(b, begin(b), NOTE, b"a1")
    send(b, begin(b), NOTE, b"b1")
    read = READS[name]
    with ThreadPoolExecutor(max_workers=1) as pool:
        before = _timed(pool, read, b)
        with b.transaction() as tx:
            assert _bodies(tx.receive(SUPPLIER_QUEUE)) == [b"a1"]
            assert _timed(pool, read, b) == before  # the committed state, at once


def test_an_open_read_holds_up_no_receive(sqlite_broker: Broker) -> None:
    """A read transaction left open (a page request in progress) takes no write lock: a
    RECEIVE and its commit go ahead at once, and the reader goes on seeing its snapshot."""
    b = sqlite_broker
    send(b, begin(b), NOTE, b"a1")
    with ThreadPoolExecutor(max_workers=1) as pool, b.read_connection() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM broker_message").scalar() == 1
        assert conn.in_transaction()
        got = _timed(pool, lambda br: _bodies(receive(br, SUPPLIER_QUEUE)), b)
        assert got == [b"a1"]
        assert conn.exec_driver_sql("SELECT count(*) FROM broker_message").scalar() == 1
