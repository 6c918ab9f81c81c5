"""What an operator does about a broker database that is a copy of another one.

:mod:`airflow_broker.storage.identity` detects a restored, cloned or copied database (its
fingerprint no longer matches); delivery to and from other brokers is then refused until an
operator chooses, as SQL Server asks for a restored or attached database:

``new_broker`` (SQL Server's ``NEW_BROKER``)
    This database is a copy that lives on beside the original: it becomes a broker instance of
    its own. It gets a new instance id; every conversation that involves another broker (bound
    to another broker instance, or routed to one) ends with an Error in its local endpoint's
    queue, so local applications are told, and its messages leave the transmission queue.
    Conversations between services of this database go on (their endpoints take the new id).
    The far brokers are not told: they hold the original's conversations, not this copy's.
``error_conversations`` (``ERROR_BROKER_CONVERSATIONS``)
    Keep the instance id, and end every conversation with an Error (both sides, where both are
    in this database); the transmission queue is emptied. For a database restored from a backup
    in place of a lost original: what it knew of its conversations is stale. Far brokers are
    not told either: their side ends by its lifetime, or when their application ends it.
``keep`` (``ENABLE_BROKER``)
    The same broker, moved (a new server, a renamed file, ``pg_upgrade``): record where it is
    now and change nothing else (messages that waited because of the copy are retried at once).

Each runs in one transaction. Other processes using the database notice a new instance id and
the lifted refusal within a second; stop delivery to and from it while resetting.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import delete, select, update
from sqlalchemy.engine import Connection

from airflow_broker import routing
from airflow_broker.constants import ERR_BROKER_IDENTITY_RESET, ERROR
from airflow_broker.errors import BrokerError, InvalidDefinition
from airflow_broker.messaging.events import record_event
from airflow_broker.messaging.lookups import hosted_services
from airflow_broker.messaging.objects import error_body
from airflow_broker.messaging.rows import to_endpoint
from airflow_broker.routing.routes import routes_of
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow
from airflow_broker.storage.context import BrokerContext
from airflow_broker.storage.endpoint_locks import exclude_writers
from airflow_broker.storage.identity import MODES, identity_status, record_fingerprint

log = logging.getLogger("airflow_broker")

#: Endpoints handled per statement (an IN list stays well under SQLite's parameter limit).
CHUNK: Final = 500

#: The command-line spelling of each mode.
FLAGS: Final = {
    "new_broker": "--new-broker",
    "error_conversations": "--error-conversations",
    "keep": "--keep",
}


@dataclass(frozen=True, slots=True)
class IdentityReset:
    """What :meth:`Broker.reset_identity` did.

    :ivar conversations_ended: endpoints that got an Error and went to ER.
    :ivar conversations_closed: endpoints that had ended on this side already (DO, waiting for
        the far side's EndDialog that will not come) and are closed now.
    :ivar transmissions_removed: messages taken out of the transmission queue.
    """

    mode: str
    database: str
    previous_instance_id: str
    instance_id: str
    fingerprint: str
    conversations_ended: int
    conversations_closed: int
    transmissions_removed: int


def reset_identity(broker: BrokerContext, mode: str) -> IdentityReset:
    """``new_broker``, ``error_conversations`` or ``keep`` (see the module's docstring), in one
    transaction of ``broker``'s database."""
    if mode not in MODES:
        raise InvalidDefinition(
            f"reset_identity mode must be one of {', '.join(MODES)}, not {mode!r}"
        )
    database = broker.engine.url.render_as_string(hide_password=True)
    bi = s.broker_instance
    with broker.engine.begin() as conn:
        identity_status(broker, conn)  # a database without broker tables says so
        stmt = select(bi.c.instance_id)
        if broker.dialect == "postgresql":
            stmt = stmt.with_for_update()  # one reset at a time
        old = conn.execute(stmt).scalar()
        if old is None:
            raise BrokerError(f"broker database {database} is not migrated: run migrate first")
        old = str(old)
        new = str(uuid.uuid4()) if mode == "new_broker" else old
        now = utcnow()
        ended = closed = removed = 0
        if mode != "keep":
            description = (
                f"broker database {database} was restored, cloned or copied: reset-identity "
                f"{FLAGS[mode]} ended this conversation"
                + (f" (broker instance {old} is now {new})" if new != old else "")
            )
            handles = (
                sorted(_remote_handles(broker, conn, old, now)) if mode == "new_broker" else None
            )
            ended, closed = _end_with_error(broker, conn, handles, description, now)
            removed = _clear_transmissions(conn, handles)
            if broker.dialect == "postgresql":
                # Packets a forwarder held for others: the senders still have them.
                conn.execute(delete(s.transit))
            if new != old:
                _rename(conn, old, new)
        fingerprint = record_fingerprint(conn)
        # Messages that waited because of the copy go at the next delivery pass.
        t = s.transmission_queue
        conn.execute(
            update(t)
            .where(t.c.transmission_status.like("copy detected:%"))
            .values(
                next_attempt_at=now,
                transmission_status=f"waiting for delivery (identity reset {FLAGS[mode]})",
            )
        )
        detail = (
            f"reset-identity {FLAGS[mode]} on broker database {database}: broker instance "
            f"{old}" + (f" -> {new}" if new != old else " kept") + f"; {ended} conversations "
            f"ended with an error, {closed} closed, {removed} messages removed from the "
            f"transmission queue; fingerprint recorded: {fingerprint}"
        )
        record_event(conn, "identity_reset", new, detail)
    broker.invalidate_identity()
    log.info("%s", detail)  # and recorded as an event
    return IdentityReset(mode, database, old, new, fingerprint, ended, closed, removed)


def _chunks(items: Sequence[Any]) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), CHUNK):
        yield items[start : start + CHUNK]


