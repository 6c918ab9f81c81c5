"""Counts that do not scan: exact up to :data:`COUNT_CAP` rows, PostgreSQL's estimate beyond.

A list that grows with traffic (a million open conversations) is never counted row by row for a
page or the overview. :func:`bounded_count` counts at most ``COUNT_CAP + 1`` matching rows (one
``LIMIT``-ed scan, about a millisecond); when more match, the count is the PostgreSQL planner's
estimate for the same statement (``EXPLAIN``: the table's ``pg_class.reltuples`` scaled to its
current size, times the selectivity of the filters from the column statistics of the last
``ANALYZE``, which autovacuum keeps fresh) and is marked ``estimated``: the page shows it as
"about N". On SQLite (the embedded store, small by nature) a count past the cap is exact.

Counts by a column's value (the overview's conversations by state) share the estimated total
out by the column's statistics (``pg_stats``: its most common values and their frequencies).
A state too rare for the statistics to see (``ANALYZE`` samples 30,000 rows) may be estimated
at 0 when the table holds many thousands of rows: the estimate says about how many, not whether
one exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, literal, select, text
from sqlalchemy.engine import Connection

#: Up to this many matching rows a count is exact; past it, estimated (PostgreSQL).
COUNT_CAP = 10_000


@dataclass(frozen=True, slots=True)
class Count:
    """How many rows match: ``value``, exact unless ``estimated``."""

    value: int
    estimated: bool = False


def estimate(conn: Connection, stmt: Any) -> int:
    """The PostgreSQL planner's estimate of the rows ``stmt`` returns (nothing is read)."""
    compiled = stmt.compile(dialect=conn.dialect)
    plan = conn.exec_driver_sql(
        "EXPLAIN (FORMAT JSON) " + str(compiled), compiled.params
    ).scalar_one()
    if isinstance(plan, str):  # a driver that does not parse json
        import json

        plan = json.loads(plan)
    return max(0, round(plan[0]["Plan"]["Plan Rows"]))


def bounded_count(
    conn: Connection, table: Any, conds: Sequence[Any] = (), *, cap: int | None = None
) -> Count:
    """How many rows of ``table`` match ``conds``: exact up to ``cap`` (:data:`COUNT_CAP`),
    else (PostgreSQL) the planner's estimate, never below ``cap + 1``."""
    cap = COUNT_CAP if cap is None else cap
    capped = select(literal(1).label("one")).select_from(table).where(*conds).limit(cap + 1)
    n = int(conn.execute(select(func.count()).select_from(capped.subquery())).scalar_one())
    if n <= cap:
        return Count(n)
    if conn.dialect.name != "postgresql":
        exact = select(func.count()).select_from(table).where(*conds)
        return Count(int(conn.execute(exact).scalar_one()))
    whole = select(literal(1).label("one")).select_from(table).where(*conds)
    return Count(max(estimate(conn, whole), cap + 1), estimated=True)


def bounded_counts_by(
    conn: Connection,
    table: Any,
    column: Any,
    values: Sequence[Any],
    conds: Sequence[Any] = (),
    *,
    cap: int | None = None,
) -> tuple[dict[Any, int], bool]:
    """Rows of ``table`` matching ``conds``, counted by ``column`` for each of ``values``:
    exact when at most ``cap`` (:data:`COUNT_CAP`) rows match in all, else (PostgreSQL) each
    value's estimate. Returns the counts and whether they are estimated."""
    cap = COUNT_CAP if cap is None else cap
    capped = select(column.label("v")).select_from(table).where(*conds).limit(cap + 1).subquery()
    counts = {
        r[0]: int(r[1]) for r in conn.execute(select(capped.c.v, func.count()).group_by(capped.c.v))
    }
    if sum(counts.values()) <= cap:
        return counts, False
    if conn.dialect.name != "postgresql":
        exact = select(column, func.count()).select_from(table).where(*conds).group_by(column)
        return {r[0]: int(r[1]) for r in conn.execute(exact)}, False
    rows = estimate(conn, select(literal(1).label("one")).select_from(table).where(*conds))
    shares = _shares(conn, table.name, column.name)
    if shares is None:  # never analyzed: the planner's guess, value by value
        out = {}
        for value in values:
            stmt = select(literal(1).label("one")).select_from(table).where(*conds, column == value)
            out[value] = estimate(conn, stmt)
        return out, True
    return {value: round(rows * shares(value)) for value in values}, True


def _shares(conn: Connection, table: str, column: str) -> Callable[[Any], float] | None:
    """The share of ``table``'s rows holding each value of ``column``, from the statistics of
    the last ``ANALYZE`` (``pg_stats``: its most common values and their frequencies, the rest
    spread over the other distinct values, as the planner does); None without statistics."""
    row = conn.execute(
        text(
            "SELECT array_to_json(s.most_common_vals) AS vals, s.most_common_freqs AS freqs, "
            "s.null_frac, s.n_distinct, c.reltuples "
            "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "JOIN pg_stats s ON s.schemaname = n.nspname AND s.tablename = c.relname "
            "AND s.attname = :column WHERE c.oid = to_regclass(:table)"
        ),
        {"table": table, "column": column},
    ).first()
    if row is None:
        return None
    common = dict(zip(row.vals or [], row.freqs or [], strict=False))
    distinct = row.n_distinct if row.n_distinct >= 0 else -row.n_distinct * max(row.reltuples, 0)
    others = max(0.0, distinct - len(common))
    rest = max(0.0, 1.0 - sum(common.values()) - (row.null_frac or 0.0))
    each = rest / others if others >= 1 else 0.0
    return lambda value: float(common.get(value, each))


__all__ = ["COUNT_CAP", "Count", "bounded_count", "bounded_counts_by", "estimate"]
