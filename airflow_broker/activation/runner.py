"""The in-process activation runner: seed 004's activation outside Airflow.

:class:`ActivationRunner` is a queue's monitor and its readers in one process: a monitor thread
makes the same decisions as the Airflow trigger (:class:`airflow_broker.activation.Monitor`, the
same cursor and reader tables), and each reader it starts is a thread that registers like an
Airflow reader run (:class:`airflow_broker.activation.ReaderSlot`), drains the queue one
conversation group per transaction, and exits::

    def handle(tx, messages):              # inside the RECEIVE's transaction
        for m in messages:
            ...                            # tx.send(...), tx.end_conversation(...), tx.connection

    with ActivationRunner(broker, "SupplierQueue", handle, max_readers=4) as runner:
        ...                                # messages arriving now are read
    runner.report                          # readers started, most at once, messages...

    ActivationRunner(broker, "SupplierQueue", handle).run_until_idle(timeout=60)

The monitor sleeps on the engine's wake-up signal (PostgreSQL LISTEN on the queue's channel,
SQLite's data_version), with ``poll_interval`` as the longest sleep and as the period at which
the queue's growth is judged.

When the server ends the LISTEN connection (a restart, ``pg_terminate_backend``), the wait logs
one warning naming the channel and the error and polls; the monitor LISTENs again on a new
connection at once, then every :data:`LISTEN_RECONNECT_SECONDS` until the server takes it, and
looks at the queue after each new LISTEN (what was notified while it was away is lost).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING

from sqlalchemy import func, select

from airflow_broker.activation.decision import ACTIVATION_KEY
from airflow_broker.activation.monitor import Monitor, due_step
from airflow_broker.activation.readers import Handler, ReaderSlot, drain, resolve_handler
from airflow_broker.constants import STATUS_READY
from airflow_broker.errors import InvalidDefinition, UnknownObject
from airflow_broker.operations import observation
from airflow_broker.storage import schema as s

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")

#: The monitor checks at most this often, however often it is woken (on SQLite every commit
#: by any connection wakes it, readers' included).
MIN_CHECK_GAP = 0.05

#: After the server ended a LISTEN connection, the listener connects again at once and then
#: every this many seconds until it LISTENs again (the runner's monitor, and the Airflow
#: triggers' listeners in airflow_broker.provider.triggers.activation).
LISTEN_RECONNECT_SECONDS = 2.0


class _OtherThreads(logging.Filter):
    """Leaves out the records of the thread that made it: the adapter's warning of each failed
    LISTEN attempt while the monitor retries (the loss was reported once, when it happened)."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


@contextlib.contextmanager
def _quietly(logger: logging.Logger) -> Iterator[None]:
    quiet = _OtherThreads()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


@dataclass(slots=True)
class RunnerReport:
    """What a runner did so far."""

    fires: int = 0
    readers_started: int = 0
    readers_refused: int = 0
    #: the most readers running at once
    max_concurrent: int = 0
    batches: int = 0
    messages: int = 0
    #: one line per reader that stopped on an exception
    failures: list[str] = field(default_factory=list)


