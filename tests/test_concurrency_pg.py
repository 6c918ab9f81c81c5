"""Concurrency and crash claims, proved with real OS processes on PostgreSQL.

Each reader is a separate OS process with its own connections (the two crash tests also run on
SQLite, the rest on PostgreSQL); the worker functions are in
``tests/procs.py``. Every reader records what it received in the receiving transaction itself
(``test_received``), so the records commit exactly when the RECEIVE does: the assertions below
read only committed truth.

- many readers drain many dialogs: every message exactly once, each dialog in order;
- two readers never hold one conversation group at the same time;
- a RECEIVE comes back empty only when every group with ready messages is locked;
- a reader killed with SIGKILL while holding messages loses none of them;
- five killed readers in a row disable the queue (poison handling), four do not;
- a waiting RECEIVE wakes as soon as another process commits a SEND.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import procs
import pytest
from sqlalchemy import create_engine, text

from airflow_broker import Broker, QueueDisabled
from airflow_broker.messaging.objects import QueueStatus

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

# Workers are forked from a fresh forkserver process, never from pytest itself: like "spawn",
# they inherit no connection, thread or lock of the parent. The server imports the main module,
# the workers and the PostgreSQL driver once, so a worker is reading in a fraction of a second
# instead of paying seconds of imports (which on 2 cores also staggered the readers' starts).
MP = multiprocessing.get_context("forkserver")
MP.set_forkserver_preload(
    ["__main__", "procs", "psycopg", "sqlalchemy.dialects.postgresql.psycopg"]
)
INIT_SERVICE = "//test/Initiator"
TARGET_SERVICE = "//test/Target"
INIT_QUEUE = "test_initiator_q"
TARGET_QUEUE = "test_target_q"

Spawner = Callable[..., BaseProcess]


@pytest.fixture
def spawn() -> Iterator[Spawner]:
    """Start worker processes; any still alive at teardown are killed (by their own pid)."""
    started: list[BaseProcess] = []

    def _spawn(target: Callable[..., None], *args: Any) -> BaseProcess:
        proc = MP.Process(target=target, args=args, daemon=True)
        proc.start()
        started.append(proc)
        return proc

    yield _spawn
    for proc in started:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)


def _join_all(processes: list[BaseProcess], timeout: float) -> None:
    """Join every process within ``timeout`` seconds overall; fail on a hang or a crash."""
    deadline = time.monotonic() + timeout
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [p.name for p in processes if p.is_alive()]
    assert not hung, f"worker processes still running after {timeout} s: {hung}"
    failed = {p.name: p.exitcode for p in processes if p.exitcode != 0}
    assert not failed, f"worker processes failed (exit codes; tracebacks above): {failed}"


def _setup_services(broker: Broker, *, poison_message_handling: bool = True) -> None:
    broker.create_queue(INIT_QUEUE)
    broker.create_queue(TARGET_QUEUE, poison_message_handling=poison_message_handling)
    broker.create_service(INIT_SERVICE, queue=INIT_QUEUE, contracts=["DEFAULT"])
    broker.create_service(TARGET_SERVICE, queue=TARGET_QUEUE, contracts=["DEFAULT"])


def _send_dialogs(broker: Broker, dialogs: int, messages: int) -> list[uuid.UUID]:
    """Begin ``dialogs`` dialogs to the target and send each ``messages`` bodies ``{"n": k}``."""
    with broker.transaction() as tx:
        handles = [tx.begin_dialog(INIT_SERVICE, TARGET_SERVICE) for _ in range(dialogs)]
        for k in range(messages):
            tx.send(handles, body={"n": k})
    return handles


def _status(broker: Broker, queue: str) -> QueueStatus:
    return next(s for s in broker.queue_status() if s.name == queue)


def _received_rows(url: str) -> list[Any]:
    engine = create_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            return list(
                conn.execute(
                    text(
                        "SELECT reader, receive_no, conversation_handle, conversation_group_id, "
                        "message_sequence_number, n FROM test_received ORDER BY id"
                    )
                )
            )
    finally:
        engine.dispose()


def _query(url: str, sql: str) -> list[Any]:
    engine = create_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(sql)))
    finally:
        engine.dispose()


def _assert_exactly_once_in_order(rows: list[Any], *, dialogs: int, messages: int) -> None:
    """Every (handle, sequence) once; per dialog bodies 0..messages-1 and sequences ascending."""
    keys = [(r.conversation_handle, r.message_sequence_number) for r in rows]
    dupes = {k for k, n in Counter(keys).items() if n > 1}
    assert not dupes, f"messages received more than once: {sorted(dupes)[:10]}"
    assert len(rows) == dialogs * messages, (
        f"{len(rows)} messages received, {dialogs * messages} sent"
    )
    by_dialog: dict[uuid.UUID, list[Any]] = defaultdict(list)
    for r in rows:  # rows are in receive order (test_received.id, taken inside the hold)
        by_dialog[r.conversation_handle].append(r)
    assert len(by_dialog) == dialogs
    for handle, seq in by_dialog.items():
        ns = [r.n for r in seq]
        assert ns == list(range(messages)), f"dialog {handle} received bodies in order {ns}"
        numbers = [r.message_sequence_number for r in seq]
        assert all(a < b for a, b in itertools.pairwise(numbers)), (
            f"dialog {handle} received sequence numbers {numbers}"
        )
    groups_per_receive: dict[tuple[int, int], set[uuid.UUID]] = defaultdict(set)
    for r in rows:
        groups_per_receive[(r.reader, r.receive_no)].add(r.conversation_group_id)
    mixed = {k: v for k, v in groups_per_receive.items() if len(v) > 1}
    assert not mixed, f"RECEIVEs that returned several conversation groups: {mixed}"


@pytest.mark.timeout(150)
def test_four_readers_drain_120_dialogs_exactly_once_in_order(pg_url: str, spawn: Spawner) -> None:
    """4 readers, 120 dialogs x 10 messages: half sent up front, half while the readers read
    (the sending process keeps pace with them, see :func:`procs.run_sender`).

    Readers take a random ``top`` each time and roll back one transaction in ten (poison
    handling is off on this queue), so messages also go back to the queue and are taken again.
    """
    dialogs, messages, readers = 120, 10, 4
    broker = Broker.connect(pg_url)
    try:
        _setup_services(broker, poison_message_handling=False)
        procs.create_test_tables(pg_url)
        _send_dialogs(broker, dialogs // 2, messages)

        go, done = MP.Event(), MP.Event()
        t0 = time.monotonic()
        sender = spawn(
            procs.run_sender,
            pg_url,
            INIT_SERVICE,
            TARGET_SERVICE,
            dialogs // 2,
            messages,
            go,
            done,
        )
        workers = [
            spawn(
                procs.run_reader,
                procs.ReaderPlan(
                    url=pg_url,
                    queue=TARGET_QUEUE,
                    reader=i,
                    expected=dialogs * messages,
                    tops=(None, 1, 2, 3, 5),
                    wait_seconds=0.5,
                    rollback_rate=0.1,
                    deadline_seconds=90,
                ),
                done,
            )
            for i in range(readers)
        ]
        # the sender starts once the readers are really reading, so its SENDs land mid-drain
        deadline = time.monotonic() + 60
        while not _query(pg_url, "SELECT 1 FROM test_received LIMIT 1"):
            assert time.monotonic() < deadline, "no reader received anything within 60 s"
            assert all(w.is_alive() or w.exitcode == 0 for w in workers), "a reader died"
            time.sleep(0.05)
        go.set()
        _join_all([sender, *workers], timeout=100)
        elapsed = time.monotonic() - t0

        rows = _received_rows(pg_url)
        _assert_exactly_once_in_order(rows, dialogs=dialogs, messages=messages)
        assert _status(broker, TARGET_QUEUE).depth == 0
        stats = _query(
            pg_url,
            "SELECT reader, receives, empty_receives, rolled_back "
            "FROM test_reader_stats ORDER BY reader",
        )
        print(f"\ndrained {len(rows)} messages with {readers} readers in {elapsed:.1f} s: {stats}")
        assert len({r.reader for r in rows}) >= 2, "only one reader ever received anything"
        assert sum(s.rolled_back for s in stats) > 0, "no transaction was rolled back"
        # the scenario really happened: each round of the sender's dialogs was being received
        # before the next round was sent
        interleaved = _query(
            pg_url,
            "SELECT s.round FROM test_sent s WHERE NOT EXISTS (SELECT 1 FROM test_received r "
            "WHERE r.src = 'sender' AND r.n = s.round - 1 AND r.received_at < s.committed_at) "
            "AND s.round > 0",
        )
        assert not interleaved, f"rounds sent before the previous one was received: {interleaved}"
    finally:
        broker.dispose()


@pytest.mark.timeout(120)
def test_two_readers_never_hold_one_conversation_group_at_once(pg_url: str, spawn: Spawner) -> None:
    """4 readers on 2 shared groups (3 dialogs each) plus 3 single-dialog groups.

    The messages come back to the initiator's queue, whose groups hold several dialogs (BEGIN
    DIALOG ... related_conversation). Readers hold each group for 40 ms with ``top=2``; once the
    single-dialog groups are drained there are 2 groups for 4 readers, so readers contend.
    """
    shared_groups, per_group, singles, messages, readers = 2, 3, 3, 8, 4
    broker = Broker.connect(pg_url)
    try:
        _setup_services(broker)
        procs.create_test_tables(pg_url)
        with broker.transaction() as tx:
            initiators: list[uuid.UUID] = []
            for _ in range(shared_groups):
                first = tx.begin_dialog(INIT_SERVICE, TARGET_SERVICE)
                initiators.append(first)
                initiators += [
                    tx.begin_dialog(INIT_SERVICE, TARGET_SERVICE, related_conversation=first)
                    for _ in range(per_group - 1)
                ]
            initiators += [tx.begin_dialog(INIT_SERVICE, TARGET_SERVICE) for _ in range(singles)]
            tx.send(initiators, body={"hello": True})
            groups = {tx.conversation(h).conversation_group_id for h in initiators}
        assert len(groups) == shared_groups + singles, "related_conversation did not join groups"
        # the target learns its handles from the first messages, then every dialog talks back
        targets: list[uuid.UUID] = []
        deadline = time.monotonic() + 10
        while len(targets) < len(initiators):
            assert time.monotonic() < deadline, f"{len(targets)} first messages arrived"
            with broker.transaction() as tx:
                targets += [m.conversation_handle for m in tx.receive(TARGET_QUEUE)]
        with broker.transaction() as tx:
            for k in range(messages):
                tx.send(targets, body={"n": k})
        dialogs = len(initiators)

        t0 = time.monotonic()
        workers = [
            spawn(
                procs.run_reader,
                procs.ReaderPlan(
                    url=pg_url,
                    queue=INIT_QUEUE,
                    reader=i,
                    expected=dialogs * messages,
                    tops=(2,),
                    hold_seconds=0.04,
                    idle_sleep=0.002,
                    deadline_seconds=60,
                ),
            )
            for i in range(readers)
        ]
        _join_all(workers, timeout=80)
        elapsed = time.monotonic() - t0

        holds = _query(
            pg_url,
            "SELECT conversation_group_id, reader, started, ended FROM test_hold ORDER BY started",
        )
        by_group: dict[uuid.UUID, list[Any]] = defaultdict(list)
        for h in holds:
            by_group[h.conversation_group_id].append(h)
        overlaps = [
            (group, (a.reader, a.started, a.ended), (b.reader, b.started, b.ended))
            for group, hs in by_group.items()
            for a, b in itertools.pairwise(hs)
            if b.started < a.ended
        ]
        assert not overlaps, f"a conversation group was held by two readers at once: {overlaps}"
        assert set(by_group) == groups

        rows = _received_rows(pg_url)
        _assert_exactly_once_in_order(rows, dialogs=dialogs, messages=messages)
        stats = _query(pg_url, "SELECT * FROM test_reader_stats ORDER BY reader")
        readers_per_group = {g: len({h.reader for h in hs}) for g, hs in by_group.items()}
        print(
            f"\n{len(holds)} holds in {elapsed:.1f} s; readers per group {readers_per_group}; "
            f"stats {stats}"
        )
        # contention was real: readers found every ready group locked and came back empty
        assert sum(s.empty_receives for s in stats) > 0
        assert max(readers_per_group.values()) >= 2, "no group ever changed hands"
    finally:
        broker.dispose()


@pytest.mark.timeout(120)
def test_receive_is_never_empty_while_an_unlocked_group_is_ready(
    pg_url: str, spawn: Spawner
) -> None:
    """RECEIVE without WAITFOR takes "the highest-priority unlocked group with messages": it
    returns nothing only when every group with ready messages is locked by someone else.

    4 readers drain 200 single-dialog groups one message at a time, committing at once. After
    each empty RECEIVE the reader counts the groups that still have ready messages; with no
    SENDs and no rollbacks that set only shrinks, and at most 3 other readers hold a group, so a
    count of 4 or more proves an unlocked group was ready all through the empty RECEIVE. (A
    reader that stops at its first empty RECEIVE, as activated readers do, would leave those
    messages behind.)
    """
    dialogs, messages, readers = 200, 3, 4
    broker = Broker.connect(pg_url)
    try:
        _setup_services(broker)
        procs.create_test_tables(pg_url)
        _send_dialogs(broker, dialogs, messages)
        workers = [
            spawn(procs.run_greedy_reader, pg_url, TARGET_QUEUE, i, readers, 1)
            for i in range(readers)
        ]
        _join_all(workers, timeout=80)
        rows = _received_rows(pg_url)
        _assert_exactly_once_in_order(rows, dialogs=dialogs, messages=messages)
        empties = [
            r.groups_ready for r in _query(pg_url, "SELECT groups_ready FROM test_empty_receive")
        ]
        spurious = [g for g in empties if g >= readers]
        print(f"\n{len(rows)} messages, {len(empties)} empty RECEIVEs, spurious: {spurious}")
        assert not spurious, (
            f"{len(spurious)} RECEIVEs came back empty while at least {readers} groups (so at "
            f"least one unlocked group) had ready messages; groups ready after each: {spurious}"
        )
    finally:
        broker.dispose()


def _hold_and_kill(
    spawn: Spawner, url: str, queue: str, timeout: float = 30
) -> list[tuple[uuid.UUID, int, int | None]]:
    """A child receives from ``queue`` and reports it; SIGKILL it inside its transaction."""
    parent_end, child_end = MP.Pipe(duplex=False)
    proc = spawn(procs.hold_received, url, queue, child_end)
    child_end.close()
    assert parent_end.poll(timeout), f"the holding reader reported nothing within {timeout} s"
    held: list[tuple[uuid.UUID, int, int | None]] = parent_end.recv()
    assert held, "the holding reader received nothing"
    assert proc.pid is not None and proc.is_alive(), "the holding reader ended before the kill"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert proc.exitcode == -signal.SIGKILL, f"exit code {proc.exitcode}"
    parent_end.close()
    return held


def _drain(broker: Broker, queue: str, expected: int, timeout: float = 20) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < expected and time.monotonic() < deadline:
        with broker.transaction() as tx:
            got += tx.receive(queue, wait_seconds=1)
    return got


@pytest.mark.timeout(90)
def test_reader_killed_while_holding_messages_loses_nothing(
    broker_url: str, spawn: Spawner
) -> None:
    """On both engines: a killed reader's transaction rolls back and its messages return."""
    pg_url = broker_url
    dialogs, messages = 6, 5
    broker = Broker.connect(pg_url)
    try:
        _setup_services(broker)
        _send_dialogs(broker, dialogs, messages)

        held = _hold_and_kill(spawn, pg_url, TARGET_QUEUE)
        held_handles = {h for h, _, _ in held}
        assert len(held_handles) == 1, "a RECEIVE returned messages of several dialogs"
        assert [n for _, _, n in held] == list(range(messages))

        got = _drain(broker, TARGET_QUEUE, dialogs * messages)
        keys = [(m.conversation_handle, m.message_sequence_number) for m in got]
        assert len(keys) == len(set(keys)), "a message was received twice"
        assert len(got) == dialogs * messages, f"{len(got)} of {dialogs * messages} came back"
        assert {(h, s) for h, s, _ in held} <= set(keys), "the killed reader's messages are lost"
        by_dialog: dict[uuid.UUID, list[int | None]] = defaultdict(list)
        for m in got:
            by_dialog[m.conversation_handle].append(procs.body_n(m))
        assert all(ns == list(range(messages)) for ns in by_dialog.values()), by_dialog
        assert _status(broker, TARGET_QUEUE).depth == 0
    finally:
        broker.dispose()


