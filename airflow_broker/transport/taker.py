"""The far broker's receiving transaction, conversation by conversation: :class:`Taker` takes
the packets of a batch addressed to this broker (messages into queues, acknowledgments and
notices applied) in the caller's transaction; :func:`apply_answers` is a sender applying what far
brokers answered it, with the same code.

Each message whose sequence number is new for its conversation and direction goes in (early
arrivals are held until the gap fills); a dialog's first message creates its target endpoint;
what this broker cannot take is failed with an Error back; every message is acknowledged. The
common case (an open endpoint, in order, types this broker does not validate, no dialog
security) takes one tight loop (:meth:`Taker._in_order`).
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Boolean, Uuid, delete, select, tuple_, update
from sqlalchemy.engine import Connection

from airflow_broker.constants import (
    END_DIALOG,
    ERR_CONTRACT_NOT_SUPPORTED,
    ERR_SERVICE_NOT_FOUND,
    ERROR,
    SENDABLE_STATES,
    STATUS_NOT_COMPLETE,
    STATUS_READY,
)
from airflow_broker.messaging.objects import error_body
from airflow_broker.messaging.rows import precedence
from airflow_broker.messaging.validation import VALIDATION_CODES
from airflow_broker.security import dialogs
from airflow_broker.security.crypto import SecurityFailure
from airflow_broker.storage import bulk
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow
from airflow_broker.storage.context import BrokerContext
from airflow_broker.transport.arrival import Definitions, fail_endpoint, next_state, opened
from airflow_broker.transport.packets import (
    ACK,
    DROPPED,
    HELD,
    MESSAGE,
    NOTICE,
    Packet,
)

log = logging.getLogger("airflow_broker")

#: The validation code of a body nothing validated (what :meth:`Definitions.check` gives).
NO_VALIDATION = VALIDATION_CODES["none"]


class Taker:
    """One transaction of a broker taking the packets addressed to it."""

    def __init__(
        self,
        broker: BrokerContext,
        conn: Connection,
        instance_id: str,
        answers: list[Packet],
        notes: dict[int, tuple[str, str]],
    ) -> None:
        self.b = broker
        self.conn = conn
        self.me = instance_id
        self.answers = answers
        self.notes = notes
        self.now = utcnow()
        # Writes are collected and made set-based at the end of run(): a batch of a few hundred
        # messages on a few dozen conversations costs a handful of statements.
        self.new_groups: list[dict[str, Any]] = []
        self.new_endpoints: list[dict[str, Any]] = []
        self.new_messages: list[dict[str, Any]] = []
        self.sequences: list[dict[str, Any]] = []
        self.bindings: list[dict[str, Any]] = []
        self.acked: list[tuple[uuid.UUID, int]] = []
        self.defs = Definitions(broker, conn, instance_id)
        #: sequence number -> validation code, of the conversation being taken
        self.validation: dict[int, str] = {}
        #: dialog security: endpoints whose dialog is secure; session keys agreed now
        self.keyed: dict[uuid.UUID, bytes] = {}
        self.certificates: dict[Any, Any] = {}
        self.dialog_keys: list[dict[str, Any]] = []

    def run(self, packets: Sequence[Packet], indexes: list[int]) -> None:
        # The batch by conversation (this side's key), in one pass: its messages, its
        # acknowledgments and its notices.
        by_conversation: dict[tuple[uuid.UUID, bool], tuple[list[int], list[int], list[int]]] = {}
        for i in indexes:
            p = packets[i]
            key = (p.conversation_id, not p.from_initiator)
            kinds = by_conversation.get(key)
            if kinds is None:
                kinds = by_conversation[key] = ([], [], [])
            kinds[0 if p.kind == MESSAGE else 1 if p.kind == ACK else 2].append(i)
        endpoints = lock_endpoints(self.conn, list(by_conversation))
        receiving = [
            ep["conversation_handle"]
            for key, ep in endpoints.items()
            if by_conversation[key][0]  # with messages
        ]
        held = held_messages(self.conn, receiving)
        self.keyed = dialogs.keyed(self.conn, receiving)
        for key, (messages, acks, notices) in by_conversation.items():
            ep = endpoints.get(key)
            if ep is not None and acks:
                self._acks(ep, [packets[i] for i in acks])
            if ep is not None and notices:
                self._notice(ep, packets[notices[0]])
            if messages:
                messages.sort(key=lambda i: packets[i].seq)
                self._messages(ep, packets, messages, held)
        self._write()

    def _write(self) -> None:
        e = s.conversation_endpoint
        bulk.insert_rows(self.conn, s.conversation_group, self.new_groups)
        if self.new_endpoints:
            columns = sorted({c for ep in self.new_endpoints for c in ep} - {"_new"})
            bulk.insert_rows(
                self.conn, e, [{c: ep.get(c) for c in columns} for ep in self.new_endpoints]
            )
        bulk.insert_rows(self.conn, s.dialog_key, self.dialog_keys)
        bulk.insert_rows(self.conn, s.message, self.new_messages)
        bulk.update_rows(self.conn, e, "conversation_handle", self.sequences)
        bulk.update_rows(
            self.conn,
            e,
            "conversation_handle",
            self.bindings,
            only_if_null=("far_broker_instance",),
        )
        bulk.delete_runs(
            self.conn,
            s.transmission_queue,
            "conversation_handle",
            "message_sequence_number",
            self.acked,
        )

    # acknowledgments and notices for conversations of this broker
    def _acks(self, ep: dict[str, Any], acks: list[Packet]) -> None:
        by = acks[0].from_broker_instance
        bound = ep["far_broker_instance"]
        if bound is not None and bound != by:
            log.warning(
                "acknowledgment from broker instance %s for conversation %s ignored: the "
                "conversation is bound to broker instance %s",
                by,
                ep["conversation_handle"],
                bound,
            )
            return
        handle = ep["conversation_handle"]
        if bound is None:
            self.bindings.append({"conversation_handle": handle, "far_broker_instance": by})
            ep["far_broker_instance"] = by
        self.acked += [(handle, a.seq) for a in acks]

    def _notice(self, ep: dict[str, Any], notice: Packet) -> None:
        self._fail(
            ep,
            notice.error_code or ERR_SERVICE_NOT_FOUND,
            notice.error_description or "the conversation failed on the way",
        )

    def _fail(self, ep: dict[str, Any], code: int, description: str) -> None:
        if ep.get("_new"):
            # Not written yet: it is created failed, with its Error message.
            ep["state"] = "ER"
            self.new_messages.append(
                self._row(ep, ERROR, ep["receive_sequence"], "X", error_body(code, description))
            )
            log.warning("conversation %s failed: %s", ep["conversation_handle"], description)
        else:
            fail_endpoint(self.conn, ep, code, description, self.now)

    # messages
    def _messages(
        self,
        ep: dict[str, Any] | None,
        packets: Sequence[Packet],
        indexes: list[int],
        held: dict[uuid.UUID, dict[int, str]],
    ) -> None:
        first = packets[indexes[0]]
        if ep is None:
            if not first.from_initiator:
                # The initiator's endpoint is gone here (ended WITH CLEANUP): EndDialog and
                # Error need nothing more; anything else fails the target's side.
                if all(packets[i].message_type in (END_DIALOG, ERROR) for i in indexes):
                    self.answers += [packets[i].answer(ACK, self.me) for i in indexes]
                else:
                    self._fail_back(
                        first, ERR_SERVICE_NOT_FOUND, "the far endpoint no longer exists"
                    )
                return
            ep = self._new_endpoint(first, indexes, packets)
            if ep is None:
                note = self.notes.get(indexes[0])
                if note is not None:
                    for i in indexes[1:]:
                        self.notes[i] = note
                return
        bound = ep["far_broker_instance"]
        if bound is not None and bound != first.from_broker_instance:
            for i in indexes:
                self.notes[i] = (
                    DROPPED,
                    f"conversation {first.conversation_id} is bound to broker instance {bound} "
                    f"here, not to {first.from_broker_instance}",
                )
            return
        handle = ep["conversation_handle"]
        key: bytes | None = None
        if handle in self.keyed or any(packets[i].sealed for i in indexes):
            try:
                key = self._session_key(ep, packets, indexes)
            except dialogs.Wait as exc:
                for i in indexes:
                    self.notes[i] = (HELD, exc.reason)
                return
            except SecurityFailure as exc:
                self._fail_back(first, exc.code, exc.reason)
                self._fail(ep, exc.code, exc.reason)
                return
        self.validation = {}
        ep_held = held.setdefault(handle, {})
        expected = ep["receive_sequence"]
        state = ep["state"]
        if (
            key is None
            and not ep_held
            and state in SENDABLE_STATES
            and self._in_order(ep, packets, indexes)
        ):
            return
        start_state = state
        failure: tuple[int, str] | None = None
        for i in indexes:
            p = packets[i]
            if p.seq < expected or p.seq in ep_held:
                self.answers.append(p.answer(ACK, self.me))  # a duplicate: acknowledge again
                continue
            if state in ("ER", "CD"):
                self.answers.append(p.answer(ACK, self.me))
                continue
            if key is not None:
                try:
                    p = opened(key, p)
                except SecurityFailure as exc:
                    failure = (exc.code, exc.reason)
                    self._fail_back(p, *failure)
                    break
            failure = self._check(ep["contract_name"], p)
            if failure is not None:
                self._fail_back(p, *failure)
                break
            # An Error is taken at once, gap or not: END WITH ERROR dropped what its side had not
            # sent yet, so the gap before it never fills.
            if p.seq > expected and p.message_type != ERROR:
                self._enqueue(ep, p, STATUS_NOT_COMPLETE)
                ep_held[p.seq] = p.message_type
                self.answers.append(p.answer(ACK, self.me))
                continue
            state = self._arrive(ep, p, state)
            expected = p.seq + 1
            self.answers.append(p.answer(ACK, self.me))
            while expected in ep_held:
                promoted_type = ep_held.pop(expected)
                m = s.message
                self.conn.execute(
                    update(m)
                    .where(m.c.conversation_handle == handle)
                    .where(m.c.message_sequence_number == expected)
                    .where(m.c.status == STATUS_NOT_COMPLETE)
                    .values(status=STATUS_READY)
                )
                state = next_state(state, promoted_type)
                expected += 1
        values: dict[str, Any] = {}
        if expected != ep["receive_sequence"]:
            values["receive_sequence"] = expected
        if failure is not None:
            if values:
                self._update_endpoint(handle, values, ep)
            self._fail(ep, *failure)
            return
        if state != start_state:
            values["state"] = state
            if state in ("ER", "CD"):
                values["timer_due_at"] = None
            if state == "CD":
                values["closed_at"] = self.now
            if state == "ER":
                self.conn.execute(
                    delete(s.transmission_queue).where(
                        s.transmission_queue.c.conversation_handle == handle
                    )
                )
        if values:
            self._update_endpoint(handle, values, ep)

    def _in_order(self, ep: dict[str, Any], packets: Sequence[Packet], indexes: list[int]) -> bool:
        """The common case in one tight loop, or False (nothing done) if this conversation's
        messages are not all of it: an open endpoint that waits for no gap and whose dialog is
        not secure, messages that follow its receive sequence number without a gap (after any
        duplicates) and are all of types :meth:`Definitions.plain` accepts whatever their body.
        Each goes into the queue as the loop in :meth:`_messages` would put it, and is
        acknowledged."""
        expected = ep["receive_sequence"]
        following = expected
        contract = ep["contract_name"]
        plain = self.defs.plain
        for i in indexes:
            p = packets[i]
            if p.seq < expected:
                continue  # a duplicate: acknowledged again below
            if p.seq != following or not plain(contract, p.from_initiator, p.message_type):
                return False
            following += 1
        me, answers, rows, row = self.me, self.answers, self.new_messages, self._row
        for i in indexes:
            p = packets[i]
            if p.seq >= expected:
                rows.append(row(ep, p.message_type, p.seq, NO_VALIDATION, p.body))
            answers.append(p.answer(ACK, me))
        handle = ep["conversation_handle"]
        if following != expected:
            self._update_endpoint(handle, {"receive_sequence": following}, ep)
        return True

    def _session_key(
        self, ep: dict[str, Any], packets: Sequence[Packet], indexes: list[int]
    ) -> bytes:
        """The session key of a secure dialog's endpoint here, agreed now from the key exchange
        its initiator's messages carry if this is the first of them."""
        first = packets[indexes[0]]
        handshake = next((packets[i].handshake for i in indexes if packets[i].handshake), None)
        key, row = dialogs.for_receiving(
            self.conn,
            ep,
            handshake,
            first.from_service,
            first.seq,
            self.now,
            keys=self.keyed,
            memo=self.certificates,
        )
        if row is not None:
            self.dialog_keys.append(row)
        return key

    def _update_endpoint(
        self, handle: uuid.UUID, values: dict[str, Any], ep: dict[str, Any]
    ) -> None:
        if ep.get("_new"):
            ep.update(values)  # inserted with these values at the end
        elif set(values) == {"receive_sequence"}:
            self.sequences.append(
                {"conversation_handle": handle, "receive_sequence": values["receive_sequence"]}
            )
        else:
            e = s.conversation_endpoint
            self.conn.execute(update(e).where(e.c.conversation_handle == handle).values(**values))
        ep.update(values)

    def _arrive(self, ep: dict[str, Any], p: Packet, state: str) -> str:
        """An in-order message: into the queue (unless this side has ended), and the state it
        leads to."""
        if state in SENDABLE_STATES or state == "DI":
            self._enqueue(ep, p, STATUS_READY)
        return next_state(state, p.message_type)

    def _enqueue(self, ep: dict[str, Any], p: Packet, status: int) -> None:
        validation = self.validation.get(p.seq, p.validation)
        self.new_messages.append(self._row(ep, p.message_type, p.seq, validation, p.body, status))

    def _row(
        self,
        ep: dict[str, Any],
        message_type: str,
        seq: int,
        validation: str,
        body: bytes | None,
        status: int = STATUS_READY,
    ) -> dict[str, Any]:
        return {
            "queue_id": ep["queue_id"],
            "conversation_group_id": ep["conversation_group_id"],
            "conversation_handle": ep["conversation_handle"],
            "message_sequence_number": seq,
            "status": status,
            "priority": ep["priority"],
            "precedence": precedence(message_type),
            "service_name": ep["service_name"],
            "service_contract_name": ep["contract_name"],
            "message_type_name": message_type,
            "validation": validation,
            "message_body": body,
            "enqueued_at": self.now,
        }

    def _check(self, contract: str, p: Packet) -> tuple[int, str] | None:
        """Whether this broker accepts the message (:meth:`Definitions.check`); RECEIVE shows
        how this broker validated the body."""
        failure, code = self.defs.check(contract, p)
        if code is not None:
            self.validation[p.seq] = code
        return failure

    def _new_endpoint(
        self, first: Packet, indexes: list[int], packets: Sequence[Packet]
    ) -> dict[str, Any] | None:
        """The target endpoint a dialog's first message to arrive here creates."""
        hosted = self.defs.hosted().get(first.to_service)
        if hosted is None:
            self.notes[indexes[0]] = (
                DROPPED,
                f"service {first.to_service!r} is not hosted by broker instance {self.me}",
            )
            return None
        queue_id, queue_name = hosted.queue_id, hosted.queue_name
        if not hosted.accepts(first.contract):
            self._fail_back(
                first,
                ERR_CONTRACT_NOT_SUPPORTED,
                f"service {first.to_service!r} does not accept contract {first.contract!r}",
            )
            return None
        if not hosted.queue_status:
            self.notes[indexes[0]] = (
                DROPPED,
                f"the queue {queue_name!r} of service {first.to_service!r} is disabled",
            )
            return None
        if first.seq == 0:
            # A dialog whose first message is refused leaves nothing behind here.
            failure = self._check(first.contract, first)
            if failure is not None:
                self._fail_back(first, *failure)
                for i in indexes[1:]:
                    self.notes[i] = (DROPPED, "an earlier message of its conversation was refused")
                return None
        ep, group = target_endpoint(
            first.conversation_id,
            first.from_initiator,
            first.to_service,
            first.from_service,
            first.from_broker_instance,
            first.contract,
            queue_id,
            self.defs.priority(first.contract, first.to_service, first.from_service),
            first.lifetime,
            self.now,
        )
        self.new_groups.append(group)
        self.new_endpoints.append(ep)
        ep["_new"] = True
        return ep

    def _fail_back(self, p: Packet, code: int, description: str) -> None:
        log.warning("%s refused: %s", p.describe(), description)
        self.answers.append(p.answer(NOTICE, self.me, code, description))


