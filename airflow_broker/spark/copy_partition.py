"""COPY from the executors: what each runs for :func:`airflow_broker.spark.jdbc.copy_table`, and
the COPY helpers of the direct write's tasks (:mod:`~airflow_broker.spark.direct_task`).
Shipped to the executors by value (cloudpickle), so it imports nothing of airflow_broker but
:mod:`~airflow_broker.spark.stall` (shipped by value with it): keep it that way."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

from airflow_broker.spark.stall import Stall, connect, touch

#: Rows per CSV chunk handed to COPY.
CSV_CHUNK = 50_000


def copy_partition(
    conninfo: str, statement: str, batches: Iterator[Any], answer_timeout: float = 300.0
) -> Iterator[Any]:
    """One Spark partition's Arrow batches into one COPY ``statement``, in one transaction;
    yields the number of rows. A server that takes no data for ``answer_timeout`` seconds has
    the connection cut (:mod:`~airflow_broker.spark.stall`): the task fails and Spark runs it
    again."""
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    # Every value quoted, nulls bare: COPY reads a bare empty field as NULL, "" as ''.
    options = pa_csv.WriteOptions(include_header=False, quoting_style="all_valid")
    rows = 0
    with (
        connect(conninfo, "the far broker") as conn,
        Stall(conn, answer_timeout, "the far broker") as guard,
    ):
        with conn.cursor().copy(statement) as copy:
            for batch in batches:
                if batch.num_rows:
                    buffer = io.BytesIO()
                    pa_csv.write_csv(batch, buffer, options)
                    copy.write(buffer.getbuffer())
                    guard.touch()
                    rows += batch.num_rows
        guard.touch()
        conn.commit()  # under the guard: a far broker that hangs in the commit is cut too
    yield pa.RecordBatch.from_pydict({"rows": [rows]}, schema=pa.schema([("rows", pa.int64())]))


def _csv(table: Any) -> Iterator[bytes]:
    """``table`` as COPY's CSV: every value quoted, nulls bare (COPY reads a bare empty field
    as NULL, "" as '')."""
    import pyarrow.csv as pa_csv

    options = pa_csv.WriteOptions(include_header=False, quoting_style="all_valid")
    for start in range(0, table.num_rows, CSV_CHUNK):
        buffer = io.BytesIO()
        pa_csv.write_csv(table.slice(start, CSV_CHUNK), buffer, options)
        yield buffer.getvalue()


def copy_arrow(cur: Any, name: str, columns: tuple[str, ...], table: Any) -> None:
    """An Arrow table of many rows (messages) into ``name``, as CSV."""
    if table.num_rows:
        with cur.copy(f"COPY {name} ({', '.join(columns)}) FROM STDIN (FORMAT csv)") as copy:
            for chunk in _csv(table):
                copy.write(chunk)
                touch()
        touch()


def copy_rows(cur: Any, name: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    """A few rows (one a conversation) into ``name``, each adapted by psycopg."""
    if rows:
        with cur.copy(f"COPY {name} ({', '.join(columns)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        touch()