def _wait_for_status(
    broker: Broker, queue: str, ok: Callable[[QueueStatus], bool], timeout: float = 15
) -> QueueStatus:
    """Run the broker's due work until ``ok(status)`` (a killed reader's backend may linger)."""
    deadline = time.monotonic() + timeout
    while True:
        broker.run_due()
        status = _status(broker, queue)
        if ok(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


def _counted(kills: int) -> Callable[[QueueStatus], bool]:
    def ok(status: QueueStatus) -> bool:
        return status.rollback_count >= kills

    return ok


@pytest.mark.timeout(120)
def test_five_killed_readers_disable_the_queue_four_do_not(broker_url: str, spawn: Spawner) -> None:
    """On both engines: PostgreSQL notices the dead reader's backend is gone, SQLite that its
    lease file's lock was released."""
    pg_url = broker_url
    broker = Broker.connect(pg_url)
    try:
        _setup_services(broker)
        _send_dialogs(broker, 1, 3)
        poison = None
        for kill in range(1, 6):
            held = _hold_and_kill(spawn, pg_url, TARGET_QUEUE)
            assert poison is None or held == poison, "the same messages come back each time"
            poison = held
            if kill < 5:
                status = _wait_for_status(broker, TARGET_QUEUE, _counted(kill))
                assert status.rollback_count == kill, f"after {kill} kills: {status}"
                assert status.status, f"the queue was disabled after {kill} kills: {status}"
                assert not [e for e in broker.events() if e.event == "queue_disabled"]
            else:
                status = _wait_for_status(broker, TARGET_QUEUE, lambda s: not s.status)
                assert not status.status, f"five killed readers left the queue enabled: {status}"

        events = [e for e in broker.events() if e.event == "queue_disabled"]
        assert [e.object_name for e in events] == [TARGET_QUEUE]
        with pytest.raises(QueueDisabled), broker.transaction() as tx:
            tx.receive(TARGET_QUEUE)
        assert _status(broker, TARGET_QUEUE).depth == 3, "messages of a poisoned queue are kept"

        broker.alter_queue(TARGET_QUEUE, status=True)
        got = _drain(broker, TARGET_QUEUE, 3)
        assert [procs.body_n(m) for m in got] == [0, 1, 2]
    finally:
        broker.dispose()


#: Delays between the reader starting to wait and the SEND, spread over half a second so that a
#: RECEIVE that polls (every 0.5 s or slower) instead of waking is late in at least one round.
SEND_DELAYS = (0.6, 0.75, 0.9)
#: How soon after the SEND's commit the waiting RECEIVE must have returned.
WAKE_WITHIN = 0.25


@pytest.mark.timeout(60)
def test_waiting_receive_wakes_when_another_process_commits_a_send(
    pg_url: str, spawn: Spawner
) -> None:
    broker = Broker.connect(pg_url)
    try:
        _setup_services(broker)
        with broker.transaction() as tx:
            handle = tx.begin_dialog(INIT_SERVICE, TARGET_SERVICE)
        parent_end, child_end = MP.Pipe(duplex=False)
        proc = spawn(procs.timed_receive, pg_url, TARGET_QUEUE, len(SEND_DELAYS), 10.0, child_end)
        child_end.close()
        latencies: list[float] = []
        for n, delay in enumerate(SEND_DELAYS):
            assert parent_end.poll(30), "the waiting reader never got ready"
            assert parent_end.recv() == ("ready",)
            time.sleep(delay)
            before_send = time.monotonic()
            with broker.transaction() as tx:
                tx.send(handle, body={"n": n})
            committed = time.monotonic()

            assert parent_end.poll(15), "the waiting RECEIVE did not return"
            tag, t0, t1, bodies = parent_end.recv()
            assert tag == "done"
            assert bodies == [{"n": n}], f"round {n}: the waiting RECEIVE returned {bodies}"
            assert t1 > before_send, f"round {n}: the RECEIVE returned before the SEND started"
            assert t1 - t0 >= delay - 0.05, f"round {n}: the RECEIVE waited only {t1 - t0:.3f} s"
            latencies.append(t1 - committed)
        _join_all([proc], timeout=10)
        parent_end.close()
        print(f"\nRECEIVE woke {[round(x * 1000) for x in latencies]} ms after each commit")
        assert max(latencies) < WAKE_WITHIN, (
            f"a waiting RECEIVE woke {max(latencies):.3f} s after the SEND committed "
            f"(all rounds: {latencies})"
        )
    finally:
        broker.dispose()


@pytest.mark.timeout(120)
def test_both_sides_sending_on_one_dialog_at_once_never_deadlock(pg_url: str) -> None:
    """The two endpoints of a dialog send to each other at the same time, each side in its own
    transactions held open for a moment: SEND locks only the sender's endpoint, so the two can
    never wait on each other (PostgreSQL would abort one with a deadlock error)."""
    import threading

    broker = Broker.connect(pg_url)
    try:
        with broker.definitions() as d:
            d.create_queue(INIT_QUEUE)
            d.create_queue(TARGET_QUEUE)
            d.create_service(INIT_SERVICE, queue=INIT_QUEUE)
            d.create_service(TARGET_SERVICE, queue=TARGET_QUEUE, contracts=["DEFAULT"])
        with broker.transaction() as tx:
            init_h = tx.begin_dialog(INIT_SERVICE, TARGET_SERVICE)
            tx.send(init_h, body="hello")
        with broker.transaction() as tx:
            (first,) = tx.receive(TARGET_QUEUE)
        target_h = first.conversation_handle
        rounds = 60
        errors: list[BaseException] = []
        start = threading.Barrier(2)

        def side(handle: uuid.UUID) -> None:
            try:
                start.wait()
                for i in range(rounds):
                    with broker.transaction() as tx:
                        tx.send(handle, body=str(i))
                        time.sleep(0.005)  # hold the lock while the other side sends
            except BaseException as exc:  # pragma: no cover - the assertion shows it
                errors.append(exc)

        threads = [threading.Thread(target=side, args=(h,)) for h in (init_h, target_h)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert not errors, errors
        for queue, expected in ((TARGET_QUEUE, rounds), (INIT_QUEUE, rounds)):
            with broker.transaction() as tx:
                bodies = [m.text() for m in tx.receive(queue)]
            assert bodies == [str(i) for i in range(expected)], queue
        with broker.transaction() as tx:
            assert tx.conversation(init_h).receive_sequence == rounds
            assert tx.conversation(target_h).receive_sequence == rounds + 1
    finally:
        broker.dispose()
