"""What an operator does: re-enable a queue, retry or drop waiting transmissions, end a
conversation. Each runs in one transaction, refuses bad input before it changes anything, and
records an ``operator_action`` event naming who did it.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.engine import Connection

from airflow_broker.errors import (
    InvalidDefinition,
    UnknownObject,
)
from airflow_broker.messaging.arguments import as_uuid
from airflow_broker.messaging.definitions import define
from airflow_broker.messaging.events import record_event
from airflow_broker.messaging.transaction import Transaction
from airflow_broker.operations.monitoring.models import (
    MAX_LIMIT,
    OPERATOR_ACTION,
    ActionResult,
    _e,
    _m,
    _queue_id,
    _t,
)
from airflow_broker.operations.monitoring.transmission import (
    _transmission_info,
    _transmission_select,
)
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow
from airflow_broker.transport import Transport

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext


def _record(conn: Connection, target: str, detail: str, actor: str | None) -> None:
    who = f"{actor}: " if actor else ""
    record_event(conn, OPERATOR_ACTION, target[:256], f"{who}{detail}")


def enable_queue(broker: BrokerContext, name: str, *, actor: str | None = None) -> ActionResult:
    """Re-enable a disabled queue (ALTER QUEUE ... STATUS = ON): its rollback count restarts
    and messages that waited for it in the transmission queue go on the next due pass. A queue
    that is already enabled is left as it is (``changed`` False)."""
    with define(broker) as d:
        conn = d.connection
        _queue_id(conn, name)
        enabled = conn.execute(
            select(s.queue.c.status).where(s.queue.c.name == name).with_for_update()
        ).scalar()
        if enabled:
            return ActionResult("enable_queue", name, False, f"queue {name!r} is already enabled")
        d.alter_queue(name, status=True)
        _record(conn, name, f"re-enabled queue {name!r}", actor)
    return ActionResult("enable_queue", name, True, f"queue {name!r} re-enabled")


def _count_waiting(conn: Connection, h: uuid.UUID) -> int:
    count = conn.execute(
        select(func.count()).select_from(_t).where(_t.c.conversation_handle == h)
    ).scalar_one()
    if not count:
        if conn.execute(select(_e.c.state).where(_e.c.conversation_handle == h)).first() is None:
            raise UnknownObject(f"conversation handle {h} does not exist in this broker")
        raise UnknownObject(f"conversation {h} has no messages in the transmission queue")
    return int(count)


def retry_transmission(
    broker: BrokerContext,
    handle: uuid.UUID | str,
    *,
    deliver: bool = True,
    actor: str | None = None,
) -> ActionResult:
    """Retry now: make every waiting message of a conversation due at once (forgetting its
    backoff), then, with ``deliver``, run one delivery pass (which also moves anything else
    that is due). ``data`` holds the pass's report and the messages of the conversation that
    still wait, with their reasons."""
    h = as_uuid(handle, "conversation handle")
    now = utcnow()
    with broker.engine.begin() as conn:
        count = _count_waiting(conn, h)
        # Each on its own again (out of the cause it waited for, if any), due now.
        conn.execute(
            update(_t)
            .where(_t.c.conversation_handle == h)
            .values(next_attempt_at=now, wait_id=None)
        )
        _record(conn, str(h), f"retry now of {count} waiting message(s)", actor)
    data: dict[str, Any] = {"rescheduled": count}
    if deliver:
        report = Transport(broker).deliver()
        data["delivery"] = dataclasses.asdict(report)
    with broker.read_connection() as conn:
        left = conn.execute(
            _transmission_select()
            .where(_t.c.conversation_handle == h)
            .order_by(_t.c.id)
            .limit(MAX_LIMIT)
        )
        data["waiting"] = [_transmission_info(r, utcnow()) for r in left]
    went = max(count - len(data["waiting"]), 0)
    detail = f"{count} message(s) made due now" + (
        f"; the delivery pass moved {went} of them" if deliver else ""
    )
    return ActionResult("retry_transmission", str(h), True, detail, data)


def drop_transmission(
    broker: BrokerContext,
    handle: uuid.UUID | str,
    *,
    message_id: int | None = None,
    actor: str | None = None,
) -> ActionResult:
    """Remove a conversation's waiting messages from the transmission queue (all of them, or
    the one ``message_id``). The far side never gets them: later messages of the dialog would
    wait for the gap, so end the conversation too unless it is meant to go on."""
    h = as_uuid(handle, "conversation handle")
    if message_id is not None and (
        not isinstance(message_id, int) or isinstance(message_id, bool) or message_id < 1
    ):
        raise InvalidDefinition(f"message_id must be a whole number >= 1, not {message_id!r}")
    with broker.engine.begin() as conn:
        _count_waiting(conn, h)
        conds = [_t.c.conversation_handle == h]
        if message_id is not None:
            conds.append(_t.c.id == message_id)
            if conn.execute(select(_t.c.id).where(*conds)).first() is None:
                raise UnknownObject(
                    f"message {message_id} of conversation {h} is not in the transmission queue"
                )
        dropped = conn.execute(delete(_t).where(*conds)).rowcount
        what = f"message {message_id}" if message_id is not None else f"{dropped} message(s)"
        _record(conn, str(h), f"dropped {what} from the transmission queue", actor)
    return ActionResult(
        "drop_transmission",
        str(h),
        True,
        f"dropped {what} of conversation {h} from the transmission queue",
        {"dropped": dropped},
    )


def end_conversation(
    broker: BrokerContext,
    handle: uuid.UUID | str,
    *,
    cleanup: bool = True,
    error_code: int | None = None,
    error_description: str | None = None,
    actor: str | None = None,
) -> ActionResult:
    """END CONVERSATION: WITH CLEANUP by default (the local endpoint, its queued messages and
    its waiting transmissions go, and nobody is told); ``cleanup=False`` ends it normally, or
    WITH ERROR given ``error_code`` and ``error_description``."""
    h = as_uuid(handle, "conversation handle")
    if cleanup and error_code is not None:
        raise InvalidDefinition("END CONVERSATION takes WITH ERROR or WITH CLEANUP, not both")
    with Transaction(broker) as tx:
        conn = tx.connection
        state = conn.execute(select(_e.c.state).where(_e.c.conversation_handle == h)).scalar()
        if state is None:
            raise UnknownObject(f"conversation handle {h} does not exist in this broker")
        messages = conn.execute(
            select(func.count()).select_from(_m).where(_m.c.conversation_handle == h)
        ).scalar_one()
        waiting = conn.execute(
            select(func.count()).select_from(_t).where(_t.c.conversation_handle == h)
        ).scalar_one()
        tx.end_conversation(
            h, error_code=error_code, error_description=error_description, cleanup=cleanup
        )
        how = (
            "WITH CLEANUP"
            if cleanup
            else f"WITH ERROR {error_code}"
            if error_code is not None
            else "normally"
        )
        _record(conn, str(h), f"ended conversation {how} (it was {state})", actor)
    return ActionResult(
        "end_conversation",
        str(h),
        True,
        f"conversation {h} ended {how}",
        {
            "previous_state": state,
            "messages_removed": int(messages),
            "transmissions_removed": int(waiting) if cleanup else 0,
        },
    )
