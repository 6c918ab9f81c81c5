"""A Spark task's guard against a far broker that stops answering.

A task writes into a far broker over one psycopg connection. If that broker hangs (its server
stopped, a partition), the task would wait until TCP gives up, about 15 minutes. :class:`Stall`
watches the connection from a thread of its own: when nothing has moved on it (no write, no
statement answered: :func:`touch`) for ``seconds``, it shuts the connection's socket down. The
task then fails at once with "no answer from ..." and Spark runs it again (or the run fails
and the transmitter's next run delivers the messages); what the task wrote in its open
transaction is not committed, and what a run committed is recognized by sequence number.

Shipped to the executors by value with the task modules: it imports only the standard library.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from types import TracebackType
from typing import Any

#: the guard of each thread's task (a dict, not a threading.local: it is pickled with the
#: functions that use it)
_current: dict[int, Stall] = {}


class StalledError(RuntimeError):
    """The far broker did not answer for the guard's time: the task was cut."""


class Stall:
    """Cut ``conn`` (a psycopg connection) when nothing moved on it for ``seconds``."""

    def __init__(self, conn: Any, seconds: float, what: str) -> None:
        self.conn = conn
        self.seconds = float(seconds)
        self.what = what
        self.last = time.monotonic()
        self.cut = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-guard", daemon=True)

    def touch(self) -> None:
        self.last = time.monotonic()

    def _watch(self) -> None:
        step = min(1.0, self.seconds / 4)
        while not self._done.wait(step):
            if time.monotonic() - self.last < self.seconds:
                continue
            self.cut = True
            try:
                with socket.socket(fileno=os.dup(self.conn.pgconn.socket)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except Exception:  # closed meanwhile: nothing waits on it any more
                pass
            return

    def __enter__(self) -> Stall:
        self._outer = _current.get(threading.get_ident())
        _current[threading.get_ident()] = self
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        if self._outer is None:
            _current.pop(threading.get_ident(), None)
        else:
            _current[threading.get_ident()] = self._outer
        if self.cut and exc is not None:
            raise StalledError(
                f"no answer from {self.what} for {self.seconds:g} s: the connection was cut"
            ) from exc


def connect(conninfo: str, what: str) -> Any:
    """A psycopg connection to a far broker for a task (nothing prepared: a pooler may hand its
    server process to others); one that cannot be made within the connect timeout raises
    :class:`StalledError`, so the job knows the far broker, not the task, failed."""
    import psycopg

    try:
        return psycopg.connect(conninfo, prepare_threshold=None)
    except psycopg.OperationalError as exc:
        raise StalledError(f"cannot connect to {what}: {exc}") from exc


def touch() -> None:
    """Something moved on the current task's guarded connection (a write, an answer)."""
    guard = _current.get(threading.get_ident())
    if guard is not None:
        guard.last = time.monotonic()


__all__ = ["Stall", "StalledError", "connect", "touch"]
