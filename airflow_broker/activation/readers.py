"""Readers: their registration, heartbeat and loop.

:class:`ReaderSlot` registers a running reader (table ``broker_activation_reader``), keeps its
heartbeat, and refuses a reader beyond ``max_readers`` or beyond the groups with messages;
:func:`drain` is the reader's loop. A monitor counts registered readers whose heartbeat is fresh,
plus the readers it fired for that have not registered yet, so that one arrival starts one
reader however often the monitor looks.
"""

from __future__ import annotations

import importlib
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, func, insert, or_, select, update

from airflow_broker.activation.decision import HEARTBEAT_SECONDS
from airflow_broker.activation.ledger import _r, counts, lock_queue, observe, queue_row, tidy
from airflow_broker.errors import InvalidDefinition
from airflow_broker.messaging.transaction import Transaction
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow

if TYPE_CHECKING:
    from airflow_broker.messaging.objects import Message
    from airflow_broker.messaging.transaction import Transaction
    from airflow_broker.storage.context import BrokerContext


# ---------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------


log = logging.getLogger("airflow_broker")


@dataclass(frozen=True, slots=True)
class ReaderRow:
    """One row of ``broker_activation_reader``."""

    reader_id: uuid.UUID
    queue: str
    monitor_key: str | None
    fired_at: datetime | None
    started_at: datetime | None
    heartbeat_at: datetime | None
    finished_at: datetime | None
    outcome: str | None
    label: str | None

    @property
    def state(self) -> str:
        """``starting`` (fired for, not registered), ``running`` or ``finished``."""
        if self.finished_at is not None:
            return "finished"
        return "starting" if self.started_at is None else "running"


def readers(broker: BrokerContext, queue: str | None = None) -> list[ReaderRow]:
    """The readers the broker knows of (all queues, or one), oldest first."""
    stmt = (
        select(_r, s.queue.c.name)
        .join(s.queue, s.queue.c.queue_id == _r.c.queue_id)
        .order_by(func.coalesce(_r.c.fired_at, _r.c.started_at), _r.c.reader_id)
    )
    if queue is not None:
        stmt = stmt.where(s.queue.c.name == queue)
    with broker.read_connection() as conn:
        return [
            ReaderRow(
                reader_id=r.reader_id,
                queue=r.name,
                monitor_key=r.monitor_key,
                fired_at=aware(r.fired_at),
                started_at=aware(r.started_at),
                heartbeat_at=aware(r.heartbeat_at),
                finished_at=aware(r.finished_at),
                outcome=r.outcome,
                label=r.label,
            )
            for r in conn.execute(stmt)
        ]


def register_reader(
    broker: BrokerContext,
    queue: str,
    *,
    max_readers: int | None = None,
    label: str | None = None,
    fire_id: str | None = None,
) -> tuple[uuid.UUID, bool]:
    """Register a reader of ``queue``; returns ``(reader_id, admitted)``.

    The reader takes the place of a reader a monitor fired for (``fire_id``, or the oldest one
    waiting), so that the monitor stops counting it as starting. It is refused (recorded with
    outcome ``refused``) when ``max_readers`` readers already run, or at least as many as there
    are conversation groups with messages: it would find nothing to read.
    """
    now = utcnow()
    with broker.engine.begin() as conn:
        qrow = queue_row(conn, queue)
        queue_id = qrow.queue_id
        lock_queue(conn, queue_id)
        obs = observe(conn, qrow)
        tidy(conn, queue_id, obs, now)
        live, _starting = counts(conn, queue_id)
        cap = max_readers or obs.activation.max_readers
        admitted = live < cap and live < obs.groups_ready
        waiting = and_(
            _r.c.queue_id == queue_id, _r.c.started_at.is_(None), _r.c.finished_at.is_(None)
        )
        claim = None
        if fire_id is not None:
            claim = conn.execute(
                select(_r.c.reader_id).where(waiting, _r.c.reader_id == uuid.UUID(fire_id))
            ).scalar()
        if claim is None:
            claim = conn.execute(
                select(_r.c.reader_id).where(waiting).order_by(_r.c.fired_at).limit(1)
            ).scalar()
        values: dict[str, Any] = {"started_at": now, "heartbeat_at": now, "label": label}
        if not admitted:
            values.update(finished_at=now, outcome="refused")
        if claim is not None:
            conn.execute(update(_r).where(_r.c.reader_id == claim).values(**values))
            reader_id: uuid.UUID = claim
        else:
            reader_id = uuid.uuid4()
            conn.execute(insert(_r).values(reader_id=reader_id, queue_id=queue_id, **values))
    if not admitted:
        log.info(
            "reader of queue %r not started: %d of at most %d readers run, %d group(s) have "
            "messages",
            queue,
            live,
            cap,
            obs.groups_ready,
        )
    return reader_id, admitted


