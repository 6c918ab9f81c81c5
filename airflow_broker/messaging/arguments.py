"""Checking and converting the arguments callers pass to the broker."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from airflow_broker.errors import InvalidDefinition

#: A conversation handle or group id, as a UUID or its string form.
Handle = uuid.UUID | str

#: "Argument not given" where None is a meaningful value (``alter_queue(activation=None)``).
UNSET: Any = object()


def as_uuid(value: Any, what: str) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except (ValueError, AttributeError, TypeError):
        raise InvalidDefinition(f"{what} {value!r} is not a UUID") from None


def as_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidDefinition(f"{what} name must be a non-empty string, not {value!r}")
    if len(value) > 256:
        raise InvalidDefinition(f"{what} name {value[:40]!r}... is longer than 256 characters")
    return value


def send_handles(handles: Handle | Sequence[Handle]) -> list[uuid.UUID]:
    """A SEND's conversation handles as a list of UUIDs: at least one, none twice."""
    if isinstance(handles, uuid.UUID | str):
        handle_list = [as_uuid(handles, "conversation handle")]
    else:
        handle_list = [as_uuid(h, "conversation handle") for h in handles]
    if not handle_list:
        raise InvalidDefinition("SEND needs at least one conversation handle")
    if len(set(handle_list)) != len(handle_list):
        raise InvalidDefinition("SEND names the same conversation handle twice")
    return handle_list
