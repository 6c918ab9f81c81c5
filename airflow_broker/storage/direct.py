"""PostgreSQL: the hot statements sent straight through libpq, one round trip each.

SEND's fast path and RECEIVE's claim are nearly all a messaging transaction does. Through
SQLAlchemy and psycopg's cursor, a transaction's first statement costs two round trips (psycopg
sends BEGIN on its own and waits for it, pipeline mode included), plus the work of both
layers. On a machine where a loopback round trip is 0.07 ms, that was a third of a single
SEND. Here a statement travels as one simple query on the connection's libpq handle:

- a transaction's ``BEGIN`` rides in the same query as its first statement;
- statements are prepared once per connection (SQL ``PREPARE``, in the same query as their
  first ``EXECUTE``) and run by ``EXECUTE name(literals)``, so the server neither parses nor
  plans them again (the claim's plan costs more than running it);
- values are written as literals: numbers and UUIDs by their own spelling, text through
  libpq's ``PQescapeLiteral``, bytea as ``decode('HEX', 'hex')`` (no backslashes, whatever
  ``standard_conforming_strings`` says);
- rows are decoded by psycopg's own loaders (:class:`psycopg.adapt.Transformer`);
- a statement that is a transaction of its own (``Broker.send``, :func:`execute_committed`)
  runs, once prepared, alone in the extended protocol with its values as parameters: the
  server commits it, with no BEGIN and COMMIT to parse and no literals to write or read
  (about 25 µs less per single SEND, a twentieth, measured alternating on this project's
  machine).

The SQLAlchemy :class:`~sqlalchemy.engine.Connection` stays the owner of the transaction: its
transaction is begun (no SQL on PostgreSQL) before the statement, and it commits or rolls back
as usual; psycopg reads the server's transaction status from libpq, so it sends COMMIT. Errors
are raised as SQLAlchemy raises them (``DBAPIError`` wrapping psycopg's exception for the
SQLSTATE). A lost connection, or an interruption while a statement is in flight, invalidates
the connection. The wait for the answer is a ``select`` loop, so signals (an Airflow task's
timeout) interrupt it as they interrupt psycopg.

The broker's engines turn psycopg's own preparing off (``prepare_threshold=None``): psycopg
answers a ROLLBACK with ``DEALLOCATE ALL`` once it has prepared anything, and that would take
these statements with it. Behind a pooler that hands each transaction another server process
(PgBouncer in transaction mode) nothing prepared lasts: the first transaction that finds its
statement missing (or another's there) starts again, and the engine sends its statements whole
from then on, still one round trip each. An engine that finds a pooler on its first connection
(:mod:`~airflow_broker.storage.pooler`) sends them whole from the start. A statement whose plan
costs more than its run (RECEIVE's claim) is still prepared there, on each server process that
runs it (``Prepared(costly_plan=True)``): the pooler's server processes are few and outlive
their clients.

SQLite, and every other statement, go through SQLAlchemy as before.
"""

from __future__ import annotations

import logging
import select
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.exc import DBAPIError

from airflow_broker.storage.prepared import Prepared, literal, parameter

if TYPE_CHECKING:
    from psycopg.pq.abc import PGresult
    from sqlalchemy.engine import Connection, Engine

log = logging.getLogger(__name__)


class _Invalidates(Protocol):
    """What a lost connection is invalidated through: SQLAlchemy's Connection, or a pooled
    connection of its own (``engine.raw_connection()``)."""

    def invalidate(self, exception: BaseException | None = None, /) -> None: ...


#: SQL the direct path ran: a hook for diagnostics (``bench.statements`` counts round trips).
#: Called with the query's bytes and the seconds it took, or not at all when None.
observer: Callable[[bytes, float], None] | None = None


#: Bodies longer than this go through SQLAlchemy's extended protocol (sent binary, not as hex
#: text twice their size); the direct path is for the many small messages.
MAX_LITERAL_BODY = 64 * 1024


