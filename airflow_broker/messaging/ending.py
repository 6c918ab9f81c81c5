"""END CONVERSATION: plain, WITH ERROR, WITH CLEANUP, and the system messages it sends."""

from __future__ import annotations

import logging
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    delete,
    select,
    update,
)

from airflow_broker.constants import (
    END_DIALOG,
    ERROR,
    state_desc,
)
from airflow_broker.errors import (
    ConversationEnded,
    InvalidDefinition,
    UnknownObject,
)
from airflow_broker.messaging import dedupe
from airflow_broker.messaging.arguments import Handle, as_uuid
from airflow_broker.messaging.delivery import Delivery
from airflow_broker.messaging.objects import (
    error_body,
)
from airflow_broker.messaging.rows import drop_waiting
from airflow_broker.messaging.tx_core import TransactionCore
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow
from airflow_broker.storage.endpoint_locks import exclude_writers

log = logging.getLogger("airflow_broker")


class Ending(TransactionCore):
    """END CONVERSATION of a :class:`Transaction`."""

    # -- END CONVERSATION ----------------------------------------------------------------------
    def end_conversation(
        self,
        handle: Handle,
        error_code: int | None = None,
        error_description: str | None = None,
        cleanup: bool = False,
        *,
        dedupe_key: str | None = None,
    ) -> None:
        """END CONVERSATION (plain, WITH ERROR, or WITH CLEANUP).

        With ``dedupe_key`` (a string of at most 512 characters), idempotent: when an END of
        this conversation with this key committed before (or ran earlier in this transaction),
        nothing happens, not even the error that the conversation has ended already or (after
        WITH CLEANUP, until housekeeping forgets the key) that it does not exist."""
        if dedupe_key is not None:
            dedupe.check_key(dedupe_key)
        h = as_uuid(handle, "conversation handle")
        if error_code is not None and cleanup:
            raise InvalidDefinition("END CONVERSATION takes WITH ERROR or WITH CLEANUP, not both")
        if error_code is not None:
            if not isinstance(error_code, int) or isinstance(error_code, bool):
                raise InvalidDefinition(f"error_code must be an integer, not {error_code!r}")
            if not isinstance(error_description, str) or not error_description:
                raise InvalidDefinition("END CONVERSATION WITH ERROR needs an error_description")
        scope = dedupe.conversation_scope(h)
        try:
            self._require_conversations([h])
            if self.broker.dialect == "postgresql":
                # The lock order: the group (rule 0), then the endpoint exclusively (rule 3):
                # its advisory lock and its row FOR UPDATE, which wait for every writer into
                # its queue: the messages they committed are then seen, and removed with the
                # endpoint or with this side's END.
                self._lock_groups_of(h)
                exclude_writers(self.connection, [h])
                self._execute(
                    select(s.conversation_endpoint.c.conversation_handle)
                    .where(s.conversation_endpoint.c.conversation_handle == h)
                    .with_for_update()
                )
            row = self._endpoint_row(h)
        except UnknownObject:
            if dedupe_key is not None and dedupe.recorded(self.connection, scope, dedupe_key):
                return  # ended WITH CLEANUP with this key before
            raise
        now = utcnow()
        if dedupe_key is None:
            self._end_locked(h, row, error_code, error_description, cleanup, now)
            return
        if not dedupe.claim(self.connection, self.broker.dialect, dedupe_key, [(scope, h)], now):
            return
        self._dirty = True
        try:
            self._end_locked(h, row, error_code, error_description, cleanup, now)
        except Exception:
            self._give_back(dedupe_key, [scope])
            raise

    def _give_back(self, key: str, scopes: list[str]) -> None:
        """A verb failed after claiming its dedupe key in ``scopes``: give the key back, so that
        a caller who commits anyway does not record a verb that did not happen (and when that
        cannot be done, the transaction must roll back)."""
        try:
            dedupe.release(self.connection, key, scopes)
        except Exception as exc:
            self._doomed = self._doomed or (
                f"dedupe key {key!r} could not be given back after its verb failed ({exc}); "
                "this transaction must roll back"
            )

    def _end_locked(
        self,
        h: uuid.UUID,
        row: Any,
        error_code: int | None,
        error_description: str | None,
        cleanup: bool,
        now: datetime,
    ) -> None:
        """END CONVERSATION of ``h`` (its endpoint ``row``, locked on PostgreSQL)."""
        e = s.conversation_endpoint
        self._dirty = True
        if cleanup:
            self._discard_messages(h, row.queue_id)
            self._execute(delete(e).where(e.c.conversation_handle == h))
            log.info("conversation %s removed WITH CLEANUP", h)
            return
        if row.state in ("CD", "DO"):
            raise ConversationEnded(
                f"conversation {h} has already ended on this side "
                f"({row.state}: {state_desc(row.state)})"
            )
        # Messages of this conversation still in this side's queue go with it.
        self._discard_messages(h, row.queue_id)
        closed = {"state": "CD", "closed_at": now, "timer_due_at": None}
        if error_code is not None:
            self._execute(drop_waiting(h))
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
                # The far side, in this database, waits (DO) for this END: close it, without
                # waiting for it while this side is held (rule 4 of the lock order).
                seq = row.send_sequence
                if Delivery(self.broker, self.connection).close_far(row, seq, now):
                    self._execute(
                        update(e).where(e.c.conversation_handle == h).values(send_sequence=seq + 1)
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
