"""What differs between PostgreSQL and SQLite, behind one small interface.

The broker's logic (``transaction.py``, ``delivery.py``...) is written once against SQLAlchemy
Core (hot statements are PostgreSQL-specific text in ``queries.py`` and ``delivery.py``). Three
things cannot be: how a transaction begins, how a waiting RECEIVE learns that another process
committed a SEND, and how a reader that died holding messages is noticed (poison handling counts
it as a rollback). Each engine has an adapter here.

PostgreSQL
    Waits LISTEN on a per-queue channel; a trigger on ``broker_message`` NOTIFYs it whenever ready
    messages are written (migration 0002), so a waiter wakes within milliseconds of the commit.
    A receiving transaction's RECEIVE statement takes a transaction-level advisory lock on its
    lease's key; the lease row (queue, messages held) is written through a side connection
    (``storage.side_writer``) before RECEIVE hands the messages out, and deleted by the
    transaction's COMMIT. A lease whose lock is free belongs to a reader that ended without
    committing; a RECEIVE of its queue counts it before handing anything out
    (:mod:`~airflow_broker.storage.receive_leases`). The lock goes with the transaction,
    however it ends, through a pooler too.

SQLite
    A broker transaction takes the single write lock at its first statement (``BEGIN IMMEDIATE``).
    A waiting RECEIVE that has written nothing gives the lock up and polls ``PRAGMA data_version``
    (which changes when another connection commits) every few tens of milliseconds. A receiving
    transaction holds an ``flock`` on a lease file beside the database; a file whose lock is free
    belongs to a process that died.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from typing import Any

from sqlalchemy import event, make_url, text
from sqlalchemy.engine import URL, Connection, Engine

from airflow_broker.errors import BrokerError
from airflow_broker.storage import direct, pooler, receive_leases
from airflow_broker.storage.adapter_base import (
    TRANSMIT_CHANNEL,
    EngineAdapter,
    FailedHold,
    ReceiveLease,
    WaitState,
    channel,
)
from airflow_broker.storage.clock import utcnow
from airflow_broker.storage.roles import RoleSession
from airflow_broker.storage.side_writer import SideWriter
from airflow_broker.storage.sqlite_adapter import SqliteAdapter

log = logging.getLogger(__name__)


class PostgresAdapter:
    """LISTEN/NOTIFY wake-ups and receive leases held by transaction-level advisory locks.

    :param pooled: a pooler in transaction mode sits in front of the server (None: find out on
        the first connection, :mod:`~airflow_broker.storage.pooler`).
    :param listen_url: a direct URL of the same database for LISTEN behind a pooler.
    """

    dialect = "postgresql"
    #: Behind a pooler with no ``listen_url``: how often a waiting RECEIVE looks again.
    POLL_SECONDS = 0.2

    def __init__(
        self, engine: Engine, *, pooled: bool | None = None, listen_url: str | None = None
    ) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._idle_listeners: list[Any] = []
        self._pooled = pooled
        self._listen_params: dict[str, Any] | None = None
        if listen_url is not None:
            self._listen_params = _connect_params(broker_url(listen_url), engine)
        #: receive-lease rows are written here, outside the readers' transactions
        self._side = SideWriter(self._raw_connect, pooled=lambda: self.pooled)
        #: owner or client role (storage.roles): a client role's connections see the views
        self.roles = RoleSession()
        event.listen(engine, "connect", self._on_connect)
        event.listen(engine, "connect", self._find_pooler)
        event.listen(engine, "connect", self.roles.on_connect)
        if pooled:
            direct.stop_preparing(engine)

    @property
    def client_role(self) -> str | None:
        """The role's name when it is a client role (not the owner), else None."""
        return self.roles.client

    @property
    def pooled(self) -> bool:
        """Whether a connection pooler in transaction mode sits in front of the server (decided
        on the engine's first connection; asking opens one if none has been yet)."""
        if self._pooled is None:
            with self._engine.connect():
                pass
        return bool(self._pooled)

    @property
    def listens(self) -> bool:
        """Whether waits LISTEN (a direct connection to the server is at hand) or poll."""
        return self._listen_params is not None or not self.pooled

    def session_params(self) -> dict[str, Any] | None:
        """psycopg connection parameters for a connection that keeps a session of its own
        (LISTEN): ``listen_url``'s, else the engine's when no pooler is in the way; None behind
        a pooler with no ``listen_url`` (then poll)."""
        if self._listen_params is not None:
            return dict(self._listen_params)
        if self.pooled:
            return None
        return _connect_params(self._engine.url, self._engine)

    @staticmethod
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        """Python lists travel as binary arrays: the set-based statements (``unnest`` of one
        array per column) send hundreds of rows per statement, and psycopg's text format
        escapes every element (measured: 14.7 ms vs 1.6 ms for 500 rows of five columns)."""
        from psycopg.types.array import ListBinaryDumper

        dbapi_conn.adapters.register_dumper(list, ListBinaryDumper)

    def _find_pooler(self, dbapi_conn: Any, _record: Any) -> None:
        """On the engine's first connection: is a pooler in the way (storage.pooler)?"""
        if self._pooled is not None:
            return
        found = pooler.inspect(dbapi_conn)
        with self._lock:
            if self._pooled is not None:
                return
            self._pooled = found.pooled
        if found.pooled:
            direct.stop_preparing(self._engine)
            where = self._engine.url.render_as_string(hide_password=True)
            log.info(
                "%s: a connection pooler sits in front of PostgreSQL (%s). Working as behind "
                "PgBouncer in transaction mode: statements are sent whole, not prepared; %s; "
                "the transmitter's lock is held by a transaction. (Broker.connect(..., "
                "pooled=False) if this is a direct connection through an address translation.)",
                where,
                found.detail,
                "waits LISTEN on listen_url"
                if self._listen_params is not None
                else f"waiting RECEIVEs and activation poll every {self.POLL_SECONDS:g} s "
                "instead of LISTEN (give listen_url, a direct URL, to LISTEN)",
            )

    # -- raw psycopg connections outside SQLAlchemy's pool ------------------------------------
    def _raw_connect(self, **kwargs: Any) -> Any:
        import psycopg

        params = _connect_params(self._engine.url, self._engine)
        params.update(kwargs)
        conn = psycopg.connect(autocommit=True, **params)
        self.roles.on_raw_connect(conn)
        return conn

    # -- waiting: LISTEN; a trigger on broker_message notifies (migration 0002) ----------
    def start_wait(self, conn: Connection, queue_id: int, *, can_release: bool) -> WaitState:
        params = self.session_params()
        if params is None:
            return WaitState(queue_id=queue_id)  # behind a pooler: wait() polls
        with self._lock:
            listener: Any = self._idle_listeners.pop() if self._idle_listeners else None
        ch = channel(queue_id)
        try:
            if listener is None or listener.closed:
                import psycopg

                listener = psycopg.connect(autocommit=True, **params)
                self.roles.on_raw_connect(listener)
                listener.info_channels = set()
            if ch not in listener.info_channels:
                listener.execute(f'LISTEN "{ch}"')  # the channel name is ours, never user text
                listener.info_channels.add(ch)
            # Forget what arrived while the listener sat idle: the caller looks next.
            for _ in listener.notifies(timeout=0):
                pass
        except Exception as exc:
            # The server ended an idle listener (a restart, pg_terminate_backend), or cannot
            # be reached for one: this wait polls; the next one connects afresh.
            log.warning("cannot LISTEN on %s (%s): polling for this wait", ch, exc)
            self._close_quietly(listener)
            return WaitState(queue_id=queue_id)
        return WaitState(queue_id=queue_id, listener=listener)

    @staticmethod
    def _close_quietly(conn: Any) -> None:
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def wait(self, conn: Connection, state: WaitState, timeout: float) -> None:
        if state.listener is None:
            # No session to LISTEN in: the caller looks again after a short sleep. Its
            # transaction is idle meanwhile, and the pooler gives its server to others.
            time.sleep(min(max(timeout, 0.0), self.POLL_SECONDS))
            return
        want = channel(state.queue_id)
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                notes = list(state.listener.notifies(timeout=remaining, stop_after=1))
            except Exception as exc:
                log.warning("LISTEN on %s ended (%s): polling for this wait", want, exc)
                self._close_quietly(state.listener)
                state.listener = None
                return
            if any(note.channel == want for note in notes):
                return

    def end_wait(self, state: WaitState) -> None:
        listener = state.listener
        if listener is None or listener.closed:
            return
        with self._lock:
            if len(self._idle_listeners) < 8:
                self._idle_listeners.append(listener)
                return
        listener.close()

    # -- leases --------------------------------------------------------------------------------
    def _backend(self, conn: Connection) -> tuple[bytes, bytes | None]:
        """The server process of ``conn`` (its pid and start), in the text format of the lease
        row's parameters; asked once per connection and kept in its pool ``info``."""
        info = conn.connection.info
        backend: tuple[bytes, bytes | None] | None = info.get("broker_backend")
        if backend is None:
            row = conn.execute(
                text("SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()")
            ).one()
            start = row.backend_start
            backend = info["broker_backend"] = (
                str(row.pid).encode(),
                None if start is None else start.isoformat().encode(),
            )
        return backend

    def new_lease_key(self) -> int | None:
        """A key for the lease of the next receive; RECEIVE's statement marks it on commit.
        63 random bits: a clash with a live lease cannot be noticed in time (the lease row is
        written without waiting), so it must not happen (migration 0015)."""
        return random.getrandbits(63) or 1

    def open_lease(
        self,
        conn: Connection,
        queue_id: int,
        key: int | None,
        held: list[int],
        *,
        check: bool = True,
    ) -> ReceiveLease:
        """Register, outside the transaction, that it holds messages ``held`` of ``queue_id``
        under the lease ``key``, whose advisory lock the RECEIVE statement that took them holds.

        The row is sent on the side connection; :meth:`lease_written` waits for it. It is not
        written while a reader of the queue that ended without committing is uncounted
        (:mod:`~airflow_broker.storage.receive_leases`; ``check=False``: written regardless)."""
        assert key is not None
        pid, backend_start = self._backend(conn)
        lease = ReceiveLease(queue_id=queue_id, key=key, pending=list(held))
        self._write_lease(lease, pid, backend_start, check=check, first=True)
        return lease

    def hold_more(self, lease: ReceiveLease, held: list[int], *, check: bool = True) -> None:
        """A later RECEIVE of the same transaction took more messages of the lease's queue
        (sent as :meth:`open_lease` is, on the same condition)."""
        lease.pending = list(held)
        self._write_lease(lease, None, None, check=check, first=False)

    def _write_lease(
        self,
        lease: ReceiveLease,
        pid: bytes | None,
        backend_start: bytes | None,
        *,
        check: bool,
        first: bool,
    ) -> None:
        self._side.send(
            receive_leases.WRITE,
            (
                b"%d" % lease.key,
                b"%d" % lease.queue_id,
                pid,
                backend_start,
                utcnow().isoformat().encode(),
                _held_text(lease.held + lease.pending),
                _BOOL[check],
                _BOOL[first],
            ),
            wanted=True,
        )

    def lease_written(self, lease: ReceiveLease) -> bool:
        """Wait for the row :meth:`open_lease` or :meth:`hold_more` sent. True: the lease holds
        the messages taken last. False: nothing was written, because a reader of the queue
        ended without committing and is uncounted; the caller gives back what it took and
        counts that reader first (:meth:`reap_dead_leases`).

        A side connection that failed (logged) holds nothing back: RECEIVE goes on, and a
        reader that then dies is counted by nobody.

        :raises BrokerError: the receiving transaction ended before its row was written (its
            connection was lost): what it took is back in the queue, and nothing is handed out.
        """
        pending, lease.pending = lease.pending, []
        answer = self._side.answer()
        code = None if answer is None or answer[0] is None else int(answer[0])
        if code == receive_leases.DEAD_READER:
            return False
        if code == receive_leases.TRANSACTION_GONE:
            raise BrokerError(
                f"receive lease {lease.key}: the receiving transaction ended (its connection "
                "was lost) before its messages were handed out; they are back in their queue"
            )
        if code == receive_leases.KEY_TAKEN:
            log.error("receive lease %d was not written: its key is taken", lease.key)
        lease.held.extend(pending)
        return True

    def rollback_keeping_lock(self, conn: Connection) -> bool:
        """No write lock to keep: a rollback here ends the transaction, and a RECEIVE that
        takes the group meanwhile counts the failed attempt first (lease_written)."""
        return False

    def dead_lease_on(self, queue_id: int) -> bool:
        """Whether a reader of ``queue_id`` ended without committing and nobody has counted
        that attempt yet (read on the side connection, after every lease row written so far)."""
        self._side.send(
            receive_leases.WRITE,
            (None, b"%d" % queue_id, None, None, None, None, b"t", b"f"),
            wanted=True,
        )
        answer = self._side.answer()
        return answer is not None and answer[0] == b"%d" % receive_leases.DEAD_READER

    def lease_cleanup(self, leases: list[ReceiveLease]) -> bytes | None:
        """The statement a committing transaction runs last: its lease rows go with it, so a
        lease row whose lock is free belongs to a transaction that did not commit."""
        if not leases:
            return None
        keys = b",".join(b"%d" % lease.key for lease in leases)
        return b"DELETE FROM broker_receive_lease WHERE lease_key IN (" + keys + b")"

    def leases_committing(self, conn: Connection, leases: list[ReceiveLease]) -> None:
        """Nothing to do apart: the COMMIT's query deletes the rows (lease_cleanup), and
        RECEIVE's statement ended the queue's run of rollbacks."""

    def close_leases(self, leases: list[ReceiveLease]) -> None:
        """Nothing to release: the due-work pass clears committed leases."""

    def forget_leases(self, conn: Connection, leases: list[ReceiveLease]) -> list[FailedHold]:
        """After a rollback: delete this transaction's lease rows; returns what to count.

        A reaper may have counted a row first; only rows this call deletes are counted here.
        """
        self._side.sync()  # the lease rows are written (they were sent without waiting)
        rows = conn.execute(
            text(
                "DELETE FROM broker_receive_lease WHERE lease_key = ANY(:keys) "
                "RETURNING queue_id, held"
            ),
            {"keys": [lease.key for lease in leases]},
        )
        return [_failed(r.queue_id, r.held) for r in rows]

    def reap_dead_leases(self, conn: Connection, queue_id: int | None = None) -> list[FailedHold]:
        """Return what the readers that ended without committing held (a lease row whose lock
        is free and that no commit marker vouches for): each one is a rolled-back receive, and
        its row is deleted here, so it is counted once. ``queue_id``: that queue's only.

        A committing transaction deletes its lease rows itself. Rows written by versions that
        marked commits instead (``broker_receive_commit``, before migration 0025) are cleared
        here when their marker says they committed.

        Two statements, in this order: the first finds every lease that has no marker and whose
        lock is free (its transaction has ended; the lock is taken and given back at once); the
        second, with a snapshot taken after, deletes those that are still there with no marker.
        A transaction releases its locks only once its commit is visible, so a reader that
        committed as the first statement ran is seen to have committed (its row gone) by the
        second, and is not counted."""
        only = "" if queue_id is None else " AND l.queue_id = :queue_id"
        params = {} if queue_id is None else {"queue_id": queue_id}
        if queue_id is None:
            conn.execute(
                text(
                    "WITH done AS (DELETE FROM broker_receive_commit c "
                    " USING broker_receive_lease l WHERE c.lease_key = l.lease_key "
                    " RETURNING c.lease_key) "
                    "DELETE FROM broker_receive_lease WHERE lease_key IN "
                    "(SELECT lease_key FROM done)"
                )
            )
        ended = [
            row.lease_key
            for row in conn.execute(
                text(
                    f"SELECT l.lease_key FROM broker_receive_lease l"
                    f" WHERE {receive_leases.NO_MARKER}{only}"
                    f" AND {receive_leases.LEASE_ENDED}"
                ),
                params,
            )
        ]
        if not ended:
            return []
        rows = conn.execute(
            text(
                "DELETE FROM broker_receive_lease l WHERE l.lease_key = ANY(:keys)"
                " AND NOT EXISTS (SELECT 1 FROM broker_receive_commit c"
                "                 WHERE c.lease_key = l.lease_key)"
                " RETURNING queue_id, held"
            ),
            {"keys": ended},
        )
        return [_failed(r.queue_id, r.held) for r in rows]

    def dead_leases(self, conn: Connection) -> list[tuple[str, int]]:
        """Read-only: (lease, queue id) of leases whose reader died holding messages and that
        no due-work pass has counted yet (what :meth:`reap_dead_leases` would count). Reads
        the locks in ``pg_locks`` rather than taking them."""
        rows = conn.execute(
            text(
                "SELECT l.lease_key, l.queue_id, l.pid FROM broker_receive_lease l"
                f" WHERE {receive_leases.LEASE_UNLOCKED}"
                " AND NOT EXISTS (SELECT 1 FROM broker_receive_commit c"
                "                 WHERE c.lease_key = l.lease_key)"
                " ORDER BY l.lease_key"
            )
        )
        return [(f"lease {r.lease_key} (server process {r.pid})", r.queue_id) for r in rows]

    def dispose(self) -> None:
        self._side.close()
        with self._lock:
            for conn in self._idle_listeners:
                with contextlib.suppress(Exception):
                    conn.close()
            self._idle_listeners.clear()


