"""Received messages as XCom-safe data: plain dicts of str, int and None.

Airflow stores a task's return value as JSON (XCom), so :class:`~airflow_broker.Message` (UUIDs,
bytes) cannot be returned as it is. :func:`message_to_dict` keeps every RECEIVE column and gives
the body three ways, so that a downstream task can use whichever fits without decoding bytes.
This module is part of the engine: it imports nothing from Airflow.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
from collections.abc import Iterable
from typing import Any

from airflow_broker.messaging.objects import Message

#: The RECEIVE columns copied as they are (ints and strs).
PLAIN_COLUMNS = (
    "status",
    "priority",
    "queuing_order",
    "message_sequence_number",
    "service_name",
    "service_contract_name",
    "message_type_name",
    "validation",
)


def message_to_dict(message: Message) -> dict[str, Any]:
    """One received message as a JSON-serializable dict.

    Keys: the RECEIVE columns (``status``, ``priority``, ``queuing_order``,
    ``conversation_group_id``, ``conversation_handle``, ``message_sequence_number``,
    ``service_name``, ``service_contract_name``, ``message_type_name``, ``validation``), UUIDs as
    strings; the body as

    - ``body_text``: the body decoded as UTF-8, or None (no body, or not UTF-8);
    - ``body_base64``: the exact bytes, base64-encoded, or None for a message without a body;
    - ``body_json``: the body parsed as JSON, present **only** when it parses (so that a body
      ``null`` and a body that is not JSON can be told apart);

    and ``error``: ``[code, description]`` for a Service Broker Error message, else None.
    """
    out: dict[str, Any] = {name: getattr(message, name) for name in PLAIN_COLUMNS}
    out["conversation_group_id"] = str(message.conversation_group_id)
    out["conversation_handle"] = str(message.conversation_handle)
    body = message.message_body
    text: str | None = None
    if body is not None:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            text = None
    out["body_text"] = text
    out["body_base64"] = None if body is None else base64.b64encode(body).decode("ascii")
    if text is not None:
        with contextlib.suppress(ValueError):
            out["body_json"] = json.loads(text, parse_constant=_refuse_constant)
    error = message.error
    out["error"] = None if error is None else [error[0], error[1]]
    return out


def _refuse_constant(name: str) -> Any:
    # NaN and Infinity are not JSON: a body holding them gets no body_json (XCom must stay JSON).
    raise ValueError(f"{name} is not JSON")


def messages_to_dicts(messages: Iterable[Message]) -> list[dict[str, Any]]:
    """:func:`message_to_dict` of each message, in order."""
    return [message_to_dict(m) for m in messages]


def body_bytes(message: dict[str, Any]) -> bytes | None:
    """The exact body of a message dict made by :func:`message_to_dict` (None: no body)."""
    encoded = message.get("body_base64")
    if encoded is None:
        return None
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(
            f"body_base64 of message {message.get('conversation_handle')} is not base64: {exc}"
        ) from exc


__all__ = ["body_bytes", "message_to_dict", "messages_to_dicts"]
