"""A queue's contents as an operator sees them: the messages waiting in it (a peek, paged, each
with a preview of its body) and the events of its failure handling (dead-lettering, poison
handling and ALTER QUEUE disabling it, re-enabling).

Nothing here receives or locks a message: :func:`waiting_messages` reads through
:func:`airflow_broker.operations.observation.peek_on`, the SELECT behind ``Broker.peek``.
"""

from __future__ import annotations

import base64
import codecs
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy import func, select

from airflow_broker.constants import STATUS_RECEIVED, STATUS_RETAINED_SENT
from airflow_broker.errors import InvalidDefinition
from airflow_broker.messaging.objects import BrokerEvent, DeadLetter
from airflow_broker.operations.monitoring.models import (
    DEFAULT_LIMIT,
    QUEUE_DISABLED,
    Page,
    _age,
    _check_offset,
    _m,
    check_page,
)
from airflow_broker.operations.monitoring.overview import events
from airflow_broker.operations.observation import check_peek, count_waiting, peek_on, peek_queue
from airflow_broker.storage.clock import utcnow

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

#: Characters of a body shown by default (``preview_chars``).
PREVIEW_CHARS = 200


#: The most characters of a body one preview may show.
MAX_PREVIEW_CHARS = 4000


#: Dead-lettering records this event, naming the queue the message was dead-lettered from.
DEAD_LETTERED = "dead_lettered"


#: ALTER QUEUE recorded this event when it re-enabled a queue.
QUEUE_ENABLED = "queue_enabled"


#: The events :func:`queue_events` lists.
QUEUE_EVENT_KINDS = (DEAD_LETTERED, QUEUE_DISABLED, QUEUE_ENABLED)


@dataclass(frozen=True, slots=True)
class BodyPreview:
    """The start of a message body, as text.

    ``encoding`` says how to read ``text``: ``"utf-8"`` (decoded, any invalid byte shown as
    U+FFFD) or ``"base64"`` (a binary body: the base64 of its first bytes); both None for a
    message without a body. ``truncated`` when the body goes on past the preview."""

    text: str | None
    encoding: str | None
    size: int | None
    truncated: bool


@dataclass(frozen=True, slots=True)
class WaitingMessage:
    """A message waiting in a queue, as a peek shows it (nothing received, nothing locked)."""

    queuing_order: int
    status: int
    priority: int
    conversation_handle: uuid.UUID
    conversation_group_id: uuid.UUID
    message_sequence_number: int
    service_name: str
    service_contract_name: str
    message_type_name: str
    validation: str
    enqueued_at: datetime | None
    age_seconds: float | None
    #: hand-outs so far that did not remove it (0: never received)
    receive_count: int
    #: on a dead-letter queue: where it came from and why
    dead_letter: DeadLetter | None
    body_preview: BodyPreview


@dataclass(frozen=True, slots=True)
class WaitingPage:
    """A page of a queue's waiting messages, in the order RECEIVE would take them, and what
    the queue keeps besides (retention)."""

    queue: str
    enabled: bool
    retention: bool
    #: messages kept by retention (received, or sent by this side): not waiting, not listed
    retained: int
    conversation_handle: uuid.UUID | None
    page: Page[WaitingMessage]


def _looks_binary(text: str) -> bool:
    """A NUL, or more than one character in ten undecodable: not meant to be read as text."""
    bad = text.count("\ufffd")
    return "\x00" in text or (bad > 0 and bad * 10 > len(text))


