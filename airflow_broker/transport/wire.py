"""Packets as bytes: how a batch sits in a far broker's inbox, and how its answers come back.

A peer that may only deliver (:mod:`airflow_broker.transport.inbox`) cannot run the far broker's
accept; it writes the batch as one value, and the far broker reads it back. The format is JSON
(one array per packet, bodies and key exchanges in base64): explicit, versioned, and safe to
read from a writer the far broker trusts less than itself. :func:`load_packets` checks every
field's type, so a malformed batch is refused whole with :class:`MalformedBatch`.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from airflow_broker.errors import BrokerError
from airflow_broker.transport.packets import ACK, MESSAGE, NOTICE, Packet

VERSION = 1
_KINDS = frozenset({MESSAGE, ACK, NOTICE})


class MalformedBatch(BrokerError):
    """A batch (or its answers) that is not what :mod:`.wire` writes."""


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(value: Any) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise MalformedBatch("a binary field is not base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError as exc:
        raise MalformedBatch(f"a binary field is not base64: {exc}") from exc


def _packet_fields(p: Packet) -> list[Any]:
    return [
        p.kind,
        str(p.conversation_id),
        p.from_initiator,
        p.from_service,
        p.from_broker_instance,
        p.to_service,
        p.to_broker_instance,
        p.seq,
        p.contract,
        p.message_type,
        p.validation,
        _b64(p.body),
        None if p.lifetime is None else p.lifetime.isoformat(),
        p.hops,
        p.error_code,
        p.error_description,
        p.sealed,
        _b64(p.handshake),
    ]


def _typed(value: Any, kind: type | tuple[type, ...], what: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    # bool is an int: a sequence number or hop count must not be one.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedBatch(f"packet field {what} has the wrong type")
    return value


def _packet_of(fields: Any) -> Packet:
    if not isinstance(fields, list) or len(fields) != 18:
        raise MalformedBatch("a packet is not an array of 18 fields")
    kind = _typed(fields[0], str, "kind")
    if kind not in _KINDS:
        raise MalformedBatch(f"unknown packet kind {kind!r}")
    try:
        conversation_id = uuid.UUID(_typed(fields[1], str, "conversation_id"))
        lifetime_text = _typed(fields[12], str, "lifetime", optional=True)
        lifetime = None if lifetime_text is None else datetime.fromisoformat(lifetime_text)
    except ValueError as exc:
        raise MalformedBatch(f"a packet field does not parse: {exc}") from exc
    if lifetime is not None and lifetime.tzinfo is None:
        raise MalformedBatch("a packet's lifetime has no time zone")
    return Packet(
        kind,
        conversation_id,
        _typed(fields[2], bool, "from_initiator"),
        _typed(fields[3], str, "from_service"),
        _typed(fields[4], str, "from_broker_instance"),
        _typed(fields[5], str, "to_service"),
        _typed(fields[6], str, "to_broker_instance", optional=True),
        _typed(fields[7], int, "seq"),
        contract=_typed(fields[8], str, "contract"),
        message_type=_typed(fields[9], str, "message_type"),
        validation=_typed(fields[10], str, "validation"),
        body=_unb64(fields[11]),
        lifetime=lifetime,
        hops=_typed(fields[13], int, "hops"),
        error_code=_typed(fields[14], int, "error_code", optional=True),
        error_description=_typed(fields[15], str, "error_description", optional=True),
        sealed=_typed(fields[16], bool, "sealed"),
        handshake=_unb64(fields[17]),
    )


def _load(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise MalformedBatch(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise MalformedBatch(f"not a version {VERSION} batch")
    return doc


def dump_packets(packets: Sequence[Packet]) -> bytes:
    return json.dumps(
        {"v": VERSION, "packets": [_packet_fields(p) for p in packets]}, separators=(",", ":")
    ).encode()


def load_packets(data: bytes) -> list[Packet]:
    packets = _load(data).get("packets")
    if not isinstance(packets, list):
        raise MalformedBatch("no packets")
    return [_packet_of(f) for f in packets]


#: A note on a packet the far broker did not take for good, by the packet it is about:
#: (conversation_id, from_initiator, seq, kind HELD or DROPPED, reason).
Note = tuple[uuid.UUID, bool, int, str, str]


def dump_answers(answers: Sequence[Packet], notes: Sequence[Note]) -> bytes:
    return json.dumps(
        {
            "v": VERSION,
            "answers": [_packet_fields(a) for a in answers],
            "notes": [[str(c), i, q, k, r] for c, i, q, k, r in notes],
        },
        separators=(",", ":"),
    ).encode()


def load_answers(data: bytes) -> tuple[list[Packet], list[Note]]:
    doc = _load(data)
    answers, notes = doc.get("answers"), doc.get("notes")
    if not isinstance(answers, list) or not isinstance(notes, list):
        raise MalformedBatch("no answers")
    out: list[Note] = []
    for n in notes:
        if not isinstance(n, list) or len(n) != 5:
            raise MalformedBatch("a note is not an array of 5 fields")
        try:
            cid = uuid.UUID(_typed(n[0], str, "note conversation_id"))
        except ValueError as exc:
            raise MalformedBatch(str(exc)) from exc
        out.append(
            (
                cid,
                _typed(n[1], bool, "note from_initiator"),
                _typed(n[2], int, "note seq"),
                _typed(n[3], str, "note kind"),
                _typed(n[4], str, "note reason"),
            )
        )
    return [_packet_of(a) for a in answers], out
