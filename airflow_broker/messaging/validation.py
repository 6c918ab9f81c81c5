"""Message bodies: how values become bytes, and how message types validate them."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from defusedxml import ElementTree as SafeElementTree

from airflow_broker.constants import VALIDATIONS
from airflow_broker.errors import InvalidDefinition, MessageValidationError

#: One-letter codes of the RECEIVE ``validation`` column (Service Broker uses N, E and X).
VALIDATION_CODES = {
    "none": "N",
    "empty": "E",
    "json": "J",
    "json_schema": "S",
    "well_formed_xml": "X",
}


def encode_body(body: Any) -> bytes | None:
    """bytes as they are, str as UTF-8, None as no body, anything else as JSON."""
    if body is None or isinstance(body, bytes):
        return body
    if isinstance(body, bytearray | memoryview):
        return bytes(body)
    if isinstance(body, str):
        return body.encode("utf-8")
    try:
        return json.dumps(body, separators=(",", ":"), default=_json_default).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise MessageValidationError(
            f"message body of type {type(body).__name__} is not bytes, str or JSON-serializable: "
            f"{exc}"
        ) from exc


def _json_default(value: Any) -> Any:
    # Dates and UUIDs are common in business messages; send them as ISO strings / hex.
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if hasattr(value, "hex") and type(value).__name__ == "UUID":
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def check_definition(name: str, validation: str, json_schema: dict[str, Any] | None) -> None:
    """Refuse a message type definition that could never validate anything."""
    if validation not in VALIDATIONS:
        raise InvalidDefinition(
            f"message type {name!r}: validation {validation!r} is not one of "
            f"{', '.join(VALIDATIONS)}"
        )
    if validation == "json_schema":
        if not isinstance(json_schema, dict):
            raise InvalidDefinition(
                f"message type {name!r}: validation 'json_schema' needs json_schema={{...}}"
            )
        try:
            validator = jsonschema.validators.validator_for(json_schema)
            validator.check_schema(json_schema)
        except jsonschema.SchemaError as exc:
            raise InvalidDefinition(
                f"message type {name!r}: json_schema is not a valid JSON Schema: {exc.message}"
            ) from exc
    elif json_schema is not None:
        raise InvalidDefinition(
            f"message type {name!r}: json_schema is only allowed with validation 'json_schema'"
        )


def validate_body(
    message_type: str, validation: str, json_schema: dict[str, Any] | None, body: bytes | None
) -> None:
    """Raise :class:`MessageValidationError` unless ``body`` satisfies the message type."""
    if validation == "none":
        return
    if validation == "empty":
        if body:
            raise MessageValidationError(
                f"message type {message_type!r} has validation 'empty' but the body has "
                f"{len(body)} bytes"
            )
        return
    if body is None:
        raise MessageValidationError(
            f"message type {message_type!r} has validation {validation!r} but the message has "
            "no body"
        )
    if validation == "well_formed_xml":
        try:
            SafeElementTree.fromstring(body)
        except Exception as exc:  # ParseError and defusedxml's refusals alike
            raise MessageValidationError(
                f"message type {message_type!r} needs well-formed XML: {exc}"
            ) from exc
        return
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MessageValidationError(
            f"message type {message_type!r} needs a JSON body: {exc}"
        ) from exc
    if validation == "json_schema":
        assert json_schema is not None
        validator_cls = jsonschema.validators.validator_for(json_schema)
        error = jsonschema.exceptions.best_match(validator_cls(json_schema).iter_errors(document))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            raise MessageValidationError(
                f"message type {message_type!r}: body does not match its JSON schema at "
                f"{where}: {error.message}"
            )
