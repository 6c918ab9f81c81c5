"""The messaging transaction: BEGIN DIALOG, SEND, RECEIVE, END CONVERSATION and friends."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Row,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.engine import Connection

from airflow_broker import bulk, metrics, queries
from airflow_broker import schema as s
from airflow_broker.arguments import Handle, as_name, as_uuid
from airflow_broker.constants import (
    DEFAULT,
    END_DIALOG,
    ERROR,
    SENDABLE_STATES,
    STATUS_READY,
    STATUS_RETAINED_SENT,
    SYSTEM_MESSAGE_TYPES,
    state_desc,
)
from airflow_broker.delivery import (
    SEND_MANY_PG,
    SEND_ONE_PG,
    Delivery,
    contract_rule,
    endpoint_statement,
    message_type_def,
    on_fast_path,
    precedence,
    priority_for,
    send_fast,
    to_endpoint,
)
from airflow_broker.duework import DueWork
from airflow_broker.engines import Lease, aware, utcnow
from airflow_broker.errors import (
    BrokerError,
    ContractViolation,
    ConversationEnded,
    InvalidDefinition,
    MessageValidationError,
    QueueDisabled,
    UnknownObject,
)
from airflow_broker.events import record_rollbacks
from airflow_broker.objects import (
    ConversationEndpoint,
    Message,
    error_body,
)
from airflow_broker.validation import (
    VALIDATION_CODES,
    encode_body,
    validate_body,
)

if TYPE_CHECKING:
    from airflow_broker.broker import Broker

log = logging.getLogger("airflow_broker")

#: RECEIVE runs the due-work step when something this process knows of falls due (a timer or
#: lifetime it set, or the earliest one the last pass saw), and at least this often otherwise, to
#: notice what other processes set and readers that died.
DUE_POLL_SECONDS = 1.0
#: Longest single sleep of a waiting RECEIVE: bounds how late a due timer is noticed.
MAX_WAIT_SLICE = 0.5

# ---------------------------------------------------------------------------------------------
# Transaction
# ---------------------------------------------------------------------------------------------


class Transaction:
    """A messaging transaction: BEGIN DIALOG, SEND, RECEIVE, END CONVERSATION and friends.

    Use as a context manager: it commits when the block ends and rolls back when it raises.
    Messages received in a transaction that rolls back return to their queue, and the rollback
    counts towards the queue's poison-message handling. ``tx.connection`` is the SQLAlchemy
    connection of this transaction, for application state that must commit with the messages.
    """

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.connection: Connection = broker.engine.connect()
        self._leases: dict[int, Lease] = {}
        self._dirty = False
        self._done = False
        self._doomed: str | None = None
        #: messages SENT, and RECEIVEd by queue name (only while metrics are on): counted by
        #: the broker.messages_sent / broker.messages_received metrics when this commits
        self._sent = 0
        self._received: dict[str, int] = {}

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> Transaction:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._done:
            return
        if exc_type is None:
            self.commit()
        else:
            self.rollback()

    def commit(self) -> None:
        """Commit: SENDs become visible to readers, RECEIVEd messages are gone for good."""
        self._check_open()
        if self._doomed is not None:
            self._after_rollback()
            raise BrokerError(f"transaction rolled back instead of committing: {self._doomed}")
        conn = self.connection
        leases = list(self._leases.values())
        adapter = self.broker.adapter
        try:
            if leases:
                # Gone with the commit: this transaction's leases, and the queues' run of
                # consecutive rollbacks (a committed RECEIVE breaks it).
                adapter.leases_committing(conn, leases)
            conn.commit()
        except BaseException:
            self._after_rollback()
            raise
        self._done = True
        adapter.close_leases(leases)
        conn.close()
        if self._sent or self._received:
            metrics.incr(metrics.MESSAGES_SENT, self._sent)
            for name, n in self._received.items():
                metrics.incr(metrics.MESSAGES_RECEIVED, n, {"queue": name})

    def rollback(self) -> None:
        """Roll back: received messages return to their queue; counts toward poison handling."""
        self._check_open()
        self._after_rollback()

    def _after_rollback(self) -> None:
        conn = self.connection
        self._done = True
        try:
            conn.rollback()
            leases = list(self._leases.values())
            if leases:
                queue_ids = self.broker.adapter.forget_leases(conn, leases)
                record_rollbacks(conn, queue_ids)
                conn.commit()
        finally:
            conn.close()

    def _check_open(self) -> None:
        if self._done:
            raise BrokerError("this broker transaction has already ended")

    def _execute(self, stmt: Any, params: Any = None) -> Any:
        self._check_open()
        return self.connection.execute(stmt, params)

    # -- lookups -------------------------------------------------------------------------------
    def _queue(self, name: str) -> Any:
        """A queue's id and settings (cached briefly: they rarely change). Whether it is
        enabled is checked by the statements themselves, see :meth:`_raise_if_disabled`."""
        conn = self.connection

        def load() -> Any:
            return conn.execute(
                select(
                    s.queue.c.queue_id,
                    s.queue.c.name,
                    s.queue.c.retention,
                    s.queue.c.poison_message_handling,
                ).where(s.queue.c.name == name)
            ).first()

        self._check_open()
        row = self.broker.cached_definition(("queue", name), load)
        if row is None:
            raise UnknownObject(f"queue {name!r} does not exist in this broker")
        return row

    def _raise_if_disabled(self, q: Row[Any]) -> None:
        status = self._execute(
            select(s.queue.c.status).where(s.queue.c.queue_id == q.queue_id)
        ).scalar()
        if status is None:
            self.broker.invalidate_definitions()
            raise UnknownObject(f"queue {q.name!r} does not exist in this broker")
        if not status:
            raise QueueDisabled(
                f"queue {q.name!r} is disabled (status off); re-enable it with "
                f"alter_queue({q.name!r}, status=True) once its readers are fixed"
            )

    def _endpoint_row(self, handle: uuid.UUID) -> Any:
        row = self._execute(endpoint_statement(self.broker.dialect), {"handles": [handle]}).first()
        if row is None:
            raise UnknownObject(f"conversation handle {handle} does not exist in this broker")
        return row

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
    ) -> uuid.UUID:
        """BEGIN DIALOG CONVERSATION from a local service; returns the conversation handle.

        The target need not be reachable yet: the first SEND waits in the transmission queue
        until a route reaches ``to_service``."""
        as_name(to_service, "target service")
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
        svc = self._execute(
            select(s.service.c.queue_id).where(s.service.c.name == from_service)
        ).first()
        if svc is None:
            raise UnknownObject(f"service {from_service!r} is not a local service of this broker")
        if (
            self._execute(select(s.contract.c.name).where(s.contract.c.name == contract)).first()
            is None
        ):
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
            if row.queue_id != svc.queue_id:
                raise InvalidDefinition(
                    f"related conversation {rel} is on another queue than service {from_service!r}"
                )
            group, new_group = row.conversation_group_id, False
        elif related_conversation_group is not None:
            group = as_uuid(related_conversation_group, "related_conversation_group")
            row = self._execute(
                select(s.conversation_group.c.queue_id).where(
                    s.conversation_group.c.conversation_group_id == group
                )
            ).first()
            if row is not None:
                if row.queue_id != svc.queue_id:
                    raise InvalidDefinition(
                        f"conversation group {group} is on another queue than service "
                        f"{from_service!r}"
                    )
                new_group = False
        if group is None:
            group = uuid.uuid4()
        now = utcnow()
        handle = uuid.uuid4()
        self._dirty = True
        if new_group:
            self._execute(
                insert(s.conversation_group).values(
                    conversation_group_id=group, queue_id=svc.queue_id
                )
            )
        self._execute(
            insert(s.conversation_endpoint).values(
                conversation_handle=handle,
                conversation_id=uuid.uuid4(),
                is_initiator=True,
                conversation_group_id=group,
                queue_id=svc.queue_id,
                service_name=from_service,
                far_service=to_service,
                far_broker_instance=broker_instance,
                far_handle=None,
                contract_name=contract,
                state="SO",
                priority=priority_for(
                    self.broker, self.connection, contract, from_service, to_service
                ),
                lifetime=now + timedelta(seconds=lifetime_seconds) if lifetime_seconds else None,
                send_sequence=0,
                receive_sequence=0,
                created_at=now,
            )
        )
        if lifetime_seconds:
            self.broker.note_due(now + timedelta(seconds=lifetime_seconds))
        return handle

    # -- SEND ----------------------------------------------------------------------------------
    def send(
        self, handles: Handle | Sequence[Handle], message_type: str = DEFAULT, body: Any = None
    ) -> None:
        """SEND ON CONVERSATION one message on one or several conversations, atomically: either
        every conversation gets it or (on any error) none does."""
        if isinstance(handles, uuid.UUID | str):
            handle_list = [as_uuid(handles, "conversation handle")]
        else:
            handle_list = [as_uuid(h, "conversation handle") for h in handles]
        if not handle_list:
            raise InvalidDefinition("SEND needs at least one conversation handle")
        if len(set(handle_list)) != len(handle_list):
            raise InvalidDefinition("SEND names the same conversation handle twice")
        if message_type in SYSTEM_MESSAGE_TYPES:
            raise ContractViolation(
                f"message type {message_type!r} is a system message type: the broker sends it"
            )
        payload = encode_body(body)
        now = utcnow()
        if self._send_fast(handle_list, message_type, payload, now):
            self._sent += len(handle_list)
            return
        rows = {
            r.conversation_handle: r
            for r in self._execute(
                endpoint_statement(self.broker.dialect), {"handles": handle_list}
            )
        }
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
        for row, code in general:
            if row.own_retention:
                self._retain_sent(row, message_type, row.send_sequence, payload, code, now)
            delivery.route(row, message_type, row.send_sequence, payload, code, now)
        delivery.flush()
        self._sent += len(handle_list)

    def _send_fast(
        self, handles: list[uuid.UUID], message_type: str, payload: bytes | None, now: datetime
    ) -> bool:
        """PostgreSQL: SEND in one statement when every conversation is on the fast path.
        False (nothing written) sends the caller down the general path."""
        if self.broker.dialect != "postgresql":
            return False
        mtype = message_type_def(self.broker, self.connection, message_type)
        if mtype is None:
            return False
        validation, json_schema = mtype
        try:
            validate_body(message_type, validation, json_schema, payload)
        except MessageValidationError:
            return False  # the general path raises it, after the checks that come first
        params = {
            "now": now,
            "message_type": message_type,
            "precedence": precedence(message_type),
            "validation": VALIDATION_CODES[validation],
            "body": payload,
        }
        if len(handles) == 1:
            row = self._execute(SEND_ONE_PG, {**params, "handle": handles[0]}).first()
            sent = 0 if row is None else 1
        else:
            sent = self._execute(
                SEND_MANY_PG, {**params, "handles": handles, "n": len(handles)}
            ).scalar_one()
        if sent == 0:
            return False
        self._dirty = True
        if sent != len(handles):
            self._doomed = (
                f"SEND on {len(handles)} conversations reached only {sent}: another "
                "transaction ended one of them meanwhile; this transaction must roll back"
            )
            raise BrokerError(self._doomed)
        return True

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

    # -- RECEIVE -------------------------------------------------------------------------------
    def receive(
        self,
        queue: str,
        top: int | None = None,
        conversation_handle: Handle | None = None,
        conversation_group: Handle | None = None,
        wait_seconds: float = 0,
    ) -> list[Message]:
        """RECEIVE from ``queue``: messages of one conversation group, whose lock this
        transaction then holds until it ends.

        :param top: at most this many messages (default: all ready messages of the group).
        :param conversation_handle: only from this conversation.
        :param conversation_group: only from this conversation group.
        :param wait_seconds: wait up to this long for messages (WAITFOR); 0 returns at once.
        """
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 1):
            raise InvalidDefinition(f"top must be a whole number >= 1, not {top!r}")
        if conversation_handle is not None and conversation_group is not None:
            raise InvalidDefinition("give conversation_handle or conversation_group, not both")
        q = self._queue(queue)
        params: dict[str, Any] = {
            "queue_id": q.queue_id,
            "top": top if top is not None else queries.no_limit(self.broker.dialect),
        }
        if conversation_handle is not None:
            params["handle"] = as_uuid(conversation_handle, "conversation handle")
        if conversation_group is not None:
            params["group_id"] = as_uuid(conversation_group, "conversation group")
        adapter = self.broker.adapter
        lease = self._leases.get(q.queue_id)
        key = lease.key if lease is not None else adapter.new_lease_key()
        # PostgreSQL: the claim itself writes the commit marker of this transaction's lease.
        mark = bool(q.poison_message_handling) and self.broker.dialect == "postgresql"
        if mark:
            params["lease_key"] = key
        by_handle, by_group = conversation_handle is not None, conversation_group is not None
        stmt = queries.claim_statement(
            self.broker.dialect,
            by_handle=by_handle,
            by_group=by_group,
            retention=q.retention,
            mark=mark,
        )

        def claim() -> list[Any]:
            rows: list[Any] = self._execute(stmt, params).all()
            if rows:
                return rows
            self._raise_if_disabled(q)
            if self.broker.dialect != "postgresql":
                return rows
            ready = queries.ready_exists_statement(by_handle=by_handle, by_group=by_group)
            for _ in range(queries.CLAIM_ATTEMPTS - 1):
                if self._execute(ready, params).first() is None:
                    break
                rows = self._execute(stmt, params).all()
                if rows:
                    break
            return rows

        rows = self._wait_for(q, wait_seconds, claim)
        if not rows:
            return []
        self._dirty = True
        if metrics.enabled():
            self._received[q.name] = self._received.get(q.name, 0) + len(rows)
        if q.poison_message_handling and lease is None:
            self._leases[q.queue_id] = adapter.open_lease(self.connection, q.queue_id, key)
        rows.sort(
            key=lambda r: (
                -r.priority,
                r.precedence,
                r.conversation_handle,
                r.message_sequence_number,
            )
        )
        return [
            Message(
                status=STATUS_READY,
                priority=r.priority,
                queuing_order=r.queuing_order,
                conversation_group_id=r.conversation_group_id,
                conversation_handle=r.conversation_handle,
                message_sequence_number=r.message_sequence_number,
                service_name=r.service_name,
                service_contract_name=r.service_contract_name,
                message_type_name=r.message_type_name,
                validation=r.validation,
                message_body=r.message_body,
            )
            for r in rows
        ]

    def get_conversation_group(self, queue: str, wait_seconds: float = 0) -> uuid.UUID | None:
        """GET CONVERSATION GROUP: lock the next group with ready messages and return its id
        (None when there is none within ``wait_seconds``)."""
        q = self._queue(queue)
        stmt = queries.lock_group_statement(self.broker.dialect)

        def lock_group() -> list[Any]:
            rows: list[Any] = self._execute(stmt, {"queue_id": q.queue_id}).all()
            if not rows:
                self._raise_if_disabled(q)
            return rows

        rows = self._wait_for(q, wait_seconds, lock_group)
        if not rows:
            return None
        self._dirty = True
        group: uuid.UUID = rows[0].conversation_group_id
        return group

    def _wait_for(
        self, q: Row[Any], wait_seconds: float, attempt: Callable[[], list[Any]]
    ) -> list[Any]:
        """Run ``attempt`` until it finds something or ``wait_seconds`` pass, sleeping on the
        engine's wake-up signal in between and doing due work (timers, lifetimes) as it goes."""
        if not isinstance(wait_seconds, int | float) or wait_seconds < 0:
            raise InvalidDefinition(f"wait_seconds must be >= 0, not {wait_seconds!r}")
        self._due_step(force=False)
        rows = attempt()
        if rows or wait_seconds <= 0:
            return rows
        deadline = time.monotonic() + wait_seconds
        adapter = self.broker.adapter
        state = adapter.start_wait(self.connection, q.queue_id, can_release=not self._dirty)
        try:
            while True:
                rows = attempt()
                if rows:
                    return rows
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                adapter.wait(self.connection, state, min(remaining, MAX_WAIT_SLICE))
                self._due_step(force=False)
        finally:
            adapter.end_wait(state)

    def _due_step(self, *, force: bool) -> None:
        b = self.broker
        if not force and time.monotonic() < b.next_due_work:
            return
        b.next_due_work = time.monotonic() + DUE_POLL_SECONDS
        if b.dialect == "postgresql":
            # In a short transaction of its own: a timer fires once, whatever this one does.
            with b.engine.begin() as conn:
                work = DueWork(b, conn)
                work.run(utcnow())
        elif self._dirty:
            # SQLite: this transaction holds the only write lock; do it inside it.
            work = DueWork(b, self.connection)
            work.run(utcnow())
        else:
            # Nothing of the caller's is in this transaction yet: commit the due work on its own,
            # so that a waiting RECEIVE that later gives the write lock back does not undo it.
            work = DueWork(b, self.connection)
            work.run(utcnow())
            self.connection.commit()
        if work.next_due is not None:
            b.note_due(work.next_due)

    # -- END CONVERSATION ----------------------------------------------------------------------
    def end_conversation(
        self,
        handle: Handle,
        error_code: int | None = None,
        error_description: str | None = None,
        cleanup: bool = False,
    ) -> None:
        """END CONVERSATION (plain, WITH ERROR, or WITH CLEANUP)."""
        h = as_uuid(handle, "conversation handle")
        if error_code is not None and cleanup:
            raise InvalidDefinition("END CONVERSATION takes WITH ERROR or WITH CLEANUP, not both")
        if error_code is not None:
            if not isinstance(error_code, int) or isinstance(error_code, bool):
                raise InvalidDefinition(f"error_code must be an integer, not {error_code!r}")
            if not isinstance(error_description, str) or not error_description:
                raise InvalidDefinition("END CONVERSATION WITH ERROR needs an error_description")
        row = self._endpoint_row(h)
        e = s.conversation_endpoint
        now = utcnow()
        self._dirty = True
        if cleanup:
            self._execute(delete(s.message).where(s.message.c.conversation_handle == h))
            self._execute(delete(e).where(e.c.conversation_handle == h))
            log.info("conversation %s removed WITH CLEANUP", h)
            return
        if row.state in ("CD", "DO"):
            raise ConversationEnded(
                f"conversation {h} has already ended on this side "
                f"({row.state}: {state_desc(row.state)})"
            )
        # Messages of this conversation still in this side's queue go with it.
        self._execute(delete(s.message).where(s.message.c.conversation_handle == h))
        closed = {"state": "CD", "closed_at": now, "timer_due_at": None}
        if error_code is not None:
            self._execute(
                delete(s.transmission_queue).where(s.transmission_queue.c.conversation_handle == h)
            )
            row = self._endpoint_row(h)
            self._execute(update(e).where(e.c.conversation_handle == h).values(**closed))
            if row.state not in ("DI", "ER") and self._far_exists(row):
                self._system_send(row, ERROR, error_body(error_code, error_description or ""), now)
            return
        if (
            row.state == "DI"
            and row.far_handle is None
            and row.far_broker_instance
            not in (
                None,
                self.broker.instance_id_on(self.connection),
            )
        ):
            # The far side, in another broker, ended first and waits (DO) for this END.
            self._execute(update(e).where(e.c.conversation_handle == h).values(**closed))
            self._system_send(row, END_DIALOG, None, now)
            return
        if row.state in ("DI", "ER") or not self._far_exists(row):
            # The far side has ended (or errored), or was never told of this dialog.
            self._execute(update(e).where(e.c.conversation_handle == h).values(**closed))
            if row.state == "DI" and row.far_handle is not None:
                self._execute(
                    update(e)
                    .where(e.c.conversation_handle == row.far_handle, e.c.state == "DO")
                    .values(**closed)
                )
            return
        self._execute(
            update(e).where(e.c.conversation_handle == h).values(state="DO", timer_due_at=None)
        )
        self._system_send(row, END_DIALOG, None, now)

    def _far_exists(self, row: Any) -> bool:
        """Whether the far side knows of this dialog (or will: messages are on their way). A
        target's far side always does: it began the dialog (in another broker, the target's
        endpoint has no far handle and may have sent nothing)."""
        return (
            not row.is_initiator
            or row.far_handle is not None
            or bool(row.has_pending)
            or row.send_sequence > 0
        )

    def _system_send(self, row: Any, message_type: str, body: bytes | None, now: datetime) -> None:
        e = s.conversation_endpoint
        seq = row.send_sequence
        self._execute(
            update(e)
            .where(e.c.conversation_handle == row.conversation_handle)
            .values(send_sequence=seq + 1)
        )
        validation = "X" if body is not None else "E"
        Delivery(self.broker, self.connection).route(row, message_type, seq, body, validation, now)

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
        row = self._endpoint_row(h)
        if row.state in ("CD", "ER", "DO"):
            raise ConversationEnded(f"conversation {h} has ended ({row.state}): no timer on it")
        e = s.conversation_endpoint
        self._dirty = True
        due = utcnow() + timedelta(seconds=timeout_seconds)
        self._execute(update(e).where(e.c.conversation_handle == h).values(timer_due_at=due))
        self.broker.note_due(due)

    def move_conversation(self, handle: Handle, to_conversation_group: Handle) -> None:
        """MOVE CONVERSATION into another conversation group on the same queue."""
        h = as_uuid(handle, "conversation handle")
        g = as_uuid(to_conversation_group, "conversation group")
        row = self._endpoint_row(h)
        target = self._execute(
            select(s.conversation_group.c.queue_id).where(
                s.conversation_group.c.conversation_group_id == g
            )
        ).first()
        if target is None:
            raise UnknownObject(f"conversation group {g} does not exist in this broker")
        if target.queue_id != row.queue_id:
            raise InvalidDefinition(
                f"conversation group {g} is on another queue than conversation {h}"
            )
        if self.broker.dialect == "postgresql":
            cg = s.conversation_group
            self._execute(
                select(cg.c.conversation_group_id)
                .where(cg.c.conversation_group_id.in_([g, row.conversation_group_id]))
                .order_by(cg.c.conversation_group_id)
                .with_for_update(key_share=False, read=False)
            )
        self._dirty = True
        e = s.conversation_endpoint
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
