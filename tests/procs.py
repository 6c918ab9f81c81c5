"""Worker functions for the PostgreSQL multi-process tests (``test_concurrency_pg.py``).

Every function here runs in a child process started from a fresh interpreter (the ``forkserver``
context; ``spawn`` works too), so each is a module-level function whose arguments pickle (URLs,
plans, ``multiprocessing`` events and pipe ends). A child opens its own
:class:`~airflow_broker.Broker`: nothing is shared with the parent but the database.

What a reader received is written to ``test_received`` **in the receiving transaction**, through
that transaction's own connection, so the rows commit (or vanish) together with the RECEIVE: a
killed or rolled-back reader cannot leave a row for a message it did not really take, and a
message taken twice leaves two rows.

Timestamps that are compared across processes come from ``time.monotonic()``: CLOCK_MONOTONIC is
one clock for the whole machine on Linux (and macOS), and unlike the wall clock it never steps.
"""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection as PipeEnd
from multiprocessing.synchronize import Event
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, Engine

from airflow_broker import Broker, Message, Transaction

#: Tables the tests own, in the broker's database (named ``test_*``: nothing of the broker's).
TEST_TABLES_DDL = (
    """
    CREATE TABLE IF NOT EXISTS test_received (
        id bigserial PRIMARY KEY,
        reader integer NOT NULL,
        receive_no integer NOT NULL,
        conversation_handle uuid NOT NULL,
        conversation_group_id uuid NOT NULL,
        message_sequence_number bigint NOT NULL,
        n integer,
        src text,
        received_at double precision NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS test_sent (
        round integer PRIMARY KEY,
        committed_at double precision NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS test_hold (
        id bigserial PRIMARY KEY,
        reader integer NOT NULL,
        conversation_group_id uuid NOT NULL,
        started double precision NOT NULL,
        ended double precision NOT NULL,
        messages integer NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS test_empty_receive (
        id bigserial PRIMARY KEY,
        reader integer NOT NULL,
        groups_ready integer NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS test_reader_stats (
        reader integer PRIMARY KEY,
        receives integer NOT NULL,
        empty_receives integer NOT NULL,
        rolled_back integer NOT NULL,
        slowest_receive double precision NOT NULL,
        first_receive double precision NOT NULL,
        finished double precision NOT NULL
    )
    """,
)

_INSERT_RECEIVED = text(
    "INSERT INTO test_received (reader, receive_no, conversation_handle, conversation_group_id, "
    "message_sequence_number, n, src, received_at) VALUES (:reader, :receive_no, "
    ":conversation_handle, :conversation_group_id, :message_sequence_number, :n, :src, "
    ":received_at)"
)
_INSERT_HOLD = text(
    "INSERT INTO test_hold (reader, conversation_group_id, started, ended, messages) "
    "VALUES (:reader, :group, :started, :ended, :messages)"
)


def create_test_tables(url: str) -> None:
    """Create the ``test_*`` tables in the broker database at ``url``."""
    engine = _plain_engine(url)
    try:
        with engine.begin() as conn:
            for ddl in TEST_TABLES_DDL:
                conn.execute(text(ddl))
    finally:
        engine.dispose()


def tx_connection(tx: Transaction) -> Connection:
    """The SQLAlchemy connection a broker transaction runs on (its writes commit with it)."""
    conn = tx.connection
    assert isinstance(conn, Connection), f"Transaction.connection is {conn!r}"
    return conn


def body_n(message: Message) -> int | None:
    """The ``n`` the tests put in every body (``{"n": 3}``), None for a body-less message."""
    body = message.json()
    return body.get("n") if isinstance(body, dict) else None


def body_src(message: Message) -> str | None:
    """Who sent the message, when the body says (``{"n": 3, "src": "sender"}``)."""
    body = message.json()
    return body.get("src") if isinstance(body, dict) else None


class _Rollback(Exception):
    """Raised inside a transaction on purpose, to roll it back."""


@dataclass(frozen=True, slots=True)
class ReaderPlan:
    """What one reader process does.

    :param expected: the reader stops once ``test_received`` holds this many rows.
    :param tops: RECEIVE's ``top`` for each transaction is picked from these at random.
    :param hold_seconds: how long a reader sleeps while it holds a group (between RECEIVE and
        COMMIT), to widen the window in which a second reader could wrongly get the same group.
    :param rollback_rate: the share of receiving transactions rolled back on purpose.
    :param quiet_receives: once ``done`` was set before a RECEIVE, this many empty RECEIVEs in a
        row also stop the reader (a lost message must end the test, not hang it).
    """

    url: str
    queue: str
    reader: int
    expected: int
    tops: tuple[int | None, ...] = (None,)
    wait_seconds: float = 0.0
    hold_seconds: float = 0.0
    rollback_rate: float = 0.0
    idle_sleep: float = 0.005
    quiet_receives: int = 3
    deadline_seconds: float = 60.0


