"""PostgreSQL: the direct path's statements and values (:mod:`airflow_broker.storage.direct`
sends them).

:class:`Prepared` is a statement prepared once per connection (or, behind a pooler, on each
server process that runs it, by :data:`PREPARE_FUNCTION`); :func:`literal` and
:func:`parameter` write Python values as SQL literals and as parameters of the extended
protocol.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

_SEQSCAN_OFF = b"SET LOCAL enable_seqscan = off"
_SEQSCAN_DEFAULT = b"SET LOCAL enable_seqscan TO DEFAULT"


class Prepared:
    """A statement prepared once per connection: ``PREPARE name (types) AS sql``.

    :param sql: the statement, with ``$1``, ``$2``... for its parameters.
    :param types: the SQL type of each parameter, in order.
    :param index_scans: plan it with sequential scans off. The server plans a prepared
        statement when it first runs, and again only when the statistics of a table it reads
        change; it keeps that plan for the connection's life. A queue's table is often nearly
        empty when autovacuum analyzes it: planned then, a RECEIVE kept reading the whole table
        by sequential scans once a burst had filled it (8.4 ms a message against 0.5 with
        20,000 waiting, until the next ANALYZE). Such a statement runs between
        ``SET LOCAL enable_seqscan = off`` and ``SET LOCAL enable_seqscan TO DEFAULT``, in the
        same round trip, so that whenever the server plans it, it plans index scans. The
        setting is back at its default for the rest of the transaction (a session's own
        ``SET enable_seqscan``, rare on a broker connection, is not restored until it ends).
    :param costly_plan: planning it costs more than running it (RECEIVE's claim). Behind a
        pooler, where a connection's statements are otherwise written whole and planned on
        every run, it is still prepared: on whichever server process runs it, by
        :data:`PREPARE_FUNCTION` called first in the same query, which prepares it there
        unless that process has it already (:attr:`ensure`). The server processes are few
        and long-lived, so after the first few transactions each has it and the call only
        looks (0.06 ms, against 0.18 for an anonymous ``DO`` block that would need no
        function: the block is compiled on every run).
    :param planned_each_run: never prepared, always written whole with its values (as behind
        a pooler), so that the server plans it for them: a statement whose best plan depends
        on its values (how many rows a bound selects), for which a generic plan could be far
        worse. It still saves the transaction's BEGIN round trip and SQLAlchemy's work.
    """

    __slots__ = (
        "_oids",
        "after",
        "before",
        "ensure",
        "name",
        "planned_each_run",
        "prepare",
        "sql",
        "types",
    )

    def __init__(
        self,
        sql: str,
        types: Sequence[str],
        *,
        index_scans: bool = False,
        costly_plan: bool = False,
        planned_each_run: bool = False,
    ) -> None:
        # The plan settings are part of the name: the server keeps one plan per name, made
        # under the settings of the query that planned it.
        key = f"{','.join(types)}|{sql}" + ("|index_scans" if index_scans else "")
        digest = hashlib.sha1(key.encode(), usedforsecurity=False)
        self.name = f"broker_{digest.hexdigest()[:16]}"
        self.sql = sql
        self.types = tuple(types)
        self.prepare = f"PREPARE {self.name} ({', '.join(types)}) AS {sql}".encode()
        #: statements sent before and after it, in the same query (see ``index_scans``)
        self.before: tuple[bytes, ...] = (_SEQSCAN_OFF,) if index_scans else ()
        self.after: tuple[bytes, ...] = (_SEQSCAN_DEFAULT,) if index_scans else ()
        self._oids: list[int] | None = None
        #: never prepared: written whole with its values, planned for them (see
        #: ``planned_each_run``)
        self.planned_each_run = planned_each_run
        #: behind a pooler, sent before its EXECUTE (see ``costly_plan``)
        self.ensure: bytes | None = None
        if costly_plan:
            if _SQL_QUOTE in sql:
                raise ValueError(f"a statement to prepare may not contain {_SQL_QUOTE}")
            self.ensure = (
                f"SELECT broker_prepare('{self.name}', '{', '.join(types)}', "
                f"{_SQL_QUOTE}{sql}{_SQL_QUOTE})"
            ).encode()

    def oids(self) -> list[int]:
        """The type OIDs of its parameters (for an unnamed statement of the extended protocol)."""
        if self._oids is None:
            from psycopg.postgres import types

            self._oids = [
                types[name[:-2]].array_oid if name.endswith("[]") else types[name].oid
                for name in self.types
            ]
        return self._oids

    def around(self, query: bytes) -> list[bytes]:
        """``query`` (this statement's EXECUTE, or the statement written whole) with what is
        sent before and after it; its result is then ``len(self.after)`` from the end of
        theirs."""
        return [*self.before, query, *self.after]

    def inline(self, literals: Sequence[bytes]) -> bytes:
        """The statement with its parameters written in (for a server that keeps no prepared
        statements between transactions)."""
        sql = self.sql.encode()
        # From the last parameter down, so that $1 never eats the start of $12.
        for i in range(len(literals), 0, -1):
            typed = b"CAST(" + literals[i - 1] + b" AS " + self.types[i - 1].encode() + b")"
            sql = sql.replace(b"$" + str(i).encode(), typed)
        return sql


#: Quotes a statement's text in :attr:`Prepared.ensure` (dollar quoting: no escaping to do).
_SQL_QUOTE = "$broker_sql$"

#: PostgreSQL (migration 0024): prepare ``statement`` (its parameters of ``parameter_types``)
#: as ``name`` on this server process unless it has a statement of that name already. The
#: caller's rights (it is not SECURITY DEFINER): it prepares only what the caller could.
PREPARE_FUNCTION = """
CREATE OR REPLACE FUNCTION broker_prepare(name text, parameter_types text, statement text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_prepared_statements p WHERE p.name = $1) THEN
        EXECUTE format('PREPARE %I (%s) AS %s', $1, $2, $3);
    END IF;
END
$$
"""
DROP_PREPARE_FUNCTION = "DROP FUNCTION IF EXISTS broker_prepare(text, text, text)"


# -- literals ------------------------------------------------------------------------------------
def literal(escaping: Any, value: Any) -> bytes:
    """``value`` as a SQL literal of its type (None, bool, int, UUID, aware datetime, str,
    bytes, or a list of those); ``escaping`` is the connection's ``psycopg.pq.Escaping``."""
    if value is None:
        return b"NULL"
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, int):
        return str(int(value)).encode()
    if isinstance(value, uuid.UUID):
        return b"'" + str(value).encode() + b"'::uuid"
    if isinstance(value, bytes | bytearray | memoryview):
        return b"decode('" + bytes(value).hex().encode() + b"','hex')"
    if isinstance(value, str):
        quoted: bytes = escaping.escape_literal(value.encode())
        return quoted
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError(f"a naive datetime cannot be sent as timestamptz: {value!r}")
        return b"'" + value.isoformat().encode() + b"'::timestamptz"
    if isinstance(value, list) and all(isinstance(v, uuid.UUID) for v in value):
        return b"'{" + ",".join(str(v) for v in value).encode() + b"}'::uuid[]"
    if isinstance(value, list):
        # Any other array as its text form, in a string literal: the statement's parameter
        # type (a CAST when written whole) makes it an array of the elements' type.
        escaped: bytes = escaping.escape_literal(array_text(value))
        return escaped
    raise TypeError(f"no SQL literal for {type(value).__name__} {value!r}")


def parameter(value: Any) -> tuple[bytes | None, int]:
    """``value`` as a parameter of the extended protocol: its bytes and format (0 text, 1
    binary). The types are :func:`literal`'s; bytea goes binary, as it is."""
    if value is None:
        return None, 0
    if isinstance(value, bool):
        return (b"t" if value else b"f"), 0
    if isinstance(value, int):
        return str(int(value)).encode(), 0
    if isinstance(value, uuid.UUID):
        return str(value).encode(), 0
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value), 1
    if isinstance(value, str):
        return value.encode(), 0
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError(f"a naive datetime cannot be sent as timestamptz: {value!r}")
        return value.isoformat().encode(), 0
    if isinstance(value, list):
        return array_text(value), 0
    raise TypeError(f"no SQL parameter for {type(value).__name__} {value!r}")


def array_text(values: Sequence[Any]) -> bytes:
    """A one-dimensional array in PostgreSQL's text form (``{a,"b c",NULL}``): elements None,
    bool, int, UUID, str or bytes (bytea as ``\\x`` hex), each quoted where it must be."""
    parts: list[bytes] = []
    for v in values:
        if v is None:
            parts.append(b"NULL")
        elif isinstance(v, bool):
            parts.append(b"t" if v else b"f")
        elif isinstance(v, int | uuid.UUID):
            parts.append(str(v).encode())
        elif isinstance(v, bytes | bytearray | memoryview):
            parts.append(b'"\\\\x' + bytes(v).hex().encode() + b'"')
        elif isinstance(v, str):
            quoted = v.replace("\\", "\\\\").replace('"', '\\"')
            parts.append(b'"' + quoted.encode() + b'"')
        else:
            raise TypeError(f"no SQL array element for {type(v).__name__} {v!r}")
    return b"{" + b",".join(parts) + b"}"


__all__ = [
    "DROP_PREPARE_FUNCTION",
    "PREPARE_FUNCTION",
    "Prepared",
    "array_text",
    "literal",
    "parameter",
]
