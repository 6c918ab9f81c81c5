"""One cause, one wait: transmission-queue rows held up by the same cause wait for it together.

A dialog whose messages cannot leave waits for a *cause*: no route to its far service, dialog
security missing for it (no remote service binding, no certificate), a far broker that does not
answer or refuses them, this database being a copy. Many dialogs often wait for the same one.
Each cause is a row of ``broker_transmission_wait`` (its kind, destination and detail name it)
with one backoff; its rows point at it (``wait_id``) and have no next attempt of their own
(``next_attempt_at`` NULL), so nothing counts them as due. When the cause falls due a delivery
pass tries one of its dialogs for all of them (:mod:`airflow_broker.transport.causes`); when that
dialog leaves, or waits for something else, the others are due at once.

A definition that can cure a cause wakes its rows at once: :func:`wake` (called by CREATE and
ALTER of routes, remote service bindings, certificates and services) makes them due now, forgets
the cause's backoff and, on PostgreSQL, NOTIFYs the transmitter's channel, as queuing does.

Lock order, so that nothing here deadlocks with a delivery pass: transmission-queue rows first
(those a pass holds are skipped: it decides about them itself), then the cause's row. A cause is
never deleted: a row pointing at it is never left without one (a cause with no rows is ignored).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import select, text, update
from sqlalchemy.engine import Connection

from airflow_broker.constants import BROKER_CONFIGURATION
from airflow_broker.storage import bulk
from airflow_broker.storage import schema as s
from airflow_broker.storage.adapter_base import TRANSMIT_CHANNEL
from airflow_broker.storage.clock import utcnow

#: no route reaches the far service yet (destination: the service; detail: the instance asked)
ROUTE = "route"
#: dialog security cannot be set up yet (destination: the far service; detail: the local one)
SECURITY = "security"
#: the far broker cannot be reached or does not answer (destination: its address)
ADDRESS = "address"
#: the far broker answered and will not take them yet (destination: its address; detail: why)
FAR = "far"
#: this database is a copy and delivers nothing to other brokers until an operator decides
COPY = "copy"
KINDS = (ROUTE, SECURITY, ADDRESS, FAR, COPY)

_w = s.transmission_wait
_t = s.transmission_queue


def release(
    conn: Connection, dialect: str, wait_ids: Iterable[int], now: datetime | None = None
) -> int:
    """The rows of these causes are due ``now`` (each on its own again) and the causes forget
    their backoff; rows another transaction holds (a delivery pass) are left to it. Returns how
    many rows were released."""
    ids = sorted(set(wait_ids))
    now = utcnow() if now is None else now
    released = release_rows(conn, dialect, ids, now)
    reset(conn, dialect, ids, now)
    return released


def release_rows(conn: Connection, dialect: str, wait_ids: Iterable[int], now: datetime) -> int:
    """The rows of these causes are due ``now``, each on its own again (those another
    transaction holds are skipped); the causes' rows are not touched. Returns how many."""
    ids = sorted(set(wait_ids))
    if not ids:
        return 0
    rows = select(_t.c.id).where(bulk.any_of(_t.c.wait_id, ids, dialect))
    if dialect == "postgresql":
        rows = rows.with_for_update(skip_locked=True)
    released = conn.execute(
        update(_t)
        .where(_t.c.id.in_(rows.scalar_subquery()))
        .values(wait_id=None, next_attempt_at=now)
    ).rowcount
    return int(released or 0)


def reset(conn: Connection, dialect: str, wait_ids: Iterable[int], now: datetime) -> None:
    """These causes forget their backoff: due ``now`` (ignored while no row waits for one)."""
    ids = sorted(set(wait_ids))
    if ids:
        conn.execute(
            update(_w)
            .where(bulk.any_of(_w.c.id, ids, dialect))
            .values(attempts=0, next_attempt_at=now)
        )


def wake(
    conn: Connection,
    kinds: Iterable[str],
    destinations: Iterable[str] | None = None,
    *,
    details: Iterable[str] | None = None,
) -> int:
    """A definition changed that may cure the causes of ``kinds`` (those of ``destinations``
    only, and of ``details``, when given): their rows are due now, and the transmitter is told
    (PostgreSQL: NOTIFY on its channel, sent when the transaction commits). Returns how many
    rows were woken."""
    cond = [_w.c.kind.in_(sorted(set(kinds)))]
    if destinations is not None:
        cond.append(_w.c.destination.in_(sorted(set(destinations))))
    if details is not None:
        cond.append(_w.c.detail.in_(sorted(set(details))))
    ids = list(conn.execute(select(_w.c.id).where(*cond)).scalars())
    if not ids:
        return 0
    dialect = conn.dialect.name
    woken = release(conn, dialect, ids)
    if dialect == "postgresql":
        conn.execute(text("SELECT pg_notify(:ch, '')"), {"ch": TRANSMIT_CHANNEL})
    return woken


def wake_for_route(conn: Connection, service_name: str | None, addresses: Iterable[Any]) -> int:
    """A route to ``service_name`` (every service: None) at ``addresses`` was created or
    changed: what waits for a route to that service (to any, for a wildcard route or one to the
    dynamic routing service), or for one of those addresses, is due now."""
    every = service_name is None or service_name == BROKER_CONFIGURATION
    woken = wake(conn, [ROUTE], None if every else [service_name])  # type: ignore[list-item]
    named = [a for a in addresses if a]
    if named:
        woken += wake(conn, [ADDRESS, FAR], named)
    return woken


def wake_for_security(conn: Connection, far_service: str | None = None) -> int:
    """A remote service binding for ``far_service`` (any: None, a certificate) was created or
    changed: what waits for dialog security to it is due now."""
    return wake(conn, [SECURITY], None if far_service is None else [far_service])


__all__ = [
    "ADDRESS",
    "COPY",
    "FAR",
    "KINDS",
    "ROUTE",
    "SECURITY",
    "release",
    "release_rows",
    "reset",
    "wake",
    "wake_for_route",
    "wake_for_security",
]
