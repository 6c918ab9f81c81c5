"""The in-process activation runner, against SQLite and PostgreSQL.

Messages arrive while the runner runs; every message is handled exactly once (the handler writes
a row keyed by conversation and sequence number in the receiving transaction, under a unique
key); at no moment do more readers run than ``max_readers`` or than there are conversation
groups (recorded from inside the handlers: the readers registered in the database, and the
handlers running at once). On PostgreSQL a growing queue gets more readers; two runner
processes on one queue share its ``max_readers``.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import BUYER, CONTRACT, ORDER, SUPPLIER, SUPPLIER_QUEUE, declare_pair
from sqlalchemy import func, select, text
from sqlalchemy.engine import Connection

from airflow_broker import Activation, Broker, InvalidDefinition
from airflow_broker.activation import readers
from airflow_broker.activation.runner import ActivationRunner
from airflow_broker.storage import schema as s

MP = multiprocessing.get_context("forkserver")

HANDLED_DDL = (
    "CREATE TABLE test_handled (conversation_handle VARCHAR(36) NOT NULL, "
    "seq BIGINT NOT NULL, live_readers INTEGER NOT NULL, "
    "PRIMARY KEY (conversation_handle, seq))"
)


def setup(broker: Broker, max_readers: int) -> None:
    declare_pair(broker)
    broker.alter_queue(SUPPLIER_QUEUE, activation=Activation(max_readers=max_readers))
    with broker.engine.begin() as conn:
        conn.execute(text(HANDLED_DDL))


def live_readers(conn: Connection) -> int:
    r = s.activation_reader
    stmt = select(func.count()).where(r.c.started_at.is_not(None), r.c.finished_at.is_(None))
    return int(conn.execute(stmt).scalar_one())


def record(tx: Any, messages: list[Any]) -> None:
    """The handler: one row per message, in the receiving transaction, with how many readers
    were registered at that moment."""
    live = live_readers(tx.connection)
    for m in messages:
        tx.connection.execute(
            text(
                "INSERT INTO test_handled (conversation_handle, seq, live_readers) "
                "VALUES (:h, :s, :n)"
            ),
            {"h": str(m.conversation_handle), "s": m.message_sequence_number, "n": live},
        )


def open_dialogs(broker: Broker, groups: int) -> list[uuid.UUID]:
    with broker.transaction() as tx:
        return [tx.begin_dialog(BUYER, SUPPLIER, contract=CONTRACT) for _ in range(groups)]


def send_spread(broker: Broker, handles: list[uuid.UUID], total: int, per_tx: int = 3) -> None:
    """``total`` orders over the dialogs, round robin, a few per transaction."""
    sent = 0
    while sent < total:
        with broker.transaction() as tx:
            for _ in range(min(per_tx, total - sent)):
                tx.send(handles[sent % len(handles)], message_type=ORDER, body={"n": sent})
                sent += 1


def handled(broker: Broker) -> list[Any]:
    with broker.engine.connect() as conn:
        rows = conn.execute(text("SELECT conversation_handle, seq, live_readers FROM test_handled"))
        return list(rows)


class Concurrency:
    """Counts handlers running at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0

    def wrap(self, handler: Callable[[Any, list[Any]], None]) -> Callable[[Any, list[Any]], None]:
        def counted(tx: Any, messages: list[Any]) -> None:
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            try:
                handler(tx, messages)
                time.sleep(0.002)  # a little work, so that readers overlap
            finally:
                with self.lock:
                    self.now -= 1

        return counted


@pytest.mark.parametrize(("groups", "max_readers", "total"), [(2, 4, 120), (8, 3, 240)])
def test_runner_handles_every_message_once_within_the_limits(
    broker: Broker, groups: int, max_readers: int, total: int
) -> None:
    setup(broker, max_readers)
    handles = open_dialogs(broker, groups)
    seen = Concurrency()
    runner = ActivationRunner(broker, SUPPLIER_QUEUE, seen.wrap(record), poll_interval=0.05)
    runner.start()
    sender = threading.Thread(target=send_spread, args=(broker, handles, total))
    sender.start()
    sender.join()
    report = runner.run_until_idle(timeout=120)
    runner.stop()

    rows = handled(broker)
    assert len(rows) == total
    assert len({(r[0], r[1]) for r in rows}) == total
    assert report.messages == total
    assert report.failures == []
    ceiling = min(max_readers, groups)
    assert 1 <= report.max_concurrent <= ceiling
    assert seen.most <= ceiling
    assert max(r[2] for r in rows) <= ceiling
    assert report.readers_started >= 1
    # Every reader it started registered, and finished once the queue was empty.
    rows_r = readers(broker, SUPPLIER_QUEUE)
    assert all(r.state == "finished" for r in rows_r)
    assert {r.outcome for r in rows_r} <= {"drained", "refused", "expired"}


