"""SQLite's adapter (see storage.adapters): single-writer transactions, ``PRAGMA data_version``
polling for waits, and receive leases as ``flock``ed files beside the database.

Every transaction begins ``BEGIN IMMEDIATE`` (it takes the database's one write lock at once, so
two writers never deadlock upgrading a read lock), except on a connection marked read-only with
the execution option :data:`READ_ONLY` (``BrokerContext.read_connection()`` opens one): that one
begins ``BEGIN DEFERRED`` and, in WAL mode, reads the last committed state without waiting for a
writer, a RECEIVE holding its messages included. A read-only connection must not write: its
first write would have to take the write lock in the middle of the transaction, and fails at
once (``SQLITE_BUSY``) when another transaction committed since it began reading.

A writer's transaction sets the savepoint :data:`TX_SAVEPOINT` right after ``BEGIN IMMEDIATE``.
A receiving transaction that rolls back goes back to that savepoint instead of ending
(``rollback_keeping_lock``): everything it did is undone, but the transaction, and with it the
write lock, stays open while its failed attempt is counted and its conversation group held
(``TransactionCore._after_rollback``), then commits. So no other reader can take the group
between the rollback and its hold."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import Connection, Engine

from airflow_broker.storage.adapter_base import FailedHold, ReceiveLease, WaitState

#: The execution option marking a connection that only reads (``conn.execution_options(
#: broker_read_only=True)``): on SQLite its transactions begin DEFERRED, not IMMEDIATE.
READ_ONLY = "broker_read_only"
#: The savepoint a writer's transaction sets right after ``BEGIN IMMEDIATE``: rolling back to it
#: undoes the whole transaction but keeps it open, with the write lock.
TX_SAVEPOINT = "broker_tx"
#: The execution option under which the next transaction SQLAlchemy begins on a connection takes
#: over the SQLite transaction already open there (set by rollback_keeping_lock only).
_ADOPT = "broker_adopt_transaction"


class SqliteAdapter:
    """Single-writer transactions, data_version polling and flock leases."""

    dialect = "sqlite"
    POLL_SECONDS = 0.02
    #: every connection may do everything: no client roles
    client_role: str | None = None
    #: no pooler in front of a file
    pooled = False

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        database = engine.url.database
        self._lease_dir: Path | None = None
        if database and database != ":memory:" and not database.startswith("file::memory:"):
            self._lease_dir = Path(database).resolve().with_name(Path(database).name + "-leases")
        event.listen(engine, "connect", self._on_connect)
        event.listen(engine, "begin", self._on_begin)

    @staticmethod
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control away from the driver, so that BEGIN is ours to emit.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=60000")
        cur.close()

    @staticmethod
    def _on_begin(conn: Connection) -> None:
        options = conn.get_execution_options()
        if options.get(READ_ONLY):
            # A reader: it takes a snapshot at its first read and never waits for the writer.
            conn.exec_driver_sql("BEGIN DEFERRED")
        elif options.get(_ADOPT):
            return  # SQLite's transaction is open already (rollback_keeping_lock)
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            # On the driver itself: no statement of the caller's, and cheaper that way.
            raw: Any = conn.connection.driver_connection
            raw.execute(_SET_TX_SAVEPOINT)

    def rollback_keeping_lock(self, conn: Connection) -> bool:
        """Undo the writer's transaction open on ``conn`` back to its savepoint
        (:data:`TX_SAVEPOINT`, set right after its ``BEGIN IMMEDIATE``), keeping it open, and so
        the database's write lock: what the caller writes next (the accounting of a failed
        RECEIVE) commits before any other transaction can begin. The caller commits or rolls
        back as usual.

        False when there is no such transaction: none is open (the connection was invalidated,
        or SQLite ended the transaction itself), or it began without the savepoint (a read-only
        one). The caller then rolls back as usual and counts in a new transaction."""
        if conn.invalidated:
            return False
        raw: Any = conn.connection.driver_connection
        if raw is None or not raw.in_transaction:
            return False
        adopt = not conn.in_transaction()
        if adopt:
            # A COMMIT that failed (a deferred foreign key) ended SQLAlchemy's transaction but
            # left SQLite's open. SQLAlchemy's rollback now only clears its own (it has no
            # transaction to end); its next one takes SQLite's over instead of beginning.
            conn.rollback()
            if not raw.in_transaction:
                return False
        try:
            raw.execute(_ROLLBACK_TO_TX_SAVEPOINT)
        except sqlite3.OperationalError:
            return False  # no such savepoint
        if adopt:
            conn.execution_options(**{_ADOPT: True})
            try:
                conn.begin()
            finally:
                conn.execution_options(**{_ADOPT: False})
        return True

    # -- waiting -------------------------------------------------------------------------------
    @staticmethod
    def _data_version(conn: Connection) -> int:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        version: int = raw.execute("PRAGMA data_version").fetchone()[0]
        return version

    def start_wait(self, conn: Connection, queue_id: int, *, can_release: bool) -> WaitState:
        state = WaitState(queue_id=queue_id)
        if can_release:
            # Nothing written yet: give the write lock back so that senders can commit.
            conn.rollback()
            state.released = True
            state.data_version = self._data_version(conn)
        return state

    def wait(self, conn: Connection, state: WaitState, timeout: float) -> None:
        deadline = time.monotonic() + max(timeout, 0.0)
        if not state.released:
            time.sleep(min(timeout, 0.1))
            return
        if conn.in_transaction():
            conn.rollback()
        while time.monotonic() < deadline:
            time.sleep(min(self.POLL_SECONDS, max(deadline - time.monotonic(), 0)))
            version = self._data_version(conn)
            if version != state.data_version:
                state.data_version = version
                return

    def end_wait(self, state: WaitState) -> None:
        """Nothing held."""

    # -- leases --------------------------------------------------------------------------------
    def new_lease_key(self) -> int | None:
        return None  # the lease is a locked file, named when it is opened

    def open_lease(
        self,
        conn: Connection,
        queue_id: int,
        key: int | None,
        held: list[int],
        *,
        check: bool = True,
    ) -> ReceiveLease:
        if self._lease_dir is None:
            # an in-memory database dies with its process
            return ReceiveLease(queue_id=queue_id, held=list(held))
        self._lease_dir.mkdir(exist_ok=True)
        path = self._lease_dir / f"{os.getpid()}-{uuid.uuid4().hex}.lease"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        lease = ReceiveLease(queue_id=queue_id, path=path, fd=fd)
        self.hold_more(lease, held)
        return lease

    def hold_more(self, lease: ReceiveLease, held: list[int], *, check: bool = True) -> None:
        """The file says which queue and which messages: ``{"queue_id": 1, "held": [...]}``."""
        lease.held.extend(held)
        if lease.fd is not None:
            data = json.dumps({"queue_id": lease.queue_id, "held": lease.held}).encode()
            os.ftruncate(lease.fd, 0)
            os.pwrite(lease.fd, data, 0)

    def lease_written(self, lease: ReceiveLease) -> bool:
        """The file is written as the lease opens (a RECEIVE holds the only write lock)."""
        return True

    def lease_cleanup(self, leases: list[ReceiveLease]) -> bytes | None:
        """Nothing to run before COMMIT: the files go after it (close_leases)."""
        return None

    def dead_lease_on(self, queue_id: int) -> bool:
        """Whether a lease file's lock is free: its reader died holding messages and no
        due-work pass has counted it yet (of any queue: the files are few, one per writer that
        died). A live reader's file, this process's included, is locked."""
        for _path, fd in self._unlocked_lease_files():
            os.close(fd)
            return True
        return False

    def leases_committing(self, conn: Connection, leases: list[ReceiveLease]) -> None:
        # The files go after the commit (close_leases); the commit breaks the run of rollbacks.
        conn.execute(
            text(
                "UPDATE broker_queue SET rollback_count = 0 "
                "WHERE queue_id IN (SELECT value FROM json_each(:queue_ids)) AND rollback_count > 0"
            ),
            {"queue_ids": json.dumps(sorted({lease.queue_id for lease in leases}))},
        )

    def close_leases(self, leases: list[ReceiveLease]) -> None:
        # Unlink before unlocking: a reaper that gets the lock then sees the file is gone.
        for lease in leases:
            if lease.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    lease.path.unlink()
            if lease.fd is not None:
                os.close(lease.fd)
                lease.fd = None

    def forget_leases(self, conn: Connection, leases: list[ReceiveLease]) -> list[FailedHold]:
        self.close_leases(leases)
        return [FailedHold(lease.queue_id, tuple(lease.held)) for lease in leases]

    def reap_dead_leases(self, conn: Connection, queue_id: int | None = None) -> list[FailedHold]:
        if self._lease_dir is None or not self._lease_dir.exists():
            return []
        dead: list[FailedHold] = []
        for path in self._lease_dir.glob("*.lease"):
            fd = _locked_if_free(path, os.O_RDWR, fcntl.LOCK_EX)
            if fd is None:
                continue
            try:
                try:
                    same = os.fstat(fd).st_ino == path.stat().st_ino
                except FileNotFoundError:
                    same = False  # committed (or rolled back and counted) just now
                if same:
                    content = _read_all(fd)
                    path.unlink()
                    dead.append(_lease_file(content))
            finally:
                os.close(fd)
        return dead

    def dead_leases(self, conn: Connection) -> list[tuple[str, int]]:
        """Read-only: (lease file, queue id) of lease files whose lock is free: their reader died
        holding messages and no due-work pass has counted it yet."""
        dead: list[tuple[str, int]] = []
        for path, fd in self._unlocked_lease_files():
            try:
                dead.append((f"lease file {path.name}", _lease_file(_read_all(fd)).queue_id))
            finally:
                os.close(fd)  # closing releases the probe's shared lock
        return dead

    def _unlocked_lease_files(self) -> Iterator[tuple[Path, int]]:
        """Each lease file whose lock is free, in name order, and its descriptor under a shared
        lock (the caller closes it, which releases the lock): one scan of the directory,
        nothing more when it is empty, as it is while no reader has died."""
        if self._lease_dir is None:
            return
        try:
            names = sorted(e.name for e in os.scandir(self._lease_dir) if e.name.endswith(".lease"))
        except FileNotFoundError:
            return
        for name in names:
            path = self._lease_dir / name
            fd = _locked_if_free(path, os.O_RDONLY, fcntl.LOCK_SH)
            if fd is not None:
                yield path, fd

    def dispose(self) -> None:
        """Nothing held outside the pool."""


_SET_TX_SAVEPOINT = f"SAVEPOINT {TX_SAVEPOINT}"
_ROLLBACK_TO_TX_SAVEPOINT = f"ROLLBACK TO {TX_SAVEPOINT}"


def _locked_if_free(path: Path, flags: int, lock: int) -> int | None:
    """``path`` opened with ``flags`` and locked with ``lock`` without waiting: its descriptor
    (the caller closes it, which releases the lock), or None when the file is gone or its
    reader holds its lock (it is alive)."""
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, lock | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _read_all(fd: int) -> str:
    return os.pread(fd, os.fstat(fd).st_size, 0).decode()


def _lease_file(content: str) -> FailedHold:
    """A lease file's content (a bare queue id, as files written before 0.1 held, or JSON)."""
    if not content.strip():
        return FailedHold(0, ())
    if content.lstrip().startswith("{"):
        d = json.loads(content)
        return FailedHold(int(d["queue_id"]), tuple(d.get("held", ())))
    return FailedHold(int(content), ())


__all__ = ["READ_ONLY", "SqliteAdapter"]