#: A boolean parameter in PostgreSQL's text format.
_BOOL = {True: b"t", False: b"f"}


#: Query parameters of a broker URL that are not the driver's: how long this broker, as a far
#: broker, may take to answer and be waited for (transport.deadlines reads them off a peer's
#: URL); a broker opened from such a URL ignores them.
PEER_LIMIT_PARAMETERS = ("answer_timeout", "patience")


def broker_url(url: str) -> URL:
    """``url`` parsed, ``postgresql://`` meaning psycopg 3 (``Broker.connect``, ``listen_url``),
    without :data:`PEER_LIMIT_PARAMETERS` (they would reach libpq)."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if any(k in parsed.query for k in PEER_LIMIT_PARAMETERS):
        parsed = parsed.difference_update_query(PEER_LIMIT_PARAMETERS)
    return parsed


def _connect_params(url: URL, engine: Engine) -> dict[str, Any]:
    """psycopg's keyword arguments for ``url`` as ``engine``'s dialect reads it."""
    _args, cparams = engine.dialect.create_connect_args(url)
    return {k: v for k, v in cparams.items() if k != "client_encoding"}


def _held_text(held: list[int]) -> bytes:
    """``held`` (queuing orders) as the JSON array the lease row keeps, written directly (a
    lease row is written per RECEIVE): ``json.dumps`` of the list, without its spaces."""
    return b"[" + b",".join(b"%d" % order for order in held) + b"]"


def _failed(queue_id: int, held: str | None) -> FailedHold:
    return FailedHold(queue_id, tuple(json.loads(held)) if held else ())


def adapter_for(
    engine: Engine, *, pooled: bool | None = None, listen_url: str | None = None
) -> PostgresAdapter | SqliteAdapter:
    name = engine.dialect.name
    if name == "postgresql":
        if engine.dialect.driver != "psycopg":
            raise ValueError(
                "PostgreSQL broker databases need the psycopg (3) driver, not "
                f"{engine.dialect.driver!r}: use a postgresql+psycopg:// URL"
            )
        return PostgresAdapter(engine, pooled=pooled, listen_url=listen_url)
    if name == "sqlite":
        return SqliteAdapter(engine)
    raise ValueError(f"unsupported broker database {name!r}: use PostgreSQL or SQLite")


__all__ = [
    "TRANSMIT_CHANNEL",
    "EngineAdapter",
    "FailedHold",
    "PostgresAdapter",
    "ReceiveLease",
    "SqliteAdapter",
    "WaitState",
    "adapter_for",
    "broker_url",
    "channel",
]
