"""Delivery by a peer that may only deliver (seed 004's least privilege between brokers).

Pushing a batch straight into a far broker (:meth:`Inbound.accept` run on its database) needs
the far broker's owner rights: every sender would hold write credentials on every peer, which a
forwarder between trust domains (seed 002) must not. A role granted only the delivery right
(:func:`grant_delivery`) gets two tables on the far side, nothing else:

- ``broker_inbox``: it may INSERT a batch (serialized by :mod:`.wire`) under its own role name
  (row-level security checks ``pushed_by = current_user``). It cannot read the inbox back.
- ``broker_inbox_answer``: it may read and delete the answers to its own batches
  (acknowledgments, Error notices, and why a packet was held or dropped), and no one else's.

The far broker's own delivery pass (its transmitter) accepts what waits in its inbox with its
own rights (:func:`accept_inbox`): the same accept as a direct push, in the same transactions,
then writes the answers and deletes the batches in one commit. A pass that dies between the two
leaves the batch; the next accepts it again and acknowledges its messages as the duplicates they
are. The sender collects answers at the start of each of its passes and with every push
(:func:`collect`), and keeps every message until its acknowledgment, as for a direct push.

Which way a push goes is decided by the far role's rights (:func:`inbox_mode`): the owner (or
any role that may write the broker's tables) pushes directly as before; a role that may write
the inbox but not the broker's tables pushes into the inbox. One delivery role per pushing
broker: answers are kept per role.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import delete, insert, literal_column, select, text
from sqlalchemy.exc import DBAPIError

from airflow_broker.errors import InvalidDefinition, UnknownObject
from airflow_broker.messaging.delivery import backoff
from airflow_broker.storage import bulk
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow
from airflow_broker.transport.inbound import Inbound
from airflow_broker.transport.packets import ACK, HELD, Outcome, Packet, Unreachable, _first_line
from airflow_broker.transport.wire import (
    MalformedBatch,
    Note,
    dump_answers,
    dump_packets,
    load_answers,
    load_packets,
)

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")


class Transport(Protocol):
    """The pass that accepts the inbox (:class:`~.outbound.Transport`): its broker, and how it
    passes packets on to other brokers (a forwarder's next hop)."""

    @property
    def b(self) -> BrokerContext:
        """This broker."""

    def push_any(
        self, addresses: Iterable[str], packets: Sequence[Packet], depth: int = 0
    ) -> tuple[Outcome | None, list[str]]:
        """Push ``packets`` to the first of ``addresses`` that takes them."""


#: Batches one transaction of :func:`accept_inbox` takes (each is accepted on its own).
ACCEPT_BATCHES = 20
#: First wait before a batch left in an inbox is pushed again (doubling, up to INBOX_RETRY_CAP):
#: the far broker's pass acknowledges it long before, unless that broker is down.
INBOX_RETRY = timedelta(seconds=30)
INBOX_RETRY_CAP = timedelta(minutes=10)

_lock = threading.Lock()
#: far database URL -> pushes go through its inbox
_modes: dict[str, bool] = {}
#: sender database URL -> addresses this process pushed to through an inbox
_inbox_addresses: dict[str, set[str]] = {}

_MODE = text(
    "SELECT CASE WHEN to_regclass('broker_inbox') IS NULL THEN false ELSE "
    "has_table_privilege('broker_inbox', 'INSERT') "
    "AND NOT has_table_privilege('broker_transit', 'INSERT') END"
)


def inbox_retry(attempts: int) -> timedelta:
    """Delay before a batch left in a far inbox is pushed again (attempt ``attempts + 1``)."""
    return backoff(attempts, base=INBOX_RETRY, cap=INBOX_RETRY_CAP)


def inbox_mode(peer: BrokerContext) -> bool:
    """Whether this process's connection to ``peer`` may only deliver (through the inbox)."""
    if peer.dialect != "postgresql":
        return False
    key = str(peer.engine.url)
    with _lock:
        known = _modes.get(key)
    if known is not None:
        return known
    try:
        with peer.engine.connect() as conn:
            mode = bool(conn.execute(_MODE).scalar())
    except DBAPIError as exc:
        raise Unreachable(_first_line(exc)) from exc
    with _lock:
        _modes[key] = mode
    return mode


def forget_modes() -> None:
    """Ask again which way to push (after a far role's rights changed)."""
    with _lock:
        _modes.clear()


def inbox_addresses(sender: BrokerContext) -> list[str]:
    with _lock:
        return sorted(_inbox_addresses.get(str(sender.engine.url), ()))


def _take_answers(conn: Any) -> tuple[list[Packet], list[Note]]:
    a = s.inbox_answer
    rows = conn.execute(
        delete(a).where(a.c.pushed_by == literal_column("current_user")).returning(a.c.answers)
    ).all()
    answers: list[Packet] = []
    notes: list[Note] = []
    for (data,) in rows:
        try:
            more, more_notes = load_answers(data)
        except MalformedBatch as exc:
            log.warning("answers from a far inbox ignored: %s", exc)
            continue
        answers += more
        notes += more_notes
    return answers, notes


def collect(peer: BrokerContext, address: str) -> tuple[list[Packet], list[Note]]:
    """Take the answers ``peer`` wrote for this role's batches (deleting them there)."""
    try:
        with peer.engine.begin() as conn:
            return _take_answers(conn)
    except DBAPIError as exc:
        raise Unreachable(f"cannot collect answers from {address}: {_first_line(exc)}") from exc


def push(
    sender: BrokerContext,
    peer: BrokerContext,
    address: str,
    packets: Sequence[Packet],
    depth: int,
) -> Outcome:
    """Write ``packets`` into ``peer``'s inbox, taking the answers waiting there in the same
    transaction. Every packet of the batch is held until its acknowledgment comes back."""
    now = utcnow()
    try:
        with peer.engine.begin() as conn:
            answers, notes = _take_answers(conn)
            conn.execute(  # inline: no RETURNING of the id, which needs SELECT rights
                insert(s.inbox)
                .inline()
                .values(
                    pushed_by=literal_column("current_user"),
                    depth=depth,
                    packets=dump_packets(packets),
                    pushed_at=now,
                )
            )
    except DBAPIError as exc:
        raise Unreachable(f"cannot deliver to the inbox at {address}: {_first_line(exc)}") from exc
    with _lock:
        _inbox_addresses.setdefault(str(sender.engine.url), set()).add(address)
    why = f"in the inbox of {address}: waiting for that broker's delivery pass to accept it"
    out = Outcome(answers=answers, inbox=True, late_notes=notes)
    out.notes.update({i: (HELD, why) for i in range(len(packets))})
    return out


def accept_inbox(transport: Transport, counts: dict[str, int]) -> int:
    """Accept the batches peers pushed into this broker's inbox; returns how many."""
    b = transport.b
    if b.dialect != "postgresql":
        return 0
    taken = 0
    while True:
        try:
            n = _accept_some(b, transport, counts)
        except Unreachable as exc:
            # Not the principal, or a restored copy: the batches wait for one that is.
            log.warning("the inbox waits: %s", exc)
            return taken
        if n == 0:
            return taken
        taken += n


def _accept_some(b: BrokerContext, transport: Transport, counts: dict[str, int]) -> int:
    i = s.inbox
    with b.engine.begin() as conn:
        rows = conn.execute(
            select(i.c.id, i.c.pushed_by, i.c.depth, i.c.packets)
            .order_by(i.c.id)
            .limit(ACCEPT_BATCHES)
            .with_for_update(skip_locked=True)
        ).all()
        if not rows:
            return 0
        answer_rows: list[dict[str, Any]] = []
        for r in rows:
            try:
                packets = load_packets(r.packets)
            except MalformedBatch as exc:
                log.warning("batch %s pushed by role %s refused: %s", r.id, r.pushed_by, exc)
                packets = []
            outcome = Inbound(b, transport.push_any).accept(packets, depth=r.depth)
            counts["delivered"] += sum(1 for a in outcome.answers if a.kind == ACK)
            counts["forwarded"] += outcome.forwarded
            counts["discarded"] += outcome.discarded
            notes: list[Note] = [
                (packets[j].conversation_id, packets[j].from_initiator, packets[j].seq, k, why)
                for j, (k, why) in outcome.notes.items()
            ]
            answer_rows.append(
                {
                    "pushed_by": r.pushed_by,
                    "inbox_id": r.id,
                    "answers": dump_answers(outcome.answers, notes + outcome.late_notes),
                    "answered_at": utcnow(),
                }
            )
        conn.execute(insert(s.inbox_answer), answer_rows)
        conn.execute(delete(i).where(bulk.any_of(i.c.id, [r.id for r in rows], conn.dialect.name)))
    return len(rows)


def pending(conn: Any) -> int:
    """Batches waiting in this broker's inbox (PostgreSQL; 0 elsewhere)."""
    if conn.dialect.name != "postgresql":
        return 0
    return int(conn.execute(select(literal_column("count(*)")).select_from(s.inbox)).scalar())


# -- the delivery right -----------------------------------------------------------------------
_GRANTS = (
    "GRANT INSERT ON broker_inbox TO {role}",
    "GRANT USAGE ON SEQUENCE broker_inbox_id_seq TO {role}",
    "GRANT SELECT, DELETE ON broker_inbox_answer TO {role}",
)
_REVOKES = (
    "REVOKE INSERT ON broker_inbox FROM {role}",
    "REVOKE USAGE ON SEQUENCE broker_inbox_id_seq FROM {role}",
    "REVOKE SELECT, DELETE ON broker_inbox_answer FROM {role}",
)


def _role(conn: Any, role: str, verb: str) -> str:
    if conn.dialect.name != "postgresql":
        raise InvalidDefinition(
            f"cannot {verb} the delivery right of role {role!r}: rights of database roles need "
            "PostgreSQL (this broker is on SQLite, where every connection may do everything)"
        )
    if conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first() is None:
        raise UnknownObject(f"database role {role!r} does not exist (CREATE ROLE it first)")
    quoted: str = conn.execute(text("SELECT quote_ident(:r)"), {"r": role}).scalar()
    return quoted


def grant_delivery(broker: BrokerContext, role: str) -> None:
    """Let ``role`` push batches into this broker's inbox and collect their answers: all a peer
    (or a forwarder) needs to deliver here, and nothing more (PostgreSQL)."""
    with broker.engine.begin() as conn:
        quoted = _role(conn, role, "grant")
        for sql in _GRANTS:
            conn.execute(text(sql.format(role=quoted)))
    log.info("role %s may deliver to this broker (through its inbox)", role)


def revoke_delivery(broker: BrokerContext, role: str) -> None:
    with broker.engine.begin() as conn:
        quoted = _role(conn, role, "revoke")
        for sql in _REVOKES:
            conn.execute(text(sql.format(role=quoted)))


def delivery_roles(broker: BrokerContext) -> list[str]:
    """Roles that may deliver to this broker (PostgreSQL; [] on SQLite)."""
    if broker.dialect != "postgresql":
        return []
    with broker.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT rolname FROM pg_roles WHERE has_table_privilege(oid, 'broker_inbox', "
                "'INSERT') AND NOT has_table_privilege(oid, 'broker_transit', 'INSERT') "
                "ORDER BY rolname"
            )
        ).all()
    return [r[0] for r in rows]