def body_preview(body: bytes | None, chars: int = PREVIEW_CHARS) -> BodyPreview:
    """The first ``chars`` characters of ``body`` decoded as UTF-8 (invalid bytes replaced),
    or, for a binary body, the base64 of its first bytes (about ``chars`` characters)."""
    if body is None:
        return BodyPreview(None, None, None, False)
    head = body[: chars * 4]  # a UTF-8 character is at most 4 bytes
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    # Not final when cut: a character split by the cut is left out, not replaced.
    text = decoder.decode(head, final=len(head) == len(body))
    if _looks_binary(text):
        shown = body[: chars * 3 // 4]
        encoded = base64.b64encode(shown).decode("ascii")
        return BodyPreview(encoded, "base64", len(body), len(shown) < len(body))
    truncated = len(head) < len(body) or len(text) > chars
    return BodyPreview(text[:chars], "utf-8", len(body), truncated)


def _check_preview(chars: int) -> None:
    if not isinstance(chars, int) or isinstance(chars, bool) or not 1 <= chars <= MAX_PREVIEW_CHARS:
        raise InvalidDefinition(
            f"preview_chars must be a whole number between 1 and {MAX_PREVIEW_CHARS}, not {chars!r}"
        )


def waiting_messages(
    broker: BrokerContext,
    name: str,
    *,
    conversation_handle: uuid.UUID | str | None = None,
    limit: int = DEFAULT_LIMIT,
    offset: int = 0,
    preview_chars: int = PREVIEW_CHARS,
) -> WaitingPage:
    """The messages waiting in queue ``name`` (or in one of its conversations), paged, in the
    order RECEIVE would take them (see :func:`airflow_broker.operations.observation.peek`), each
    with its age, receive count, dead-letter origin and a preview of its body."""
    check_page(limit, offset)
    _check_preview(preview_chars)
    handle = check_peek(limit, offset, conversation_handle)
    with broker.read_connection() as conn:
        q = peek_queue(conn, name)
        total = count_waiting(conn, q.queue_id, handle)
        _check_offset(offset, total, "waiting messages")
        messages = peek_on(conn, q.queue_id, top=limit, offset=offset, handle=handle)
        retained = 0
        if q.retention:
            retained = int(
                conn.execute(
                    select(func.count())
                    .select_from(_m)
                    .where(
                        _m.c.queue_id == q.queue_id,
                        _m.c.status.in_((STATUS_RECEIVED, STATUS_RETAINED_SENT)),
                    )
                ).scalar_one()
            )
    now = utcnow()
    items = [
        WaitingMessage(
            queuing_order=m.queuing_order,
            status=m.status,
            priority=m.priority,
            conversation_handle=m.conversation_handle,
            conversation_group_id=m.conversation_group_id,
            message_sequence_number=m.message_sequence_number,
            service_name=m.service_name,
            service_contract_name=m.service_contract_name,
            message_type_name=m.message_type_name,
            validation=m.validation,
            enqueued_at=m.enqueued_at,
            age_seconds=_age(now, m.enqueued_at),
            receive_count=m.receive_count,
            dead_letter=m.dead_letter,
            body_preview=body_preview(m.message_body, preview_chars),
        )
        for m in messages
    ]
    return WaitingPage(
        queue=q.name,
        enabled=bool(q.status),
        retention=bool(q.retention),
        retained=retained,
        conversation_handle=handle,
        page=Page(items, total, limit, offset),
    )


def queue_events(
    broker: BrokerContext, name: str, *, limit: int = DEFAULT_LIMIT, offset: int = 0
) -> Page[BrokerEvent]:
    """The failure-handling events of queue ``name``, newest first: messages dead-lettered
    from it (``dead_lettered``), the queue disabled (``queue_disabled``: by poison handling or
    ALTER QUEUE) and re-enabled (``queue_enabled``)."""
    check_page(limit, offset)
    with broker.read_connection() as conn:
        peek_queue(conn, name)
    return events(broker, object_name=name, kinds=QUEUE_EVENT_KINDS, limit=limit, offset=offset)


__all__ = [
    "DEAD_LETTERED",
    "MAX_PREVIEW_CHARS",
    "PREVIEW_CHARS",
    "QUEUE_ENABLED",
    "QUEUE_EVENT_KINDS",
    "BodyPreview",
    "WaitingMessage",
    "WaitingPage",
    "body_preview",
    "queue_events",
    "waiting_messages",
]