def apply_answers(
    broker: BrokerContext, conn: Connection, me: str, answers: Sequence[Packet]
) -> tuple[int, int]:
    """A sender applies what far brokers answered it, in the caller's transaction:
    acknowledgments take messages out of the transmission queue (and bind the conversation to
    the broker that answered first), Error notices fail the conversation. Returns the counts
    of (acknowledgments, notices)."""
    Taker(broker, conn, me, [], {}).run(answers, list(range(len(answers))))
    acks = sum(1 for a in answers if a.kind == ACK)
    return acks, sum(1 for a in answers if a.kind == NOTICE)


def lock_endpoints(
    conn: Connection, keys: Sequence[tuple[uuid.UUID, bool]]
) -> dict[tuple[uuid.UUID, bool], dict[str, Any]]:
    """The endpoints here of ``(conversation id, is_initiator)`` keys, by key, locked in handle
    order (ORDER BY under FOR UPDATE) whatever the order of the keys: every writer that takes
    a batch of arriving conversations locks them so."""
    e = s.conversation_endpoint
    stmt = select(e).order_by(e.c.conversation_handle)
    if conn.dialect.name == "postgresql":  # one array per key: the same statement every batch
        k = bulk.keys_table("k", {"cid": Uuid(), "ini": Boolean()}, keys)
        on = (e.c.conversation_id == k.c.cid) & (e.c.is_initiator == k.c.ini)
        stmt = stmt.join(k, on).with_for_update(of=e)
    else:
        stmt = stmt.where(tuple_(e.c.conversation_id, e.c.is_initiator).in_(list(keys)))
    return {(r.conversation_id, r.is_initiator): dict(r._mapping) for r in conn.execute(stmt)}


