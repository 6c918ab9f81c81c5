"""storage.direct and storage.side_writer against a real PostgreSQL: the hot statements sent
through libpq in one round trip, and the receive lease written without waiting.

What they must keep from the SQLAlchemy path they replace: every value reaches the server as it
was, errors are the DBAPIError subclasses SQLAlchemy raises, a broken or interrupted connection
is invalidated and never reused, a server that keeps no prepared statements (a transaction-mode
pooler) still gets its statements, and a reader that dies the moment RECEIVE returns still has
its failed attempt counted.
"""

from __future__ import annotations

import json
import multiprocessing
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import procs
import pytest
import sqlalchemy.exc
from helpers import (
    NOTE,
    SUPPLIER_QUEUE,
    begin,
    declare_pair,
    drain,
    receive,
    rollbacks_after_reaping,
    send,
)
from sqlalchemy import text

from airflow_broker import Broker
from airflow_broker.storage import direct

MP = multiprocessing.get_context("forkserver")


@pytest.fixture
def observed() -> Iterator[list[bytes]]:
    """The queries the direct path sends while the test runs."""
    seen: list[bytes] = []
    before = direct.observer
    direct.observer = lambda query, _seconds: seen.append(query)
    yield seen
    direct.observer = before


def _select(conn: Any, sql_type: str, value: Any) -> Any:
    rows = direct.execute(conn, direct.Prepared("SELECT $1", [sql_type]), [value])
    return rows[0][0]


ROUND_TRIPS = [
    ("text", "plain"),
    ("text", "it's 'quoted'"),
    ("text", "back\\slash and \\x41"),
    ("text", "ünïcødé ✓ \u2028"),
    ("text", ""),
    ("text", None),
    ("bytea", b"\x00\x01\xfe\xff'\\"),
    ("bytea", b""),
    ("bigint", 0),
    ("bigint", -(2**63)),
    ("bigint", 2**63 - 1),
    ("boolean", True),
    ("boolean", False),
    ("uuid", uuid.UUID("00000000-0000-0000-0000-000000000001")),
    ("uuid[]", [uuid.uuid4(), uuid.uuid4()]),
    ("timestamptz", datetime(2026, 11, 26, 7, 30, 1, 123456, tzinfo=UTC)),
]


@pytest.mark.parametrize("conforming", ["on", "off"])
def test_values_reach_the_server_as_they_were(pg_broker: Broker, conforming: str) -> None:
    with pg_broker.engine.connect() as conn:
        conn.execute(text(f"SET standard_conforming_strings = {conforming}"))
        for sql_type, value in ROUND_TRIPS:
            assert _select(conn, sql_type, value) == value, (sql_type, value)
        other_zone = datetime(2026, 11, 26, 9, 0, tzinfo=timezone(timedelta(hours=2)))
        assert _select(conn, "timestamptz", other_zone) == other_zone
        conn.rollback()


def test_values_reach_the_server_as_they_were_as_parameters_of_a_committed_statement(
    pg_broker: Broker, observed: list[bytes]
) -> None:
    """execute_committed runs a statement prepared on the connection in the extended
    protocol, its values as parameters (bytea binary): the same values come back."""
    fairy = pg_broker.engine.raw_connection()
    try:
        for sql_type, value in ROUND_TRIPS:
            echo = direct.Prepared("SELECT $1", [sql_type])
            for _ in range(2):  # prepared (simple query), then a parameter
                rows = direct.execute_committed(fairy, pg_broker.engine, echo, [value])
                assert rows == [(value,)], (sql_type, value)
        other_zone = datetime(2026, 11, 26, 9, 0, tzinfo=timezone(timedelta(hours=2)))
        echo = direct.Prepared("SELECT $1", ["timestamptz"])
        assert direct.execute_committed(fairy, pg_broker.engine, echo, [other_zone]) == [
            (other_zone,)
        ]
        with pytest.raises(ValueError, match="naive"):
            direct.execute_committed(fairy, pg_broker.engine, echo, [datetime(2026, 1, 1)])
        assert fairy.driver_connection.pgconn.transaction_status == 0  # PQTRANS_IDLE
    finally:
        fairy.close()
    # Every run but the first of each statement (one per SQL type) took the parameters.
    extended = [q for q in observed if q.endswith(b"(extended protocol, autocommit)")]
    assert len(extended) == 2 * len(ROUND_TRIPS) + 1 - len({t for t, _ in ROUND_TRIPS})