def test_a_growing_queue_gets_more_readers(pg_broker: Broker) -> None:
    """PostgreSQL (SQLite's single writer lets only one transaction in at a time): the first
    reader holds its group while orders keep arriving on other groups; the monitor sees the
    queue grow and starts more readers, up to max_readers."""
    broker = pg_broker
    setup(broker, 3)
    handles = open_dialogs(broker, 6)
    second = threading.Event()
    first_call = threading.Event()

    def hold_first(tx: Any, messages: list[Any]) -> None:
        if not first_call.is_set():
            first_call.set()
            assert second.wait(30), "no second reader started while the queue grew"
        record(tx, messages)

    runner = ActivationRunner(broker, SUPPLIER_QUEUE, hold_first, poll_interval=0.05)
    runner.start()
    sent = 0
    deadline = time.monotonic() + 30
    while not second.is_set() and time.monotonic() < deadline:
        send_spread(broker, handles[sent % 6 : sent % 6 + 1], 1)
        sent += 1
        if runner.report.readers_started >= 2:
            second.set()
        time.sleep(0.01)  # paces the sender; nothing is asserted on time
    report = runner.run_until_idle(timeout=60)
    runner.stop()
    assert second.is_set()
    assert report.readers_started >= 2
    assert report.max_concurrent <= 3
    assert len(handled(broker)) == sent == report.messages


def test_max_readers_one_never_runs_two(broker: Broker) -> None:
    setup(broker, 1)
    handles = open_dialogs(broker, 5)
    seen = Concurrency()
    with ActivationRunner(broker, SUPPLIER_QUEUE, seen.wrap(record), poll_interval=0.05) as runner:
        send_spread(broker, handles, 60)
        runner.run_until_idle(timeout=60)
    assert runner.report.max_concurrent == 1
    assert seen.most == 1
    assert len(handled(broker)) == 60


def test_a_failed_batch_goes_back_and_is_handled_later(broker: Broker) -> None:
    setup(broker, 2)
    handles = open_dialogs(broker, 3)
    send_spread(broker, handles, 9)
    failed: list[Any] = []

    def fail_once(tx: Any, messages: list[Any]) -> None:
        if not failed:
            failed.append(messages[0].conversation_handle)
            raise RuntimeError("first batch fails")
        record(tx, messages)

    report = ActivationRunner(broker, SUPPLIER_QUEUE, fail_once, poll_interval=0.05).run_until_idle(
        timeout=60
    )
    assert len(report.failures) == 1
    assert "first batch fails" in report.failures[0]
    assert len(handled(broker)) == 9
    outcomes = [r.outcome for r in readers(broker, SUPPLIER_QUEUE)]
    assert "failed" in outcomes


def test_handler_by_name(broker: Broker) -> None:
    setup(broker, 2)
    send_spread(broker, open_dialogs(broker, 2), 4)
    report = ActivationRunner(broker, SUPPLIER_QUEUE, "test_runner:record").run_until_idle(60)
    assert report.messages == 4
    with pytest.raises(InvalidDefinition):
        ActivationRunner(broker, SUPPLIER_QUEUE, record, poll_interval=0)


def test_handler_from_the_queues_activation(broker: Broker) -> None:
    setup(broker, 2)
    with pytest.raises(InvalidDefinition, match="names no reader"):
        ActivationRunner(broker, SUPPLIER_QUEUE)
    broker.alter_queue(
        SUPPLIER_QUEUE, activation=Activation(max_readers=2, reader="test_runner:record")
    )
    send_spread(broker, open_dialogs(broker, 2), 4)
    assert ActivationRunner(broker, SUPPLIER_QUEUE).run_until_idle(60).messages == 4
    assert len(handled(broker)) == 4


def test_run_until_idle_times_out_on_a_disabled_queue(broker: Broker) -> None:
    setup(broker, 1)
    send_spread(broker, open_dialogs(broker, 1), 1)
    broker.alter_queue(SUPPLIER_QUEUE, status=False)
    runner = ActivationRunner(broker, SUPPLIER_QUEUE, record, poll_interval=0.05)
    with pytest.raises(TimeoutError, match="not drained"):
        runner.run_until_idle(timeout=0.5)
    assert runner.report.readers_started == 0  # the monitor starts no reader for it


# --------------------------------------------------------------------------- two processes


def run_in_child(url: str, max_readers: int, go: Any, stop: Any) -> None:
    """A runner in a process of its own, until ``stop`` is set."""
    broker = Broker.connect(url)
    try:
        go.wait(60)
        runner = ActivationRunner(broker, SUPPLIER_QUEUE, record, poll_interval=0.05).start()
        stop.wait(120)
        runner.stop()
    finally:
        broker.dispose()


def test_two_runner_processes_share_max_readers(
    broker: Broker, broker_url: str, tmp_path: Path
) -> None:
    max_readers, total = 2, 200
    setup(broker, max_readers)
    handles = open_dialogs(broker, 6)
    go, stop = MP.Event(), MP.Event()
    children = [
        MP.Process(target=run_in_child, args=(broker_url, max_readers, go, stop)) for _ in range(2)
    ]
    for child in children:
        child.start()
    try:
        go.set()
        send_spread(broker, handles, total)
        deadline = time.monotonic() + 120
        while len(handled(broker)) < total and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for the children; the assertions are on the rows
    finally:
        stop.set()
        for child in children:
            child.join(60)
    assert [c.exitcode for c in children] == [0, 0]
    rows = handled(broker)
    assert len(rows) == total
    assert len({(r[0], r[1]) for r in rows}) == total
    assert max(r[2] for r in rows) <= max_readers
