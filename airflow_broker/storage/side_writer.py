"""PostgreSQL: writes made outside the caller's transaction, sent without waiting for them.

A receiving transaction registers its lease (which messages it holds, and its server process)
on a connection of its own, so that the row is visible at once and survives the transaction:
if the transaction never commits, the row says what to count as a failed attempt. Waiting for
the server's answer to that INSERT was a round trip in every RECEIVE (0.15 ms of 0.75 on this
project's machine). :class:`SideWriter` sends the statement and goes on; the answer is read
before the next write, or when a rollback needs the rows to be there (:meth:`SideWriter.sync`).

What "sent" guarantees: the statement's bytes are in the kernel's socket buffer. A reader that
dies right after still has its lease written, because the server reads (and runs, in a
transaction of its own) what arrived before it sees the connection close; that is the same
guarantee as before, when the reader could die between its claim and the INSERT. The
connection is autocommit with ``synchronous_commit`` off, and the lease table is UNLOGGED:
nothing here needs to survive a server crash, which ends every open transaction anyway. A
write the server refuses is logged; it cannot fail the transaction that made it.

Behind a pooler in transaction mode (:mod:`~airflow_broker.storage.pooler`) each statement may
reach another server process: nothing is prepared (each goes as an unnamed statement of the
extended protocol, parsed with its values in one message) and no session setting is made
(``synchronous_commit`` would stay with a server process that others use next; the lease table
being UNLOGGED, its writes do not wait for the disk anyway). And each statement is waited for:
the pooler holds a statement until it has a server process for it, and drops it if its client
dies first, so bytes in the socket no longer mean the statement will run (a reader killed the
moment RECEIVE returned went uncounted about one time in three on two busy cores).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from airflow_broker.storage.direct import (
    COMMAND_OK,
    CONNECTION_OK,
    TUPLES_OK,
    flush,
    wait_ready,
)

log = logging.getLogger(__name__)


class SideWriter:
    """One autocommit connection, opened on first use and shared under a lock, whose
    statements are sent and not waited for.

    :param connect: opens a psycopg connection in autocommit mode (the adapter's, with the
        engine's credentials, TLS settings and role set-up).
    :param pooled: says whether a transaction-mode pooler is in the way (asked when connecting).
    """

    def __init__(self, connect: Callable[[], Any], pooled: Callable[[], bool] = bool) -> None:
        self._connect = connect
        self._pooled = pooled
        #: behind a pooler: statements go unnamed, nothing is set on the session
        self._unnamed = False
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pid = 0
        #: statements sent whose answers are not read yet
        self._pending = 0
        #: for each of them, whether its caller wants its answer (:meth:`answer`)
        self._wanted: deque[bool] = deque()
        #: the first row of the last wanted answer read (None: the server refused it, or the
        #: connection was lost)
        self._answer: tuple[bytes | None, ...] | None = None
        #: SQL -> the name it is prepared under on the current connection
        self._prepared: dict[str, bytes] = {}
        #: connections a forked child inherited: never used or closed here (that would talk
        #: over the parent's socket), only kept from the garbage collector
        self._inherited: list[Any] = []

    def send(self, sql: str, values: Sequence[bytes | None], *, wanted: bool = False) -> None:
        """Send ``sql`` (``$1``... for ``values``, each already in PostgreSQL's text format;
        None is NULL) to run in a transaction of its own. Each statement is prepared once per
        connection (the server's parse and plan were a quarter of a lease row's cost). The
        caller encodes the values: what does not change (a receive lease's server process) is
        encoded once, not on every RECEIVE.

        ``wanted``: the caller reads the statement's answer with :meth:`answer` (and may do
        other work first, while the server runs it)."""
        with self._lock:
            for attempt in (1, 2):
                try:
                    conn = self._connection()
                    if self._pending:
                        self._drain(conn)
                    params = list(values)  # psycopg 3.2's pgconn takes a list, not a tuple
                    if self._unnamed:
                        conn.pgconn.send_query_params(sql.encode(), params)
                    else:
                        name = self._prepared.get(sql)
                        if name is None:
                            name = self._prepare(conn, sql)
                        conn.pgconn.send_query_prepared(name, params)
                    flush(conn.pgconn)
                    self._pending += 1
                    self._wanted.append(wanted)
                    if wanted:
                        self._answer = None
                    if self._unnamed:
                        # A pooler reads a statement and then finds it a server: a client that
                        # dies before that loses it. Its answer is the proof it ran.
                        self._drain(conn)
                    return
                except Exception as exc:
                    # The server ended the connection (a restart, an administrator's
                    # pg_terminate_backend): once more on a fresh one.
                    self._discard()
                    if attempt == 2:
                        raise
                    log.warning("side connection lost (%s): connecting again", exc)

    def answer(self) -> tuple[bytes | None, ...] | None:
        """Wait for the statement last sent with ``wanted`` and return the first row of its
        answer, each value in PostgreSQL's text format; None if the server refused it or the
        connection was lost before it answered (whether it ran is then unknown)."""
        with self._lock:
            if self._conn is not None and self._pending:
                try:
                    self._drain(self._conn)
                except Exception as exc:
                    log.warning("side connection lost before it answered: %s", exc)
                    self._discard()
            found, self._answer = self._answer, None
            return found

    def sync(self) -> None:
        """Wait until everything sent so far has run."""
        with self._lock:
            if self._conn is None or self._pending == 0:
                return
            pending = self._pending
            try:
                self._drain(self._conn)
            except Exception as exc:
                log.warning("side connection lost with %d write(s) unanswered: %s", pending, exc)
                self._discard()

    def close(self) -> None:
        """Read the last answers and close the connection."""
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                with contextlib.suppress(Exception):
                    self._drain(self._conn)
            self._discard()

    # -- inside the lock -----------------------------------------------------------------------
    def _connection(self) -> Any:
        if self._conn is not None and self._pid != os.getpid():
            self._inherited.append(self._conn)
            self._conn, self._pending = None, 0
            self._wanted.clear()
            self._prepared.clear()
        if self._conn is None or self._conn.closed:
            self._unnamed = self._pooled()
            conn = self._connect()
            if not self._unnamed:
                conn.execute("SET synchronous_commit = off")
            self._conn, self._pid, self._pending = conn, os.getpid(), 0
            self._wanted.clear()
            self._prepared.clear()
        return self._conn

    def _prepare(self, conn: Any, sql: str) -> bytes:
        """Prepare ``sql`` on ``conn`` (nothing is pending: the caller drained it)."""
        name = f"broker_side_{len(self._prepared)}".encode()
        result = conn.pgconn.prepare(name, sql.encode())
        if result.status != COMMAND_OK:
            message = (result.error_message or b"").decode(errors="replace").strip()
            raise ConnectionError(f"cannot prepare {sql!r}: {message}")
        self._prepared[sql] = name
        return name

    def _drain(self, conn: Any) -> None:
        """Read the answer of every statement sent; log the ones the server refused."""
        pgconn = conn.pgconn
        # The answers are usually in the socket already (the server ran the statement while the
        # caller worked): read them without waiting on the socket first.
        pgconn.consume_input()
        while self._pending:
            wait_ready(pgconn)
            result = pgconn.get_result()
            if result is None:  # the end of one statement's answers
                self._pending -= 1
                self._wanted.popleft()
                if pgconn.status != CONNECTION_OK:
                    raise ConnectionError(pgconn.get_error_message().decode(errors="replace"))
                continue
            if result.status == TUPLES_OK:
                if self._wanted[0] and result.ntuples:
                    self._answer = tuple(result.get_value(0, i) for i in range(result.nfields))
            elif result.status != COMMAND_OK:
                message = (result.error_message or b"").decode(errors="replace").strip()
                log.error("a write outside the transaction failed: %s", message)
            elif result.command_status == b"INSERT 0 0":
                log.error("a receive lease was not written: its key is taken")

    def _discard(self) -> None:
        conn, self._conn, self._pending = self._conn, None, 0
        self._wanted.clear()
        self._prepared.clear()
        if conn is None:
            return
        if self._pid != os.getpid():
            self._inherited.append(conn)
            return
        with contextlib.suppress(Exception):
            conn.close()


__all__ = ["SideWriter"]
