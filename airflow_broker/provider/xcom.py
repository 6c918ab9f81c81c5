"""Received messages and leases as XCom-safe data: plain dicts of str, int and None.

Airflow stores a task's return value as JSON (XCom), so :class:`~airflow_broker.Message` (UUIDs,
bytes) cannot be returned as it is. :func:`message_to_dict` keeps every RECEIVE column and gives
the body three ways, so that a downstream task can use whichever fits without decoding bytes.
:func:`lease_to_dict` does the same for a :class:`~airflow_broker.Lease`, and
:func:`lease_from_xcom` gives the lease (with its messages) back to the task that completes it.
This module is part of the engine: it imports nothing from Airflow.
"""

from __future__ import annotations

import ast
import base64
import binascii
import contextlib
import json
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from airflow_broker.errors import InvalidDefinition
from airflow_broker.messaging.leases import Lease
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


def rendered_literal(text: str) -> Any:
    """A value a template rendered back to Python: JSON, or the Python literal Airflow renders
    an XCom list or dict as (``str()``). Raises ValueError when it is neither."""
    try:
        return json.loads(text)
    except ValueError:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"{text[:80]!r} is neither JSON nor a Python literal") from exc


def message_to_dict(message: Message) -> dict[str, Any]:
    """One received message as a JSON-serializable dict.

    Keys: the RECEIVE columns (``status``, ``priority``, ``queuing_order``,
    ``conversation_group_id``, ``conversation_handle``, ``message_sequence_number``,
    ``service_name``, ``service_contract_name``, ``message_type_name``, ``validation``), UUIDs as
    strings; ``receive_count`` (how many times the message has been handed out, this time
    included); the body as

    - ``body_text``: the body decoded as UTF-8, or None (no body, or not UTF-8);
    - ``body_base64``: the exact bytes, base64-encoded, or None for a message without a body;
    - ``body_json``: the body parsed as JSON, present **only** when it parses (so that a body
      ``null`` and a body that is not JSON can be told apart);

    and ``error``: ``[code, description]`` for a Service Broker Error message, else None.
    """
    out: dict[str, Any] = {name: getattr(message, name) for name in PLAIN_COLUMNS}
    out["conversation_group_id"] = str(message.conversation_group_id)
    out["conversation_handle"] = str(message.conversation_handle)
    out["receive_count"] = message.receive_count
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


def message_from_dict(message: dict[str, Any]) -> Message:
    """The :class:`~airflow_broker.Message` a dict made by :func:`message_to_dict` came from."""
    try:
        extra = {k: message[k] for k in ("receive_count",) if k in message}
        return Message(
            **{name: message[name] for name in PLAIN_COLUMNS},
            conversation_group_id=uuid.UUID(str(message["conversation_group_id"])),
            conversation_handle=uuid.UUID(str(message["conversation_handle"])),
            message_body=body_bytes(message),
            **extra,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidDefinition(
            f"not a received message (a message_to_dict dict): {type(exc).__name__} {exc}"
        ) from exc


# --------------------------------------------------------------------------------------------
# Leases (``Broker.lease``): what ReceiveOperator(lease_seconds=...) returns


def lease_to_dict(lease: Lease) -> dict[str, Any]:
    """A lease as a JSON-serializable dict: ``token``, ``queue``, ``conversation_group_id``
    (UUIDs as strings), ``expires_at`` (ISO 8601, UTC) and ``messages`` (each as
    :func:`message_to_dict` gives it). :func:`lease_from_xcom` reads it back."""
    expires_at = lease.expires_at
    if expires_at.tzinfo is None:
        expires_at = expires_at.replace(tzinfo=UTC)
    return {
        "token": str(lease.token),
        "queue": lease.queue,
        "conversation_group_id": str(lease.conversation_group_id),
        "expires_at": expires_at.isoformat(),
        "messages": messages_to_dicts(lease.messages),
    }


def lease_from_xcom(value: Any, field: str = "lease") -> Lease | None:
    """The :class:`~airflow_broker.Lease` of a :func:`lease_to_dict` dict, as it comes from XCom:
    natively (``receive.output``) or rendered by a template as text (the dict's Python literal,
    or JSON). None, an empty string or an empty dict (no lease: the queue had nothing) give None;
    anything else that is not a lease raises :class:`~airflow_broker.errors.InvalidDefinition`
    naming ``field``."""
    if isinstance(value, Lease):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text in ("", "None", "null"):
            return None
        try:
            value = rendered_literal(text)
        except ValueError:
            raise InvalidDefinition(
                f"{field} {text[:80]!r} is not a lease (ReceiveOperator(lease_seconds=...)'s "
                "return value)"
            ) from None
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise InvalidDefinition(
            f"{field} must be a lease (ReceiveOperator(lease_seconds=...)'s return value), "
            f"not {type(value).__name__} {value!r:.80}"
        )
    try:
        expires_at = datetime.fromisoformat(str(value["expires_at"]))
        return Lease(
            token=uuid.UUID(str(value["token"])),
            queue=str(value["queue"]),
            messages=[message_from_dict(m) for m in value["messages"]],
            conversation_group_id=uuid.UUID(str(value["conversation_group_id"])),
            expires_at=expires_at if expires_at.tzinfo else expires_at.replace(tzinfo=UTC),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidDefinition(
            f"{field} is not a lease (ReceiveOperator(lease_seconds=...)'s return value): "
            f"{type(exc).__name__} {exc}"
        ) from exc


__all__ = [
    "body_bytes",
    "lease_from_xcom",
    "lease_to_dict",
    "message_from_dict",
    "message_to_dict",
    "messages_to_dicts",
]
