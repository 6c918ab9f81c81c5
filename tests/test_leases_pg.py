"""Leases on PostgreSQL with real OS processes and SIGKILL (workers in ``tests/lease_procs.py``).

- a lease holder killed mid-handler: after expiry other readers lease its group, and every
  message is completed exactly once, none lost;
- two readers never hold one conversation group at once, whether they hold it by a lease or by
  a receiving transaction;
- ``complete`` after expiry and a new lease raises LeaseExpired and changes nothing, and a lease
  being completed is never expired under the completing transaction;
- a reader killed inside its receiving transaction counts: the next RECEIVE shows
  receive_count 2.

Every worker and every wait has a timeout, so a hang fails the test instead of blocking the run.
The timeouts cover the test function only (``func_only``): the last test of a run also carries
the session's teardown, which drops every test database and can take a while on a busy server.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import lease_procs
import procs
import pytest
from sqlalchemy import create_engine, text

from airflow_broker import Broker, LeaseExpired, Message

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

# Forked from a fresh forkserver process, never from pytest itself (see test_concurrency_pg).
MP = multiprocessing.get_context("forkserver")
MP.set_forkserver_preload(
    ["lease_procs", "procs", "psycopg", "sqlalchemy.dialects.postgresql.psycopg"]
)
INIT_SERVICE = "//test/LeaseInitiator"
TARGET_SERVICE = "//test/LeaseTarget"
INIT_QUEUE = "test_lease_initiator_q"
TARGET_QUEUE = "test_lease_target_q"

Spawner = Callable[..., BaseProcess]


@pytest.fixture
def spawn() -> Iterator[Spawner]:
    """Start worker processes; any still alive at teardown are killed (by their own pid)."""
    started: list[BaseProcess] = []

    def _spawn(target: Callable[..., None], *args: Any, **kwargs: Any) -> BaseProcess:
        proc = MP.Process(target=target, args=args, kwargs=kwargs, daemon=True)
        proc.start()
        started.append(proc)
        return proc

    yield _spawn
    for proc in started:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)


@pytest.fixture
def broker(pg_url: str) -> Iterator[Broker]:
    """The initiator and target services on a fresh PostgreSQL broker, with the test tables."""
    b = Broker.connect(pg_url)
    b.create_queue(INIT_QUEUE)
    b.create_queue(TARGET_QUEUE)
    b.create_service(INIT_SERVICE, queue=INIT_QUEUE, contracts=["DEFAULT"])
    b.create_service(TARGET_SERVICE, queue=TARGET_QUEUE, contracts=["DEFAULT"])
    lease_procs.create_test_tables(pg_url)
    yield b
    b.dispose()


def _join_all(processes: list[BaseProcess], timeout: float) -> None:
    """Join every process within ``timeout`` seconds overall; fail on a hang or a crash."""
    deadline = time.monotonic() + timeout
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [p.name for p in processes if p.is_alive()]
    assert not hung, f"worker processes still running after {timeout} s: {hung}"
    failed = {p.name: p.exitcode for p in processes if p.exitcode != 0}
    assert not failed, f"worker processes failed (exit codes; tracebacks above): {failed}"


def _send_dialogs(broker: Broker, dialogs: int, messages: int) -> list[uuid.UUID]:
    """``dialogs`` dialogs (a conversation group each on the target side), each carrying
    ``messages`` bodies ``"<dialog>-<k>"``."""
    with broker.transaction() as tx:
        handles = [tx.begin_dialog(INIT_SERVICE, TARGET_SERVICE) for _ in range(dialogs)]
        for k in range(messages):
            for d, h in enumerate(handles):
                tx.send(h, body=f"{d}-{k}")
    return handles


def _rows(url: str, sql: str) -> list[Any]:
    engine = create_engine(url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(sql)))
    finally:
        engine.dispose()


def _kill(proc: BaseProcess) -> None:
    assert proc.pid is not None and proc.is_alive(), "the worker ended before the kill"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert proc.exitcode == -signal.SIGKILL, f"exit code {proc.exitcode}"


def _depth(broker: Broker) -> int:
    return next(s for s in broker.queue_status() if s.name == TARGET_QUEUE).depth


def _assert_exactly_once_in_order(url: str, dialogs: int, messages: int) -> list[Any]:
    done = _rows(
        url,
        "SELECT reader, how, conversation_handle, message_sequence_number, body, receive_count "
        "FROM test_lease_done ORDER BY id",
    )
    seen = Counter(r.body for r in done)
    twice = sorted(b for b, n in seen.items() if n > 1)
    lost = sorted({f"{d}-{k}" for d in range(dialogs) for k in range(messages)} - set(seen))
    assert not twice, f"processed more than once: {twice}"
    assert not lost, f"never processed: {lost}"
    assert len(done) == dialogs * messages
    # Each conversation's messages were completed in order (by whoever held the group).
    by_handle: dict[uuid.UUID, list[int]] = defaultdict(list)
    for r in done:
        by_handle[r.conversation_handle].append(r.message_sequence_number)
    assert all(seqs == sorted(seqs) for seqs in by_handle.values()), by_handle
    return done


# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(60, func_only=True)
def test_a_killed_lease_holder_loses_nothing_and_duplicates_nothing(
    broker: Broker, pg_url: str, spawn: Spawner
) -> None:
    dialogs, messages, readers = 6, 5, 3
    _send_dialogs(broker, dialogs, messages)
    pipe, child_end = MP.Pipe(duplex=False)
    victim = spawn(lease_procs.lease_and_hang, pg_url, TARGET_QUEUE, 1.0, child_end)
    child_end.close()
    assert pipe.poll(30), "the lease holder reported nothing within 30 s"
    held: list[str] = pipe.recv()
    assert held == [f"0-{k}" for k in range(messages)], held
    workers = [
        spawn(
            lease_procs.lease_reader,
            pg_url,
            TARGET_QUEUE,
            r,
            dialogs * messages,
            lease_seconds=5.0,
            tops=(None, 1, 2),
            handler_seconds=0.02,
        )
        for r in range(readers)
    ]
    _kill(victim)  # mid-handler: the readers are already at work on the other groups
    _join_all(workers, timeout=45)

    done = _assert_exactly_once_in_order(pg_url, dialogs, messages)
    # The killed holder's messages came back after its lease expired: a second hand-out.
    counts = {r.body: r.receive_count for r in done}
    assert {counts[b] for b in held} == {2}, counts
    assert _depth(broker) == 0
    assert _rows(pg_url, "SELECT token FROM broker_lease") == []


@pytest.mark.timeout(60, func_only=True)
def test_two_readers_never_hold_one_group_at_once(
    broker: Broker, pg_url: str, spawn: Spawner
) -> None:
    dialogs, messages, readers = 4, 12, 3
    _send_dialogs(broker, dialogs, messages)
    workers = [
        spawn(
            lease_procs.lease_reader,
            pg_url,
            TARGET_QUEUE,
            r,
            dialogs * messages,
            lease_seconds=10.0,
            tops=(1, 2, 3),
            handler_seconds=0.03,
            receive_too=True,
        )
        for r in range(readers)
    ]
    _join_all(workers, timeout=50)

    _assert_exactly_once_in_order(pg_url, dialogs, messages)
    holds = _rows(
        pg_url,
        "SELECT reader, how, conversation_group_id, started, ended FROM test_lease_hold",
    )
    assert {h.how for h in holds} == {"lease", "receive"}, "both ways must have held groups"
    by_group: dict[uuid.UUID, list[Any]] = defaultdict(list)
    for h in holds:
        by_group[h.conversation_group_id].append(h)
    assert len(by_group) == dialogs
    overlaps = []
    for group, spans in by_group.items():
        spans.sort(key=lambda h: h.started)
        for a, b in itertools.pairwise(spans):
            if b.started < a.ended:
                overlaps.append((group, a, b))
    assert not overlaps, f"two readers held one group at once: {overlaps[:5]}"


@pytest.mark.timeout(30, func_only=True)
def test_complete_after_expiry_and_a_new_lease_changes_nothing(broker: Broker, pg_url: str) -> None:
    _send_dialogs(broker, 1, 3)
    other = Broker.connect(pg_url)
    try:
        first = broker.lease(TARGET_QUEUE, lease_seconds=0.3)
        assert first is not None
        time.sleep(0.4)
        assert other.run_due().leases_expired == 1
        second = other.lease(TARGET_QUEUE, lease_seconds=60)
        assert second is not None
        assert [m.queuing_order for m in second.messages] == [
            m.queuing_order for m in first.messages
        ]
        assert {m.receive_count for m in second.messages} == {2}
        reply_to = first.messages[0].conversation_handle
        with pytest.raises(LeaseExpired), broker.transaction() as tx:
            tx.send(reply_to, body="late")
            tx.complete(first.token)
        with pytest.raises(LeaseExpired):
            broker.release(first.token)
        with pytest.raises(LeaseExpired):
            broker.extend(first.token, 10)
        # Nothing changed: no reply, the second lease still holds all three messages.
        assert (
            _rows(
                pg_url,
                "SELECT count(*) AS n FROM broker_message m JOIN broker_queue q "
                f"ON q.queue_id = m.queue_id WHERE q.name = '{INIT_QUEUE}'",
            )[0].n
            == 0
        )
        left = _rows(pg_url, "SELECT lease_token FROM broker_message ORDER BY queuing_order")
        assert [r.lease_token for r in left] == [second.token] * 3
        with other.transaction() as tx:
            assert tx.complete(second.token) == 3
        assert _depth(broker) == 0
    finally:
        other.dispose()


@pytest.mark.timeout(30, func_only=True)
def test_a_lease_being_completed_is_not_expired_under_it(broker: Broker, pg_url: str) -> None:
    """Due work skips a lease whose row a completing transaction holds, even past its expiry;
    the transaction then commits and the messages go exactly once."""
    _send_dialogs(broker, 2, 2)
    other = Broker.connect(pg_url)
    try:
        lease = broker.lease(TARGET_QUEUE, lease_seconds=0.3)
        assert lease is not None
        time.sleep(0.4)
        reports: list[Any] = []
        with broker.transaction() as tx:
            assert tx.complete(lease.token) == 2
            # In a thread with a timeout: if due work waited for this transaction's locks, the
            # test must fail, not deadlock with itself.
            due = threading.Thread(target=lambda: reports.append(other.run_due()), daemon=True)
            due.start()
            due.join(10)
            assert not due.is_alive(), "due work waited for the completing transaction"
            assert reports[0].leases_expired == 0
            grabbed = other.lease(TARGET_QUEUE, lease_seconds=60)
            assert grabbed is not None, "the other group is free"
            assert grabbed.conversation_group_id != lease.conversation_group_id
        assert other.run_due().leases_expired == 0
        left = _rows(pg_url, "SELECT lease_token FROM broker_message")
        assert [r.lease_token for r in left] == [grabbed.token] * 2
    finally:
        other.dispose()


def _reap(broker: Broker, timeout: float = 15) -> int:
    """Run due work until it has counted a dead reader's receive (PostgreSQL sees the killed
    reader's backend go a moment after the kill); returns the rollbacks counted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counted = broker.run_due().rollbacks_counted
        if counted:
            return counted
        time.sleep(0.05)
    raise AssertionError(f"due work counted no dead reader within {timeout} s")


@pytest.mark.timeout(60, func_only=True)
def test_a_reader_killed_in_its_transaction_counts_a_receive(
    broker: Broker, pg_url: str, spawn: Spawner
) -> None:
    with broker.transaction() as tx:
        h = tx.begin_dialog(INIT_SERVICE, TARGET_SERVICE)
        tx.send(h, body={"n": 0})
        tx.send(h, body={"n": 1})
    pipe, child_end = MP.Pipe(duplex=False)
    reader = spawn(procs.hold_received, pg_url, TARGET_QUEUE, child_end)
    child_end.close()
    assert pipe.poll(30), "the reader reported nothing within 30 s"
    held = pipe.recv()
    assert [n for _, _, n in held] == [0, 1], held
    _kill(reader)
    assert _reap(broker) == 1
    assert next(s for s in broker.queue_status() if s.name == TARGET_QUEUE).rollback_count == 1
    with broker.transaction() as tx:
        got: list[Message] = tx.receive(TARGET_QUEUE)
    assert [(m.json(), m.receive_count) for m in got] == [({"n": 0}, 2), ({"n": 1}, 2)]
