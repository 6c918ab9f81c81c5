"""Worker functions for the PostgreSQL lease tests with several processes (``test_leases_pg.py``).

Each runs in a child process of the ``forkserver`` context, so each is a module-level function
whose arguments pickle; a child opens its own :class:`~airflow_broker.Broker`. What a worker
processed is written to ``test_lease_done`` **in the transaction that completes the lease** (or
commits the RECEIVE), through that transaction's own connection: a row exists if and only if the
messages really went, so a message processed twice leaves two rows and a lost one none.

Times compared across processes come from ``time.monotonic()`` (one clock for the machine).
"""

from __future__ import annotations

import random
import time
from multiprocessing.connection import Connection as PipeEnd
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection

from airflow_broker import Broker, LeaseExpired, Message

TEST_TABLES_DDL = (
    """
    CREATE TABLE IF NOT EXISTS test_lease_done (
        id bigserial PRIMARY KEY,
        reader integer NOT NULL,
        how text NOT NULL,
        conversation_group_id uuid NOT NULL,
        conversation_handle uuid NOT NULL,
        message_sequence_number bigint NOT NULL,
        body text NOT NULL,
        receive_count integer NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS test_lease_hold (
        id bigserial PRIMARY KEY,
        reader integer NOT NULL,
        how text NOT NULL,
        conversation_group_id uuid NOT NULL,
        started double precision NOT NULL,
        ended double precision NOT NULL
    )
    """,
)

_INSERT_DONE = text(
    "INSERT INTO test_lease_done (reader, how, conversation_group_id, conversation_handle, "
    "message_sequence_number, body, receive_count) VALUES (:reader, :how, :group, :handle, "
    ":seq, :body, :count)"
)
_INSERT_HOLD = text(
    "INSERT INTO test_lease_hold (reader, how, conversation_group_id, started, ended) "
    "VALUES (:reader, :how, :group, :started, :ended)"
)


def create_test_tables(url: str) -> None:
    engine = create_engine(url, pool_size=1, max_overflow=0)
    try:
        with engine.begin() as conn:
            for ddl in TEST_TABLES_DDL:
                conn.execute(text(ddl))
    finally:
        engine.dispose()


def _done_count(conn: Connection) -> int:
    return int(conn.execute(text("SELECT count(*) FROM test_lease_done")).scalar_one())


def _record(conn: Connection, reader: int, how: str, messages: list[Message]) -> None:
    conn.execute(
        _INSERT_DONE,
        [
            {
                "reader": reader,
                "how": how,
                "group": m.conversation_group_id,
                "handle": m.conversation_handle,
                "seq": m.message_sequence_number,
                "body": m.text() or "",
                "count": m.receive_count,
            }
            for m in messages
        ],
    )


def _hold(conn: Connection, reader: int, how: str, group: Any, started: float) -> None:
    conn.execute(
        _INSERT_HOLD,
        {
            "reader": reader,
            "how": how,
            "group": group,
            "started": started,
            "ended": time.monotonic(),
        },
    )


def lease_and_hang(url: str, queue: str, lease_seconds: float, pipe: PipeEnd) -> None:
    """Lease from ``queue``, report the lease's bodies through ``pipe``, then sleep in the
    handler until the parent kills this process (SIGKILL)."""
    broker = Broker.connect(url)
    lease = None
    deadline = time.monotonic() + 30
    while lease is None and time.monotonic() < deadline:
        lease = broker.lease(queue, lease_seconds=lease_seconds, wait_seconds=1)
    pipe.send([] if lease is None else [m.text() for m in lease.messages])
    time.sleep(300 if lease is not None else 0)


def lease_reader(
    url: str,
    queue: str,
    reader: int,
    expected: int,
    *,
    lease_seconds: float,
    tops: tuple[int | None, ...] = (None,),
    handler_seconds: float = 0.0,
    receive_too: bool = False,
    deadline_seconds: float = 40.0,
) -> None:
    """Process ``queue`` until ``test_lease_done`` holds ``expected`` rows: lease, run the
    "handler" (a sleep), then complete the lease in a transaction that records the messages.

    With ``receive_too``, every other round RECEIVEs in a transaction instead (sleeping inside
    it as long). Each hold is recorded as ``(group, started, ended)``: ``started`` after the
    messages were handed out, ``ended`` before the lease completes or the transaction commits,
    so the recorded span lies inside the real one. Raises when the deadline passes first.
    """
    broker = Broker.connect(url)
    counter = create_engine(url, pool_size=1, max_overflow=0)
    rng = random.Random(reader)
    deadline = time.monotonic() + deadline_seconds
    expired = 0
    try:
        for round_no in range(1_000_000):
            if time.monotonic() > deadline:
                with counter.connect() as conn:
                    got = _done_count(conn)
                raise TimeoutError(
                    f"reader {reader}: {got} of {expected} messages done after "
                    f"{deadline_seconds} s ({expired} leases expired under it)"
                )
            top = rng.choice(tops)
            if receive_too and round_no % 2 == 1:
                with broker.transaction() as tx:
                    messages = tx.receive(queue, top=top, wait_seconds=0.2)
                    if messages:
                        started = time.monotonic()
                        time.sleep(handler_seconds)
                        conn = tx.connection
                        _hold(conn, reader, "receive", messages[0].conversation_group_id, started)
                        _record(conn, reader, "receive", messages)
            else:
                lease = broker.lease(queue, lease_seconds=lease_seconds, top=top, wait_seconds=0.2)
                messages = [] if lease is None else lease.messages
                if lease is not None:
                    started = time.monotonic()
                    time.sleep(handler_seconds)
                    try:
                        with broker.transaction() as tx:
                            conn = tx.connection
                            _hold(conn, reader, "lease", lease.conversation_group_id, started)
                            _record(conn, reader, "lease", messages)
                            tx.complete(lease.token)
                    except LeaseExpired:
                        expired += 1  # its messages went back; someone processes them again
            if not messages:
                with counter.connect() as conn:
                    if _done_count(conn) >= expected:
                        return
    finally:
        counter.dispose()
        broker.dispose()
