"""The state every transaction verb shares: the connection, its leases, commit and rollback.

:class:`TransactionCore` is the base of :class:`~airflow_broker.messaging.transaction.Transaction`;
the verbs live in mixins over it (RECEIVE in :mod:`~airflow_broker.messaging.receiving`, END
CONVERSATION in :mod:`~airflow_broker.messaging.ending`) so that each module holds one verb's
rules.
"""

from __future__ import annotations

import logging
import uuid
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from sqlalchemy import (
    Row,
    delete,
    select,
)
from sqlalchemy.engine import Connection

from airflow_broker import metrics
from airflow_broker.errors import (
    BrokerError,
    QueueDisabled,
    UnknownObject,
)
from airflow_broker.messaging.begins import PendingBegins
from airflow_broker.messaging.fast_send import (
    endpoint_statement,
)
from airflow_broker.security import permissions
from airflow_broker.storage import direct
from airflow_broker.storage import schema as s
from airflow_broker.storage.adapters import FailedHold, ReceiveLease

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")

#: RECEIVE runs the due-work step when something this process knows of falls due (a timer or
#: lifetime it set, or the earliest one the last pass saw), and at least this often otherwise, to
#: notice what other processes set and readers that died.
DUE_POLL_SECONDS = 1.0
#: Longest single sleep of a waiting RECEIVE: bounds how late a due timer is noticed.
MAX_WAIT_SLICE = 0.5