def run_reader(plan: ReaderPlan, done: Event | None = None) -> None:
    """Drain ``plan.queue``, recording every message in the receiving transaction.

    Stops when ``test_received`` holds ``plan.expected`` rows, or, with ``done``, after
    ``plan.quiet_receives`` empty RECEIVEs that all started after ``done`` was set. Raises (the
    process exits non-zero) when the deadline passes first.
    """
    broker = Broker.connect(plan.url)
    counter = _plain_engine(plan.url)
    rng = random.Random(plan.reader)
    deadline = time.monotonic() + plan.deadline_seconds
    receives = empty = rolled_back = quiet = 0
    slowest = 0.0
    first = time.monotonic()
    try:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"reader {plan.reader}: {_count(counter)} of {plan.expected} messages "
                    f"recorded after {plan.deadline_seconds} s"
                )
            done_before = done is not None and done.is_set()
            receives += 1
            messages: list[Message] = []
            try:
                with broker.transaction() as tx:
                    asked = time.monotonic()
                    messages = tx.receive(
                        plan.queue, top=rng.choice(plan.tops), wait_seconds=plan.wait_seconds
                    )
                    took = time.monotonic() - asked
                    if messages or not plan.wait_seconds:
                        slowest = max(slowest, took)
                    if messages:
                        started = time.monotonic()
                        _record(tx_connection(tx), plan.reader, receives, messages)
                        if plan.hold_seconds:
                            time.sleep(plan.hold_seconds)
                        ended = time.monotonic()
                        _record_hold(tx_connection(tx), plan.reader, messages, started, ended)
                        if rng.random() < plan.rollback_rate:
                            raise _Rollback
            except _Rollback:
                rolled_back += 1
                continue
            if messages:
                quiet = 0
                # now and then, so that a reader fed duplicates forever still stops
                if receives % 10 == 0 and _count(counter) >= plan.expected:
                    break
                continue
            empty += 1
            quiet = quiet + 1 if done_before else 0
            if quiet >= plan.quiet_receives or _count(counter) >= plan.expected:
                break
            time.sleep(plan.idle_sleep)
        with counter.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO test_reader_stats (reader, receives, empty_receives, rolled_back, "
                    "slowest_receive, first_receive, finished) VALUES (:r, :n, :e, :b, :s, :f, :d)"
                ),
                {
                    "r": plan.reader,
                    "n": receives,
                    "e": empty,
                    "b": rolled_back,
                    "s": slowest,
                    "f": first,
                    "d": time.monotonic(),
                },
            )
    finally:
        counter.dispose()
        broker.dispose()


def run_greedy_reader(
    url: str,
    queue: str,
    reader: int,
    readers: int,
    top: int | None = None,
    deadline_seconds: float = 60.0,
) -> None:
    """RECEIVE without waiting and commit at once, until the queue is empty; nothing is sent
    meanwhile, so the set of conversation groups with ready messages only shrinks.

    After every empty RECEIVE it counts those groups and writes the count to
    ``test_empty_receive``. At most ``readers - 1`` other readers hold a group at any moment, so
    a count of ``readers`` or more means that an unlocked group with ready messages existed all
    through the RECEIVE that came back empty. Stops when the count is 0.
    """
    broker = Broker.connect(url)
    counter = _plain_engine(url)
    deadline = time.monotonic() + deadline_seconds
    receive_no = 0
    try:
        while time.monotonic() < deadline:
            receive_no += 1
            with broker.transaction() as tx:
                messages = tx.receive(queue, top=top)
                if messages:
                    _record(tx_connection(tx), reader, receive_no, messages)
            if messages:
                continue
            with counter.begin() as conn:
                ready = int(
                    conn.execute(
                        text(
                            "SELECT count(DISTINCT m.conversation_group_id) FROM broker_message m "
                            "JOIN broker_queue q ON q.queue_id = m.queue_id "
                            "WHERE q.name = :q AND m.status = 1"
                        ),
                        {"q": queue},
                    ).scalar_one()
                )
                conn.execute(
                    text("INSERT INTO test_empty_receive (reader, groups_ready) VALUES (:r, :g)"),
                    {"r": reader, "g": ready},
                )
            if ready == 0:
                return
            time.sleep(0.005)
        raise TimeoutError(f"reader {reader}: the queue was not empty after {deadline_seconds} s")
    finally:
        counter.dispose()
        broker.dispose()


