"""ConversationMessageTrigger: wait, in the triggerer, for the next message on one conversation.

A long-running dialog (seed 004's purchase order lasts days) is a chain of short tasks, each of
which waits for the other side's next message. Waiting in a worker would hold a slot for days;
the deferrable ``ConversationSensor`` hands the wait to this trigger instead. It fires once, when
a message is ready on the conversation (without receiving it: the next task RECEIVEs it), and
fires an error event when the conversation does not exist, belongs to another queue, or is
closed with nothing left to read.

It wakes like :class:`~airflow_broker.provider.triggers.activation.QueueActivationTrigger` (LISTEN
on the queue's channel on PostgreSQL, polling on SQLite) and runs the broker's due work as it polls,
so
that a conversation timer fires (its DialogTimer is a message) even when no reader is running.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError

from airflow_broker.activation import due_step
from airflow_broker.constants import STATUS_READY, state_desc
from airflow_broker.errors import InvalidDefinition, UnknownObject
from airflow_broker.messaging.arguments import as_uuid
from airflow_broker.provider.compat import BaseTrigger, TriggerEvent
from airflow_broker.provider.triggers.activation import (
    MAX_BACKOFF,
    QueueWaiter,
    acquire_broker,
    hold_broker,
    release_broker,
)
from airflow_broker.provider.triggers.hub import IDLE, in_database, looks
from airflow_broker.storage import schema as s

if TYPE_CHECKING:
    from airflow_broker.broker import Broker

log = logging.getLogger("airflow_broker")


def conversation_ready(
    broker: Broker, queue: str, conversation_handle: Any
) -> dict[str, Any] | None:
    """What is ready on a conversation, as an event payload; None while nothing is.

    The payload has ``status`` ``"ready"`` (with ``queue``, ``queue_id``, ``conversation_handle``,
    ``conversation_group_id``, ``ready``: the number of ready messages, and
    ``message_type_name``: the one RECEIVE returns first) or ``"error"`` (with ``reason``:
    ``missing``, ``other_queue`` or ``closed``, and ``error``: why waiting is pointless).
    """
    handle = as_uuid(conversation_handle, "conversation handle")
    e, m = s.conversation_endpoint, s.message
    with broker.read_connection() as conn:
        qid = conn.execute(select(s.queue.c.queue_id).where(s.queue.c.name == queue)).scalar()
        if qid is None:
            raise UnknownObject(f"queue {queue!r} does not exist in this broker")
        base: dict[str, Any] = {
            "queue": queue,
            "queue_id": qid,
            "conversation_handle": str(handle),
        }
        ep = conn.execute(
            select(e.c.queue_id, e.c.conversation_group_id, e.c.state).where(
                e.c.conversation_handle == handle
            )
        ).first()
        if ep is None:
            return {
                **base,
                "status": "error",
                "reason": "missing",
                "error": f"conversation {handle} does not exist",
            }
        if ep.queue_id != qid:
            return {
                **base,
                "status": "error",
                "reason": "other_queue",
                "error": f"conversation {handle} is not on queue {queue!r}",
            }
        ready = (m.c.conversation_handle == handle, m.c.status == STATUS_READY)
        count = conn.execute(select(func.count()).where(*ready)).scalar_one()
        if count:
            first = conn.execute(
                select(m.c.message_type_name)
                .where(*ready)
                .order_by(m.c.priority.desc(), m.c.precedence, m.c.message_sequence_number)
                .limit(1)
            ).scalar()
            return {
                **base,
                "status": "ready",
                "conversation_group_id": str(ep.conversation_group_id),
                "ready": int(count),
                "message_type_name": first,
            }
        if ep.state == "CD":
            return {
                **base,
                "status": "error",
                "reason": "closed",
                "error": f"conversation {handle} is {state_desc(ep.state)} and has no messages",
            }
    return None


def idle_conversations(broker: Broker, handles: Sequence[str]) -> dict[str, Any]:
    """Of the conversations ``handles`` (as text), those with nothing for their trigger, each
    mapped to :data:`IDLE`: the endpoint exists and is not closed, and no message waits on it.
    The triggers waiting on many conversations of one queue are all woken by a message to any
    of them: this sorts them out in one statement, and only the others make their full look."""
    by_id = {as_uuid(h, "conversation handle"): h for h in handles}
    if not by_id:
        return {}
    e, m = s.conversation_endpoint, s.message
    waiting = select(m.c.conversation_handle).where(
        m.c.conversation_handle == e.c.conversation_handle, m.c.status == STATUS_READY
    )
    with broker.read_connection() as conn:
        rows = conn.execute(
            select(e.c.conversation_handle).where(
                e.c.conversation_handle.in_(list(by_id)), e.c.state != "CD", ~waiting.exists()
            )
        ).scalars()
        return {by_id[handle]: IDLE for handle in rows if handle in by_id}


class ConversationMessageTrigger(BaseTrigger):
    """Fires once a message is ready on ``conversation_handle`` (not received).

    :param queue: the queue of the conversation's local endpoint.
    :param conversation_handle: the local endpoint's handle (str or UUID).
    :param broker_conn_id: the Airflow connection of the broker database.
    :param poll_interval: the longest wait between two looks (seconds).
    """

    def __init__(
        self,
        queue: str,
        conversation_handle: str | uuid.UUID,
        broker_conn_id: str = "broker_default",
        poll_interval: float = 1.0,
    ) -> None:
        super().__init__()
        if not isinstance(poll_interval, int | float) or poll_interval <= 0:
            raise InvalidDefinition(f"poll_interval must be > 0, not {poll_interval!r}")
        self.queue_name = queue
        self.conversation_handle = str(as_uuid(conversation_handle, "conversation handle"))
        self.broker_conn_id = broker_conn_id
        self.poll_interval = float(poll_interval)
        self._held: Broker | None = None
        self._waiter: QueueWaiter | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "queue": self.queue_name,
                "conversation_handle": self.conversation_handle,
                "broker_conn_id": self.broker_conn_id,
                "poll_interval": self.poll_interval,
            },
        )

    def _broker(self) -> Broker:
        """The broker database of ``broker_conn_id`` (blocking)."""
        return acquire_broker(self.broker_conn_id)

    def _look(self, broker: Broker) -> tuple[dict[str, Any] | None, int]:
        due_step(broker)
        found = conversation_ready(broker, self.queue_name, self.conversation_handle)
        return found, self._queue_id(broker) if found is None else 0

    async def run(self) -> AsyncIterator[TriggerEvent]:
        broker = self._held = await hold_broker(self.broker_conn_id, self._broker)
        batch = looks(broker, due_step)
        failures = 0
        try:
            while True:
                if self._waiter is not None:
                    self._waiter.clear()
                try:
                    if self._waiter is None:
                        looked = await in_database(batch.key, self._look, broker)
                    else:
                        looked = await batch.ask(
                            idle_conversations,
                            self.conversation_handle,
                            functools.partial(self._look, broker),
                        )
                    failures = 0
                except DBAPIError as exc:
                    failures += 1
                    delay = min(self.poll_interval * 2 ** min(failures, 16), MAX_BACKOFF)
                    log.warning("waiting on conversation %s: %s", self.conversation_handle, exc)
                    await asyncio.sleep(delay)
                    continue
                except UnknownObject as exc:
                    yield TriggerEvent(
                        {
                            "status": "error",
                            "reason": "missing",
                            "queue": self.queue_name,
                            "conversation_handle": self.conversation_handle,
                            "error": str(exc),
                        }
                    )
                    return
                if looked is not IDLE:  # idle: nothing yet (polled still: an END writes none)
                    found, queue_id = looked
                    if found is not None:
                        yield TriggerEvent(found)
                        return
                if self._waiter is None:
                    self._waiter = QueueWaiter(broker, queue_id, self.poll_interval)
                    await self._waiter.open()
                    continue
                await self._waiter.wait()
        finally:
            await self.cleanup()

    def _queue_id(self, broker: Broker) -> int:
        with broker.read_connection() as conn:
            qid = conn.execute(
                select(s.queue.c.queue_id).where(s.queue.c.name == self.queue_name)
            ).scalar()
        if qid is None:
            raise UnknownObject(f"queue {self.queue_name!r} does not exist in this broker")
        return int(qid)

    async def cleanup(self) -> None:
        """Stop listening and give the broker back."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            await waiter.close()
        broker, self._held = self._held, None
        if broker is not None:
            release_broker(broker)


__all__ = ["ConversationMessageTrigger", "conversation_ready"]
