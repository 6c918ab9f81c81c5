"""Message bodies: how values become bytes, and how message types validate them."""

from __future__ import annotations

import functools
import json
import warnings
from typing import TYPE_CHECKING, Any

import jsonschema
from defusedxml import ElementTree as SafeElementTree

from airflow_broker.constants import VALIDATIONS
from airflow_broker.errors import InvalidDefinition, MessageValidationError

if TYPE_CHECKING:
    from xmlschema import XMLSchemaBase

#: One-letter codes of the RECEIVE ``validation`` column (Service Broker uses N, E and X).
VALIDATION_CODES = {
    "none": "N",
    "empty": "E",
    "json": "J",
    "json_schema": "S",
    "well_formed_xml": "X",
    "xml_schema": "V",
}

#: Compiled XML schemas kept per process (see :func:`compiled_xml_schema`).
XML_SCHEMA_CACHE_SIZE = 128
#: Said of a schema that names another document (an include, an import with a location).
_WHOLE = "(the broker reads no other document: give the whole schema in one)"


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


def check_definition(
    name: str,
    validation: str,
    json_schema: dict[str, Any] | None,
    xml_schema: str | None = None,
) -> None:
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
    if validation == "xml_schema":
        if not isinstance(xml_schema, str) or not xml_schema.strip():
            raise InvalidDefinition(
                f"message type {name!r}: validation 'xml_schema' needs xml_schema='<xs:schema ...>'"
            )
        complaint = xml_schema_complaint(xml_schema)
        if complaint is not None:
            raise InvalidDefinition(
                f"message type {name!r}: xml_schema is not a valid XML Schema: {complaint}"
            )
    elif xml_schema is not None:
        raise InvalidDefinition(
            f"message type {name!r}: xml_schema is only allowed with validation 'xml_schema'"
        )


def _build_xml_schema(text: str) -> XMLSchemaBase:
    """An XSD 1.0 schema from its text. Nothing outside the text is read: no file, no URL (an
    ``xs:include`` or ``xs:import`` with a location fails), and the text is parsed defused."""
    import xmlschema  # here: importing it costs half a second that most processes never need

    if not text.lstrip().startswith("<"):
        # xmlschema would take the string for a file name or a URL
        raise ValueError("it is not XML text (give the schema itself, not a file name or URL)")
    return xmlschema.XMLSchema10(text, allow="none", defuse="always")


def _complaint(exc: Exception) -> str:
    """The library's complaint in one line: what is wrong, and where when it says."""
    message = getattr(exc, "reason", None) or getattr(exc, "message", None)
    if not message:
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    path = getattr(exc, "path", None)
    return f"{str(message).rstrip(':')} (at {path})" if path else str(message).rstrip(":")


def xml_schema_complaint(text: str) -> str | None:
    """Why ``text`` is not an XML Schema that message bodies can be validated against (the
    library's complaint), or None when it is one."""
    from xmlschema.exceptions import XMLResourceBlocked

    try:
        with warnings.catch_warnings():
            # An import that could not be read: reported below, not printed.
            warnings.simplefilter("ignore")
            schema = _build_xml_schema(text)
    except XMLResourceBlocked as exc:  # an include (or redefine) with a location
        return f"{_complaint(exc)} {_WHOLE}"
    except Exception as exc:  # parse errors, bad components alike
        return _complaint(exc)
    if schema.warnings:
        return f"{str(schema.warnings[0]).rstrip('.')} {_WHOLE}"
    return None


@functools.lru_cache(maxsize=XML_SCHEMA_CACHE_SIZE)
def compiled_xml_schema(message_type: str, text: str) -> XMLSchemaBase:
    """The schema ``text`` of ``message_type``, compiled once per process: SEND does not parse
    the XSD again. Keyed by the text, so a schema altered here or in another process is compiled
    afresh as soon as the definition is read again."""
    try:
        return _build_xml_schema(text)
    except Exception as exc:  # checked at CREATE / ALTER: only a library change gets here
        raise MessageValidationError(
            f"message type {message_type!r}: its xml_schema does not compile: {_complaint(exc)}"
        ) from exc


def validate_body(message_type: str, validation: str, schema: Any, body: bytes | None) -> None:
    """Raise :class:`MessageValidationError` unless ``body`` satisfies the message type.

    ``schema``: the message type's JSON schema (a dict) with ``validation="json_schema"``, its
    XML schema text with ``validation="xml_schema"``, else None."""
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
    if validation in ("well_formed_xml", "xml_schema"):
        try:
            root = SafeElementTree.fromstring(body)
        except Exception as exc:  # ParseError and defusedxml's refusals alike
            raise MessageValidationError(
                f"message type {message_type!r} needs well-formed XML: {exc}"
            ) from exc
        if validation == "xml_schema":
            assert isinstance(schema, str)
            error = next(compiled_xml_schema(message_type, schema).iter_errors(root), None)
            if error is not None:
                raise MessageValidationError(
                    f"message type {message_type!r}: body does not match its XML schema at "
                    f"{error.path or '(root)'}: {error.reason or error.message}"
                )
        return
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MessageValidationError(
            f"message type {message_type!r} needs a JSON body: {exc}"
        ) from exc
    if validation == "json_schema":
        assert schema is not None
        validator_cls = jsonschema.validators.validator_for(schema)
        error = jsonschema.exceptions.best_match(validator_cls(schema).iter_errors(document))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            raise MessageValidationError(
                f"message type {message_type!r}: body does not match its JSON schema at "
                f"{where}: {error.message}"
            )
