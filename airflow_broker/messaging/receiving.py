"""RECEIVE and GET CONVERSATION GROUP: take one conversation group's messages, waiting if asked.

The claim itself is one statement (:mod:`airflow_broker.storage.queries`); this module adds
the WAITFOR (LISTEN on PostgreSQL, ``PRAGMA data_version`` polling on SQLite), the due-work step
RECEIVE takes as it polls, and the lease that lets poison handling count readers that die.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Self, TypeVar

from sqlalchemy import (
    Row,
)

from airflow_broker import metrics
from airflow_broker.errors import (
    InvalidDefinition,
)
from airflow_broker.messaging import leases
from airflow_broker.messaging.arguments import Handle, as_uuid
from airflow_broker.messaging.duework import DueWork
from airflow_broker.messaging.failure import count_dead_attempts
from airflow_broker.messaging.objects import (
    Message,
    messages_from_rows,
)
from airflow_broker.messaging.tx_core import DUE_POLL_SECONDS, MAX_WAIT_SLICE, TransactionCore
from airflow_broker.storage import direct, queries
from airflow_broker.storage.clock import utcnow

log = logging.getLogger("airflow_broker")

#: What a claim hands out (Receiving._claim_handing_out).
_Out = TypeVar("_Out")


class Receiving(TransactionCore):
    """RECEIVE and GET CONVERSATION GROUP of a :class:`Transaction`."""

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
        _q, messages = self._claim_handing_out(
            queue,
            top,
            conversation_handle,
            conversation_group,
            wait_seconds,
            lambda q, rows, look: self._hold(q, rows, checked=look),
        )
        return messages

    def _claim_handing_out(
        self,
        queue: str,
        top: int | None,
        conversation_handle: Handle | None,
        conversation_group: Handle | None,
        wait_seconds: float,
        hand_out: Callable[[Any, list[Any], bool], _Out | None],
        *,
        lease_token: uuid.UUID | None = None,
    ) -> tuple[Any, _Out]:
        """Claim (:meth:`_claim`), then ``hand_out(queue row, rows, look)``: what it returns,
        or None when a reader of the queue that ended without committing must be counted
        first (``look``: whether to look for one). Then the claim is given back, that reader
        counted (:meth:`_give_claim_back`) and the queue claimed again, within the same
        ``wait_seconds``."""
        deadline = time.monotonic() + wait_seconds
        look = True
        while True:
            savepoint = self._needs_savepoint()
            q, rows = self._claim(
                queue,
                top,
                conversation_handle,
                conversation_group,
                max(0.0, deadline - time.monotonic()),
                lease_token=lease_token,
                savepoint=savepoint,
            )
            out = hand_out(q, rows, look)
            if out is not None:
                return q, out
            look = self._give_claim_back(q, savepoint=savepoint)

    def commit_and_receive(
        self, queue: str, top: int | None = None, *, wait_seconds: float = 0
    ) -> tuple[Self, list[Message]]:
        """Commit this transaction, then RECEIVE from ``queue`` in a new one: a reader's loop
        (:func:`airflow_broker.activation.readers.drain`). Returns the new transaction, which
        the caller commits or rolls back, and what it received (as :meth:`receive`).

        On PostgreSQL the COMMIT and the next RECEIVE travel in one round trip
        (``COMMIT; BEGIN; EXECUTE claim``) on the same connection, so a reader that takes one
        message per transaction waits on the server once per message instead of twice. The
        next transaction's receive lease is opened after its claim, as in :meth:`receive`. When
        the claim takes nothing, the claim's answer says whether the queue is enabled with
        nothing free (then that is the answer, unless ``wait_seconds`` asks to wait); otherwise
        the new transaction RECEIVEs again the usual way (waiting up to ``wait_seconds``, saying
        whether the queue is disabled, trying again after a group it locked turned out empty).

        If the COMMIT fails, nothing was received and the error is raised, as :meth:`commit`
        raises it. If the RECEIVE fails, this transaction is committed all the same, the new
        one is rolled back, and the error is raised.
        """
        self._check_open()
        self._check_owned()
        _check_wait(wait_seconds)
        b = self.broker
        pipelined = b.dialect == "postgresql" and b.client_role is None and self._doomed is None
        if pipelined:
            nxt = self._successor()
            nxt._due_step(force=False)  # on PostgreSQL in a transaction of its own
            q, params, shape = nxt._claim_shape(queue, top, None, None, None)
            prepared, names = queries.claim_prepared(**shape)
            pipelined = direct.can_commit_then_execute(self.connection, prepared)
        if not pipelined:
            self.commit()
            nxt = type(self)(b)
            try:
                return nxt, nxt.receive(queue, top=top, wait_seconds=wait_seconds)
            except BaseException:
                nxt.rollback()
                raise
        params["now"] = utcnow()
        cleanup = b.adapter.lease_cleanup(list(self._leases.values()))
        try:
            rows = direct.commit_then_execute(
                self.connection, prepared, [params[n] for n in names], before=cleanup
            )
        except direct.CommittedThenFailed as failed:
            self._committed(close=False)  # the connection is the successor's
            nxt._after_rollback()
            raise failed.error from None
        except BaseException:
            self._after_rollback()
            raise
        self._committed(close=False)
        try:
            if not rows and wait_seconds <= 0:
                return nxt, []  # an enabled queue with nothing free
            if not rows or queries.is_probe(rows):
                return nxt, nxt.receive(queue, top=top, wait_seconds=wait_seconds)
            nxt._dirty = True
            held = nxt._hold(q, rows)
            if held is None:  # a dead reader's attempt is counted first (see _hold)
                nxt._give_claim_back(q, savepoint=False)
                held = nxt.receive(queue, top=top, wait_seconds=wait_seconds)
            return nxt, held
        except BaseException:
            nxt.rollback()
            raise

    def _hold(self, q: Any, rows: list[Any], *, checked: bool = True) -> list[Message] | None:
        """The messages of claimed ``rows`` of queue ``q``, held by this transaction's receive
        lease (opened here on its first RECEIVE of the queue).

        None when they must not be handed out yet (PostgreSQL): the lease's row, written as
        they were taken, found a reader of the queue that ended without committing and whose
        attempt nobody has counted (it may have held these very messages). The caller gives
        its claim back (:meth:`_give_claim_back`), which counts that attempt, and claims again: so
        no hand-out escapes a count, and a group held back by the failure is seen as held.
        ``checked=False`` holds them regardless."""
        if not rows:
            return []
        held = [r[0] for r in rows]  # queuing_order (MESSAGE_COLUMNS)
        lease = self._leases.get(q.queue_id)
        adapter = self.broker.adapter
        if lease is None:
            lease = adapter.open_lease(
                self.connection, q.queue_id, self._lease_key, held, check=checked
            )
        else:
            adapter.hold_more(lease, held, check=checked)
        # This hand-out is counted in the row only if it fails (its transaction is undone).
        ordered = queries.claim_is_ordered(adapter.dialect)
        messages = messages_from_rows(rows, counted=False, ordered=ordered)
        if not adapter.lease_written(lease):
            return None
        if q.queue_id not in self._leases:
            self._leases[q.queue_id] = lease
            self._lease_key = None
        if metrics.enabled():
            self._received[q.name] = self._received.get(q.name, 0) + len(rows)
        return messages

    def _count_dead_readers(self, queue_id: int) -> None:
        """SQLite: with the write lock held (this begins the transaction if it has not), count
        the readers that died holding messages before claiming, so that none of their
        hand-outs goes uncounted (no reader can die holding messages while this transaction
        holds the lock). Counted in a transaction of its own when this one has done nothing
        yet; otherwise inside it (a rollback of this transaction then undoes the count too)."""
        conn = self.connection
        adapter = self.broker.adapter
        while True:
            if not conn.in_transaction():
                conn.begin()  # BEGIN IMMEDIATE (storage.sqlite_adapter)
            if not adapter.dead_lease_on(queue_id):
                return
            work = DueWork(self.broker, conn)
            work.run(utcnow())
            if self._dirty:
                return
            conn.commit()  # and look again, under the lock taken anew

    def _needs_savepoint(self) -> bool:
        """Whether a claim must be undone apart from the rest of this transaction (PostgreSQL:
        it has done something of its own already), should it be given back (:meth:`_hold`)."""
        return self.broker.dialect == "postgresql" and (self._dirty or bool(self._leases))

    def _give_claim_back(self, q: Any, *, savepoint: bool) -> bool:
        """Undo the claim :meth:`_hold` refused (back to its savepoint, or the whole transaction,
        which held nothing else), then count the dead readers' attempts on ``q``. Returns
        whether the next claim should look for dead readers again (False when counting them
        had to wait for a lock, which this transaction may hold: then the due-work pass counts
        them, and the next claim hands out what it takes)."""
        if savepoint:
            self.connection.exec_driver_sql(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT.decode()}")
        else:
            self.connection.rollback()
            self._dirty = False
        log.info(
            "queue %r: a reader ended without committing; its attempt is counted before this "
            "RECEIVE takes messages again",
            q.name,
        )
        return count_dead_attempts(self.broker, q.queue_id)

    def _claim(
        self,
        queue: str,
        top: int | None,
        conversation_handle: Handle | None,
        conversation_group: Handle | None,
        wait_seconds: float,
        *,
        lease_token: uuid.UUID | None = None,
        savepoint: bool = False,
    ) -> tuple[Any, list[Any]]:
        """Lock the next free group of ``queue`` with ready messages and take (or, with
        ``lease_token``, mark) up to ``top`` of them, waiting up to ``wait_seconds``.
        ``savepoint`` (PostgreSQL): each attempt sets the savepoint that
        :meth:`_give_claim_back` undoes."""
        q, params, shape = self._claim_shape(
            queue, top, conversation_handle, conversation_group, lease_token
        )
        pg = self.broker.dialect == "postgresql"
        if pg:
            # One round trip, BEGIN included, on PostgreSQL (storage.direct).
            prepared, names = queries.claim_prepared(**shape)

            mark = _SAVEPOINT if savepoint else None

            def take() -> list[Any]:
                self._check_open()
                args = [params[n] for n in names]
                return direct.execute(self.connection, prepared, args, savepoint=mark)
        else:
            stmt = queries.claim_statement(self.broker.dialect, **shape)

            def take() -> list[Any]:
                self._count_dead_readers(q.queue_id)
                rows: list[Any] = self._execute(stmt, params).all()
                return rows

        def claim() -> list[Any]:
            params["now"] = utcnow()
            rows = take()
            if not pg:
                if not rows:
                    self._raise_if_disabled(q)
                return rows
            if not queries.is_probe(rows):
                # Messages, or none with nothing more to know (see queries._TAKEN_OR_PROBE).
                return rows
            self._raise_if_disabled(q)
            # A group was locked whose messages another reader had just taken: again, with a
            # new snapshot.
            for _ in range(queries.CLAIM_ATTEMPTS - 1):
                rows = take()
                if not queries.is_probe(rows):
                    return rows
            return []

        rows = self._wait_for(q, wait_seconds, claim)
        if rows:
            self._dirty = True
        return q, rows

    def _claim_shape(
        self,
        queue: str,
        top: int | None,
        conversation_handle: Handle | None,
        conversation_group: Handle | None,
        lease_token: uuid.UUID | None,
    ) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """A claim's queue, parameters (all but ``now``) and shape (``queries.claim_*``), its
        arguments checked."""
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 1):
            raise InvalidDefinition(f"top must be a whole number >= 1, not {top!r}")
        if conversation_handle is not None and conversation_group is not None:
            raise InvalidDefinition("give conversation_handle or conversation_group, not both")
        self._require_receive(queue)
        q = self._queue(queue)
        params: dict[str, Any] = {"queue_id": q.queue_id}
        if conversation_handle is not None:
            params["handle"] = as_uuid(conversation_handle, "conversation handle")
        if conversation_group is not None:
            params["group_id"] = as_uuid(conversation_group, "conversation group")
        adapter = self.broker.adapter
        # PostgreSQL: the claim itself writes the commit marker of this transaction's receive
        # lease (what tells a rollback or a dead reader from a commit).
        mark = self.broker.dialect == "postgresql" and lease_token is None
        if mark:
            lease = self._leases.get(q.queue_id)
            if lease is not None:
                params["lease_key"] = lease.key
            else:
                self._lease_key = self._lease_key or adapter.new_lease_key()
                params["lease_key"] = self._lease_key
        if lease_token is not None:
            params["token"] = lease_token
        by_handle, by_group = conversation_handle is not None, conversation_group is not None
        shape = {
            "top": top,
            "by_handle": by_handle,
            "by_group": by_group,
            "retention": q.retention,
            "mark": mark,
            "lease": lease_token is not None,
        }
        return q, params, shape

    # -- leases --------------------------------------------------------------------------------
    def complete(self, token: Handle) -> int:
        """Complete the lease ``token`` (see :meth:`Broker.lease`): its messages are removed
        when this transaction commits, together with what it SENDs and writes; returns how many.

        :raises LeaseExpired: the lease lapsed and its messages went back to the queue (another
            reader may have them); nothing was removed.
        """
        self._check_open()
        queue, done = leases.complete(self.broker, self.connection, token)
        self._dirty = True
        if metrics.enabled():  # counted by broker.messages_received when this commits
            self._received[queue] = self._received.get(queue, 0) + done
        return done

    def get_conversation_group(self, queue: str, wait_seconds: float = 0) -> uuid.UUID | None:
        """GET CONVERSATION GROUP: lock the next group with ready messages and return its id
        (None when there is none within ``wait_seconds``)."""
        self._require_receive(queue)
        q = self._queue(queue)
        stmt = queries.lock_group_statement(self.broker.dialect)

        def lock_group() -> list[Any]:
            params = {"queue_id": q.queue_id, "now": utcnow()}
            rows: list[Any] = self._execute(stmt, params).all()
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
        _check_wait(wait_seconds)
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
        if b.client_role is not None:
            return  # due work spans every queue: the owner's processes do it (run_due)
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


#: The savepoint a claim sets when it may have to be undone apart (Receiving._give_claim_back).
_SAVEPOINT = b"broker_claim"


def _check_wait(wait_seconds: float) -> None:
    if not isinstance(wait_seconds, int | float) or wait_seconds < 0:
        raise InvalidDefinition(f"wait_seconds must be >= 0, not {wait_seconds!r}")
