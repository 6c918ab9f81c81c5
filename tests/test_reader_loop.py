"""A reader's loop: Transaction.commit_and_receive, and drain() built on it.

On PostgreSQL the COMMIT of one receiving transaction and the next RECEIVE travel in one round
trip; these tests hold both engines to the same outcome: what the first transaction did is
committed (or, when its COMMIT fails, undone, with nothing received in its place), and the next
transaction holds only what it received.
"""

from __future__ import annotations

import multiprocessing
import re
import signal
from typing import Any

import procs
import pytest
from helpers import (
    NOTE,
    SUPPLIER_QUEUE,
    begin,
    bodies,
    declare_pair,
    rollbacks_after_reaping,
    send,
)
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError

from airflow_broker import Broker, QueueDisabled
from airflow_broker.activation.readers import drain
from airflow_broker.storage import direct

MP = multiprocessing.get_context("forkserver")


@pytest.fixture
def paired(broker: Broker) -> Broker:
    """The broker of each engine, with the buyer and supplier services declared."""
    declare_pair(broker)
    return broker


def queue_rows(broker: Broker) -> list[Any]:
    """Every message in the broker's queues: ``(message_body, receive_count)``, oldest first;
    read on an engine of its own (the broker's SQLite engine begins every transaction as a
    writer, and an open receiving transaction holds the write lock)."""
    engine = create_engine(broker.engine.url)
    try:
        with engine.connect() as conn:
            sql = "SELECT message_body, receive_count FROM broker_message ORDER BY queuing_order"
            return list(conn.execute(text(sql)))
    finally:
        engine.dispose()


def test_the_commit_holds_and_the_next_transaction_holds_its_own(paired: Broker) -> None:
    broker = paired
    h1, h2 = begin(broker), begin(broker)
    send(broker, h1, NOTE, b"a1", b"a2")
    send(broker, h2, NOTE, b"b1")
    tx = broker.transaction()
    first = tx.receive(SUPPLIER_QUEUE, top=1)
    assert bodies(first) == [b"a1"]
    nxt, second = tx.commit_and_receive(SUPPLIER_QUEUE, top=1)
    assert tx.ended and not nxt.ended
    assert bodies(second) == [b"a2"]  # the same conversation, in order
    # Committed: a1 is gone for good; a2 is held by the open transaction.
    left = sorted(r.message_body for r in queue_rows(broker))
    assert left == [b"a2", b"b1"]
    nxt.rollback()  # only a2 goes back
    with broker.transaction() as again:
        assert bodies(again.receive(SUPPLIER_QUEUE, top=1)) == [b"a2"]


def test_the_loop_ends_with_an_empty_transaction_when_the_queue_is(paired: Broker) -> None:
    broker = paired
    h = begin(broker)
    send(broker, h, NOTE, b"only")
    tx = broker.transaction()
    assert bodies(tx.receive(SUPPLIER_QUEUE)) == [b"only"]
    nxt, more = tx.commit_and_receive(SUPPLIER_QUEUE)
    assert more == []
    nxt.commit()
    assert queue_rows(broker) == []


def test_a_failed_commit_undoes_the_first_and_receives_nothing(paired: Broker) -> None:
    """A COMMIT that fails (here a deferred constraint the handler's write broke) rolls back
    what the transaction received, and the RECEIVE that would have followed it never runs."""
    broker = paired  # SQLite checks the deferred key at COMMIT too (foreign_keys is on)
    with broker.engine.begin() as conn:
        conn.execute(text("CREATE TABLE parent (id INTEGER PRIMARY KEY)"))
        conn.execute(
            text(
                "CREATE TABLE child (id INTEGER PRIMARY KEY, parent_id INTEGER REFERENCES "
                "parent (id) DEFERRABLE INITIALLY DEFERRED)"
            )
        )
    h1, h2 = begin(broker), begin(broker)
    send(broker, h1, NOTE, b"a1")
    send(broker, h2, NOTE, b"b1")
    tx = broker.transaction()
    assert bodies(tx.receive(SUPPLIER_QUEUE)) == [b"a1"]
    tx.connection.execute(text("INSERT INTO child VALUES (1, 42)"))  # no parent 42
    with pytest.raises(IntegrityError):
        tx.commit_and_receive(SUPPLIER_QUEUE)
    assert tx.ended
    # Both messages are back, and the failed hand-out of a1 is counted.
    assert sorted(queue_rows(broker)) == [(b"a1", 1), (b"b1", 0)]
    with broker.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM child")).scalar_one() == 0


def test_a_failed_receive_keeps_the_commit(paired: Broker) -> None:
    broker = paired
    """The first transaction's COMMIT went through; the RECEIVE after it fails (the queue was
    disabled meanwhile) and its error is raised."""
    h = begin(broker)
    send(broker, h, NOTE, b"a1", b"a2")
    tx = broker.transaction()
    assert bodies(tx.receive(SUPPLIER_QUEUE, top=1)) == [b"a1"]
    tx.connection.execute(text("UPDATE broker_queue SET status = false"))  # as poison handling
    with pytest.raises(QueueDisabled, match=SUPPLIER_QUEUE):
        tx.commit_and_receive(SUPPLIER_QUEUE, top=1)
    assert tx.ended
    assert [r.message_body for r in queue_rows(broker)] == [b"a2"]


