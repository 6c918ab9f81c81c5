"""The floor of ``bench.delivery``: the same rows copied between two databases through Python.

A table in database A holds a snapshot of A's transmission queue (the same rows, the same
columns, ``LIKE broker_transmission_queue INCLUDING ALL``: primary key and indexes, no foreign
key); an equivalent empty table waits in database B. One batch is what any exactly-once transfer
between two databases has to do at least:

1. SELECT the next ``batch`` rows from A (keyset on the primary key);
2. INSERT them into B in one round trip and COMMIT on B;
3. DELETE them from A and COMMIT on A (B first, then A: a row is never lost, only possibly
   duplicated by a crash between the two commits, which an idempotent insert then absorbs).

Three ways to do step 2, all plain psycopg 3 (binary parameters and results, prepared
statements), and the fastest one is the floor:

- ``unnest``: ``INSERT INTO t (...) SELECT * FROM unnest(%s::bigint[], %s::uuid[], ...)``, one
  statement with one array per column;
- ``executemany``: ``cursor.executemany(INSERT ... VALUES (%s, ...))`` inside
  ``conn.pipeline()``, one statement per row but no round trip between them;
- ``copy``: ``COPY t (...) FROM STDIN (FORMAT BINARY)``, the rows written by psycopg's
  ``Copy.write_row`` (in C); the broker's accept COPYs its large batches too
  (``airflow_broker/storage/bulk.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psycopg
from psycopg import sql
from psycopg.adapt import PyFormat

from bench._scratch import Database

SNAPSHOT = "bench_copy_snapshot"
SOURCE = "bench_copy_src"
TARGET = "bench_copy_dst"
QUEUE_TABLE = "broker_transmission_queue"
METHODS = ("unnest", "executemany", "copy")


@dataclass(frozen=True, slots=True)
class CopyResult:
    """One timed copy."""

    rows: int
    seconds: float
    batches: int


def prepare(a: Database, b: Database) -> int:
    """Snapshot A's transmission queue into ``SNAPSHOT`` on A; ``SOURCE`` (A) and ``TARGET``
    (B) created empty, with the queue table's columns, keys and indexes.

    Returns the number of rows snapshotted. Untimed.
    """
    like = sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)")
    with psycopg.connect(a.conninfo) as conn:
        for table in (SNAPSHOT, SOURCE):
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
            conn.execute(like.format(sql.Identifier(table), sql.Identifier(QUEUE_TABLE)))
        cur = conn.execute(
            sql.SQL("INSERT INTO {} SELECT * FROM {}").format(
                sql.Identifier(SNAPSHOT), sql.Identifier(QUEUE_TABLE)
            )
        )
        rows = cur.rowcount
    with psycopg.connect(b.conninfo) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(TARGET)))
        conn.execute(like.format(sql.Identifier(TARGET), sql.Identifier(QUEUE_TABLE)))
    return rows


def fill(a: Database, b: Database) -> None:
    """``TARGET`` (B) emptied, ``SOURCE`` (A) refilled from the snapshot, both vacuumed and
    analyzed: every copy starts from the same rows and the same table state. Untimed."""
    with psycopg.connect(b.conninfo, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(TARGET)))
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(TARGET)))
    with psycopg.connect(a.conninfo, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(SOURCE)))
        conn.execute(
            sql.SQL("INSERT INTO {} SELECT * FROM {}").format(
                sql.Identifier(SOURCE), sql.Identifier(SNAPSHOT)
            )
        )
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(SOURCE)))


def _columns(conn: psycopg.Connection, table: str) -> list[tuple[str, str]]:
    """``(name, SQL type)`` of ``table``'s columns, in order."""
    return conn.execute(
        """
        SELECT attname, format_type(atttypid, atttypmod)
        FROM pg_attribute
        WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped
        ORDER BY attnum
        """,
        (table,),
    ).fetchall()


def _type_oids(conn: psycopg.Connection, table: str) -> list[int]:
    """The type OIDs of ``table``'s columns, in order (what a binary COPY is written in)."""
    return [
        int(r[0])
        for r in conn.execute(
            "SELECT atttypid FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum",
            (table,),
        )
    ]


def count(db: Database, table: str) -> int:
    """Rows in ``table``."""
    with psycopg.connect(db.conninfo) as conn:
        query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))
        row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def copy(a: Database, b: Database, batch: int, method: str) -> CopyResult:
    """Move every row of ``SOURCE`` (A) to ``TARGET`` (B), ``batch`` rows per transaction pair.

    Connections are opened (and the statements prepared) before the clock starts.
    """
    if method not in METHODS:
        raise ValueError(f"unknown copy method {method!r}; known: {', '.join(METHODS)}")
    with psycopg.connect(a.conninfo) as ca, psycopg.connect(b.conninfo) as cb:
        columns = _columns(ca, SOURCE)
        names = sql.SQL(", ").join(sql.Identifier(n) for n, _ in columns)
        select = sql.SQL("SELECT {} FROM {} WHERE id > %s ORDER BY id LIMIT %s").format(
            names, sql.Identifier(SOURCE)
        )
        delete = sql.SQL("DELETE FROM {} WHERE id = ANY(%s)").format(sql.Identifier(SOURCE))
        copy_in = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
            sql.Identifier(TARGET), names
        )
        oids = _type_oids(cb, TARGET)
        if method == "unnest":
            insert = sql.SQL("INSERT INTO {} ({}) SELECT * FROM unnest({})").format(
                sql.Identifier(TARGET),
                names,
                sql.SQL(", ").join(sql.SQL("%b::" + t + "[]") for _, t in columns),
            )
        else:
            insert = sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
                sql.Identifier(TARGET),
                names,
                sql.SQL(", ").join(sql.Placeholder(format=PyFormat.BINARY) for _ in columns),
            )
        id_index = [n for n, _ in columns].index("id")
        cur_a = ca.cursor(binary=True)
        cur_b = cb.cursor(binary=True)
        ca.commit()
        cb.commit()

        moved = batches = 0
        last_id = 0
        start = time.perf_counter()
        while True:
            rows = cur_a.execute(select, (last_id, batch), prepare=True).fetchall()
            if not rows:
                ca.commit()
                break
            if method == "unnest":
                cur_b.execute(insert, [list(col) for col in zip(*rows, strict=True)], prepare=True)
            elif method == "copy":
                with cur_b.copy(copy_in) as cp:
                    cp.set_types(oids)
                    for r in rows:
                        cp.write_row(r)
            else:
                with cb.pipeline():
                    cur_b.executemany(insert, rows)
            cb.commit()
            ids = [r[id_index] for r in rows]
            cur_a.execute(delete, (ids,), prepare=True)
            ca.commit()
            last_id = max(ids)
            moved += len(rows)
            batches += 1
        seconds = time.perf_counter() - start
    return CopyResult(moved, seconds, batches)