def test_a_naive_datetime_or_an_unknown_type_is_refused(pg_broker: Broker) -> None:
    with pg_broker.engine.connect() as conn:
        with pytest.raises(ValueError, match="naive"):
            _select(conn, "timestamptz", datetime(2026, 1, 1))
        with pytest.raises(TypeError, match="float"):
            _select(conn, "float8", 1.5)


def test_errors_are_the_dbapi_errors_sqlalchemy_raises(
    pg_broker: Broker, observed: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    divide = direct.Prepared("SELECT 1 / $1", ["integer"])
    with pg_broker.engine.connect() as conn:
        with pytest.raises(sqlalchemy.exc.DataError) as caught:
            direct.execute(conn, divide, [0])
        assert caught.value.orig.sqlstate == "22012"
        assert not caught.value.connection_invalidated
        conn.rollback()
        # The statement prepared in the failed transaction is still there, and used as such:
        # preparing it again would fail as if a pooler had changed the server process.
        assert direct.execute(conn, divide, [2]) == [(0,)]
        conn.commit()
    assert observed[-1].startswith(b"BEGIN;EXECUTE ")
    assert "prepared statements do not last" not in caplog.text


def test_the_statement_begins_the_transaction_it_runs_in(
    pg_broker: Broker, observed: list[bytes]
) -> None:
    one = direct.Prepared("SELECT $1::int + 1", ["integer"])
    with pg_broker.engine.connect() as conn:
        assert direct.execute(conn, one, [1]) == [(2,)]
        assert conn.in_transaction()
        status = conn.connection.driver_connection.pgconn.transaction_status
        assert status == 2  # PQTRANS_INTRANS: the server is inside the BEGIN
        assert direct.execute(conn, one, [2]) == [(3,)]
        conn.commit()
    first, second = observed
    assert first.startswith(b"PREPARE ") and b";BEGIN;EXECUTE " in first
    assert second.startswith(b"EXECUTE ")


def test_a_killed_connection_is_invalidated_and_not_reused(pg_broker: Broker) -> None:
    one = direct.Prepared("SELECT $1::int", ["integer"])
    with pg_broker.engine.connect() as conn:
        direct.execute(conn, one, [1])
        pid = conn.connection.driver_connection.info.backend_pid
        conn.commit()
        with pg_broker.engine.connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            other.commit()
        time.sleep(0.2)
        with pytest.raises(sqlalchemy.exc.OperationalError) as caught:
            direct.execute(conn, one, [2])
        assert caught.value.connection_invalidated
        assert conn.invalidated
    with pg_broker.engine.connect() as conn:
        assert direct.execute(conn, one, [3]) == [(3,)]
        assert conn.connection.driver_connection.info.backend_pid != pid


class Interrupted(Exception):
    pass


def test_an_interrupted_statement_invalidates_its_connection(pg_broker: Broker) -> None:
    """A signal (an Airflow task's timeout) interrupts the wait for the answer."""
    sleep = direct.Prepared("SELECT pg_sleep($1)", ["integer"])

    def interrupt(_signum: int, _frame: Any) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with pg_broker.engine.connect() as conn:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            started = time.monotonic()
            with pytest.raises(Interrupted):
                direct.execute(conn, sleep, [30])
            assert time.monotonic() - started < 5
            assert conn.invalidated
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with pg_broker.engine.connect() as conn:
        assert direct.execute(conn, direct.Prepared("SELECT $1::int", ["integer"]), [4]) == [(4,)]


def test_a_server_that_keeps_no_prepared_statements_gets_them_whole(
    pg_broker: Broker, observed: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    """A transaction-mode pooler (PgBouncer) hands the next transaction another server process,
    where the statement this connection prepared does not exist; DEALLOCATE ALL does the same
    to one server process."""
    one = direct.Prepared("SELECT $1::int * 10", ["integer"])
    with pg_broker.engine.connect() as conn:
        assert direct.execute(conn, one, [1]) == [(10,)]
        conn.commit()
        conn.exec_driver_sql("DEALLOCATE ALL")
        conn.commit()
        assert direct.execute(conn, one, [2]) == [(20,)]
        conn.commit()
        assert direct.execute(conn, one, [3]) == [(30,)]
        conn.commit()
    assert "prepared statements do not last between transactions" in caplog.text
    # Prepared; then refused (missing) and sent again whole; and whole from then on.
    verbs = [q.split(b" ", 1)[0] for q in observed]
    assert verbs == [b"PREPARE", b"BEGIN;EXECUTE", b"BEGIN;SELECT", b"BEGIN;SELECT"]
    assert observed[-1] == b"BEGIN;SELECT CAST(3 AS integer)::int * 10"


def test_large_bodies_take_the_extended_protocol(pg_broker: Broker, observed: list[bytes]) -> None:
    declare_pair(pg_broker)
    h = begin(pg_broker)
    small, large = b"s" * 100, bytes(range(256)) * (direct.MAX_LITERAL_BODY // 256 + 1)
    send(pg_broker, h, NOTE, small)

    def sends() -> int:
        return sum(b"broker_send_one" in q or b"EXECUTE " in q for q in observed)

    assert sends() == 1
    send(pg_broker, h, NOTE, large)
    assert sends() == 1, "a body over MAX_LITERAL_BODY went as a hex literal"
    assert [m.message_body for m in receive(pg_broker, SUPPLIER_QUEUE)] == [small, large]


@pytest.mark.timeout(120)
def test_a_reader_killed_as_receive_returns_has_its_attempt_counted(pg_url: str) -> None:
    """The lease row is sent without waiting for the server's answer: SIGKILL right after
    RECEIVE returns (no pause for the row to land) must still count a failed attempt."""
    broker = Broker.connect(pg_url)
    try:
        declare_pair(broker)
        h = begin(broker)
        send(broker, h, NOTE, b"1")
        kills = 3
        for kill in range(1, kills + 1):
            proc = MP.Process(target=procs.receive_then_die, args=(pg_url, SUPPLIER_QUEUE))
            proc.start()
            proc.join(60)
            assert proc.exitcode == -signal.SIGKILL, f"the reader ended with {proc.exitcode}"
            counted = rollbacks_after_reaping(broker, SUPPLIER_QUEUE, kill)
            assert counted == kill, f"after {kill} killed reader(s): {counted} counted"
        (m,) = receive(broker, SUPPLIER_QUEUE)
        # receive_count counts this hand-out too: three failed ones before it.
        assert m.message_body == b"1" and m.receive_count == kills + 1
    finally:
        broker.dispose()


def test_the_receive_lease_row_names_the_messages_and_the_server_process(pg_url: str) -> None:
    """The lease row's values go to the server already in text form (encoded once per
    connection, or directly): what lands is what a reaper reads back, the queuing orders
    taken as a JSON array (a second RECEIVE of the queue in the same transaction adds its own)
    and the reader's server process as pg_stat_activity shows it."""
    broker = Broker.connect(pg_url)
    try:
        declare_pair(broker)
        h = begin(broker)
        send(broker, h, NOTE, b"1", b"2", b"3", b"4")
        with broker.engine.connect() as conn:
            waiting = (
                conn.execute(
                    text("SELECT queuing_order FROM broker_message ORDER BY queuing_order")
                )
                .scalars()
                .all()
            )
        with broker.transaction() as tx:
            taken = tx.receive(SUPPLIER_QUEUE, top=3)
            taken += tx.receive(SUPPLIER_QUEUE, top=1)  # the lease's held list grows
            pid, started = tx.connection.execute(
                text("SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()")
            ).one()
            broker.adapter._side.sync()  # the row was sent without waiting
            with broker.engine.connect() as other:
                row = other.execute(
                    text("SELECT queue_id, pid, backend_start, held FROM broker_receive_lease")
                ).one()
            queue_id = tx.connection.execute(
                text("SELECT queue_id FROM broker_queue WHERE name = :n"), {"n": SUPPLIER_QUEUE}
            ).scalar_one()
        assert [m.message_body for m in taken] == [b"1", b"2", b"3", b"4"]
        assert (row.queue_id, row.pid, row.backend_start) == (queue_id, pid, started)
        assert len(waiting) == 4 and json.loads(row.held) == waiting
    finally:
        broker.dispose()


def test_a_broker_transaction_commits_through_libpq(
    pg_broker: Broker, observed: list[bytes]
) -> None:
    declare_pair(pg_broker)
    h = begin(pg_broker)
    observed.clear()
    with pg_broker.transaction() as tx:
        tx.send(h, NOTE, b"x")
        conn = tx.connection
    assert observed[-1] == b"COMMIT"
    assert not conn.in_transaction()
    assert [m.message_body for m in receive(pg_broker, SUPPLIER_QUEUE)] == [b"x"]
    # A transaction that failed inside commits the usual way: nothing of it stays.
    with pg_broker.transaction() as tx:
        tx.send(h, NOTE, b"y")
        with pytest.raises(sqlalchemy.exc.DataError):
            direct.execute(tx.connection, direct.Prepared("SELECT 1 / $1", ["integer"]), [0])
    assert receive(pg_broker, SUPPLIER_QUEUE) == []


# -- execute_committed: a whole transaction on a pooled connection (Broker.send) ----------------
def test_a_committed_statement_is_one_query_and_leaves_the_connection_idle(
    pg_broker: Broker, observed: list[bytes]
) -> None:
    one = direct.Prepared("SELECT $1::int + 100", ["integer"])
    for value in (1, 2):
        fairy = pg_broker.engine.raw_connection()
        try:
            assert direct.execute_committed(fairy, pg_broker.engine, one, [value]) == [
                (100 + value,)
            ]
            assert fairy.driver_connection.pgconn.transaction_status == 0  # PQTRANS_IDLE
        finally:
            fairy.close()
    first, second = observed
    assert first.startswith(b"PREPARE ") and first.endswith(b";COMMIT")
    # Prepared: the statement alone, its value a parameter, committed by the server.
    assert second == b"EXECUTE " + one.name.encode() + b" (extended protocol, autocommit)"


def _inserting(broker: Broker, table: str, column: str) -> direct.Prepared:
    """A new table of one column ``n`` (``column``: its type and checks) and a statement that
    inserts ``$1`` into it and returns it."""
    with broker.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {table} (n {column})"))
    return direct.Prepared(
        f"WITH i AS (INSERT INTO {table} VALUES ($1) RETURNING n) SELECT n FROM i", ["integer"]
    )


def test_a_committed_statement_on_a_connection_inside_a_transaction_still_commits(
    pg_broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """The pool never hands out a connection inside a transaction; if one came, the statement
    must not run there in the extended protocol, whose Sync would leave it uncommitted. It
    takes the simple query, without preparing again what is prepared already."""
    insert = _inserting(pg_broker, "committed_inside", "int")
    fairy = pg_broker.engine.raw_connection()
    try:
        assert direct.execute_committed(fairy, pg_broker.engine, insert, [1]) == [(1,)]
        fairy.driver_connection.pgconn.exec_(b"BEGIN")
        assert direct.execute_committed(fairy, pg_broker.engine, insert, [2]) == [(2,)]
        assert fairy.driver_connection.pgconn.transaction_status == 0  # PQTRANS_IDLE
    finally:
        fairy.close()
    assert "prepared statements do not last" not in caplog.text
    with pg_broker.engine.connect() as conn:
        assert conn.execute(text("SELECT n FROM committed_inside ORDER BY n")).scalars().all() == [
            1,
            2,
        ]


def test_a_committed_statement_that_fails_is_rolled_back_and_raised(pg_broker: Broker) -> None:
    """The error SQLAlchemy would raise; nothing of the transaction stays, and the connection
    goes back to the pool clean (the next one on it works)."""
    insert = _inserting(pg_broker, "committed_probe", "int CHECK (n > 0)")
    fairy = pg_broker.engine.raw_connection()
    try:
        # First in the simple query that prepares the statement; then, prepared, in the
        # extended protocol, where the server rolls it back.
        for bad, good in ((-1, 5), (-2, 6)):
            with pytest.raises(sqlalchemy.exc.IntegrityError) as caught:
                direct.execute_committed(fairy, pg_broker.engine, insert, [bad])
            assert caught.value.orig.sqlstate == "23514"
            assert not caught.value.connection_invalidated
            assert fairy.driver_connection.pgconn.transaction_status == 0
            assert direct.execute_committed(fairy, pg_broker.engine, insert, [good]) == [(good,)]
    finally:
        fairy.close()
    with pg_broker.engine.connect() as conn:
        assert conn.execute(text("SELECT n FROM committed_probe ORDER BY n")).scalars().all() == [
            5,
            6,
        ]


def test_a_committed_statement_on_a_killed_connection_invalidates_it(pg_broker: Broker) -> None:
    one = direct.Prepared("SELECT $1::int", ["integer"])
    fairy = pg_broker.engine.raw_connection()
    try:
        pid = fairy.driver_connection.info.backend_pid
        with pg_broker.engine.connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            other.commit()
        time.sleep(0.2)
        with pytest.raises(sqlalchemy.exc.OperationalError) as caught:
            direct.execute_committed(fairy, pg_broker.engine, one, [1])
        assert caught.value.connection_invalidated
    finally:
        fairy.close()
    fairy = pg_broker.engine.raw_connection()
    try:
        assert fairy.driver_connection.info.backend_pid != pid
        assert direct.execute_committed(fairy, pg_broker.engine, one, [2]) == [(2,)]
    finally:
        fairy.close()


def test_broker_send_survives_a_server_that_keeps_no_prepared_statements(
    pg_broker: Broker, observed: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    declare_pair(pg_broker)
    h = begin(pg_broker)
    send(pg_broker, h, NOTE, b"first")  # the far endpoint exists from here on
    pg_broker.send(h, NOTE, b"a")
    with pg_broker.engine.connect() as conn:  # the pool's one connection, as a pooler would
        conn.exec_driver_sql("DEALLOCATE ALL")
        conn.commit()
    pg_broker.send(h, NOTE, b"b")
    pg_broker.send(h, NOTE, b"c")
    assert "prepared statements do not last between transactions" in caplog.text
    assert [m.message_body for m in receive(pg_broker, SUPPLIER_QUEUE)] == [
        b"first",
        b"a",
        b"b",
        b"c",
    ]


def test_a_first_send_that_takes_the_usual_way_leaves_its_statement_prepared(
    pg_broker: Broker, observed: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    """Broker.send on a dialog's first message: the fast path refuses (no far endpoint yet) in
    the query that prepared its statement; the next Broker.send uses that statement."""
    declare_pair(pg_broker)
    send(pg_broker, begin(pg_broker), NOTE, b"other")  # this process knows the message type
    h = begin(pg_broker)
    observed.clear()
    pg_broker.send(h, NOTE, b"first")
    pg_broker.send(h, NOTE, b"second")
    assert "prepared statements do not last" not in caplog.text
    committed = [q for q in observed if q.endswith((b";COMMIT", b"autocommit)"))]
    assert len(committed) == 2
    assert committed[0].startswith(b"PREPARE ")  # refused: the dialog's first message
    assert committed[1].startswith(b"EXECUTE ") and committed[1].endswith(b"autocommit)")
    got = [m.message_body for m in drain(pg_broker, SUPPLIER_QUEUE)]
    assert sorted(got) == [b"first", b"other", b"second"]
