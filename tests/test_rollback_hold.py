"""A failed attempt is counted before its group can be taken again, on both engines: a poller
racing each rollback never takes a held group, and the RECEIVE after a reader killed holding
messages counts that reader first.

A queue with ``retry_delay`` holds a conversation group after a failed attempt (its receiving
transaction rolled back): RECEIVE skips the group until the hold ends. The hold must be in place
before any other reader can take the group again, although the attempt is counted after the
rollback: on SQLite the rollback and its accounting keep the one write lock between them (see
``TransactionCore._after_rollback``); on PostgreSQL a RECEIVE that finds a reader of the queue
that ended without committing counts that attempt before it hands messages out
(``Receiving._hold``).

Real processes, no mocks. Every dialog is a conversation group of its own on the supplier's
queue and always has exactly one message there: ``"<dialog>:<n>"``. Pollers RECEIVE in a tight
loop and, in the same transaction, record what they took (a row of ``test_polled``) and SEND
the next message on the dialog (``n + 1``), then commit: so a group a poller takes stays in play
and the pollers race every rollback for as long as the test runs. One process, the failer,
RECEIVEs and rolls back at once, again and again; each rollback holds that group for longer
than the test lasts. A message ``<i>:<n>`` the failer rolled back must never be received by a
poller, nor any later message of the dialog (message ``n`` is there until a transaction that
took it commits, so a poller holding ``n`` or later received it after the failure).
"""

from __future__ import annotations

import multiprocessing
import signal
import sqlite3
import threading
import time
import uuid
from multiprocessing.connection import Connection as PipeEnd
from multiprocessing.synchronize import Event
from pathlib import Path

import procs
import pytest
from helpers import NOTE, SUPPLIER_QUEUE, begin, declare_pair, send
from sqlalchemy import create_engine, event, text
from sqlalchemy.exc import IntegrityError

from airflow_broker import Broker

MP = multiprocessing.get_context("spawn")

DLQ = "supplier_dead_letters"
#: dialogs, each a conversation group of its own on the supplier's queue
DIALOGS = 24
POLLERS = 2
#: longer than the test: a failed group stays held throughout
RETRY_DELAY = 120.0
#: the failer's pause between attempts (each rollback is raced all the same)
PAUSE = 0.05
#: the failer stops after this long even if some group never stayed held (the old bug)
FAILER_SECONDS = 20.0

_CREATE_POLLED = (
    "CREATE TABLE test_polled (poller INTEGER NOT NULL, dialog INTEGER NOT NULL, "
    "n INTEGER NOT NULL)"
)
_INSERT_POLLED = text("INSERT INTO test_polled (poller, dialog, n) VALUES (:poller, :dialog, :n)")


def _parse(body: bytes | None) -> tuple[int, int]:
    dialog, n = (body or b"").decode().split(":")
    return int(dialog), int(n)


def failer(url: str, go: Event, pipe: PipeEnd) -> None:
    """RECEIVE and roll back at once, until every dialog has failed once (or time runs out);
    report the ``(dialog, n)`` of each rolled-back message, in order. A short pause between
    attempts lets the pollers go round the groups that have not failed yet."""
    broker = Broker.connect(url)
    failed: list[tuple[int, int]] = []
    try:
        go.wait(60)
        deadline = time.monotonic() + FAILER_SECONDS
        while len({d for d, _ in failed}) < DIALOGS and time.monotonic() < deadline:
            tx = broker.transaction()
            try:
                got = tx.receive(SUPPLIER_QUEUE, wait_seconds=0.2)
            finally:
                tx.rollback()
            failed.extend(_parse(m.message_body) for m in got)
            time.sleep(PAUSE)
    finally:
        pipe.send(failed)
        broker.dispose()


