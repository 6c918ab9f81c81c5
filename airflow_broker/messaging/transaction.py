"""The messaging transaction: BEGIN DIALOG, SEND, RECEIVE, END CONVERSATION and friends.

:class:`Transaction` puts together the shared core (:mod:`~airflow_broker.messaging.tx_core`),
RECEIVE (:mod:`~airflow_broker.messaging.receiving`) and END CONVERSATION
(:mod:`~airflow_broker.messaging.ending`); BEGIN DIALOG, SEND, conversation timers, MOVE
CONVERSATION and the endpoint view are here.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    func,
    insert,
    select,
    update,
)

from airflow_broker.constants import (
    DEFAULT,
    SENDABLE_STATES,
    STATUS_RETAINED_SENT,
    SYSTEM_MESSAGE_TYPES,
    state_desc,
)
from airflow_broker.errors import (
    BrokerError,
    ContractViolation,
    ConversationEnded,
    InvalidDefinition,
    UnknownObject,
)
from airflow_broker.messaging import dedupe
from airflow_broker.messaging.arguments import Handle, as_name, as_uuid, send_handles
from airflow_broker.messaging.delivery import Delivery
from airflow_broker.messaging.ending import Ending
from airflow_broker.messaging.failure import record_failed_attempts
from airflow_broker.messaging.fast_send import (
    SEND_MANY_DIRECT,
    SEND_MANY_PG,
    SEND_ONE_DIRECT,
    SEND_ONE_PG,
    SEND_PARAMS,
    endpoint_statement,
    far_endpoints_unchanged,
    fast_args,
    on_fast_path,
    send_fast,
)
from airflow_broker.messaging.lookups import (
    contract_exists,
    contract_rule,
    local_service_queue,
    priority_for,
)
from airflow_broker.messaging.objects import (
    ConversationEndpoint,
)
from airflow_broker.messaging.receiving import Receiving
from airflow_broker.messaging.rows import to_endpoint
from airflow_broker.messaging.validation import (
    VALIDATION_CODES,
    encode_body,
    validate_body,
)
from airflow_broker.storage import bulk, direct
from airflow_broker.storage import schema as s
from airflow_broker.storage.adapters import FailedHold
from airflow_broker.storage.clock import aware, utcnow
from airflow_broker.storage.endpoint_locks import ADVISORY_BUDGET, exclude_writers

log = logging.getLogger("airflow_broker")


class Transaction(Receiving, Ending):
    """A messaging transaction: BEGIN DIALOG, SEND, RECEIVE, END CONVERSATION and friends.

    Use as a context manager: it commits when the block ends and rolls back when it raises.
    Messages received in a transaction that rolls back return to their queue, and the rollback
    counts towards the queue's poison-message handling. ``tx.connection`` is the SQLAlchemy
    connection of this transaction, for application state that must commit with the messages.
    """

    def _record_failures(self, conn: Any, holds: list[FailedHold]) -> None:
        record_failed_attempts(self.broker, conn, holds, utcnow())

    # -- BEGIN DIALOG --------------------------------------------------------------------------
    def begin_dialog(
        self,
        from_service: str,
        to_service: str,
        contract: str = DEFAULT,
        broker_instance: str | None = None,
        lifetime_seconds: int | None = None,
        related_conversation: Handle | None = None,
        related_conversation_group: Handle | None = None,
        *,
        dedupe_key: str | None = None,
        encryption: bool = True,
    ) -> uuid.UUID:
        """BEGIN DIALOG CONVERSATION from a local service; returns the conversation handle.

        The target need not be reachable yet: the first SEND waits in the transmission queue
        until a route reaches ``to_service``.

        ``encryption`` (seed 004's ENCRYPTION, on by default): a dialog with another broker
        sends nothing until dialog security is configured for ``to_service`` (a remote service
        binding, certificates and the master key); its messages wait in the transmission queue
        with a reason naming what is missing. Off, messages travel in clear when no dialog
        security is configured, and sealed when it is. A dialog within one broker needs nothing.

        With ``dedupe_key`` (a string of at most 512 characters), idempotent per initiating
        service: when a BEGIN DIALOG from ``from_service`` with this key committed before (or
        ran earlier in this transaction), nothing is begun and the handle it returned is
        returned again, whatever the other arguments say."""
        if dedupe_key is not None:
            dedupe.check_key(dedupe_key)
        as_name(to_service, "target service")
        self._require_send(to_service)
        if related_conversation is not None and related_conversation_group is not None:
            raise InvalidDefinition(
                "give related_conversation or related_conversation_group, not both"
            )
        if lifetime_seconds is not None and (
            not isinstance(lifetime_seconds, int | float) or lifetime_seconds <= 0
        ):
            raise InvalidDefinition(
                f"lifetime_seconds must be a positive number, not {lifetime_seconds!r}"
            )
        if broker_instance is not None:
            broker_instance = str(as_uuid(broker_instance, "broker_instance"))
        self._check_open()
        # Checked against the broker's cached definitions, read again when not found there;
        # the service is read once more when the rows are written (messaging.begins).
        queue_id = local_service_queue(self.broker, self._conn, from_service)
        if queue_id is None:
            raise UnknownObject(f"service {from_service!r} is not a local service of this broker")
        if not contract_exists(self.broker, self._conn, contract):
            raise UnknownObject(f"contract {contract!r} does not exist in this broker")

        group: uuid.UUID | None = None
        new_group = True
        if related_conversation is not None:
            rel = as_uuid(related_conversation, "related_conversation")
            row = self._execute(
                select(
                    s.conversation_endpoint.c.conversation_group_id,
                    s.conversation_endpoint.c.queue_id,
                ).where(s.conversation_endpoint.c.conversation_handle == rel)
            ).first()
            if row is None:
                raise UnknownObject(f"related conversation {rel} does not exist in this broker")
            if row.queue_id != queue_id:
                raise InvalidDefinition(
                    f"related conversation {rel} is on another queue than service {from_service!r}"
                )
            group = row.conversation_group_id
            # Its group is ours to join unless it was removed meanwhile (the related
            # conversation closed and purged): then this dialog starts it again.
            new_group = self._join_group(group) is None
        elif related_conversation_group is not None:
            group = as_uuid(related_conversation_group, "related_conversation_group")
            joined = self._join_group(group)
            if joined is not None:
                if joined != queue_id:
                    raise InvalidDefinition(
                        f"conversation group {group} is on another queue than service "
                        f"{from_service!r}"
                    )
                new_group = False
        if group is None:
            group = uuid.uuid4()
        now = utcnow()
        handle = uuid.uuid4()
        if dedupe_key is not None:
            first = self._claim_begin(from_service, dedupe_key, handle, now)
            if first is not None:
                return first
        self._dirty = True
        endpoint = {
            "conversation_handle": handle,
            "conversation_id": uuid.uuid4(),
            "is_initiator": True,
            "conversation_group_id": group,
            "queue_id": queue_id,
            "service_name": from_service,
            "far_service": to_service,
            "far_broker_instance": broker_instance,
            "far_handle": None,
            "contract_name": contract,
            "state": "SO",
            "priority": priority_for(self.broker, self._conn, contract, from_service, to_service),
            "lifetime": now + timedelta(seconds=lifetime_seconds) if lifetime_seconds else None,
            "timer_due_at": None,
            "send_sequence": 0,
            "receive_sequence": 0,
            "created_at": now,
            "closed_at": None,
            "encryption": bool(encryption),
        }
        if self._owned and self.broker.client_role is None:
            self._begins.add(endpoint, new_group=new_group)  # written by the next statement
        else:
            if new_group:
                self._execute(
                    insert(s.conversation_group).values(
                        conversation_group_id=group, queue_id=queue_id
                    )
                )
            self._execute(insert(s.conversation_endpoint).values(**endpoint))
        if lifetime_seconds:
            self.broker.note_due(now + timedelta(seconds=lifetime_seconds))
        return handle

    def _claim_begin(
        self, from_service: str, key: str, handle: uuid.UUID, now: datetime
    ) -> uuid.UUID | None:
        """Claim a BEGIN DIALOG's dedupe key for ``handle``: None when claimed (begin the
        dialog), else the handle recorded with the key by the BEGIN that claimed it first."""
        scope = dedupe.service_scope(from_service)
        for _ in range(3):
            if dedupe.claim(self.connection, self.broker.dialect, key, [(scope, handle)], now):
                self._dirty = True
                return None
            first = dedupe.recorded(self.connection, scope, key)
            if first is not None:
                return first
            # Housekeeping removed the key between the two statements: claim it again.
        raise BrokerError(f"dedupe key {key!r} of service {from_service!r} kept changing")

    # -- SEND ----------------------------------------------------------------------------------
    def send(
        self,
        handles: Handle | Sequence[Handle],
        message_type: str = DEFAULT,
        body: Any = None,
        *,
        dedupe_key: str | None = None,
    ) -> None:
        """SEND ON CONVERSATION one message on one or several conversations, atomically: either
        every conversation gets it or (on any error) none does.

        With ``dedupe_key`` (a string of at most 512 characters), idempotent per conversation:
        a conversation on which a SEND with this key committed before (or ran earlier in this
        transaction) is skipped, the others get the message."""
        if dedupe_key is not None:
            dedupe.check_key(dedupe_key)
        handle_list = send_handles(handles)
        self._require_conversations(handle_list)
        if message_type in SYSTEM_MESSAGE_TYPES:
            raise ContractViolation(
                f"message type {message_type!r} is a system message type: the broker sends it"
            )
        payload = encode_body(body)
        now = utcnow()
        claimed: list[str] = []
        if dedupe_key is not None:
            handle_list, claimed = self._claim_sends(handle_list, dedupe_key, now)
            if not handle_list:
                return
        rest = handle_list
        try:
            rest = self._send_fast(handle_list, message_type, payload, now)
            if rest:
                self._send_general(rest, message_type, payload, now)
        except BaseException as exc:
            if len(rest) < len(handle_list):
                # Sent on some already: a SEND on several conversations reaches all or none.
                self._doomed = (
                    f"SEND on {len(handle_list)} conversations reached only "
                    f"{len(handle_list) - len(rest)}: {exc}; this transaction must roll back"
                )
            if dedupe_key is not None and isinstance(exc, Exception):
                self._give_back(dedupe_key, claimed)
            raise
        self._sent += len(handle_list)

    def _claim_sends(
        self, handles: list[uuid.UUID], key: str, now: datetime
    ) -> tuple[list[uuid.UUID], list[str]]:
        """Claim a SEND's dedupe key on each conversation: the conversations to send on, and
        the scopes claimed. On PostgreSQL the senders are locked first, as SEND locks them."""
        if self.broker.dialect == "postgresql":
            e = s.conversation_endpoint
            self._execute(
                select(e.c.conversation_handle)
                .where(e.c.conversation_handle.in_(handles))
                .order_by(e.c.conversation_handle)
                .with_for_update(key_share=True)  # FOR NO KEY UPDATE, as SEND takes it
            )
        scopes = [dedupe.conversation_scope(h) for h in handles]
        claimed = dedupe.claim(
            self.connection, self.broker.dialect, key, list(zip(scopes, handles, strict=True)), now
        )
        if claimed:
            self._dirty = True
        return [h for h, scope in zip(handles, scopes, strict=True) if scope in claimed], [
            scope for scope in scopes if scope in claimed
        ]

    def _send_general(
        self, handle_list: list[uuid.UUID], message_type: str, payload: bytes | None, now: datetime
    ) -> None:
        """SEND by the general path: every check with its precise error, then the writes."""
        rows = self._senders(handle_list)
        checked: list[tuple[Any, str]] = []
        validated: set[tuple[str, Any]] = set()
        for h in handle_list:
            row = rows.get(h)
            if row is None:
                raise UnknownObject(f"conversation handle {h} does not exist in this broker")
            self._check_sendable(row, now)
            sent_by, validation, schema_ = contract_rule(
                self.broker, self.connection, row.contract_name, message_type
            )
            side = "initiator" if row.is_initiator else "target"
            if sent_by not in (side, "any"):
                raise ContractViolation(
                    f"contract {row.contract_name!r} lets only the {sent_by} send message type "
                    f"{message_type!r}; conversation {h} is the {side} side"
                )
            if (validation, message_type) not in validated:
                validate_body(message_type, validation, schema_, payload)
                validated.add((validation, message_type))
            checked.append((row, VALIDATION_CODES[validation]))
        self._dirty = True
        fast = [row for row, _ in checked if on_fast_path(row)]
        if fast:
            send_fast(
                self.connection,
                self.broker.dialect,
                fast,
                message_type,
                payload,
                checked[0][1],
                now,
            )
        # Each conversation is routed once; what waits for another broker (or a queue) is
        # written in one statement, as are the senders' new sequence numbers.
        # (Sequence numbers first: routing may fail a conversation, and that must stand.)
        general = [(row, code) for row, code in checked if not on_fast_path(row)]
        bulk.update_rows(
            self.connection,
            s.conversation_endpoint,
            "conversation_handle",
            [
                {
                    "conversation_handle": row.conversation_handle,
                    "send_sequence": row.send_sequence + 1,
                    "state": "CO" if row.state == "SO" else row.state,
                }
                for row, _ in general
            ],
        )
        delivery = Delivery(self.broker, self.connection, batch=True)
        delivery.prefetch_sealing([row for row, _ in general if row.far_queue_id is None], now)
        for row, code in general:
            if row.own_retention:
                self._retain_sent(row, message_type, row.send_sequence, payload, code, now)
            delivery.route(row, message_type, row.send_sequence, payload, code, now)
        delivery.flush()

    def _senders(self, handles: list[uuid.UUID]) -> dict[uuid.UUID, Any]:
        """The sending endpoints (locked), with the far endpoints of local dialogs locked FOR
        KEY SHARE as the lock order asks: read again when a far endpoint was removed or moved
        between the read and its lock (the second read sees it, and nothing can change it
        any more)."""
        stmt = endpoint_statement(self.broker.dialect)
        if self.broker.dialect == "postgresql":
            # A locking read that waited re-reads the locked rows but not its subqueries (what
            # waits in the transmission queue): the reads below, once the locks are held, see
            # everything committed before.
            self._execute(stmt, {"handles": handles})
        for _ in range(3):
            rows = {r.conversation_handle: r for r in self._execute(stmt, {"handles": handles})}
            if self.broker.dialect != "postgresql" or far_endpoints_unchanged(
                self.connection, list(rows.values())
            ):
                return rows
        raise BrokerError(
            f"the far endpoints of conversations {handles} kept changing while SEND locked them"
        )

    def _send_fast(
        self, handles: list[uuid.UUID], message_type: str, payload: bytes | None, now: datetime
    ) -> list[uuid.UUID]:
        """PostgreSQL: SEND in one statement when every conversation is on the fast path.
        Returns the conversations still to send on by the general path: all of them when the
        statement wrote nothing, the few another transaction changed meanwhile, or none."""
        if self.broker.dialect != "postgresql":
            return handles
        # The far endpoints are locked in memory (advisory locks) up to a budget per
        # transaction, then by row locks (storage.endpoint_locks says why).
        in_memory = self._advisory_locked | set(handles)
        row_lock = len(in_memory) > ADVISORY_BUDGET
        args = fast_args(
            self.broker, self.connection, message_type, payload, now, row_lock=row_lock
        )
        if args is None:
            return handles
        if not row_lock:
            self._advisory_locked = in_memory
        single = len(handles) == 1
        target: Any = handles[0] if single else handles
        rows: Sequence[Any]
        if payload is None or len(payload) <= direct.MAX_LITERAL_BODY:
            # One round trip, BEGIN included (storage.direct).
            self._check_open()
            statement = SEND_ONE_DIRECT if single else SEND_MANY_DIRECT
            rows = direct.execute(self.connection, statement, [target, *args])
        else:  # a large body goes binary, through SQLAlchemy
            params = dict(zip(SEND_PARAMS, args, strict=True))
            params["handle" if single else "handles"] = target
            rows = self._execute(SEND_ONE_PG if single else SEND_MANY_PG, params).all()
        if single:  # broker_send_one: the sequence number sent, NULL when it wrote nothing
            return handles if rows[0][0] is None else []
        sent = {r[0] for r in rows}
        if sent:
            self._dirty = True
        return [h for h in handles if h not in sent]

    def _check_sendable(self, row: Any, now: datetime) -> None:
        lifetime = aware(row.lifetime)
        if row.state not in SENDABLE_STATES:
            raise ConversationEnded(
                f"conversation {row.conversation_handle} is {row.state} "
                f"({state_desc(row.state)}): nothing more can be sent on it"
            )
        if lifetime is not None and lifetime <= now:
            raise ConversationEnded(
                f"conversation {row.conversation_handle} has expired (lifetime ended {lifetime})"
            )

    def _retain_sent(
        self, row: Any, message_type: str, seq: int, payload: bytes | None, code: str, now: datetime
    ) -> None:
        self._execute(
            to_endpoint(row, message_type, seq, payload, code, now, status=STATUS_RETAINED_SENT)
        )

    # -- timers, groups, endpoints -------------------------------------------------------------
    def begin_conversation_timer(self, handle: Handle, timeout_seconds: float) -> None:
        """BEGIN CONVERSATION TIMER: a DialogTimer message arrives on this side's queue after
        ``timeout_seconds``. One timer per endpoint: setting it again re-arms it."""
        h = as_uuid(handle, "conversation handle")
        if (
            not isinstance(timeout_seconds, int | float)
            or isinstance(timeout_seconds, bool)
            or timeout_seconds < 0
        ):
            raise InvalidDefinition(f"timeout_seconds must be >= 0, not {timeout_seconds!r}")
        self._require_conversations([h])
        due = utcnow() + timedelta(seconds=timeout_seconds)
        self._check_open()
        if self._begins.set_timer(h, due):  # begun in this transaction, not written yet
            self.broker.note_due(due)
            return
        row = self._endpoint_row(h)
        if row.state in ("CD", "ER", "DO"):
            raise ConversationEnded(f"conversation {h} has ended ({row.state}): no timer on it")
        e = s.conversation_endpoint
        self._dirty = True
        self._execute(update(e).where(e.c.conversation_handle == h).values(timer_due_at=due))
        self.broker.note_due(due)

    def _join_group(self, group: uuid.UUID) -> int | None:
        """The queue of an existing conversation group a new endpoint goes into, or None if
        there is no such group. PostgreSQL: locked ``FOR KEY SHARE`` until the transaction ends
        (what a foreign key's check would lock), so that the group is not removed as empty
        before the endpoint commits (see :meth:`DueWork.purge_closed`); readers and their ``FOR NO
        KEY UPDATE`` are not kept waiting."""
        g = s.conversation_group
        stmt = select(g.c.queue_id).where(g.c.conversation_group_id == group)
        if self.broker.dialect == "postgresql":
            stmt = stmt.with_for_update(read=True, key_share=True)
        row = self._execute(stmt).first()
        return None if row is None else int(row.queue_id)

    def move_conversation(self, handle: Handle, to_conversation_group: Handle) -> None:
        """MOVE CONVERSATION into another conversation group on the same queue."""
        h = as_uuid(handle, "conversation handle")
        g = as_uuid(to_conversation_group, "conversation group")
        target = self._execute(
            select(s.conversation_group.c.queue_id).where(
                s.conversation_group.c.conversation_group_id == g
            )
        ).first()
        if target is None:
            raise UnknownObject(f"conversation group {g} does not exist in this broker")
        self._require_queue_id(target.queue_id)
        if self.broker.dialect == "postgresql":
            # Both groups first (rule 0 of the lock order), then the endpoint.
            self._lock_groups_of(h, g)
            # Read again under the lock: an empty group may have been removed meanwhile.
            if self._join_group(g) is None:
                raise UnknownObject(f"conversation group {g} does not exist in this broker")
        row = self._endpoint_row(h)
        if target.queue_id != row.queue_id:
            raise InvalidDefinition(
                f"conversation group {g} is on another queue than conversation {h}"
            )
        self._dirty = True
        e = s.conversation_endpoint
        if self.broker.dialect == "postgresql":
            # The lock order: moving an endpoint's messages waits for writers into its queue
            # (rule 3), so none of them files a message under the old group afterwards.
            exclude_writers(self.connection, [h])
            self._execute(
                select(e.c.conversation_handle)
                .where(e.c.conversation_handle == h)
                .with_for_update()
            )
        self._execute(update(e).where(e.c.conversation_handle == h).values(conversation_group_id=g))
        self._execute(
            update(s.message)
            .where(s.message.c.conversation_handle == h)
            .values(conversation_group_id=g)
        )

    def conversation(self, handle: Handle) -> ConversationEndpoint:
        """The local endpoint of a conversation."""
        h = as_uuid(handle, "conversation handle")
        e = s.conversation_endpoint
        f = e.alias("f")
        t = s.transmission_queue
        # A far endpoint in this database does not record what it was sent (see delivery.py):
        # what arrived is what it sent, less what still waits in its transmission queue.
        arrived = (
            select(
                f.c.send_sequence
                - select(func.count())
                .where(t.c.conversation_handle == f.c.conversation_handle)
                .scalar_subquery()
            )
            .where(f.c.conversation_handle == e.c.far_handle)
            .scalar_subquery()
        )
        row = self._execute(
            select(e, s.queue.c.name.label("queue_name"), arrived.label("arrived"))
            .join(s.queue, s.queue.c.queue_id == e.c.queue_id)
            .where(e.c.conversation_handle == h)
        ).first()
        if row is None:
            raise UnknownObject(f"conversation handle {h} does not exist in this broker")
        return ConversationEndpoint(
            conversation_handle=row.conversation_handle,
            conversation_id=row.conversation_id,
            conversation_group_id=row.conversation_group_id,
            is_initiator=row.is_initiator,
            service_name=row.service_name,
            far_service=row.far_service,
            far_broker_instance=row.far_broker_instance,
            contract_name=row.contract_name,
            state=row.state,
            lifetime=aware(row.lifetime),
            send_sequence=row.send_sequence,
            receive_sequence=max(row.receive_sequence, row.arrived or 0),
            priority=row.priority,
            queue_name=row.queue_name,
            timer_due_at=aware(row.timer_due_at),
        )
