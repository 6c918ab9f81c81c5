"""Delivery's common case between two PostgreSQL brokers, without packets: a conversation's
messages go from the sender's transmission rows into the far broker's queue in one COPY, and the
far broker answers with one number per conversation (it now has every message below it)
instead of one acknowledgment per message.

The far broker takes a conversation this way only when :class:`~.taker.Taker` would take every
one of its messages into the queue with nothing else to do (its in-order loop): the
conversation is for this broker, its endpoint here is open (or it is new and starts at 0, for a
hosted service with an enabled queue that accepts the contract), bound to the sender or to
nobody, not secure, with no message held for a gap; the messages follow its receive sequence
number without a gap (after any it already has) and are all of types this broker accepts from
that side whatever the body. Any other conversation goes as packets, as before, in a
transaction of its own. Exactly once and order rest where they rest for packets: the far
endpoints are locked, only messages at or above their receive sequence numbers go in, and the
numbers are raised in the same transaction.

Only between PostgreSQL brokers the sender reaches directly (not through the inbox of a role
that may only deliver, :mod:`.inbox`). A secure dialog's messages travel sealed, as packets
do: the far broker agrees the session key from the key exchange (or has it), opens every body
before it takes any, and leaves the conversation to packets if it cannot.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

import airflow_broker.transport.known as known
from airflow_broker.constants import (
    PRECEDENCE_NORMAL,
    SENDABLE_STATES,
    STATUS_READY,
)
from airflow_broker.messaging.rows import QUEUE_INSERT_COLUMNS
from airflow_broker.messaging.validation import VALIDATION_CODES
from airflow_broker.security import dialogs
from airflow_broker.security.crypto import SecurityFailure
from airflow_broker.storage import bulk
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow
from airflow_broker.storage.context import BrokerContext
from airflow_broker.transport.arrival import Definitions
from airflow_broker.transport.batch_rows import message_columns
from airflow_broker.transport.inbound import far_settings
from airflow_broker.transport.known import gapless
from airflow_broker.transport.taker import held_messages, lock_endpoints, target_endpoint

_NO_VALIDATION = VALIDATION_CODES["none"]


@dataclass(slots=True)
class Conversation:
    """One conversation's rows of a batch, as the sender's plan sees them."""

    #: the sender's endpoint
    handle: uuid.UUID
    conversation_id: uuid.UUID
    from_initiator: bool
    from_service: str
    to_service: str
    contract: str
    lifetime: datetime | None
    #: the broker instance the messages are for (None: whichever hosts the service)
    target: str | None
    #: transmission-queue rows, in sequence order
    rows: list[Any]
    #: dialog security: the bodies are sealed under the dialog's session key
    secure: bool = False
    #: dialog security: the initiator's key exchange, until the target has the key
    handshake: bytes | None = None


@dataclass(slots=True)
class Taken:
    """What the far broker took: per sender handle, the sequence number it has every message
    below; the messages it queued; and its instance id (the conversations bind to it)."""

    upto: dict[uuid.UUID, int]
    inserted: int
    instance_id: str


def accept(
    peer: BrokerContext, sender: str, conversations: Sequence[Conversation], taken: list[Taken]
) -> None:
    """Take what :mod:`this module <.direct>` can of ``conversations`` into ``peer``'s queues;
    appends what it took to ``taken`` (one :class:`Taken` a far transaction, as soon as it
    committed) and leaves the rest to packets. Known conversations in clear go first, in one
    statement (:func:`_accept_known`), the others in one transaction. Raises what the database
    raises (the caller sends what is left as packets then)."""
    rest = list(conversations)
    known = _accept_known(peer, sender, rest)
    if known is not None and known.upto:
        taken.append(known)
        rest = [c for c in rest if c.handle not in known.upto]
    if not rest:
        return
    with peer.engine.begin() as conn:
        settings = far_settings(peer, conn)  # Unreachable: not migrated, a restored copy
        if not settings.principal:
            # A mirror or a standby: the packets' push says so and tries the other addresses.
            return
        more, _left = _Accept(peer, conn, settings.instance_id, sender).run(rest)
    if more.upto:
        taken.append(more)


def _accept_known(
    peer: BrokerContext, sender: str, conversations: Sequence[Conversation]
) -> Taken | None:
    """The conversations ``peer`` has an endpoint for, in clear, taken in one round trip
    (:mod:`.known`); None when none was asked (none is known to be for ``peer``'s instance, or
    the function is missing there)."""
    asked = [
        c
        for c in conversations
        if c.target is not None
        and not c.secure
        and gapless([r.message_sequence_number for r in c.rows])
    ]
    if not asked or len({c.target for c in asked}) != 1 or not known.asks(peer):
        return None
    target = str(asked[0].target)
    offered = [
        known.Known(
            c.conversation_id, c.from_initiator, c.contract, [message_columns(r) for r in c.rows]
        )
        for c in asked
    ]
    took = known.accept_known(peer, sender, target, offered)
    if took is None:
        return None
    upto: dict[uuid.UUID, int] = {}
    inserted = 0
    for c in asked:
        answer = took.get((c.conversation_id, c.from_initiator))
        if answer is not None:
            upto[c.handle] = answer[0]
            inserted += answer[1]
    return Taken(upto, inserted, target)


class _Accept:
    """One transaction of the far broker taking conversations the common way."""

    def __init__(self, peer: BrokerContext, conn: Connection, me: str, sender: str) -> None:
        self.conn = conn
        self.me = me
        self.sender = sender
        self.defs = Definitions(peer, conn, me)
        self.now = utcnow()
        self.groups: list[dict[str, Any]] = []
        self.endpoints: list[dict[str, Any]] = []
        self.messages: list[tuple[Any, ...]] = []
        self.dialog_keys: list[dict[str, Any]] = []
        #: dialog security: the sealed session keys of the endpoints here, and certificates
        #: looked up in this transaction
        self.keyed: dict[uuid.UUID, bytes] = {}
        self.certificates: dict[Any, Any] = {}
        self.raised: list[dict[str, Any]] = []
        self.bindings: list[dict[str, Any]] = []
        self.upto: dict[uuid.UUID, int] = {}

    def run(self, conversations: Sequence[Conversation]) -> tuple[Taken, list[Conversation]]:
        hosted = self.defs.hosted()
        candidates: list[Conversation] = []
        rest: list[Conversation] = []
        for c in conversations:
            mine = c.target == self.me or (c.target is None and c.to_service in hosted)
            (candidates if mine and self._plain(c) else rest).append(c)
        if not candidates:
            return Taken({}, 0, self.me), rest
        endpoints = lock_endpoints(
            self.conn, [(c.conversation_id, not c.from_initiator) for c in candidates]
        )
        handles = [ep["conversation_handle"] for ep in endpoints.values()]
        waiting = held_messages(self.conn, handles)
        keyed = self.keyed = dialogs.keyed(self.conn, handles)
        for c in candidates:
            ep = endpoints.get((c.conversation_id, not c.from_initiator))
            if ep is None:
                taken = self._new(c)
            else:
                handle = ep["conversation_handle"]
                taken = (
                    handle not in waiting
                    and (c.secure or handle not in keyed)
                    and self._into(ep, c)
                )
            if not taken:
                rest.append(c)
        bulk.insert_rows(self.conn, s.conversation_group, self.groups)
        bulk.insert_rows(self.conn, s.conversation_endpoint, self.endpoints)
        bulk.insert_rows(self.conn, s.dialog_key, self.dialog_keys)
        bulk.copy_tuples(self.conn, s.message, QUEUE_INSERT_COLUMNS, self.messages)
        bulk.update_rows(self.conn, s.conversation_endpoint, "conversation_handle", self.raised)
        bulk.update_rows(
            self.conn,
            s.conversation_endpoint,
            "conversation_handle",
            self.bindings,
            only_if_null=("far_broker_instance",),
        )
        return Taken(self.upto, len(self.messages), self.me), rest

    def _plain(self, c: Conversation) -> bool:
        """Messages without a gap between them, all of types taken whatever the body."""
        plain = self.defs.plain
        following = c.rows[0].message_sequence_number
        for r in c.rows:
            seq, message_type, _body = message_columns(r)
            if seq != following or not plain(c.contract, c.from_initiator, message_type):
                return False
            following += 1
        return True

    def _new(self, c: Conversation) -> bool:
        """A dialog's first messages: its endpoint here, as the packets' accept makes it."""
        hosted = self.defs.hosted().get(c.to_service)
        if (
            not c.from_initiator  # a reply whose initiator's endpoint is gone here
            or c.rows[0].message_sequence_number != 0
            or hosted is None
            or hosted.router
            or not hosted.queue_status
            or not hosted.accepts(c.contract)
        ):
            return False
        priority = self.defs.priority(c.contract, c.to_service, c.from_service)
        ep, group = target_endpoint(
            c.conversation_id,
            c.from_initiator,
            c.to_service,
            c.from_service,
            self.sender,
            c.contract,
            hosted.queue_id,
            priority,
            c.lifetime,
            self.now,
        )
        handle, upto = ep["conversation_handle"], c.rows[-1].message_sequence_number + 1
        ep["receive_sequence"] = upto
        ok, bodies = self._opened(ep, c)
        if not ok:
            return False
        self.groups.append(group)
        self.endpoints.append(ep)
        self._queue(
            hosted.queue_id,
            ep["conversation_group_id"],
            handle,
            priority,
            c.to_service,
            c,
            0,
            bodies,
        )
        self.upto[c.handle] = upto
        return True

    def _opened(
        self, ep: dict[str, Any], c: Conversation
    ) -> tuple[bool, list[bytes | None] | None]:
        """Whether ``c`` can be taken, and a secure dialog's bodies opened with its session key
        (agreed now from the key exchange if this is the dialog's first batch here; None for a
        dialog that is not secure). Not if they cannot be opened: the packets' accept says why,
        or holds them."""
        if not c.secure:
            return True, None
        try:
            key, row = dialogs.for_receiving(
                self.conn,
                ep,
                c.handshake,
                c.from_service,
                c.rows[0].message_sequence_number,
                self.now,
                keys=self.keyed,
                memo=self.certificates,
            )
            bodies = [
                dialogs.open_body(key, c.conversation_id, c.from_initiator, seq, mtype, body)
                for seq, mtype, body in map(message_columns, c.rows)
            ]
        except (dialogs.Wait, SecurityFailure):
            return False, None
        if row is not None:
            self.dialog_keys.append(row)
        return True, bodies

    def _into(self, ep: dict[str, Any], c: Conversation) -> bool:
        """More messages of a conversation this broker has: those at or above its receive
        sequence number (the others it has already)."""
        recv = ep["receive_sequence"]
        bound = ep["far_broker_instance"]
        if (
            ep["state"] not in SENDABLE_STATES
            or bound not in (None, self.sender)
            or c.rows[0].message_sequence_number > recv
        ):
            return False
        ok, bodies = self._opened(ep, c)
        if not ok:
            return False
        upto = max(recv, c.rows[-1].message_sequence_number + 1)
        handle = ep["conversation_handle"]
        if upto > recv:
            self._queue(
                ep["queue_id"],
                ep["conversation_group_id"],
                handle,
                ep["priority"],
                ep["service_name"],
                c,
                recv,
                bodies,
            )
            self.raised.append({"conversation_handle": handle, "receive_sequence": upto})
        if bound is None:
            self.bindings.append(
                {"conversation_handle": handle, "far_broker_instance": self.sender}
            )
        self.upto[c.handle] = upto
        return True

    def _queue(
        self,
        queue: int,
        group: uuid.UUID,
        handle: uuid.UUID,
        priority: int,
        service: str,
        c: Conversation,
        start: int,
        bodies: list[bytes | None] | None,
    ) -> None:
        """The queue rows of ``c``'s messages from sequence number ``start`` on (``bodies``:
        opened, for a secure dialog)."""
        now, contract, add = self.now, c.contract, self.messages.append
        for i, r in enumerate(c.rows):
            seq, message_type, body = message_columns(r)
            if bodies is not None:
                body = bodies[i]
            if seq >= start:
                add(
                    (
                        queue,
                        group,
                        handle,
                        seq,
                        STATUS_READY,
                        priority,
                        PRECEDENCE_NORMAL,
                        service,
                        contract,
                        message_type,
                        _NO_VALIDATION,
                        body,
                        now,
                    )
                )


#: Conversations that a far broker took bound to it, if to none yet (locked in handle order,
#: as an acknowledgment's endpoints are).
_BIND = text(
    "UPDATE broker_conversation_endpoint SET far_broker_instance = :instance "
    "WHERE conversation_handle IN (SELECT conversation_handle FROM broker_conversation_endpoint "
    "WHERE conversation_handle = ANY(CAST(:handles AS uuid[])) AND far_broker_instance IS NULL "
    "ORDER BY conversation_handle FOR UPDATE)"
)


#: The transmission queue's rows by conversation and sequence number (bulk.delete_ranges).
TRANSMITTED = (s.transmission_queue, "conversation_handle", "message_sequence_number")


def record(
    conn: Connection,
    rows: dict[uuid.UUID, list[Any]],
    taken: Sequence[Taken],
    counts: dict[str, int],
    *,
    deferred: list[tuple[uuid.UUID, int, int]] | None = None,
) -> None:
    """The sender, in its batch's transaction: what far brokers took without packets out of
    its transmission queue (``rows``: the batch's rows by handle), the conversations bound to
    the broker that took them if to none yet, and the pass's counts. With ``deferred``, the
    rows' ranges are added to it instead, for the caller to delete (with its COMMIT: the rows
    are this transaction's, locked since the batch took them)."""
    for t in taken:
        ranges: list[tuple[uuid.UUID, int, int]] = []
        unbound: list[uuid.UUID] = []
        for handle in t.upto:
            msgs = rows[handle]
            # The far broker has every message below its number: all of this batch's rows (and
            # perhaps later ones another pass holds, which that pass removes).
            first, last = msgs[0].message_sequence_number, msgs[-1].message_sequence_number
            ranges.append((handle, first, last))
            counts["delivered"] += len(msgs)
            counts["acknowledged"] += len(msgs)
            if msgs[0].bound_instance is None:
                unbound.append(handle)
        if deferred is not None:
            deferred += ranges
        else:
            bulk.delete_ranges(conn, *TRANSMITTED, ranges)
        if unbound:
            conn.execute(_BIND, {"handles": sorted(unbound), "instance": t.instance_id})