def held_messages(
    conn: Connection, handles: Sequence[uuid.UUID]
) -> dict[uuid.UUID, dict[int, str]]:
    """Messages of these endpoints that arrived out of order and wait for the gap before them
    to fill: handle -> sequence number -> message type."""
    if not handles:
        return {}
    m = s.message
    held: dict[uuid.UUID, dict[int, str]] = defaultdict(dict)
    for r in conn.execute(
        select(m.c.conversation_handle, m.c.message_sequence_number, m.c.message_type_name)
        .where(bulk.any_of(m.c.conversation_handle, handles, conn.dialect.name))
        .where(m.c.status == STATUS_NOT_COMPLETE)
    ):
        held[r.conversation_handle][r.message_sequence_number] = r.message_type_name
    return held


def target_endpoint(
    conversation_id: uuid.UUID,
    from_initiator: bool,
    service: str,
    far_service: str,
    far_instance: str,
    contract: str,
    queue_id: int,
    priority: int,
    lifetime: Any,
    now: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rows of the endpoint a dialog's first message to arrive here creates, and of its
    new conversation group."""
    handle, group = uuid.uuid4(), uuid.uuid4()
    ep = {
        "conversation_handle": handle,
        "conversation_id": conversation_id,
        "is_initiator": not from_initiator,
        "conversation_group_id": group,
        "queue_id": queue_id,
        "service_name": service,
        "far_service": far_service,
        "far_broker_instance": far_instance,
        "far_handle": None,
        "contract_name": contract,
        "state": "CO",
        "priority": priority,
        "lifetime": lifetime,
        "send_sequence": 0,
        "receive_sequence": 0,
        "created_at": now,
    }
    return ep, {"conversation_group_id": group, "queue_id": queue_id}
