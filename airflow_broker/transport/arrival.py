"""What an arriving message does to its endpoint here: the state it leads to, a secure
dialog's body opened, a conversation failed by what arrived (or by dialog security)."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.engine import Connection

from airflow_broker.constants import END_DIALOG, ERROR, SENDABLE_STATES
from airflow_broker.messaging.objects import error_body
from airflow_broker.messaging.rows import drop_waiting, insert_message
from airflow_broker.security import dialogs
from airflow_broker.security.crypto import SecurityFailure
from airflow_broker.storage import schema as s
from airflow_broker.transport.packets import Packet

log = logging.getLogger("airflow_broker")


def opened(key: bytes, p: Packet) -> Packet:
    """A message of a secure dialog with its body opened; :class:`SecurityFailure` when it came
    in clear or was altered on the way."""
    if not p.sealed:
        raise SecurityFailure(
            f"message {p.seq} of conversation {p.conversation_id} arrived in clear on a dialog "
            "secured by dialog security"
        )
    body = dialogs.open_body(
        key, p.conversation_id, p.from_initiator, p.seq, p.message_type, p.body
    )
    # Not dataclasses.replace: this runs once per message, and replace() costs 3x a call.
    return Packet(
        p.kind,
        p.conversation_id,
        p.from_initiator,
        p.from_service,
        p.from_broker_instance,
        p.to_service,
        p.to_broker_instance,
        p.seq,
        p.contract,
        p.message_type,
        p.validation,
        body,
        p.lifetime,
        p.hops,
        p.error_code,
        p.error_description,
    )


def next_state(state: str, message_type: str) -> str:
    """The state an endpoint goes to when an EndDialog or Error arrives in order."""
    if message_type == END_DIALOG:
        if state == "DO":
            return "CD"
        if state in SENDABLE_STATES:
            return "DI"
    elif message_type == ERROR:
        return "CD" if state in ("DO", "CD") else "ER"
    return state


def fail_endpoint(
    conn: Connection, ep: dict[str, Any], code: int, description: str, now: datetime
) -> None:
    """The conversation failed: this side gets an Error message and goes to ER; whatever it
    still had to send is dropped."""
    if ep["state"] in ("ER", "CD"):
        return
    e = s.conversation_endpoint
    handle = ep["conversation_handle"]
    conn.execute(
        insert_message(
            queue_id=ep["queue_id"],
            group_id=ep["conversation_group_id"],
            handle=handle,
            seq=ep["receive_sequence"],
            priority=ep["priority"],
            service_name=ep["service_name"],
            contract=ep["contract_name"],
            message_type=ERROR,
            validation="X",
            body=error_body(code, description),
            now=now,
        )
    )
    conn.execute(
        update(e).where(e.c.conversation_handle == handle).values(state="ER", timer_due_at=None)
    )
    conn.execute(drop_waiting(handle))
    ep["state"] = "ER"
    log.warning("conversation %s failed: %s", handle, description)
