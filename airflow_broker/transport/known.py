"""Known conversations in clear taken by the far broker in one statement, whatever carried them.

``broker_accept_plain`` (:mod:`airflow_broker.storage.accept_function`) takes the messages of
conversations the far broker has an endpoint for, in clear and of types it takes whatever the
body, in one round trip that commits on its own. Two paths use it: a sender's push without
packets (:mod:`.direct`) and a far broker taking packets (:class:`.inbound.Inbound`: from a
forwarder, from its inbox, from a sender on SQLite). Each gives it :class:`Known`
conversations, and takes the rest the general way afterwards.
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.exc import DBAPIError

from airflow_broker.storage import direct as storage_direct
from airflow_broker.storage.accept_function import ACCEPT_PLAIN
from airflow_broker.storage.clock import utcnow
from airflow_broker.storage.context import BrokerContext
from airflow_broker.storage.identity import copy_refusal
from airflow_broker.transport.packets import Unreachable

#: Bodies in one ``broker_accept_plain`` call at most (bytes): it writes them as hex text; a
#: batch of larger messages goes the general way, by COPY.
MAX_KNOWN_BODIES = 1 << 20

#: How long a far broker without ``broker_accept_plain`` (not upgraded) is not asked again.
_MISSING_FOR = 60.0
_missing: weakref.WeakKeyDictionary[BrokerContext, float] = weakref.WeakKeyDictionary()

#: SQLSTATE undefined_function: the far broker's schema predates ``broker_accept_plain``.
_UNDEFINED_FUNCTION = "42883"


@dataclass(slots=True)
class Known:
    """One conversation's messages for the far broker, in sequence order without a gap."""

    conversation_id: uuid.UUID
    from_initiator: bool
    contract: str
    #: (sequence number, message type, body)
    messages: list[tuple[int, str, bytes | None]]


def gapless(seqs: Sequence[int]) -> bool:
    """Whether the sequence numbers follow one another without a gap."""
    return all(n == seqs[0] + i for i, n in enumerate(seqs))


def asks(peer: BrokerContext) -> bool:
    """Whether ``peer`` may be asked (it was not found without the function a moment ago)."""
    return _missing.get(peer, 0.0) <= time.monotonic()


def accept_known(
    peer: BrokerContext, sender: str, target: str, conversations: Sequence[Known]
) -> dict[tuple[uuid.UUID, bool], tuple[int, int]] | None:
    """Offer ``conversations`` from broker instance ``sender`` to ``peer`` (broker instance
    ``target``); returns, for each it took, (conversation id, from initiator) -> (the number it
    now has every message below, how many it queued); None when it was not asked (bodies too
    large for one statement, or the function is missing there). Raises :class:`Unreachable`
    when ``peer`` is a copy or cannot be connected to, and what the statement raises."""
    if not conversations or not asks(peer):
        return None
    size = sum(len(body or b"") for c in conversations for _, _, body in c.messages)
    if size > MAX_KNOWN_BODIES:
        return None
    refused = copy_refusal(peer)
    if refused is not None:
        raise Unreachable(refused)
    of: list[int] = []
    seqs: list[int] = []
    types: list[str] = []
    bodies: list[bytes | None] = []
    for i, c in enumerate(conversations, 1):
        for seq, message_type, body in c.messages:
            of.append(i)
            seqs.append(seq)
            types.append(message_type)
            bodies.append(body)
    args = [
        sender,
        target,
        [c.conversation_id for c in conversations],
        [c.from_initiator for c in conversations],
        [c.contract for c in conversations],
        [c.messages[0][0] for c in conversations],
        [c.messages[-1][0] for c in conversations],
        of,
        seqs,
        types,
        bodies,
        utcnow(),
    ]
    try:
        fairy = peer.engine.raw_connection()
    except peer.engine.dialect.loaded_dbapi.Error as exc:  # not wrapped by the pool
        raise Unreachable(f"cannot connect: {exc}".strip()) from exc
    try:
        rows = storage_direct.execute_committed(fairy, peer.engine, ACCEPT_PLAIN, args)
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) != _UNDEFINED_FUNCTION:
            raise
        _missing[peer] = time.monotonic() + _MISSING_FOR
        return None
    finally:
        fairy.close()
    return {(cid, ini): (int(upto), int(n)) for cid, ini, upto, n in rows}


__all__ = ["MAX_KNOWN_BODIES", "Known", "accept_known", "asks", "gapless"]