class ActivationRunner:
    """A queue's activation monitor with thread readers (see the module docstring).

    :param broker: the broker database.
    :param queue: the queue to read.
    :param handler: ``handler(tx, messages)``, or ``"package.module:function"``: called inside
        each receiving transaction with the messages of one conversation group. None: the
        queue's ``Activation.reader`` (``ACTIVATION (PROCEDURE_NAME = ...)``).
    :param max_readers: the most readers at once (None: the queue's ``Activation.max_readers``).
    :param poll_interval: the longest the monitor sleeps between two looks at the queue.
    :param top: at most this many messages per RECEIVE.
    :param wait_seconds: how long a reader's RECEIVE waits before the reader decides the queue
        is empty and exits.
    :param monitor_key: the monitor's name in ``broker_activation`` (shared with the Airflow
        trigger's default: it is the queue's activation).
    """

    def __init__(
        self,
        broker: BrokerContext,
        queue: str,
        handler: Handler | str | None = None,
        max_readers: int | None = None,
        poll_interval: float = 0.5,
        *,
        top: int | None = None,
        wait_seconds: float = 0,
        monitor_key: str = ACTIVATION_KEY,
    ) -> None:
        if not isinstance(poll_interval, int | float) or poll_interval <= 0:
            raise InvalidDefinition(f"poll_interval must be > 0, not {poll_interval!r}")
        self.broker = broker
        self.queue = queue
        if handler is None:
            queue_def = observation.catalog(broker).queues.get(queue)
            if queue_def is None:
                raise UnknownObject(f"queue {queue!r} does not exist in this broker")
            handler = (queue_def.activation or {}).get("reader")
            if not handler:
                raise InvalidDefinition(
                    f"queue {queue!r} names no reader in its activation: pass a handler, or "
                    f"alter_queue({queue!r}, activation=Activation(reader='module:function'))"
                )
        self.handler = resolve_handler(handler)
        self.max_readers = max_readers
        self.poll_interval = float(poll_interval)
        self.top = top
        self.wait_seconds = wait_seconds
        self.monitor = Monitor(
            broker,
            queue,
            key=monitor_key,
            mode="arrival",
            max_readers=max_readers,
            sample_seconds=self.poll_interval,
        )
        self.report = RunnerReport()
        self._stop = threading.Event()
        self._lock = threading.Condition()
        self._readers: set[threading.Thread] = set()
        self._running = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> ActivationRunner:
        """Start the monitor thread (readers start as the monitor decides)."""
        if self._thread is not None:
            raise RuntimeError("this ActivationRunner has already been started")
        self._thread = threading.Thread(
            target=self._monitor, name=f"broker-monitor-{self.queue}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> RunnerReport:
        """Stop the monitor, let running readers finish their current transaction, and wait."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for reader in self._reader_threads():
            reader.join(timeout)
        if self._error is not None:
            raise RuntimeError(f"the activation monitor of {self.queue!r} failed") from self._error
        return self.report

    def __enter__(self) -> ActivationRunner:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def run_until_idle(self, timeout: float | None = None) -> RunnerReport:
        """Run until the queue is empty and no reader runs (or ``timeout`` seconds pass: then
        :class:`TimeoutError`); returns the report. Empty means no message at all: messages
        held after a failed attempt, or leased, are waited for (readers start for them only
        when they can be taken)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        started_here = self._thread is None
        if started_here:
            self.start()
        try:
            while True:
                if self._error is not None:
                    break
                with self._lock:
                    idle = self._running == 0 and not self._reader_threads()
                if idle and self._waiting() == 0:
                    with self._lock:
                        if self._running == 0 and not self._reader_threads():
                            break
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"queue {self.queue!r} not drained within {timeout} s: {self.report}"
                    )
                with self._lock:
                    self._lock.wait(self.poll_interval)
        finally:
            if started_here:
                self.stop()
        if self._error is not None:
            raise RuntimeError(f"the activation monitor of {self.queue!r} failed") from self._error
        return self.report

    # -- the monitor ---------------------------------------------------------------------------
    def _waiting(self) -> int:
        """Messages the queue still holds for its readers: ready, held and leased alike.

        Not the depth activation counts (ready messages only, which is what the monitor
        decides on): :meth:`run_until_idle` runs until the queue is *empty*, so it waits out a
        group held after a failed attempt (the monitor starts a reader when the hold ends) and
        a lease (completed, or back in the queue when it expires)."""
        m = s.message
        stmt = (
            select(func.count())
            .select_from(m.join(s.queue, s.queue.c.queue_id == m.c.queue_id))
            .where(s.queue.c.name == self.queue, m.c.status == STATUS_READY)
        )
        with self.broker.read_connection() as conn:
            return int(conn.execute(stmt).scalar_one())

    def _reader_threads(self) -> list[threading.Thread]:
        with self._lock:
            self._readers = {t for t in self._readers if t.is_alive()}
            return list(self._readers)

    def _monitor(self) -> None:
        adapter = self.broker.adapter
        try:
            with self.broker.engine.connect() as conn:
                self._look()
                assert self.monitor.queue_id is not None
                queue_id = self.monitor.queue_id
                state = adapter.start_wait(conn, queue_id, can_release=True)
                #: PostgreSQL, not behind a pooler without listen_url: waits should LISTEN
                listens = bool(getattr(adapter, "listens", False))
                relisten_at = 0.0  # when to LISTEN again once the listener is lost: at once
                try:
                    while not self._stop.is_set():
                        began = time.monotonic()
                        adapter.wait(conn, state, self.poll_interval)
                        gap = MIN_CHECK_GAP - (time.monotonic() - began)
                        if gap > 0 and self._stop.wait(gap):
                            break
                        if listens and state.listener is None:
                            # The server ended the LISTEN connection (the wait polls now).
                            now = time.monotonic()
                            if now >= relisten_at:
                                adapter.end_wait(state)
                                with _quietly(logging.getLogger(type(adapter).__module__)):
                                    state = adapter.start_wait(conn, queue_id, can_release=True)
                                if state.listener is None:
                                    relisten_at = now + LISTEN_RECONNECT_SECONDS
                                else:
                                    relisten_at = 0.0
                                    log.info("activation monitor of %r: LISTEN again", self.queue)
                        if not self._stop.is_set():
                            self._look()  # after a new LISTEN too: nothing notified is missed
                finally:
                    adapter.end_wait(state)
        except BaseException as exc:  # reported by stop() / run_until_idle()
            log.exception("activation monitor of queue %r failed", self.queue)
            self._error = exc
            with self._lock:
                self._lock.notify_all()

    def _look(self) -> None:
        due_step(self.broker)
        fire = self.monitor.check()
        if fire is None:
            return
        self.report.fires += 1
        for _ in range(fire.readers):
            self._start_reader(fire.fire_id)

    # -- readers -------------------------------------------------------------------------------
    def _start_reader(self, fire_id: str | None) -> None:
        with self._lock:
            number = self.report.readers_started + self.report.readers_refused + 1
        thread = threading.Thread(
            target=self._read,
            args=(fire_id, number),
            name=f"broker-reader-{self.queue}-{number}",
            daemon=True,
        )
        with self._lock:
            self._readers.add(thread)
        thread.start()

    def _read(self, fire_id: str | None, number: int) -> None:
        slot = ReaderSlot(
            self.broker,
            self.queue,
            max_readers=self.max_readers,
            label=f"runner {threading.current_thread().name}",
            fire_id=fire_id,
        )
        try:
            with slot:
                if not slot.admitted:
                    with self._lock:
                        self.report.readers_refused += 1
                    return
                with self._lock:
                    self.report.readers_started += 1
                    self._running += 1
                    self.report.max_concurrent = max(self.report.max_concurrent, self._running)
                try:
                    done = drain(
                        self.broker,
                        self.queue,
                        self.handler,
                        top=self.top,
                        wait_seconds=self.wait_seconds,
                        stop=self._stop,
                        committed=self._committed,
                    )
                    slot.outcome = "drained" if done.drained else "stopped"
                except Exception as exc:
                    slot.outcome = "failed"
                    log.exception("reader %d of queue %r failed", number, self.queue)
                    with self._lock:
                        self.report.failures.append(f"reader {number}: {type(exc).__name__}: {exc}")
                finally:
                    with self._lock:
                        self._running -= 1
        except Exception as exc:  # registration itself failed (database gone...)
            log.exception("reader %d of queue %r could not register", number, self.queue)
            with self._lock:
                self.report.failures.append(f"reader {number}: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._lock.notify_all()

    def _committed(self, messages: int) -> None:
        with self._lock:
            self.report.batches += 1
            self.report.messages += messages


__all__ = ["LISTEN_RECONNECT_SECONDS", "ActivationRunner", "RunnerReport"]