def test_drain_handles_every_message_once_in_order(paired: Broker) -> None:
    broker = paired
    handles = [begin(broker) for _ in range(3)]
    for i, h in enumerate(handles):
        send(broker, h, NOTE, *[f"{i}-{k}".encode() for k in range(5)])
    seen: list[bytes] = []
    batches: list[int] = []

    def handle(tx: Any, messages: list[Any]) -> None:
        seen.extend(m.message_body for m in messages)

    report = drain(broker, SUPPLIER_QUEUE, handle, top=2, committed=batches.append)
    assert report.drained and report.messages == 15 and sum(batches) == 15
    assert sorted(seen) == sorted(f"{i}-{k}".encode() for i in range(3) for k in range(5))
    for i in range(3):  # each conversation in its order
        mine = [b for b in seen if b.startswith(f"{i}-".encode())]
        assert mine == [f"{i}-{k}".encode() for k in range(5)]
    assert queue_rows(broker) == []


def test_drain_stops_after_max_batches_holding_nothing(paired: Broker) -> None:
    broker = paired
    h = begin(broker)
    send(broker, h, NOTE, b"a1", b"a2", b"a3")
    report = drain(broker, SUPPLIER_QUEUE, lambda tx, m: None, top=1, max_batches=2)
    assert (report.batches, report.messages, report.drained) == (2, 2, False)
    # The third message was never claimed: it is ready, not counted as a failed hand-out.
    [row] = queue_rows(broker)
    assert row.message_body == b"a3" and row.receive_count == 0


def test_a_failing_handler_rolls_back_only_its_own_batch(paired: Broker) -> None:
    broker = paired
    h = begin(broker)
    send(broker, h, NOTE, b"a1", b"a2", b"a3")

    def fail_on_a2(tx: Any, messages: list[Any]) -> None:
        if messages[0].message_body == b"a2":
            raise RuntimeError("handler failed on a2")

    with pytest.raises(RuntimeError, match="a2"):
        drain(broker, SUPPLIER_QUEUE, fail_on_a2, top=1)
    rows = [(r.message_body, r.receive_count) for r in queue_rows(broker)]
    assert sorted(rows) == [(b"a2", 1), (b"a3", 0)]  # a1 committed; a2 back, counted once


@pytest.mark.postgres
def test_postgres_sends_the_commit_with_the_next_receive(
    pg_broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One round trip per message in a reader's loop: the committing transaction's lease row
    deleted, COMMIT; BEGIN; EXECUTE claim."""
    declare_pair(pg_broker)
    h = begin(pg_broker)
    send(pg_broker, h, NOTE, *[f"m{k}".encode() for k in range(6)])
    sent: list[bytes] = []
    monkeypatch.setattr(direct, "observer", lambda query, _seconds: sent.append(query))
    report = drain(pg_broker, SUPPLIER_QUEUE, lambda tx, m: None, top=1)
    assert report.messages == 6
    # The claim prepared (EXECUTE), or written whole behind a pooler (BROKER_TEST_VIA_PGBOUNCER).
    cleanup = re.compile(rb"^DELETE FROM broker_receive_lease WHERE lease_key IN \(\d+\);")
    pipelined = [
        q
        for q in sent
        if cleanup.sub(b"", q).startswith(b"COMMIT;BEGIN;")
        and (b"EXECUTE " in q or b"broker_message" in q)
    ]
    assert len(pipelined) == 6  # five that took a message, one that found the queue empty
    # Each COMMIT ended a transaction that held a message: its lease row went with it.
    assert all(cleanup.match(q) for q in pipelined)
    # No COMMIT of its own but the last one, after the claim that found the queue empty.
    assert sent.count(b"COMMIT") == 1 and sent[-1] == b"COMMIT"


@pytest.mark.postgres
@pytest.mark.timeout(120)
def test_a_reader_killed_as_commit_and_receive_returns(pg_url: str) -> None:
    """SIGKILL the moment commit_and_receive returns: the committed message stays handled once,
    the one the new transaction took goes back to the queue with its failed attempt counted,
    and the next reader handles it."""
    broker = Broker.connect(pg_url)
    try:
        declare_pair(broker)
        with broker.engine.begin() as conn:
            conn.execute(text("CREATE TABLE handled (body BYTEA NOT NULL)"))
        h = begin(broker)
        send(broker, h, NOTE, b"1", b"2", b"3")
        proc = MP.Process(target=procs.loop_then_die, args=(pg_url, SUPPLIER_QUEUE))
        proc.start()
        proc.join(60)
        assert proc.exitcode == -signal.SIGKILL, f"the reader ended with {proc.exitcode}"
        assert rollbacks_after_reaping(broker, SUPPLIER_QUEUE, 1) == 1
        assert sorted(queue_rows(broker)) == [(b"2", 1), (b"3", 0)]

        def record(tx: Any, messages: list[Any]) -> None:
            for m in messages:
                tx.connection.execute(
                    text("INSERT INTO handled (body) VALUES (:b)"), {"b": m.message_body}
                )

        drain(broker, SUPPLIER_QUEUE, record, top=1)
        with broker.engine.connect() as conn:
            handled = conn.execute(text("SELECT body FROM handled")).scalars().all()
        assert sorted(bytes(b) for b in handled) == [b"1", b"2", b"3"]  # each once
    finally:
        broker.dispose()