def poller(url: str, poller_no: int, initiators: list[str], started: Event, stop: Event) -> None:
    """RECEIVE in a tight loop; record each message taken and send the dialog's next one, in
    the receiving transaction, and commit. ``started`` is set after the first one."""
    broker = Broker.connect(url)
    handles = [uuid.UUID(h) for h in initiators]
    first = True
    try:
        while not stop.is_set():
            with broker.transaction() as tx:
                for m in tx.receive(SUPPLIER_QUEUE):
                    dialog, n = _parse(m.message_body)
                    tx.connection.execute(
                        _INSERT_POLLED, {"poller": poller_no, "dialog": dialog, "n": n}
                    )
                    tx.send(handles[dialog], NOTE, f"{dialog}:{n + 1}".encode())
            if first:
                started.set()
                first = False
    finally:
        broker.dispose()


def declare_held_queue(broker: Broker) -> None:
    """The buyer/supplier pair; the supplier's queue holds a group after a failed attempt. With
    a dead-letter queue (which no group reaches here) rollbacks in a row never disable it."""
    declare_pair(broker)
    broker.create_queue(DLQ)
    broker.alter_queue(
        SUPPLIER_QUEUE, retry_delay=RETRY_DELAY, max_receives=50, dead_letter_queue=DLQ
    )


def race_rollbacks(url: str) -> None:
    broker = Broker.connect(url)
    try:
        declare_held_queue(broker)
        initiators = [begin(broker) for _ in range(DIALOGS)]
        for i, h in enumerate(initiators):
            send(broker, h, NOTE, f"{i}:0".encode())
        with broker.engine.begin() as conn:
            conn.execute(text(_CREATE_POLLED))
    finally:
        broker.dispose()

    go, stop = MP.Event(), MP.Event()
    started = [MP.Event() for _ in range(POLLERS)]
    receive_end, send_end = MP.Pipe(duplex=False)
    handles = [str(h) for h in initiators]
    procs = [MP.Process(target=failer, args=(url, go, send_end), daemon=True)]
    procs += [
        MP.Process(target=poller, args=(url, p, handles, started[p], stop), daemon=True)
        for p in range(POLLERS)
    ]
    for proc in procs:
        proc.start()
    try:
        for p, ready in enumerate(started):  # the failer starts once the pollers poll
            assert ready.wait(60), f"poller {p} never polled"
        go.set()
        assert receive_end.poll(FAILER_SECONDS + 60), "the failer never reported"
        failed: list[tuple[int, int]] = receive_end.recv()
        stop.set()
        for proc in procs:
            proc.join(30)
            assert proc.exitcode == 0, f"{proc.name} ended with {proc.exitcode}"
    finally:
        stop.set()
        for proc in procs:
            if proc.is_alive():
                proc.kill()

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            polled = [
                (int(r.dialog), int(r.n))
                for r in conn.execute(text("SELECT dialog, n FROM test_polled"))
            ]
    finally:
        engine.dispose()

    first_failure: dict[int, int] = {}
    for dialog, n in failed:
        first_failure.setdefault(dialog, n)
    taken_after = sorted(
        (dialog, n, first_failure[dialog])
        for dialog, n in polled
        if dialog in first_failure and n >= first_failure[dialog]
    )
    assert not taken_after, (
        f"{len(taken_after)} message(s) of a held group were received by a poller after the "
        f"group's failed attempt, as (dialog, n, n that failed): {taken_after[:10]}"
    )
    assert len(failed) == len(first_failure), f"a held group was taken again: {failed}"
    assert len(first_failure) == DIALOGS, f"only {len(first_failure)} groups failed"
    # The pollers raced the failer: they took messages of groups that had not failed yet.
    before = [(d, n) for d, n in polled if n < first_failure.get(d, n + 1)]
    assert len(before) >= DIALOGS, f"the pollers took only {len(before)} messages in all"


def test_a_poller_racing_each_rollback_never_takes_a_held_group_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    b = Broker.connect(url)
    b.migrate()
    b.dispose()
    race_rollbacks(url)


@pytest.mark.postgres
def test_a_poller_racing_each_rollback_never_takes_a_held_group_postgres(pg_url: str) -> None:
    race_rollbacks(pg_url)