def _remote_handles(
    broker: BrokerContext, conn: Connection, me: str, now: datetime
) -> set[uuid.UUID]:
    """Endpoints of conversations that involve another broker: bound to (or begun for) another
    broker instance, or not bound yet with messages waiting that the routes send to another
    broker. A local dialog has its far endpoint here (``far_handle``)."""
    e, t = s.conversation_endpoint, s.transmission_queue
    handles = set(
        conn.execute(
            select(e.c.conversation_handle).where(
                e.c.far_handle.is_(None),
                e.c.far_broker_instance.is_not(None),
                e.c.far_broker_instance != me,
            )
        ).scalars()
    )
    pending = conn.execute(
        select(e.c.conversation_handle, e.c.conversation_id, e.c.far_service).where(
            e.c.far_handle.is_(None),
            e.c.far_broker_instance.is_(None),
            e.c.conversation_handle.in_(select(t.c.conversation_handle)),
        )
    ).all()
    if pending:
        routes = routes_of(broker, conn)
        hosted = list(hosted_services(broker, conn))
        for r in pending:
            decision = routing.delivery_decision(
                routes, r.far_service, None, dialog_id=r.conversation_id, me=me, now=now,
                hosted=hosted,
            )  # fmt: skip
            if decision.kind == "remote":
                handles.add(r.conversation_handle)
    return handles


def _end_with_error(
    broker: BrokerContext,
    conn: Connection,
    handles: Sequence[uuid.UUID] | None,
    description: str,
    now: datetime,
) -> tuple[int, int]:
    """End the conversations of ``handles`` (sorted; None: every endpoint) that are still open
    here: an Error into the endpoint's queue and state ER, as an expired lifetime does; an
    endpoint that ended already (DO) is closed. Returns (ended, closed)."""
    e, g = s.conversation_endpoint, s.conversation_group
    open_ = e.c.state.notin_(("ER", "CD"))
    if handles is None:
        handles = (
            conn.execute(
                select(e.c.conversation_handle).where(open_).order_by(e.c.conversation_handle)
            )
            .scalars()
            .all()
        )
    if broker.dialect == "postgresql":
        # The lock order: conversation groups first (as RECEIVE and END take them), in id
        # order, then the endpoints FOR UPDATE in handle order (rule 3: waits for writers).
        groups: set[uuid.UUID] = set()
        for chunk in _chunks(handles):
            groups.update(
                conn.execute(
                    select(e.c.conversation_group_id).where(e.c.conversation_handle.in_(chunk))
                ).scalars()
            )
        for chunk in _chunks(sorted(groups)):
            conn.execute(
                select(g.c.conversation_group_id)
                .where(g.c.conversation_group_id.in_(chunk))
                .order_by(g.c.conversation_group_id)
                .with_for_update(key_share=True)  # FOR NO KEY UPDATE, as RECEIVE takes it
            )
        for chunk in _chunks(handles):
            exclude_writers(conn, chunk)
            conn.execute(
                select(e.c.conversation_handle)
                .where(e.c.conversation_handle.in_(chunk))
                .order_by(e.c.conversation_handle)
                .with_for_update()
            )
    rows: list[Any] = []
    for chunk in _chunks(handles):
        rows += conn.execute(select(e).where(open_, e.c.conversation_handle.in_(chunk))).all()
    body = error_body(ERR_BROKER_IDENTITY_RESET, description)
    closing = [r.conversation_handle for r in rows if r.state == "DO"]
    erring = [r for r in rows if r.state != "DO"]
    for r in erring:
        conn.execute(to_endpoint(r, ERROR, r.receive_sequence, body, "X", now))
    for chunk in _chunks([r.conversation_handle for r in erring]):
        conn.execute(
            update(e)
            .where(e.c.conversation_handle.in_(chunk))
            .values(state="ER", timer_due_at=None)
        )
    for chunk in _chunks(closing):
        conn.execute(
            update(e)
            .where(e.c.conversation_handle.in_(chunk))
            .values(state="CD", closed_at=now, timer_due_at=None)
        )
    return len(erring), len(closing)


def _clear_transmissions(conn: Connection, handles: Sequence[uuid.UUID] | None) -> int:
    """Take the messages of ``handles`` (None: every message) out of the transmission queue."""
    t = s.transmission_queue
    if handles is None:
        return conn.execute(delete(t)).rowcount or 0
    removed = 0
    for chunk in _chunks(handles):
        removed += conn.execute(delete(t).where(t.c.conversation_handle.in_(chunk))).rowcount or 0
    return removed


def _rename(conn: Connection, old: str, new: str) -> None:
    """The new instance id everywhere this broker names itself: the instance row, the local
    dialogs' endpoints (their far side is here) and what waits for local delivery."""
    e, t = s.conversation_endpoint, s.transmission_queue
    conn.execute(update(s.broker_instance).values(instance_id=new))
    conn.execute(update(e).where(e.c.far_broker_instance == old).values(far_broker_instance=new))
    conn.execute(update(t).where(t.c.from_broker_instance == old).values(from_broker_instance=new))
    conn.execute(update(t).where(t.c.to_broker_instance == old).values(to_broker_instance=new))


__all__ = ["FLAGS", "IdentityReset", "reset_identity"]