# -- running ---------------------------------------------------------------------------------
def execute(
    conn: Connection,
    statement: Prepared,
    args: Sequence[Any],
    *,
    commit: bool = False,
    savepoint: bytes | None = None,
) -> list[tuple[Any, ...]]:
    """Run ``statement`` with ``args`` inside ``conn``'s transaction (begun here when it is
    not yet) in one round trip; return its rows as tuples.

    ``savepoint``: a savepoint of that name is set just before the statement, in the same
    round trip (``ROLLBACK TO SAVEPOINT`` then undoes the statement and what followed it).

    ``commit``: the transaction's COMMIT follows in the same query; it runs only if the
    statement succeeded (the server runs nothing of a query after its first error). SQLAlchemy's
    transaction on ``conn`` is still open afterwards: end it with :func:`commit`, which then
    finds the server idle and sends nothing."""
    if not conn.in_transaction():
        conn.begin()
    fairy = conn.connection
    raw: Any = fairy.driver_connection
    pgconn = raw.pgconn
    info = fairy.info
    literals = [literal(_escaping(info, raw), a) for a in args]
    begin = pgconn.transaction_status == _IDLE
    inline = _written_whole(conn.engine, statement)
    query, sent = _statement_parts(statement, literals, inline=inline)
    prepared: set[str] = info.setdefault("broker_prepared", set())
    new = not inline and statement.name not in prepared
    parts = [statement.prepare] if new else []
    if begin:
        parts.append(b"BEGIN")
    mark = [] if savepoint is None else [b"SAVEPOINT " + savepoint]
    parts += mark + sent
    tail = [b"COMMIT"] if commit else []
    pick = -1 - len(statement.after) - len(tail)
    try:
        results = _results(conn, raw, b";".join(parts + tail))
        if new:
            _note_prepared(prepared, statement, results)
        result = _checked(conn, raw, query, results, pick=pick)
    except DBAPIError as exc:
        state = getattr(exc.orig, "sqlstate", None)
        if inline or state not in _NOT_KEPT or not begin or exc.connection_invalidated:
            raise
        # This transaction had done nothing yet, so it starts again.
        _stop_preparing(conn.engine, prepared, exc.orig)
        conn.rollback()
        conn.begin()
        _, sent = _statement_parts(statement, literals, inline=True)
        result = _run(conn, raw, b";".join([b"BEGIN", *mark, *sent, *tail]), pick=pick)
    return _rows(info, raw, result)


def execute_committed(
    fairy: Any, engine: Engine, statement: Prepared, args: Sequence[Any]
) -> list[tuple[Any, ...]]:
    """Run ``statement`` with ``args`` in a transaction of its own, COMMIT included, in one
    round trip, on a pooled connection that no SQLAlchemy Connection wraps (``fairy``, from
    ``engine.raw_connection()``; the caller gives it back). Returns the statement's rows.

    For a statement that is a whole transaction (``Broker.send``): SQLAlchemy's Connection and
    transaction cost about as much client time as the rest of the SEND. Once the statement is
    prepared on the connection it runs alone in the extended protocol, with its arguments as
    parameters (:func:`_autocommitted`): the server commits it, or rolls it back on an error,
    with no BEGIN or COMMIT to parse and no literals to write. The first time, it is prepared
    and run as ``PREPARE; BEGIN; EXECUTE name(literals); COMMIT`` in one simple query. On an
    error the transaction is rolled back, so that the connection goes back to the pool clean,
    and the error is raised as SQLAlchemy raises it; a lost connection is invalidated."""
    raw: Any = fairy.driver_connection
    info = fairy.info
    for attempt in (1, 2):
        inline = _written_whole(engine, statement)
        prepared: set[str] = info.setdefault("broker_prepared", set())
        # Outside a transaction only: inside one (never, from the pool), Sync would not end it.
        idle = raw.pgconn.transaction_status == _IDLE
        # Behind a pooler, a statement that is cheap to plan goes unnamed, with its arguments.
        unnamed = inline and statement.ensure is None
        ready = unnamed or (not inline and statement.name in prepared)
        if ready and idle and not statement.before:
            how = b"unnamed" if unnamed else b"EXECUTE " + statement.name.encode()
            query = how + b" (extended protocol, autocommit)"
            results = _autocommitted(fairy, raw, statement, args, query, unnamed=unnamed)
            pick = -1
        else:
            literals = [literal(_escaping(info, raw), a) for a in args]
            new = not inline and statement.name not in prepared
            query, sent = _statement_parts(statement, literals, inline=inline)
            parts = [statement.prepare] if new else []
            run = [*parts, b"BEGIN", *sent, b"COMMIT"]
            results = _results(fairy, raw, b";".join(run))
            if new:
                _note_prepared(prepared, statement, results)
            pick = -2 - len(statement.after)
        failed = next((r for r in results if r.status not in _SUCCESS), None)
        if failed is None:
            return _rows(info, raw, results[pick])
        if raw.pgconn.transaction_status != _IDLE:
            _results(fairy, raw, b"ROLLBACK")
        state = (failed.error_field(_SQLSTATE) or b"").decode()
        if inline or state not in _NOT_KEPT or attempt == 2:
            _raise(fairy, raw, query, failed)
        _stop_preparing(
            engine, prepared, (failed.error_message or b"").decode(errors="replace").strip()
        )
    raise AssertionError("unreachable")  # pragma: no cover