@pytest.mark.parametrize("ending", ["rollback", "rollback_after_waiting", "failed_commit"])
def test_sqlite_keeps_the_write_lock_until_the_rollback_is_counted(
    tmp_path: Path, ending: str
) -> None:
    """The same in one process, step by step: from the moment a receiving transaction starts to
    roll back (or its COMMIT fails, here on a deferred foreign key) until its failed attempt
    is counted and its group held, no other writer can begin; then the group is held. Also
    after a RECEIVE that waited (it gave the write lock up while it waited, and took it again
    in a new transaction to take the message)."""
    path = tmp_path / "broker.db"
    broker = Broker.connect(f"sqlite:///{path}")
    outsider = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        broker.migrate()
        declare_held_queue(broker)
        with broker.engine.begin() as conn:
            conn.execute(text("CREATE TABLE test_parent (id INTEGER PRIMARY KEY)"))
            conn.execute(
                text(
                    "CREATE TABLE test_child (id INTEGER PRIMARY KEY, parent_id INTEGER "
                    "REFERENCES test_parent (id) DEFERRABLE INITIALLY DEFERRED)"
                )
            )
        h = begin(broker)
        later = threading.Timer(0.3, send, (broker, h, NOTE, b"0:0"))
        if ending == "rollback_after_waiting":
            later.start()
        else:
            send(broker, h, NOTE, b"0:0")
        could_begin: list[bool] = []

        def probe(*_args: object) -> None:
            """Before each statement of the ending: could another writer begin now?"""
            try:
                outsider.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError:
                could_begin.append(False)  # database is locked
            else:
                outsider.execute("ROLLBACK")
                could_begin.append(True)

        tx = broker.transaction()
        [m] = tx.receive(SUPPLIER_QUEUE, wait_seconds=10)
        if later.is_alive():
            later.join()
        if ending == "failed_commit":
            tx.connection.execute(text("INSERT INTO test_child VALUES (1, 42)"))  # no parent
        event.listen(broker.engine, "before_cursor_execute", probe)
        try:
            if ending != "failed_commit":
                tx.rollback()
            else:
                with pytest.raises(IntegrityError):
                    tx.commit()
        finally:
            event.remove(broker.engine, "before_cursor_execute", probe)
        assert tx.ended
        assert could_begin and not any(could_begin), could_begin
        # Counted once, and the group is held.
        rows = outsider.execute("SELECT receive_count FROM broker_message").fetchall()
        assert rows == [(1,)]
        held = outsider.execute(
            "SELECT held_until FROM broker_conversation_group WHERE conversation_group_id = ?",
            (m.conversation_group_id.hex,),
        ).fetchall()
        assert len(held) == 1 and held[0][0] is not None, held
        with broker.transaction() as tx2:
            assert tx2.receive(SUPPLIER_QUEUE) == []
        assert outsider.execute("SELECT count(*) FROM test_child").fetchone() == (0,)
    finally:
        outsider.close()
        broker.dispose()


@pytest.mark.timeout(120)
def test_the_next_receive_counts_a_reader_killed_as_receive_returned(broker_url: str) -> None:
    """A reader SIGKILLed the moment RECEIVE returns; the very next RECEIVE, with no due-work
    pass due, counts it before it claims and gets the message with that attempt counted
    (receive count 2), and no dead lease is left for the due-work pass. PostgreSQL: the lease
    write finds the dead reader; SQLite: under the write lock, its lease file's lock is free."""
    broker = Broker.connect(broker_url)
    try:
        declare_pair(broker)
        send(broker, begin(broker), NOTE, b"only")
        proc = multiprocessing.get_context("fork").Process(
            target=procs.receive_then_die, args=(broker_url, SUPPLIER_QUEUE)
        )
        proc.start()
        proc.join(60)
        assert proc.exitcode == -signal.SIGKILL, f"the reader ended with {proc.exitcode}"
        broker.next_due_work = time.monotonic() + 3600  # no due-work pass: RECEIVE counts
        with broker.transaction() as tx:
            got = tx.receive(SUPPLIER_QUEUE)
            assert [(m.message_body, m.receive_count) for m in got] == [(b"only", 2)]
        with broker.engine.connect() as conn:
            assert broker.adapter.dead_leases(conn) == []
    finally:
        broker.dispose()