class TransactionCore:
    """The open transaction: its connection, receive leases, commit and rollback (with poison
    accounting), and the look-ups every verb makes."""

    def __init__(self, broker: BrokerContext, *, within: Connection | None = None) -> None:
        """:param within: run the verbs inside this connection's transaction, which its owner
        commits or rolls back (DROP SERVICE ends the service's conversations inside its
        definitions transaction); this object then never commits, rolls back or closes it.
        """
        self.broker = broker
        self._owned = within is None
        self._conn: Connection = broker.engine.connect() if within is None else within
        #: BEGIN DIALOGs not written yet: written as soon as anything uses the connection
        #: (:attr:`connection`) or the transaction commits (messaging.begins)
        self._begins = PendingBegins()
        self._leases: dict[int, ReceiveLease] = {}
        #: PostgreSQL: the key of the receive lease the next RECEIVE opens (its commit marker
        #: is written by the RECEIVE statement itself)
        self._lease_key: int | None = None
        self._dirty = False
        self._done = False
        self._doomed: str | None = None
        #: messages SENT, and RECEIVEd by queue name (only while metrics are on): counted by
        #: the broker.messages_sent / broker.messages_received metrics when this commits
        self._sent = 0
        self._received: dict[str, int] = {}
        #: a client role's grants, read once per transaction (None: not read yet)
        self._grants: permissions.Grants | None = None
        #: PostgreSQL: the senders whose far endpoints this transaction's fast-path SENDs
        #: locked in memory (storage.endpoint_locks.ADVISORY_BUDGET bounds them)
        self._advisory_locked: set[uuid.UUID] = set()

    @property
    def connection(self) -> Connection:
        """This transaction's SQLAlchemy connection, with the BEGIN DIALOGs made so far
        written (:mod:`~airflow_broker.messaging.begins`)."""
        if self._begins:
            self._write_begins()
        return self._conn

    def _write_begins(self) -> None:
        pending, self._begins = self._begins, PendingBegins()
        try:
            pending.write(self._conn)
        except BaseException as exc:
            self._doomed = self._doomed or (
                f"the conversations begun in this transaction could not be written ({exc})"
            )
            raise

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> Self:
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

    @property
    def ended(self) -> bool:
        """Whether this transaction has committed or rolled back."""
        return self._done

    def commit(self) -> None:
        """Commit: SENDs become visible to readers, RECEIVEd messages are gone for good."""
        self._check_open()
        self._check_owned()
        if self._doomed is not None:
            self._after_rollback()
            raise BrokerError(f"transaction rolled back instead of committing: {self._doomed}")
        leases = list(self._leases.values())
        adapter = self.broker.adapter
        try:
            conn = self.connection  # the BEGIN DIALOGs not written yet, first
            if leases:
                # Gone with the commit: this transaction's leases, and the queues' run of
                # consecutive rollbacks (a committed RECEIVE breaks it).
                adapter.leases_committing(conn, leases)
            if adapter.dialect == "postgresql":
                direct.commit(conn, before=adapter.lease_cleanup(leases))
            else:
                conn.commit()
        except BaseException:
            self._after_rollback()
            raise
        self._committed()

    def _committed(self, *, close: bool = True) -> None:
        """After the COMMIT went through: this transaction is over. ``close``: give the
        connection back (not when a successor took it over, see :meth:`_successor`)."""
        self._done = True
        self.broker.adapter.close_leases(list(self._leases.values()))
        if close:
            self._conn.close()
        if self._sent or self._received:
            metrics.incr(metrics.MESSAGES_SENT, self._sent)
            for name, n in self._received.items():
                metrics.incr(metrics.MESSAGES_RECEIVED, n, {"queue": name})

    def _successor(self) -> Self:
        """A new transaction on this one's connection, which it owns from the COMMIT of this
        one on (``Receiving.commit_and_receive`` sends that COMMIT and the successor's first
        statement together)."""
        nxt = type(self)(self.broker, within=self._conn)
        nxt._owned = True
        return nxt

    def rollback(self) -> None:
        """Roll back: received messages return to their queue; counts toward poison handling."""
        self._check_open()
        self._check_owned()
        self._after_rollback()

    def _after_rollback(self) -> None:
        self._begins = PendingBegins()  # never written
        conn = self._conn
        self._done = True
        adapter = self.broker.adapter
        try:
            leases = list(self._leases.values())
            if leases and adapter.rollback_keeping_lock(conn):
                # SQLite: undone, but the transaction (the write lock) is still open: the
                # failed attempt is counted and its group held before any other RECEIVE can
                # take the group again.
                self._record_failures(conn, adapter.forget_leases(conn, leases))
                conn.commit()
                return
            conn.rollback()
            if self.broker.dialect == "sqlite" and not conn.invalidated:
                # A COMMIT that failed (a deferred foreign key) leaves SQLite's transaction
                # open, and SQLAlchemy's rollback after it finds none of its own to end.
                raw: Any = conn.connection.driver_connection
                if raw is not None and raw.in_transaction:
                    raw.rollback()
            if leases:
                # PostgreSQL, or SQLite without the transaction to keep: counted in a new one.
                holds = adapter.forget_leases(conn, leases)
                self._record_failures(conn, holds)
                conn.commit()
        finally:
            conn.close()

    def _record_failures(self, conn: Connection, holds: list[FailedHold]) -> None:
        """After a rollback: the hand-outs it undid are failed attempts (see
        :mod:`airflow_broker.messaging.failure`; the transaction class provides it)."""
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._done:
            raise BrokerError("this broker transaction has already ended")

    def _check_owned(self) -> None:
        if not self._owned:
            raise BrokerError(
                "these verbs run inside a transaction their caller owns: the caller commits it"
            )

    def _execute(self, stmt: Any, params: Any = None) -> Any:
        self._check_open()
        return self.connection.execute(stmt, params)

    # -- permissions (a client role only: the owner is never checked) -------------------------
    def _client_grants(self) -> permissions.Grants | None:
        """The grants of the client role this broker connects as, read once per transaction;
        None for the owner (and on SQLite)."""
        role = self.broker.client_role
        if role is None:
            return None
        if self._grants is None:
            self._grants = permissions.grants_of(self.connection, role)
        return self._grants

    def _require_receive(self, queue: str) -> None:
        grants = self._client_grants()
        if grants is not None:
            grants.require_receive(queue)

    def _require_send(self, service: str) -> None:
        grants = self._client_grants()
        if grants is not None:
            grants.require_send(service)

    def _require_conversations(self, handles: list[uuid.UUID]) -> None:
        """A client role may SEND on (END) these conversations, or PermissionDenied."""
        grants = self._client_grants()
        if grants is not None:
            permissions.require_conversations(self.connection, grants, handles)

    def _require_queue_id(self, queue_id: int) -> None:
        """A client role may RECEIVE from the queue with this id (MOVE CONVERSATION)."""
        grants = self._client_grants()
        if grants is not None:
            permissions.require_queue_id(self.connection, grants, queue_id)

    def _discard_messages(self, handle: uuid.UUID, queue_id: int) -> None:
        """END: the conversation's messages in this side's queue go (a client role that may not
        RECEIVE from that queue has them removed by the database, which it cannot see)."""
        grants = self._client_grants()
        if grants is not None and queue_id not in grants.receive_ids:
            permissions.discard_messages(self.connection, handle)
            return
        self._execute(delete(s.message).where(s.message.c.conversation_handle == handle))

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

    def _lock_groups_of(self, handle: uuid.UUID, *more: uuid.UUID) -> uuid.UUID:
        """PostgreSQL: lock the conversation group of ``handle`` (and the groups ``more``), as
        RECEIVE does, before anything of the conversation is locked; return its group id.

        Rule 0 of the lock order: END and MOVE CONVERSATION wait here for a reader that holds
        the group (it may be about to answer or end on this very conversation) instead of
        locking the endpoint under it. Groups are locked in id order; the endpoint's group is
        read again under the lock, because a MOVE may have changed it meanwhile.
        """
        e, cg = s.conversation_endpoint, s.conversation_group
        current = select(e.c.conversation_group_id).where(e.c.conversation_handle == handle)
        group = self._execute(current).scalar()
        while True:
            if group is None:
                raise UnknownObject(f"conversation handle {handle} does not exist in this broker")
            self._execute(
                select(cg.c.conversation_group_id)
                .where(cg.c.conversation_group_id.in_({group, *more}))
                .order_by(cg.c.conversation_group_id)
                .with_for_update(key_share=True)  # FOR NO KEY UPDATE, as RECEIVE takes it
            )
            now_in = self._execute(current).scalar()
            if now_in == group:
                return group
            group = now_in

    def _endpoint_row(self, handle: uuid.UUID) -> Any:
        row = self._execute(endpoint_statement(self.broker.dialect), {"handles": [handle]}).first()
        if row is None:
            raise UnknownObject(f"conversation handle {handle} does not exist in this broker")
        return row
