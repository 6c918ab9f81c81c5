"""A delivery pass on PostgreSQL in overlapping stages: while one batch waits on the far broker,
the next waits on the source database.

One batch at a time, a pass spends about half its time waiting on one database or the other, and
the two never overlap. Here three stages run at once, one batch in each:

1. this thread takes and plans batch k+2 (:meth:`Transport._take`: its rows locked in a source
   transaction of its own);
2. a pushing thread hands batch k+1 to its far brokers (:meth:`Transport._send`): far brokers
   take the batches in order, one at a time, as they do one pass at a time;
3. a recording thread applies batch k's answers in its source transaction and commits it
   (:meth:`Transport._finish`).

What a batch guarantees does not change: its rows stay locked from its SELECT to its commit, the
far broker commits before the source does, and a process that dies leaves at most the batches in
flight to be sent again (the far broker acknowledges the duplicates and writes nothing twice).

Batches in flight never share a conversation: a full batch takes the rest of its last
conversation (:meth:`Transport._take`'s ``room``) and the next batch starts after that
conversation, so a message sent on it meanwhile waits for the next pass; when a batch cannot
(a conversation longer than a batch, or the pass's budget) the pipeline drains before the next
batch. So recording one batch (an Error notice that drops a conversation's waiting rows, say)
never waits for rows another batch in flight holds, which would stop the pass: the batch
holding them commits only after it.

SQLite keeps one batch at a time: one writer, and no lock is held while far brokers are called.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy.engine import Connection

from airflow_broker.transport.packets import Outcome, Packet, _first_line

log = logging.getLogger("airflow_broker")


@dataclass(slots=True)
class Batch:
    """Transmission-queue rows taken in one source transaction (``conn``), and their plan."""

    conn: Connection
    rows: list[Any]
    plan: dict[str, Any]
    me: str
    now: datetime
    #: the next batch may take rows of its last conversation
    open_ended: bool


#: What one destination answered a batch: (the packets sent, the outcome or None, the failure).
Results = list[tuple[list[Packet], Outcome | None, str]]


class Transport(Protocol):
    """The pass whose batches the pipeline runs (:class:`~.outbound.Transport`): its batch size,
    how many batches it has in flight at most, and its stages."""

    BATCH: int
    IN_FLIGHT: int

    def _take(self, limit: int, retry_now: bool, after: list[Any], *, room: int) -> Batch | None:
        """Take and plan the next batch, in a new source transaction."""

    def _send(self, plan: dict[str, Any]) -> Results:
        """Push a batch's messages to their far brokers."""

    def _finish(self, batch: Batch, results: Results, counts: dict[str, int]) -> None:
        """Apply what the far brokers answered and commit the batch."""


def deliver_batches(
    transport: Transport, budget: int | None, retry_now: bool, counts: dict[str, int]
) -> None:
    """The pass's batches (at most ``budget`` messages), ``transport.IN_FLIGHT`` at once; the
    first failure of any stage is raised once the batches already taken have finished."""
    size = transport.BATCH
    after: list[Any] = []
    limit = size if budget is None else min(size, budget)
    room = size if budget is None else budget - limit
    first = transport._take(limit, retry_now, after, room=room)
    if first is None:
        return
    if len(first.rows) < limit:
        # Every due message fits in one batch (the pass's common case): no stage to overlap
        # with, so no threads; a message sent meanwhile waits for the next pass.
        try:
            transport._finish(first, transport._send(first.plan), counts)
        finally:
            first.conn.close()
        return
    if budget is not None:
        budget -= len(first.rows)
    flight: deque[Future[None]] = deque()
    with (
        ThreadPoolExecutor(1, thread_name_prefix="airflow-broker-push") as pushing,
        ThreadPoolExecutor(1, thread_name_prefix="airflow-broker-record") as recording,
    ):
        try:
            batch: Batch | None = first
            while batch is not None:
                try:
                    sent = pushing.submit(transport._send, batch.plan)
                except BaseException:
                    batch.conn.close()
                    raise
                flight.append(recording.submit(_finish, transport, batch, sent, counts))
                if batch.open_ended:
                    while flight:
                        flight.popleft().result()
                if budget is not None and budget <= 0:
                    break
                while flight and (len(flight) >= transport.IN_FLIGHT or flight[0].done()):
                    flight.popleft().result()  # a batch's failure stops the pass
                limit = size if budget is None else min(size, budget)
                room = size if budget is None else budget - limit
                batch = transport._take(limit, retry_now, after, room=room)
                if batch is not None and budget is not None:
                    budget -= len(batch.rows)
            while flight:
                flight.popleft().result()
        except BaseException:
            # Batches taken before the failure finish on their own: each commits what its far
            # brokers took, or rolls back.
            for left in flight:
                try:
                    left.result()
                except Exception as exc:  # the first failure is the one raised
                    log.warning("another delivery batch failed too: %s", _first_line(exc))
            raise


def _finish(transport: Transport, batch: Batch, sent: Future[Any], counts: dict[str, int]) -> None:
    """The recording stage: one batch's answers applied and committed, its connection closed
    (rolled back if its push failed)."""
    try:
        transport._finish(batch, sent.result(), counts)
    finally:
        batch.conn.close()