def release_fires(broker: BrokerContext, fire_ids: list[str]) -> int:
    """Readers a monitor fired for that will never come, because one reader came for all of
    them (Airflow merges asset events that arrive before the run starts into one run): stop
    counting them, so that the monitor may start another reader if the queue still grows.
    Returns how many were still waiting."""
    ids = [uuid.UUID(str(f)) for f in fire_ids]
    if not ids:
        return 0
    with broker.engine.begin() as conn:
        return int(
            conn.execute(
                update(_r)
                .where(
                    _r.c.reader_id.in_(ids), _r.c.started_at.is_(None), _r.c.finished_at.is_(None)
                )
                .values(finished_at=utcnow(), outcome="merged")
            ).rowcount
        )


def heartbeat_reader(broker: BrokerContext, reader_id: uuid.UUID) -> None:
    """The reader is alive. A reader counted as lost (its heartbeat was late) counts again."""
    with broker.engine.begin() as conn:
        alive_or_lost = or_(_r.c.finished_at.is_(None), _r.c.outcome == "lost")
        conn.execute(
            update(_r)
            .where(_r.c.reader_id == reader_id, alive_or_lost)
            .values(heartbeat_at=utcnow(), finished_at=None, outcome=None)
        )


def finish_reader(broker: BrokerContext, reader_id: uuid.UUID, outcome: str = "drained") -> None:
    """The reader has stopped (``drained``, ``failed``, ``stopped``...)."""
    with broker.engine.begin() as conn:
        conn.execute(
            update(_r)
            .where(_r.c.reader_id == reader_id)
            .values(finished_at=utcnow(), outcome=outcome)
        )