def _autocommitted(
    conn: _Invalidates,
    raw: Any,
    statement: Prepared,
    args: Sequence[Any],
    query: bytes,
    *,
    unnamed: bool = False,
) -> list[PGresult]:
    """Run the prepared ``statement`` with ``args`` as parameters, outside any transaction:
    the server runs it in one of its own and commits it (the extended protocol's Sync ends
    it), or rolls it back on an error. ``unnamed``: parsed with its arguments in the same
    message instead (behind a pooler). ``query`` names it for errors and :data:`observer`."""
    values: list[bytes | None] = []
    formats: list[int] = []
    for a in args:
        value, fmt = parameter(a)
        values.append(value)
        formats.append(fmt)
    if unnamed:
        sql, oids = statement.sql.encode(), statement.oids()
        return _sent(
            conn, raw, query, lambda pgconn: pgconn.send_query_params(sql, values, oids, formats)
        )
    name = statement.name.encode()
    return _sent(conn, raw, query, lambda pgconn: pgconn.send_query_prepared(name, values, formats))


def _statement_parts(
    statement: Prepared, literals: list[bytes], *, inline: bool
) -> tuple[bytes, list[bytes]]:
    """``statement`` with its arguments, and the statements sent for it (its result is then
    ``len(statement.after)`` from the end of theirs): ``EXECUTE name(...)``; behind a pooler
    (``inline``), written whole, or for a costly plan ``EXECUTE`` after the block that
    prepares it on the server process that runs it (:attr:`Prepared.ensure`)."""
    ensure = statement.ensure
    if inline and ensure is None:
        query = statement.inline(literals)
        return query, statement.around(query)
    query = b"EXECUTE " + statement.name.encode() + b"(" + b",".join(literals) + b")"
    if inline and ensure is not None:
        return query, [ensure, *statement.around(query)]
    return query, statement.around(query)


def stop_preparing(engine: Engine) -> None:
    """``engine`` talks to the server through a transaction-mode pooler (storage.pooler): its
    statements are written out whole from the start, never prepared."""
    _inline_engines.add(engine)


def _stop_preparing(engine: Engine, prepared: set[str], why: object) -> None:
    """The server did not keep what this connection prepared (or kept another's): a
    transaction-mode pooler such as PgBouncer hands each transaction another server process.
    ``engine`` writes its statements out from now on."""
    log.warning(
        "%s: prepared statements do not last between transactions here (%s); the broker's "
        "hot statements are sent whole from now on",
        engine.url.render_as_string(hide_password=True),
        why,
    )
    stop_preparing(engine)
    prepared.clear()


def _escaping(info: dict[str, Any], raw: Any) -> Any:
    """The connection's ``psycopg.pq.Escaping``, kept in its pool ``info``."""
    escaping = info.get("broker_escaping")
    if escaping is None:
        from psycopg import pq

        escaping = info["broker_escaping"] = pq.Escaping(raw.pgconn)
    return escaping


def _rows(info: dict[str, Any], raw: Any, result: PGresult) -> list[tuple[Any, ...]]:
    """``result``'s rows as tuples, decoded by psycopg's loaders (one Transformer per
    connection, kept in its pool ``info``)."""
    transformer = info.get("broker_transformer")
    if transformer is None:
        from psycopg.adapt import Transformer

        transformer = info["broker_transformer"] = Transformer(raw)
    transformer.set_pgresult(result)
    rows: list[tuple[Any, ...]] = transformer.load_rows(0, result.ntuples, tuple)
    transformer.set_pgresult(None)
    return rows


def written(conn: Connection, statement: Prepared, args: Sequence[Any]) -> bytes:
    """``statement`` with ``args`` written in as literals, never prepared: SQL to send in
    another statement's query (:func:`commit`'s ``before``)."""
    fairy = conn.connection
    escaping = _escaping(fairy.info, fairy.driver_connection)
    return statement.inline([literal(escaping, a) for a in args])


