"""One cause, one wait, in the delivery pass (the table and the wake-up are
:mod:`airflow_broker.storage.waits`).

What a batch could not deliver waits with the reason. When the reason is a cause other dialogs
may share (no route to the service, dialog security missing, the far broker unreachable, hung,
or refusing them, this database a copy), the rows are *parked* under the cause: they point at
it and have no next attempt of their own, and the cause keeps one backoff (1, 2, 4 ... 60 s)
for all of them. When it falls due, the next pass makes one dialog of it due (:func:`probe_due`)
and tries that one alone. If that dialog waits again for the same cause, all wait again
together; if it leaves, or waits for something else, the cause is cured (or changed) and all its
rows are due at once (:func:`record`). Messages held by a forwarder, or by an inbox, keep a
backoff of their own: they are on their way.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from sqlalchemy import exists, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

import airflow_broker.transport.inbox as inbox
from airflow_broker.messaging.delivery import backoff
from airflow_broker.storage import bulk, waits
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware
from airflow_broker.storage.context import BrokerContext
from airflow_broker.transport.outcomes import UNREACHABLE
from airflow_broker.transport.packets import DROPPED

#: (kind, destination, detail): what names a cause (:mod:`airflow_broker.storage.waits`)
Key = tuple[str, str, str]

_w = s.transmission_wait
_t = s.transmission_queue


def routing(service: str, asked: str | None) -> Key:
    """No route reaches ``service`` (bound to broker instance ``asked``, or not)."""
    return (waits.ROUTE, service, asked or "")


def security(far_service: str, local_service: str) -> Key:
    """Dialog security between these services cannot be set up yet."""
    return (waits.SECURITY, far_service, local_service)


COPY: Key = (waits.COPY, "", "")


def of_push(plan: dict[str, Any], row: Any, kind: str, reason: str) -> Key | None:
    """The cause of a row a push left waiting (``kind``: :data:`UNREACHABLE`, DROPPED by the
    far broker, or held on its way), or None when it has none to share."""
    address = plan["dest"].get(row.conversation_handle)
    if address is None:
        return None
    if kind == UNREACHABLE:
        return (waits.ADDRESS, address, "")
    if kind == DROPPED:
        return (waits.FAR, address, reason)
    return None


def of_address(plan: dict[str, Any], row: Any) -> Key | None:
    """The cause of a row whose destination did not answer in time (or is suspect)."""
    address = plan["dest"].get(row.conversation_handle)
    return None if address is None else (waits.ADDRESS, address, "")


def record(
    conn: Connection,
    b: BrokerContext,
    plan: dict[str, Any],
    waiting: list[tuple[Any, str, Key | None]],
    inboxed: set[int],
    now: datetime,
    started: datetime,
) -> tuple[int, int]:
    """What a batch left waiting, recorded in its transaction: each row with its reason, those
    with a cause parked under it; causes its rows were tried for and that no longer hold them
    released. ``started``: when the delivery pass began (a cause is one attempt more once per
    pass). Returns (rows parked, rows released)."""
    t = _t
    if b.client_role is not None:  # a restricted role sees no causes: each row on its own
        waiting = [(r, why, None) for r, why, _ in waiting]
    # A row that waits for no cause backs off on its own: as an inbox retries, or as delivery does.
    retry = {r.id: inbox.inbox_retry if r.id in inboxed else backoff for r, _, _ in waiting}
    bulk.update_rows(
        conn,
        t,
        "id",
        [
            _tried(r, reason, next_attempt_at=now + retry[r.id](r.attempts + 1))
            for r, reason, key in waiting
            if key is None
        ],
    )
    by_key: dict[Key, list[tuple[Any, str]]] = defaultdict(list)
    for r, reason, key in waiting:
        if key is not None:
            by_key[key].append((r, reason))
    # The causes' ids (a new one created), then their rows, then the causes' own rows, in one
    # order for every pass (the lock order of airflow_broker.storage.waits).
    ids = {key: _wait_id(conn, key, by_key[key][-1][1], now) for key in sorted(by_key)}
    parked_under: dict[int, int] = {}
    reasons: dict[int, str] = {}
    for key, wait_id in ids.items():
        rows = by_key[key]
        bulk.update_rows(
            conn,
            t,
            "id",
            [_tried(r, reason, next_attempt_at=None, wait_id=wait_id) for r, reason in rows],
        )
        parked_under.update((r.id, wait_id) for r, _ in rows)
        reasons[wait_id] = rows[-1][1]
    # Rows that waited for a cause and were tried (the cause's probe, or all of them on a
    # retry_now pass): a cause that no longer holds one of them is cured, or has changed.
    tried = {r.wait_id for rows in plan["rows"].values() for r in rows if r.wait_id is not None}
    cured = {
        r.wait_id
        for rows in plan["rows"].values()
        for r in rows
        if r.wait_id is not None and parked_under.get(r.id) != r.wait_id
    }
    released = waits.release_rows(conn, b.dialect, cured, now)
    for wait_id in sorted(cured | set(reasons)):
        if wait_id in cured:
            waits.reset(conn, b.dialect, [wait_id], now)
        else:
            _attempted(conn, wait_id, reasons[wait_id], now, started, wait_id in tried)
    if released:
        b.note_due(now)
    return len(parked_under), released


def _tried(r: Any, reason: str, **then: Any) -> dict[str, Any]:
    """The update of transmission row ``r``, tried and left waiting for ``reason``: one attempt
    more, and ``then`` (when it is tried next, or the cause it is parked under)."""
    return {"id": r.id, "attempts": r.attempts + 1, "transmission_status": reason, **then}


def _wait_id(conn: Connection, key: Key, reason: str, now: datetime) -> int:
    """The id of cause ``key``, created (due now, no attempt yet) if it is new. Not locked:
    its rows are updated first (the lock order of :mod:`airflow_broker.storage.waits`)."""
    kind, destination, detail = key
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    conn.execute(
        insert(_w)
        .values(
            kind=kind,
            destination=destination,
            detail=detail,
            reason=reason,
            attempts=0,
            next_attempt_at=now,
            since=now,
        )
        .on_conflict_do_nothing(index_elements=["kind", "destination", "detail"])
    )
    return int(
        conn.execute(
            select(_w.c.id).where(
                _w.c.kind == kind, _w.c.destination == destination, _w.c.detail == detail
            )
        ).scalar_one()
    )


def _attempted(
    conn: Connection, wait_id: int, reason: str, now: datetime, started: datetime, tried: bool
) -> None:
    """A batch of the pass that ``started`` found cause ``wait_id`` holding its rows at ``now``.
    It is one attempt more, and backs off, when the batch tried rows that waited for it (its
    probe, or every row on a ``retry_now`` pass) and no other batch of the pass counted it yet,
    or when it was not waiting yet (new, or cured a while ago); rows that only join it wait
    for its next attempt."""
    stmt = select(_w.c.attempts, _w.c.next_attempt_at, _w.c.tried_at).where(_w.c.id == wait_id)
    if conn.dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    attempts, next_at, tried_at = conn.execute(stmt).one()
    values: dict[str, Any] = {"reason": reason}
    counted = tried_at is not None and aware(tried_at) >= started  # type: ignore[operator]
    if (tried and not counted) or aware(next_at) <= now:  # type: ignore[operator]
        values["attempts"] = attempts + 1
        values["next_attempt_at"] = now + backoff(attempts + 1)
        values["tried_at"] = started
        if attempts == 0:
            values["since"] = now
    conn.execute(update(_w).where(_w.c.id == wait_id).values(**values))


def probe_due(b: BrokerContext, now: datetime) -> int:
    """Causes whose next attempt is due: one dialog of each made due now, for the pass to try
    for all of them (its recording counts the attempt). Until then the cause's next attempt is
    one backoff step away, as it was: if the pass dies, it is tried again then. Returns how many
    causes are tried."""
    if b.client_role is not None:
        return 0
    due_now = (_w.c.next_attempt_at <= now, exists().where(_t.c.wait_id == _w.c.id))
    # Most passes find none: a read (on SQLite, without the write lock) says so.
    with b.read_connection() as conn:
        if conn.execute(select(_w.c.id).where(*due_now).limit(1)).first() is None:
            return 0
    pg = b.dialect == "postgresql"
    with b.engine.begin() as conn:
        stmt = select(_w.c.id, _w.c.attempts).where(*due_now)
        if pg:
            stmt = stmt.with_for_update(of=_w, skip_locked=True)
        due = conn.execute(stmt).all()
        for wait_id, attempts in due:
            first = (
                select(_t.c.conversation_handle)
                .where(_t.c.wait_id == wait_id)
                .order_by(_t.c.id)
                .limit(1)
            )
            handle = conn.execute(first).scalar()
            if handle is None:
                continue
            rows = select(_t.c.id).where(
                _t.c.wait_id == wait_id, _t.c.conversation_handle == handle
            )
            if pg:
                rows = rows.with_for_update(skip_locked=True)
            conn.execute(
                update(_t).where(_t.c.id.in_(rows.scalar_subquery())).values(next_attempt_at=now)
            )
            conn.execute(
                update(_w)
                .where(_w.c.id == wait_id)
                .values(next_attempt_at=now + backoff(max(attempts, 1)))
            )
    return len(due)


def answered(b: BrokerContext, conn: Connection, address: str) -> int:
    """``address`` answered (a push that a pass stopped waiting for ended well): what waits
    for it is due now. Returns how many rows were released."""
    ids = conn.execute(
        select(_w.c.id).where(_w.c.kind == waits.ADDRESS, _w.c.destination == address)
    ).scalars()
    return waits.release(conn, b.dialect, list(ids))


__all__ = [
    "COPY",
    "Key",
    "answered",
    "of_address",
    "of_push",
    "probe_due",
    "record",
    "routing",
    "security",
]
