"""The rows a message becomes: its INSERT into a queue, and its precedence within a dialog; and
the DELETE of what waits to leave a failed or ended side.

A receiver sees a dialog's DialogTimer first, then an Error, then the rest in order: the
``precedence`` column orders them ahead of the sequence number.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Delete,
    delete,
    insert,
)

from airflow_broker.constants import (
    DIALOG_TIMER,
    ERROR,
    PRECEDENCE_ERROR,
    PRECEDENCE_NORMAL,
    PRECEDENCE_TIMER,
    STATUS_READY,
)
from airflow_broker.storage import schema as s

#: The columns a message arriving in a queue is written with, in this order (the bulk writes of
#: delivery and of the Spark job's commit; the rest keep their defaults).
QUEUE_INSERT_COLUMNS = (
    "queue_id",
    "conversation_group_id",
    "conversation_handle",
    "message_sequence_number",
    "status",
    "priority",
    "precedence",
    "service_name",
    "service_contract_name",
    "message_type_name",
    "validation",
    "message_body",
    "enqueued_at",
)


def drop_waiting(handle: uuid.UUID) -> Delete:
    """Delete what waits in the transmission queue to leave endpoint ``handle`` (its side failed
    or ended: nothing more goes out from it)."""
    t = s.transmission_queue
    return delete(t).where(t.c.conversation_handle == handle)


def precedence(message_type: str) -> int:
    if message_type == DIALOG_TIMER:
        return PRECEDENCE_TIMER
    if message_type == ERROR:
        return PRECEDENCE_ERROR
    return PRECEDENCE_NORMAL


def insert_message(
    *,
    queue_id: int,
    group_id: uuid.UUID,
    handle: uuid.UUID,
    seq: int,
    priority: int,
    service_name: str,
    contract: str,
    message_type: str,
    validation: str,
    body: bytes | None,
    now: datetime,
    status: int = STATUS_READY,
) -> Any:
    """The INSERT of one message into a queue."""
    return insert(s.message).values(
        queue_id=queue_id,
        conversation_group_id=group_id,
        conversation_handle=handle,
        message_sequence_number=seq,
        status=status,
        priority=priority,
        precedence=precedence(message_type),
        service_name=service_name,
        service_contract_name=contract,
        message_type_name=message_type,
        validation=validation,
        message_body=body,
        enqueued_at=now,
    )


def to_endpoint(
    endpoint: Any,
    message_type: str,
    seq: int,
    body: bytes | None,
    validation: str,
    now: datetime,
    status: int = STATUS_READY,
) -> Any:
    """The INSERT of a message into an endpoint's own queue: an Error or DialogTimer for this
    side, or (status 3) the retained copy of a message it sent."""
    return insert_message(
        queue_id=endpoint.queue_id,
        group_id=endpoint.conversation_group_id,
        handle=endpoint.conversation_handle,
        seq=seq,
        priority=endpoint.priority,
        service_name=endpoint.service_name,
        contract=endpoint.contract_name,
        message_type=message_type,
        validation=validation,
        body=body,
        now=now,
        status=status,
    )
