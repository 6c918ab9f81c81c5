"""What each executor runs for :func:`airflow_broker.spark.jdbc.copy_table`. Shipped to the
executors by value (cloudpickle), so it imports nothing of airflow_broker: keep it that way."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any


def copy_partition(conninfo: str, statement: str, batches: Iterator[Any]) -> Iterator[Any]:
    """One Spark partition's Arrow batches into one COPY ``statement``, in one transaction;
    yields the number of rows."""
    import psycopg
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    # Every value quoted, nulls bare: COPY reads a bare empty field as NULL, "" as ''.
    options = pa_csv.WriteOptions(include_header=False, quoting_style="all_valid")
    rows = 0
    # prepare_threshold=None: nothing prepared on a server process a pooler may hand to others
    with (
        psycopg.connect(conninfo, prepare_threshold=None) as conn,
        conn.cursor().copy(statement) as copy,
    ):
        for batch in batches:
            if batch.num_rows:
                buffer = io.BytesIO()
                pa_csv.write_csv(batch, buffer, options)
                copy.write(buffer.getbuffer())
                rows += batch.num_rows
    yield pa.RecordBatch.from_pydict({"rows": [rows]}, schema=pa.schema([("rows", pa.int64())]))