def run_sender(
    url: str,
    from_service: str,
    to_service: str,
    dialogs: int,
    messages: int,
    go: Event,
    done: Event,
    pace_timeout: float = 20.0,
) -> None:
    """Once ``go`` is set, begin ``dialogs`` dialogs and send each ``messages`` bodies
    ``{"n": k, "src": "sender"}``, message ``k`` of every dialog in transaction ``k``.

    The sender keeps pace with the readers: it sends round ``k + 1`` only once a reader has
    committed a message of round ``k``, so every dialog's later messages arrive while readers are
    working on its earlier ones, whatever the machine's speed. Each round's commit time goes to
    ``test_sent``.
    """
    broker = Broker.connect(url)
    engine = _plain_engine(url)
    try:
        if not go.wait(60):
            raise TimeoutError("sender: nobody said go within 60 s")
        handles: list[uuid.UUID] = []
        for k in range(messages):
            with broker.transaction() as tx:
                if k == 0:
                    handles = [tx.begin_dialog(from_service, to_service) for _ in range(dialogs)]
                tx.send(handles, body={"n": k, "src": "sender"})
            committed = time.monotonic()
            with engine.begin() as conn:
                conn.execute(
                    text("INSERT INTO test_sent (round, committed_at) VALUES (:k, :t)"),
                    {"k": k, "t": committed},
                )
            deadline = time.monotonic() + pace_timeout
            while k + 1 < messages and time.monotonic() < deadline:
                with engine.connect() as conn:
                    seen = conn.execute(
                        text("SELECT 1 FROM test_received WHERE src = 'sender' AND n = :k LIMIT 1"),
                        {"k": k},
                    ).first()
                if seen:
                    break
                time.sleep(0.01)
        done.set()
    finally:
        engine.dispose()
        broker.dispose()


def hold_received(url: str, queue: str, pipe: PipeEnd, deadline_seconds: float = 30.0) -> None:
    """RECEIVE from ``queue``, report what was received through ``pipe``, then never commit.

    The parent kills this process with SIGKILL while it sleeps inside the transaction. The report
    is ``[(conversation_handle, message_sequence_number, n), ...]``; an empty list means nothing
    arrived before the deadline. All RECEIVEs happen in one transaction, so this process never
    commits a receiving transaction (which would reset the queue's poison count).
    """
    broker = Broker.connect(url)
    deadline = time.monotonic() + deadline_seconds
    with broker.transaction() as tx:
        messages: list[Message] = []
        while not messages and time.monotonic() < deadline:
            messages = tx.receive(queue, wait_seconds=1)
        pipe.send([(m.conversation_handle, m.message_sequence_number, body_n(m)) for m in messages])
        time.sleep(300 if messages else 0)


def timed_receive(url: str, queue: str, rounds: int, wait_seconds: float, pipe: PipeEnd) -> None:
    """``rounds`` times: report ``("ready",)``, then RECEIVE waiting up to ``wait_seconds``, then
    report ``("done", t0, t1, bodies)``.

    ``t0``/``t1`` are ``time.monotonic()`` just before the RECEIVE and just after it returned.
    The connection and the catalog are warmed up by one RECEIVE beforehand.
    """
    broker = Broker.connect(url)
    try:
        with broker.transaction() as tx:
            tx.receive(queue)
        for _ in range(rounds):
            with broker.transaction() as tx:
                pipe.send(("ready",))
                t0 = time.monotonic()
                messages = tx.receive(queue, wait_seconds=wait_seconds)
                t1 = time.monotonic()
            pipe.send(("done", t0, t1, [m.json() for m in messages]))
    finally:
        broker.dispose()


def _plain_engine(url: str) -> Engine:
    return create_engine(url, pool_size=1, max_overflow=0)


def _count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM test_received")).scalar_one())


def _record(conn: Connection, reader: int, receive_no: int, messages: list[Message]) -> None:
    now = time.monotonic()
    rows: list[dict[str, Any]] = [
        {
            "reader": reader,
            "receive_no": receive_no,
            "conversation_handle": m.conversation_handle,
            "conversation_group_id": m.conversation_group_id,
            "message_sequence_number": m.message_sequence_number,
            "n": body_n(m),
            "src": body_src(m),
            "received_at": now,
        }
        for m in messages
    ]
    conn.execute(_INSERT_RECEIVED, rows)


def _record_hold(
    conn: Connection, reader: int, messages: list[Message], started: float, ended: float
) -> None:
    conn.execute(
        _INSERT_HOLD,
        {
            "reader": reader,
            "group": messages[0].conversation_group_id,
            "started": started,
            "ended": ended,
            "messages": len(messages),
        },
    )


def loop_then_die(url: str, queue: str) -> None:
    """A reader's loop: RECEIVE one message, record it in the same transaction, then COMMIT it
    together with the next RECEIVE (``commit_and_receive``) and SIGKILL this process the moment
    that returns: the first message is handled once, the second one was taken by a transaction
    that never commits. The parent checks both."""
    broker = Broker.connect(url)
    tx = broker.transaction()
    first = tx.receive(queue, top=1)
    if not first:
        os._exit(3)  # nothing to receive: the parent reports it
    tx.connection.execute(
        text("INSERT INTO handled (body) VALUES (:b)"), {"b": first[0].message_body}
    )
    _nxt, second = tx.commit_and_receive(queue, top=1)
    if second:
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(4)  # the second message was not there: the parent reports it


def receive_then_die(url: str, queue: str) -> None:
    """RECEIVE from ``queue`` and SIGKILL this process the moment RECEIVE returns: no report, no
    pause, no cleanup. The receive lease was sent to the server without waiting for its answer
    (storage.side_writer); the parent checks that the failed attempt is counted all the same."""
    broker = Broker.connect(url)
    with broker.transaction() as tx:
        messages = tx.receive(queue)
        if messages:
            os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)  # nothing to receive: the parent reports it
