"""``Broker.check()``: a consistency check of a live broker database (fsck for the broker).

Each check is one query for one kind of impossible state; what it finds becomes a
:class:`Problem` that names the object and says in a sentence what is wrong. The checks read a
single snapshot (REPEATABLE READ on PostgreSQL; SQLite's read transaction is one already), so a
busy broker is not reported for what a concurrent transaction was in the middle of.

The check streams: each check is one statement over the snapshot, whose rows (the problems it
finds) come from a server-side cursor :data:`BATCH` at a time, so nothing is held but the
problems listed (at most :data:`MAX_LISTED` of a kind, the rest counted). Progress (checks done
of how many, seconds, problems so far, the endpoints there are) is logged at INFO and handed to
a callback at most every :data:`PROGRESS_EVERY` seconds and after the last check; :func:`run`
returns the problems with the endpoints checked and the seconds it took (``airflow-broker
check`` prints both). Why one pass over the whole handle space: :mod:`.check_progress`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, delete, func, insert, not_, or_, select, text, update
from sqlalchemy.engine import Connection

from airflow_broker.constants import DIALOG_TIMER, END_DIALOG, ERROR, STATE_DESC
from airflow_broker.messaging.duework import run_due
from airflow_broker.messaging.events import record_event
from airflow_broker.operations.check_progress import Progress
from airflow_broker.storage import schema as s
from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")

#: At most this many problems of one kind are listed one by one; the rest are counted.
MAX_LISTED = 200
#: The ``broker_event`` row that records each check's outcome (the UI's overview shows the last).
EVENT = "consistency_check"
#: Rows a check's server-side cursor fetches at a time.
BATCH = 10_000
#: Progress is reported at most this often, in seconds (and once at the end).
PROGRESS_EVERY = 2.0

_m = s.message
_e = s.conversation_endpoint
_f = s.conversation_endpoint.alias("far")
_g = s.conversation_group
_q = s.queue
_svc = s.service
_t = s.transmission_queue


@dataclass(frozen=True, slots=True)
class Problem:
    """One impossible state: its ``kind`` (see :data:`KINDS`), the ``object`` it was found on,
    and a ``detail`` sentence; ``repaired`` when ``check(repair=True)`` fixed it."""

    kind: str
    object: str
    detail: str
    repaired: bool = False

    def __str__(self) -> str:
        mark = " (repaired)" if self.repaired else ""
        return f"{self.kind}: {self.object}: {self.detail}{mark}"


#: Every kind of problem the check reports, with what it means.
KINDS: dict[str, str] = {
    "message_without_endpoint": "a message whose conversation endpoint does not exist",
    "message_misfiled": "a message in another queue or group than its endpoint's",
    "duplicate_message": "two messages of one conversation with the same sequence number",
    "message_ahead_of_sender": "a message numbered at or past what its sender has sent",
    "endpoint_without_group": "an endpoint whose conversation group does not exist",
    "endpoint_without_queue": "an endpoint whose queue does not exist",
    "endpoint_without_service": "an endpoint whose service does not exist",
    "impossible_state": "an endpoint whose state or sequence numbers cannot occur",
    "transmission_after_end": "a transmission of a conversation that has ended or failed",
    "dead_reader_lease": "a receive lease of a reader that died, not counted yet",
    "stray_lease_mark": "a message or group marked by a lease that does not exist",
}

#: The kinds ``repair=True`` fixes, and how; the fix cannot lose a message anyone can receive.
REPAIRS: dict[str, str] = {
    "message_without_endpoint": "deleted: no conversation can receive or end it",
    "message_misfiled": "moved to its endpoint's queue and conversation group",
    "endpoint_without_group": "its conversation group is created on the endpoint's queue",
    "transmission_after_end": "deleted: the conversation can send nothing more",
    "dead_reader_lease": "counted as a rolled-back receive by a due-work pass",
    "stray_lease_mark": "the mark is cleared: the messages are ready again",
}


def _short(handle: Any) -> str:
    return str(handle)


# ---------------------------------------------------------------------------------------------
# The checks: each yields (kind, object, detail)
# ---------------------------------------------------------------------------------------------

Found = Iterator[tuple[str, str, str]]


def _messages_without_endpoint(conn: Connection) -> Found:
    rows = conn.execute(
        select(_m.c.queuing_order, _m.c.conversation_handle, _m.c.message_type_name, _q.c.name)
        .outerjoin(_e, _e.c.conversation_handle == _m.c.conversation_handle)
        .outerjoin(_q, _q.c.queue_id == _m.c.queue_id)
        .where(_e.c.conversation_handle.is_(None))
        .order_by(_m.c.queuing_order)
    )
    for r in rows:
        yield (
            "message_without_endpoint",
            f"message {r.queuing_order} in queue {r.name!r}",
            f"its conversation {_short(r.conversation_handle)} has no endpoint in this broker "
            f"(type {r.message_type_name!r}): RECEIVE would hand out a message nobody can answer",
        )


def _misfiled_messages(conn: Connection) -> Found:
    rows = conn.execute(
        select(
            _m.c.queuing_order,
            _m.c.conversation_handle,
            _m.c.queue_id,
            _m.c.conversation_group_id,
            _e.c.queue_id.label("endpoint_queue"),
            _e.c.conversation_group_id.label("endpoint_group"),
        )
        .join(_e, _e.c.conversation_handle == _m.c.conversation_handle)
        .where(
            or_(
                _m.c.queue_id != _e.c.queue_id,
                _m.c.conversation_group_id != _e.c.conversation_group_id,
            )
        )
        .order_by(_m.c.queuing_order)
    )
    for r in rows:
        yield (
            "message_misfiled",
            f"message {r.queuing_order} of conversation {_short(r.conversation_handle)}",
            f"it is in queue {r.queue_id} group {r.conversation_group_id}, its endpoint in queue "
            f"{r.endpoint_queue} group {r.endpoint_group}",
        )


def _duplicate_messages(conn: Connection) -> Found:
    rows = conn.execute(
        select(_m.c.conversation_handle, _m.c.message_sequence_number, func.count().label("n"))
        .where(_m.c.message_type_name.not_in([DIALOG_TIMER, ERROR]))
        .group_by(_m.c.conversation_handle, _m.c.message_sequence_number, _m.c.status)
        .having(func.count() > 1)
        .order_by(_m.c.conversation_handle, _m.c.message_sequence_number)
    )
    for r in rows:
        yield (
            "duplicate_message",
            f"conversation {_short(r.conversation_handle)}",
            f"{r.n} messages carry sequence number {r.message_sequence_number}: exactly-once "
            "delivery was broken",
        )


def _messages_ahead_of_sender(conn: Connection) -> Found:
    # Within one database the sender is the far endpoint: everything it sent is numbered below
    # its send_sequence. Messages an endpoint writes to its own queue (DialogTimer, Error of a
    # failed dialog, retained copies) are numbered by this side, not by the far one.
    rows = conn.execute(
        select(
            _m.c.queuing_order,
            _m.c.conversation_handle,
            _m.c.message_sequence_number,
            _f.c.send_sequence,
        )
        .join(_e, _e.c.conversation_handle == _m.c.conversation_handle)
        .join(_f, _f.c.conversation_handle == _e.c.far_handle)
        .where(
            _m.c.status == 1,
            _m.c.message_type_name.not_in([DIALOG_TIMER, ERROR]),
            _m.c.message_sequence_number >= _f.c.send_sequence,
        )
        .order_by(_m.c.queuing_order)
    )
    for r in rows:
        yield (
            "message_ahead_of_sender",
            f"message {r.queuing_order} of conversation {_short(r.conversation_handle)}",
            f"it is numbered {r.message_sequence_number}, but its sender has sent only "
            f"{r.send_sequence} messages (0 to {r.send_sequence - 1})",
        )


def _endpoints_without(conn: Connection) -> Found:
    checks: list[tuple[str, Any, Any, str, Any]] = [
        (
            "endpoint_without_group",
            _g,
            _g.c.conversation_group_id == _e.c.conversation_group_id,
            "its conversation group {group} does not exist: RECEIVE cannot lock it",
            None,
        ),
        (
            "endpoint_without_queue",
            _q,
            _q.c.queue_id == _e.c.queue_id,
            "its queue {queue} does not exist",
            None,
        ),
        (
            "endpoint_without_service",
            _svc,
            _svc.c.name == _e.c.service_name,
            "its service {service!r} does not exist (dropped while the conversation was open): "
            "end it WITH CLEANUP if it is dead",
            # DROP SERVICE ends the service's conversations and keeps the endpoints that ended
            # before their far side did (DO) or still have their Error to send (CD).
            _e.c.state.not_in(["DO", "CD"]),
        ),
    ]
    for kind, table, on, sentence, only in checks:
        missing = next(iter(table.primary_key.columns))
        stmt = (
            select(
                _e.c.conversation_handle,
                _e.c.conversation_group_id,
                _e.c.queue_id,
                _e.c.service_name,
            )
            .outerjoin(table, on)
            .where(missing.is_(None))
            .order_by(_e.c.conversation_handle)
        )
        rows = conn.execute(stmt if only is None else stmt.where(only))
        for r in rows:
            yield (
                kind,
                f"conversation endpoint {_short(r.conversation_handle)}",
                sentence.format(
                    group=r.conversation_group_id, queue=r.queue_id, service=r.service_name
                ),
            )


def _impossible_states(conn: Connection) -> Found:
    rows = conn.execute(
        select(_e)
        .where(
            or_(
                _e.c.state.not_in(list(STATE_DESC)),
                _e.c.send_sequence < 0,
                _e.c.receive_sequence < 0,
                and_(_e.c.state == "CD", _e.c.timer_due_at.is_not(None)),
                and_(_e.c.state == "CD", _e.c.closed_at.is_(None)),
                and_(_e.c.state == "SO", _e.c.receive_sequence > 0),
                and_(_e.c.state.in_(["SO", "SI"]), not_(_e.c.is_initiator == (_e.c.state == "SO"))),
            )
        )
        .order_by(_e.c.conversation_handle)
    )
    for r in rows:
        if r.state not in STATE_DESC:
            why = f"state {r.state!r} is not a Service Broker state ({', '.join(STATE_DESC)})"
        elif r.send_sequence < 0 or r.receive_sequence < 0:
            why = (
                f"negative sequence numbers (send {r.send_sequence}, receive {r.receive_sequence})"
            )
        elif r.state == "CD" and r.timer_due_at is not None:
            why = "closed (CD) with a conversation timer still set"
        elif r.state == "CD":
            why = "closed (CD) without the time it closed"
        elif r.state == "SO":
            why = f"started outbound (SO) yet it has received {r.receive_sequence} messages"
        else:
            side = "initiator" if r.is_initiator else "target"
            why = f"state {r.state} ({STATE_DESC[r.state]}) cannot belong to the {side}"
        yield "impossible_state", f"conversation endpoint {_short(r.conversation_handle)}", why


def _transmissions_after_end(conn: Connection) -> Found:
    rows = conn.execute(
        select(_t.c.id, _t.c.conversation_handle, _t.c.message_type_name, _e.c.state)
        .join(_e, _e.c.conversation_handle == _t.c.conversation_handle)
        .where(
            or_(
                _e.c.state == "ER",
                and_(_e.c.state == "CD", _t.c.message_type_name.not_in([END_DIALOG, ERROR])),
            )
        )
        .order_by(_t.c.id)
    )
    for r in rows:
        yield (
            "transmission_after_end",
            f"transmission {r.id} of conversation {_short(r.conversation_handle)}",
            f"a {r.message_type_name!r} message still waits to leave a conversation in state "
            f"{r.state} ({STATE_DESC.get(r.state, '?')}), which can send nothing more",
        )


def _dead_reader_leases(broker: BrokerContext, conn: Connection) -> Found:
    names = {r.queue_id: r.name for r in conn.execute(select(_q.c.queue_id, _q.c.name))}
    for lease, queue_id in broker.adapter.dead_leases(conn):
        yield (
            "dead_reader_lease",
            lease,
            f"a reader of queue {names.get(queue_id, queue_id)!r} died holding messages and no "
            "due-work pass has counted it toward poison handling yet (is anything running "
            "run_due() or a reader of this broker?)",
        )


def _stray_lease_marks(conn: Connection) -> Found:
    lease = s.lease
    for table, what in ((_m, "message"), (_g, "conversation group")):
        key = table.c.queuing_order if table is _m else table.c.conversation_group_id
        rows = conn.execute(
            select(key, table.c.lease_token)
            .where(
                table.c.lease_token.is_not(None),
                ~select(lease.c.token).where(lease.c.token == table.c.lease_token).exists(),
            )
            .order_by(key)
        )
        for r in rows:
            yield (
                "stray_lease_mark",
                f"{what} {r[0]}",
                f"it is held by lease {_short(r.lease_token)}, which does not exist: nothing "
                "will ever complete, release or expire it, so RECEIVE never hands it out",
            )


#: The checks that read conversations, each one pass over the whole snapshot.
_CHECKS: list[Callable[[Connection], Found]] = [
    _messages_without_endpoint,
    _misfiled_messages,
    _duplicate_messages,
    _messages_ahead_of_sender,
    _endpoints_without,
    _impossible_states,
    _transmissions_after_end,
]


def _once(broker: BrokerContext) -> list[Callable[[Connection], Found]]:
    """The checks that read what is small by nature (leases), run once."""
    return [lambda conn: _dead_reader_leases(broker, conn), _stray_lease_marks]


@dataclass(frozen=True, slots=True)
class Report:
    """What :func:`run` found: the problems, how many endpoints it checked, how long it took."""

    problems: list[Problem]
    endpoints: int
    seconds: float

    def __str__(self) -> str:
        return f"checked {self.endpoints:,} conversation endpoints in {self.seconds:.1f} s"


def _find(
    broker: BrokerContext,
    conn: Connection,
    progress: Callable[[Progress], None] | None = None,
    *,
    batch: int,
    every: float,
) -> tuple[list[Problem], int]:
    from airflow_broker.operations.counts import bounded_count

    started = time.monotonic()
    endpoints = bounded_count(conn, _e)
    listed: dict[str, list[Problem]] = {}
    counts: dict[str, int] = {}
    # Rows come from a server-side cursor, ``batch`` at a time: only problems listed are kept.
    streamed = conn.execution_options(yield_per=batch)
    steps: list[tuple[str, Callable[[Connection], Found]]] = [
        (check.__name__.strip("_"), check) for check in _CHECKS
    ]
    dead_leases, stray_marks = _once(broker)
    steps += [("dead_reader_leases", dead_leases), ("stray_lease_marks", stray_marks)]
    reported = started
    for n, (name, check) in enumerate(steps, 1):
        for kind, obj, detail in check(streamed):
            counts[kind] = counts.get(kind, 0) + 1
            if counts[kind] <= MAX_LISTED:
                listed.setdefault(kind, []).append(Problem(kind, obj, detail))
        now = time.monotonic()
        last = n == len(steps)
        if last or now - reported >= every:
            reported = now
            p = Progress(
                n, len(steps), name, endpoints.value, endpoints.estimated, now - started,
                sum(counts.values()), last,
            )  # fmt: skip
            log.info("consistency check: %s", p)
            if progress is not None:
                progress(p)
    problems: list[Problem] = []
    for kind in KINDS:  # each kind's problems together, in the order the kinds are listed
        problems += listed.get(kind, [])
        if counts.get(kind, 0) > MAX_LISTED:
            problems.append(
                Problem(kind, f"{counts[kind] - MAX_LISTED} more", f"not listed: {KINDS[kind]}")
            )
    return problems, endpoints.value


# ---------------------------------------------------------------------------------------------
# Repairs
# ---------------------------------------------------------------------------------------------


def _repair(conn: Connection) -> None:
    """The fixes of :data:`REPAIRS` (but the dead leases, which a due-work pass counts)."""
    orphan = select(_e.c.conversation_handle).where(
        _e.c.conversation_handle == _m.c.conversation_handle
    )
    conn.execute(delete(_m).where(~orphan.exists()))
    endpoint = select(_e.c.queue_id, _e.c.conversation_group_id).where(
        _e.c.conversation_handle == _m.c.conversation_handle
    )
    conn.execute(
        update(_m)
        .where(
            or_(
                _m.c.queue_id != endpoint.with_only_columns(_e.c.queue_id).scalar_subquery(),
                _m.c.conversation_group_id
                != endpoint.with_only_columns(_e.c.conversation_group_id).scalar_subquery(),
            )
        )
        .values(
            queue_id=endpoint.with_only_columns(_e.c.queue_id).scalar_subquery(),
            conversation_group_id=endpoint.with_only_columns(
                _e.c.conversation_group_id
            ).scalar_subquery(),
        )
    )
    missing = (
        select(_e.c.conversation_group_id, func.min(_e.c.queue_id))
        .outerjoin(_g, _g.c.conversation_group_id == _e.c.conversation_group_id)
        .where(_g.c.conversation_group_id.is_(None))
        .group_by(_e.c.conversation_group_id)
    )
    conn.execute(insert(_g).from_select(["conversation_group_id", "queue_id"], missing))
    ended = select(_e.c.conversation_handle).where(
        _e.c.conversation_handle == _t.c.conversation_handle,
        or_(
            _e.c.state == "ER",
            and_(_e.c.state == "CD", _t.c.message_type_name.not_in([END_DIALOG, ERROR])),
        ),
    )
    conn.execute(delete(_t).where(ended.exists()))
    for table in (_m, _g):
        stray = ~select(s.lease.c.token).where(s.lease.c.token == table.c.lease_token).exists()
        conn.execute(
            update(table).where(table.c.lease_token.is_not(None), stray).values(lease_token=None)
        )


def run(
    broker: BrokerContext,
    *,
    repair: bool = False,
    record: bool = True,
    progress: Callable[[Progress], None] | None = None,
    batch: int = BATCH,
    every: float = PROGRESS_EVERY,
) -> Report:
    """:func:`check`, with what it took: the endpoints there are and the seconds. ``progress``
    is called (and the ``airflow_broker`` logger told, at INFO) at most every ``every``
    seconds, after a check, and once at the end; each check's rows come ``batch`` at a time
    from a server-side cursor."""
    started = time.monotonic()
    found, endpoints = _read(broker, progress, batch=batch, every=every)
    if repair and any(p.kind in REPAIRS for p in found):
        with broker.engine.begin() as conn:
            _repair(conn)
        if any(p.kind == "dead_reader_lease" for p in found):
            run_due(broker)
        again, _ = _read(broker, None, batch=batch, every=every)
        still = {(p.kind, p.object) for p in again}
        found = [
            Problem(p.kind, p.object, p.detail, repaired=(p.kind, p.object) not in still)
            for p in found
        ]
    if record:
        with broker.engine.begin() as conn:
            record_event(conn, EVENT, "broker", summary(found))
    for p in found:
        log.warning("consistency check: %s", p)
    report = Report(found, endpoints, time.monotonic() - started)
    log.info("consistency check: %s: %s", report, summary(found))
    return report


def check(broker: BrokerContext, *, repair: bool = False, record: bool = True) -> list[Problem]:
    """Every problem found, in one consistent snapshot; with ``repair``, the repairable ones
    (:data:`REPAIRS`) are fixed and reported with ``repaired=True``, the rest as they are.
    Each check streams its rows (nothing is held but the problems listed), with progress
    logged; :func:`run` also says how long it took.

    :param record: write the outcome as a ``consistency_check`` event (the UI's overview shows
        the last one); the check itself only reads.
    """
    return run(broker, repair=repair, record=record).problems


def _read(
    broker: BrokerContext,
    progress: Callable[[Progress], None] | None,
    *,
    batch: int,
    every: float,
) -> tuple[list[Problem], int]:
    with broker.read_connection() as conn:
        if broker.dialect == "postgresql":
            conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
            # The checks' server-side cursors read every row: plan them for all of it (hash
            # joins over sequential scans), not for the first tenth (nested index loops).
            conn.execute(text("SET LOCAL cursor_tuple_fraction = 1.0"))
        try:
            return _find(broker, conn, progress, batch=batch, every=every)
        finally:
            conn.rollback()


def summary(problems: list[Problem]) -> str:
    """One line: how many problems of which kinds, and how many were repaired."""
    if not problems:
        return "no problems"
    kinds: dict[str, int] = {}
    for p in problems:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
    repaired = sum(p.repaired for p in problems)
    listed = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    tail = f" ({repaired} repaired)" if repaired else ""
    return f"{len(problems)} problem{'s' if len(problems) != 1 else ''}: {listed}{tail}"


__all__ = [
    "BATCH",
    "EVENT",
    "KINDS",
    "MAX_LISTED",
    "PROGRESS_EVERY",
    "REPAIRS",
    "Problem",
    "Progress",
    "Report",
    "check",
    "run",
    "summary",
]