class ReaderSlot:
    """A registered reader of a queue, for the length of a ``with`` block.

    Registers on entry (see :func:`register_reader`); while admitted, a daemon thread refreshes
    the heartbeat every :data:`HEARTBEAT_SECONDS`; on exit the reader is recorded as finished
    (``failed`` when the block raised).

    :ivar admitted: False when the reader was refused: the block should read nothing.
    """

    def __init__(
        self,
        broker: BrokerContext,
        queue: str,
        *,
        max_readers: int | None = None,
        label: str | None = None,
        fire_id: str | None = None,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
    ) -> None:
        self.broker = broker
        self.queue = queue
        self.max_readers = max_readers
        self.label = label
        self.fire_id = fire_id
        self.heartbeat_seconds = heartbeat_seconds
        self.reader_id: uuid.UUID | None = None
        self.admitted = False
        #: the outcome recorded on a clean exit
        self.outcome = "drained"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ReaderSlot:
        self.reader_id, self.admitted = register_reader(
            self.broker,
            self.queue,
            max_readers=self.max_readers,
            label=self.label,
            fire_id=self.fire_id,
        )
        if self.admitted:
            self._thread = threading.Thread(
                target=self._beat, name=f"broker-reader-heartbeat-{self.queue}", daemon=True
            )
            self._thread.start()
        return self

    def _beat(self) -> None:
        assert self.reader_id is not None
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                heartbeat_reader(self.broker, self.reader_id)
            except Exception:  # the next beat tries again; a reader is not killed by this
                log.warning("reader heartbeat on queue %r failed", self.queue, exc_info=True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.admitted and self.reader_id is not None:
            finish_reader(self.broker, self.reader_id, "failed" if exc_type else self.outcome)


# ---------------------------------------------------------------------------------------------
# The reader's loop
# ---------------------------------------------------------------------------------------------

#: A reader's handler: called with the transaction and the messages of one conversation group,
#: inside that transaction (it SENDs and ENDs through ``tx``; application state through
#: ``tx.connection``). Raising rolls the transaction back: the messages return to the queue.
Handler = Callable[["Transaction", "list[Message]"], Any]


@dataclass(frozen=True, slots=True)
class DrainReport:
    """What one reader did: transactions that received messages, and messages."""

    batches: int = 0
    messages: int = 0
    #: True when the reader stopped because the queue was empty (not max_batches or stop)
    drained: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_handler(handler: Handler | str) -> Handler:
    """A handler given as a callable, or as ``"package.module:function"``."""
    if callable(handler):
        return handler
    if not isinstance(handler, str) or ":" not in handler:
        raise InvalidDefinition(
            f"handler must be a callable or 'package.module:function', not {handler!r}"
        )
    module_name, _, attr = handler.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise InvalidDefinition(f"handler {handler!r} cannot be imported: {exc}") from exc
    if not callable(target):
        raise InvalidDefinition(f"handler {handler!r} is not callable")
    resolved: Handler = target
    return resolved


def drain(
    broker: BrokerContext,
    queue: str,
    handler: Handler,
    *,
    top: int | None = None,
    max_batches: int | None = None,
    wait_seconds: float = 0,
    stop: threading.Event | None = None,
    committed: Callable[[int], Any] | None = None,
) -> DrainReport:
    """Read ``queue`` until it is empty: one conversation group per transaction, each handed to
    ``handler(tx, messages)`` inside that transaction.

    :param top: at most this many messages per RECEIVE.
    :param max_batches: stop after this many transactions that received messages.
    :param wait_seconds: how long a RECEIVE waits for more messages before the reader decides
        the queue is empty (seed 004's activated procedures use ``WAITFOR (RECEIVE ...)``).
    :param stop: stop between two transactions once this is set (a batch already received
        with the previous COMMIT is handled first).
    :param committed: called with the number of messages after each transaction that received
        them has committed.
    """
    if max_batches is not None and (not isinstance(max_batches, int) or max_batches < 1):
        raise InvalidDefinition(f"max_batches must be a whole number >= 1, not {max_batches!r}")
    batches = messages = 0
    # On PostgreSQL each COMMIT travels with the next RECEIVE (Transaction.commit_and_receive):
    # tx is then the next transaction, already holding what it received.
    tx: Transaction | None = None
    received: list[Message] = []
    try:
        while max_batches is None or batches < max_batches:
            if tx is None:
                if stop is not None and stop.is_set():
                    return DrainReport(batches, messages, False)
                tx = Transaction(broker)
                received = tx.receive(queue, top=top, wait_seconds=wait_seconds)
            if not received:
                tx.commit()
                tx = None
                return DrainReport(batches, messages, True)
            handler(tx, received)
            last = (max_batches is not None and batches + 1 >= max_batches) or (
                stop is not None and stop.is_set()
            )
            done = len(received)
            if last:
                tx.commit()
                tx, received = None, []
            else:
                tx, received = tx.commit_and_receive(queue, top=top, wait_seconds=wait_seconds)
            batches += 1
            messages += done
            if committed is not None:
                committed(done)
    except BaseException:
        if tx is not None and not tx.ended:
            tx.rollback()
        raise
    return DrainReport(batches, messages, False)