def commit(conn: Connection, *, before: bytes | None = None) -> None:
    """Commit ``conn``'s transaction with a COMMIT sent through libpq (psycopg's own commit costs
    about as much client CPU as the round trip itself), then SQLAlchemy's commit, which finds
    the server idle and sends nothing. A transaction in error goes the usual way.

    ``before``: a statement (SQL with no parameters) the transaction runs last, in the same
    round trip; if it fails, nothing is committed and its error is raised."""
    if conn.in_transaction():
        raw: Any = conn.connection.driver_connection
        if raw.pgconn.transaction_status == _INTRANS:
            query = b"COMMIT" if before is None else before + b";COMMIT"
            result = _run(conn, raw, query)
            if result.command_status != b"COMMIT":
                raise RuntimeError(f"COMMIT answered {result.command_status!r}")
    conn.commit()


class CommittedThenFailed(Exception):
    """:func:`commit_then_execute`: the COMMIT went through, the statement after it failed
    (``error``, as :func:`execute` raises it); the connection is in that failed transaction."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def can_commit_then_execute(conn: Connection, statement: Prepared) -> bool:
    """Whether :func:`commit_then_execute` can run ``statement`` on ``conn``: its transaction is
    open and healthy, and the statement is prepared on the connection already (or the engine
    writes its statements whole, behind a pooler)."""
    if not conn.in_transaction():
        return False
    fairy = conn.connection
    raw: Any = fairy.driver_connection
    if raw.pgconn.transaction_status != _INTRANS:
        return False
    if _written_whole(conn.engine, statement):
        return True
    prepared: set[str] = fairy.info.get("broker_prepared", set())
    return statement.name in prepared


def commit_then_execute(
    conn: Connection, statement: Prepared, args: Sequence[Any], *, before: bytes | None = None
) -> list[tuple[Any, ...]]:
    """Commit ``conn``'s transaction and run ``statement`` with ``args`` in the next one, in one
    round trip (``COMMIT; BEGIN; EXECUTE ...``); return its rows. Only when
    :func:`can_commit_then_execute` says so. ``before``: as for :func:`commit`.

    SQLAlchemy's transaction on ``conn`` stays open and is the new one's: commit it with
    :func:`commit`, or roll it back.

    :raises DBAPIError: the COMMIT failed (nothing after it ran) or the connection was lost
        with the query in flight (whether the COMMIT happened is then unknown).
    :raises CommittedThenFailed: the COMMIT went through and the statement failed.
    """
    fairy = conn.connection
    raw: Any = fairy.driver_connection
    literals = [literal(_escaping(fairy.info, raw), a) for a in args]
    # Behind a pooler the whole query runs on one server process: the transaction that BEGIN
    # opens keeps it, and the statement goes whole or after the block that prepares it.
    _, sent = _statement_parts(statement, literals, inline=_written_whole(conn.engine, statement))
    first = [] if before is None else [before]
    query = b";".join([*first, b"COMMIT", b"BEGIN", *sent])
    results = _results(conn, raw, query)
    if before is not None:
        if results[0].status not in _SUCCESS:
            _raise(conn, raw, query, results[0])
        results = results[1:]
    done = results[0]
    if done.status not in _SUCCESS:
        _raise(conn, raw, query, done)
    if done.command_status != b"COMMIT":  # an aborted transaction; can_commit_then_execute
        raise RuntimeError(f"COMMIT answered {done.command_status!r}")
    for result in results[1:]:
        if result.status not in _SUCCESS:
            try:
                _raise(conn, raw, query, result)
            except DBAPIError as exc:
                raise CommittedThenFailed(exc) from exc
    return _rows(fairy.info, raw, results[-1 - len(statement.after)])


#: SQLSTATEs of a prepared statement missing (26000) or already there (42P05).
_NOT_KEPT = ("26000", "42P05")
#: Engines whose server keeps no prepared statements between transactions (see execute).
_inline_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def _written_whole(engine: Engine, statement: Prepared) -> bool:
    """Whether ``statement`` goes written whole with its values rather than prepared: behind a
    pooler (:func:`stop_preparing`), or planned for its values on every run."""
    return statement.planned_each_run or engine in _inline_engines


def _run(conn: Connection, raw: Any, query: bytes, *, pick: int = -1) -> PGresult:
    """Send ``query`` (a simple query, perhaps several statements) and return its last result
    (``pick``: another, by index), raising the first error as SQLAlchemy would."""
    return _checked(conn, raw, query, _results(conn, raw, query), pick=pick)


def _checked(
    conn: _Invalidates, raw: Any, query: bytes, results: list[PGresult], *, pick: int
) -> PGresult:
    """``results[pick]``, once no result is an error (the first one is raised)."""
    for result in results:
        if result.status not in _SUCCESS:
            _raise(conn, raw, query, result)
    return results[pick]


def _note_prepared(prepared: set[str], statement: Prepared, results: list[PGresult]) -> None:
    """Remember ``statement`` as prepared on the connection once its PREPARE (the query's first
    statement) went through, whatever became of the rest: a prepared statement is no part of
    the transaction and outlives its rollback. Sent again, the PREPARE would fail as if a
    pooler had handed the connection another server process."""
    if results and results[0].status == COMMAND_OK:
        prepared.add(statement.name)


def _results(conn: _Invalidates, raw: Any, query: bytes) -> list[PGresult]:
    """Send ``query`` and return every result, errors included (the server runs nothing of a
    simple query after its first error)."""
    return _sent(conn, raw, query, lambda pgconn: pgconn.send_query(query))


def _sent(
    conn: _Invalidates, raw: Any, query: bytes, send: Callable[[Any], None]
) -> list[PGresult]:
    """``send(pgconn)`` (a query: ``query`` names it) and every result it brings. Interrupted,
    or the connection broken, with it in flight: the connection is invalidated."""
    pgconn = raw.pgconn
    started = _clock() if observer is not None else 0.0
    try:
        send(pgconn)
        results = _collect(pgconn)
    except BaseException as exc:
        _lost(conn, query, exc)
        raise
    if observer is not None:
        observer(query, _clock() - started)
    return results


def _lost(conn: _Invalidates, query: bytes, exc: BaseException) -> None:
    """Interrupted, or the connection broke, with ``query`` in flight: nothing more can be said
    on this connection. Invalidates it; a psycopg error is raised as SQLAlchemy's (the caller
    raises anything else)."""
    conn.invalidate(exc if isinstance(exc, Exception) else None)
    if isinstance(exc, Exception) and not isinstance(exc, DBAPIError):
        import psycopg

        if isinstance(exc, psycopg.Error):
            raise DBAPIError.instance(
                query.decode(errors="replace"),
                None,
                exc,
                psycopg.Error,
                connection_invalidated=True,
            ) from exc


def _raise(conn: _Invalidates, raw: Any, query: bytes, result: PGresult) -> None:
    import psycopg
    from psycopg import errors

    error = errors.error_from_result(result, encoding=raw.info.encoding)
    lost = raw.pgconn.status != CONNECTION_OK
    if lost:
        conn.invalidate(error)
    raise DBAPIError.instance(
        query.decode(errors="replace"), None, error, psycopg.Error, connection_invalidated=lost
    ) from error


def _collect(pgconn: Any) -> list[PGresult]:
    """Push a query just sent and read every result it brings, waiting on the socket."""
    from psycopg import OperationalError

    flush(pgconn)
    results: list[PGresult] = []
    while True:
        wait_ready(pgconn)
        result = pgconn.get_result()
        if result is None:
            if pgconn.status != CONNECTION_OK:
                raise OperationalError(pgconn.get_error_message())
            return results
        results.append(result)


def flush(pgconn: Any) -> None:
    """Push what libpq buffered into the socket (a non-blocking connection's ``flush`` returns 1
    while there is more to send; what the server sends meanwhile is read, or libpq may stall)."""
    while pgconn.flush():
        readable, _, _ = select.select([pgconn.socket], [pgconn.socket], [])
        if readable:
            pgconn.consume_input()


def wait_ready(pgconn: Any) -> None:
    """Read from the socket until libpq holds the next result (or the end of a query's)."""
    while pgconn.is_busy():
        select.select([pgconn.socket], [], [])
        pgconn.consume_input()


def _clock() -> float:
    return time.perf_counter()


# libpq's enum values (psycopg.pq mirrors them): PQTRANS_IDLE, PQTRANS_INTRANS, CONNECTION_OK,
# PGRES_COMMAND_OK and PGRES_TUPLES_OK. Spelled here so that importing this module needs no psycopg.
_IDLE = 0
_INTRANS = 2
CONNECTION_OK = 0
COMMAND_OK = 1
TUPLES_OK = 2
_SUCCESS = (COMMAND_OK, TUPLES_OK)
#: libpq's PG_DIAG_SQLSTATE field code ('C').
_SQLSTATE = ord("C")


__all__ = [
    "COMMAND_OK",
    "CONNECTION_OK",
    "MAX_LITERAL_BODY",
    "TUPLES_OK",
    "CommittedThenFailed",
    "Prepared",
    "can_commit_then_execute",
    "commit",
    "commit_then_execute",
    "execute",
    "execute_committed",
    "flush",
    "literal",
    "observer",
    "stop_preparing",
    "wait_ready",
    "written",
]
