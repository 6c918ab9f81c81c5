"""Delivery isolated per destination: each far broker has a lane of its own.

A batch of the transmission queue holds messages for several far brokers. Its pushes run at
once, each destination's in its own workers (a *lane*, per source database and address, shared
by the process's passes), and the pass waits for each destination at most its *patience*
(:data:`~.deadlines.PATIENCE`, 5 s; none for a destination that did not answer last time).
A destination still busy after that is left to its lane: the pass records its messages as
waiting ("no answer from broker://b for 5 s yet ...") and commits the rest of the batch, so the
others go on at their usual rate. The push itself stays bounded by the answer timeout
(:mod:`.deadlines`); when it ends, what it brought back (acknowledgments, what the far broker
took) is recorded in a transaction of its own (:meth:`.Transport._late`).

While a push a pass stopped waiting for is still out, later passes do not push to that
destination again: its messages wait with the reason, and are tried once the push has ended
and their backoff is due. A pass's pushes to one destination follow each other, as the far
broker takes them; passes that run at once in one process push at once, as before.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from airflow_broker.storage.context import BrokerContext

_T = TypeVar("_T")


class Lane:
    """The workers of one destination: its pushes run here, in daemon threads (a process that
    ends does not wait for a far broker that hangs: what it was pushing stays in the
    transmission queue and goes again). A pass's pushes to one destination follow each other;
    passes running at once in one process push at once, up to :attr:`WORKERS`."""

    #: pushes to one destination at once (from passes running at once in this process)
    WORKERS = 4

    def __init__(self, address: str) -> None:
        self.address = address
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None]
        self._jobs = queue.SimpleQueue()
        self._threads = 0
        self._lock = threading.Lock()
        #: pushes submitted and not finished
        self._queued = 0
        #: pushes a pass stopped waiting for, by id, with time.monotonic() when they started
        self._overdue: dict[int, float] = {}
        #: time.monotonic() of its last push's end (lanes idle for IDLE_SECONDS are closed)
        self.last_used = time.monotonic()

    def idle_for(self, now: float) -> float:
        with self._lock:
            return 0.0 if self._queued else now - self.last_used

    def close(self) -> None:
        with self._lock:
            threads = self._threads
        for _ in range(threads):
            self._jobs.put(None)

    def busy(self) -> str | None:
        """Why nothing more should be handed to this lane now (a push a pass stopped waiting
        for is still out), or None."""
        with self._lock:
            if not self._overdue:
                return None
            waited = time.monotonic() - min(self._overdue.values())
        return (
            f"no answer from {self.address} for {waited:.0f} s yet "
            "(a delivery to it is still waiting); tried again when it answers"
        )

    def overdue(self, future: Future[Any], since: float) -> None:
        """A pass stopped waiting for ``future`` (it started at ``since``): the lane counts as
        busy until it ends."""
        key = id(future)
        with self._lock:
            self._overdue[key] = since

        def ended(_done: Future[Any]) -> None:
            with self._lock:
                self._overdue.pop(key, None)

        future.add_done_callback(ended)

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        future: Future[_T] = Future()
        with self._lock:
            self._queued += 1
            if self._queued > self._threads and self._threads < self.WORKERS:
                self._threads += 1
                threading.Thread(
                    target=self._work, name=f"airflow-broker-lane-{self.address}", daemon=True
                ).start()
        self._jobs.put((future, functools.partial(fn, *args)))
        return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, call = job
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(call())
                    except BaseException as exc:
                        future.set_exception(exc)
            finally:
                with self._lock:
                    self._queued -= 1
                    self.last_used = time.monotonic()


#: A lane with nothing to do for this long has its thread ended (made again on next use).
IDLE_SECONDS = 300.0

_lanes: dict[tuple[str, str], Lane] = {}
_lock = threading.Lock()


def lane(source: BrokerContext, address: str) -> Lane:
    """The lane of ``source``'s deliveries to ``address`` (made on first use)."""
    key = (str(source.engine.url), address)
    now = time.monotonic()
    with _lock:
        found = _lanes.get(key)
        if found is None:
            for other_key, other in list(_lanes.items()):
                if other.idle_for(now) > IDLE_SECONDS:
                    del _lanes[other_key]
                    other.close()
            found = _lanes[key] = Lane(address)
        return found


def _forget_in_child() -> None:
    """A forked child has none of its parent's lane threads: it makes its own."""
    global _lock
    _lanes.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


__all__ = ["Lane", "lane"]
