"""The Spark job's IO: JDBC reads of a broker's transmission queue and writes to a far broker's
staging table. Everything that knows about JDBC URLs, drivers and each database's text forms
lives here; :mod:`airflow_broker.spark.transforms` sees only DataFrames.

JDBC drivers
    Debian ships them as ``libpostgresql-jdbc-java`` and ``libxerial-sqlite-jdbc-java``
    (:data:`DEBIAN_JARS`); on a cluster give ``spark.jars.packages`` (or
    ``SparkSubmitOperator(packages=...)``) the Maven coordinates in :data:`MAVEN_PACKAGES`.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.engine import URL, make_url

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: Debian's JDBC drivers (``apt-get install libpostgresql-jdbc-java libxerial-sqlite-jdbc-java``).
DEBIAN_JARS = ("/usr/share/java/postgresql.jar", "/usr/share/java/sqlite-jdbc.jar")
#: The same drivers from Maven Central, for ``spark.jars.packages`` on a cluster.
MAVEN_PACKAGES = "org.postgresql:postgresql:42.5.5,org.xerial:sqlite-jdbc:3.40.1.0"

#: Rows per JDBC batch when writing the staging table.
WRITE_BATCH = 10_000


@dataclass(frozen=True)
class Jdbc:
    """How Spark reaches one broker database: URL, driver and the connection properties (the
    password among them: it travels in Spark's options, never on a command line)."""

    dialect: str
    url: str
    properties: dict[str, str]

    def options(self) -> dict[str, str]:
        return {"url": self.url, **self.properties}


def jdbc_of(url: str | URL, *, for_write: bool = False) -> Jdbc:
    """The JDBC form of a broker's SQLAlchemy URL (``postgresql+psycopg://...`` or
    ``sqlite:///path``)."""
    u = make_url(url) if isinstance(url, str) else url
    backend = u.get_backend_name()
    if backend == "sqlite":
        if not u.database or u.database == ":memory:":
            raise ValueError(
                f"the Spark job needs a broker in a file, not {u.render_as_string()!r}"
            )
        path = Path(u.database).resolve()
        return Jdbc("sqlite", f"jdbc:sqlite:{path}", {"driver": "org.sqlite.JDBC"})
    if backend == "postgresql":
        host = u.host or "localhost"
        port = f":{u.port}" if u.port else ""
        params = {k: v for k, v in u.query.items() if isinstance(v, str)}
        if for_write:
            # Batched INSERTs become multi-row INSERTs; text binds may fill uuid columns.
            params.update(reWriteBatchedInserts="true", stringtype="unspecified")
        query = "&".join(f"{k}={v}" for k, v in sorted(params.items()))
        props = {"driver": "org.postgresql.Driver"}
        if u.username:
            props["user"] = u.username
        if u.password:
            props["password"] = str(u.password)
        jdbc_url = f"jdbc:postgresql://{host}{port}/{u.database}" + (f"?{query}" if query else "")
        return Jdbc("postgresql", jdbc_url, props)
    raise ValueError(f"the Spark job supports PostgreSQL and SQLite brokers, not {backend!r}")


def session(app_name: str = "airflow-broker routing", master: str | None = None) -> SparkSession:
    """A SparkSession for the job: the one spark-submit configured, or (run directly) a
    ``local[*]`` one with Debian's JDBC drivers. Times are UTC."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name).config("spark.sql.session.timeZone", "UTC")
    if master is not None:
        builder = builder.master(master)
    # Python workers run this interpreter (the one airflow_broker is installed in) unless
    # spark-submit or the environment says otherwise.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if "spark.jars" not in os.environ.get("PYSPARK_SUBMIT_ARGS", ""):
        jars = [j for j in DEBIAN_JARS if Path(j).exists()]
        if jars:
            builder = builder.config("spark.jars", ",".join(jars))
    return builder.getOrCreate()


def _sql_time(dialect: str, when: datetime) -> str:
    """A literal for ``when`` in the database's own form (SQLite stores naive UTC text)."""
    when = when.astimezone(UTC)
    if dialect == "postgresql":
        return f"TIMESTAMPTZ '{when.isoformat()}'"
    return "'" + when.replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f") + "'"


def pending_query(dialect: str, due_by: datetime | None) -> str:
    """The transmission queue's rows with what routing needs of their endpoint, ids as text
    and the lifetime as epoch seconds (the same shape from both databases)."""
    if dialect == "postgresql":
        as_text = "CAST({} AS text)"
        epoch = "CAST(EXTRACT(EPOCH FROM t.lifetime) AS double precision)"
    else:
        as_text = "{}"
        epoch = "(julianday(t.lifetime) - 2440587.5) * 86400.0"
    # Secure dialogs (sealed bodies, a session key, or encryption required) are the Python
    # pass's: it seals, carries the key exchange, and holds what waits for dialog security.
    where = (
        "WHERE t.sealed IS NOT TRUE AND e.encryption IS NOT TRUE AND NOT EXISTS "
        "(SELECT 1 FROM broker_dialog_key k WHERE k.conversation_handle = t.conversation_handle)"
    )
    if due_by is not None:
        where += f" AND t.next_attempt_at <= {_sql_time(dialect, due_by)}"
    return f"""
        SELECT t.id,
               {as_text.format("t.conversation_handle")} AS conversation_handle,
               {as_text.format("t.conversation_id")} AS conversation_id,
               t.is_initiator,
               t.from_service_name,
               e.far_service AS to_service_name,
               e.far_broker_instance AS bound_instance,
               t.service_contract_name,
               t.message_type_name,
               t.message_sequence_number,
               t.validation,
               t.message_body,
               {epoch} AS lifetime_epoch,
               0 AS hops
        FROM broker_transmission_queue t
        JOIN broker_conversation_endpoint e ON e.conversation_handle = t.conversation_handle
        {where}
    """


def read_pending(
    spark: SparkSession,
    url: str | URL,
    *,
    due_by: datetime | None,
    bounds: tuple[int, int] | None,
    partitions: int,
) -> DataFrame:
    """The due rows of a broker's transmission queue, read in ``partitions`` parallel JDBC
    queries split on the row id between ``bounds`` (inclusive; None: the queue is empty)."""
    jdbc = jdbc_of(url)
    reader = spark.read.format("jdbc").options(**jdbc.options())
    reader = reader.option("dbtable", f"({pending_query(jdbc.dialect, due_by)}) pending")
    reader = reader.option("fetchsize", "10000")
    if bounds is not None and partitions > 1 and bounds[1] > bounds[0]:
        reader = (
            reader.option("partitionColumn", "id")
            .option("lowerBound", str(bounds[0]))
            .option("upperBound", str(bounds[1] + 1))
            .option("numPartitions", str(partitions))
        )
    return reader.load()


def write_table(df: DataFrame, url: str | URL, table: str, *, partitions: int) -> None:
    """Append ``df`` to ``table`` of a broker database (the staging table; the benchmark's plain
    copy). SQLite takes one writer at a time: one partition writes there."""
    jdbc = jdbc_of(url, for_write=True)
    if jdbc.dialect == "sqlite":
        df = df.coalesce(1)
    elif df.rdd.getNumPartitions() > partitions:
        df = df.coalesce(partitions)
    writer = df.write.format("jdbc").options(**jdbc.options()).mode("append")
    writer = writer.option("dbtable", table).option("batchsize", str(WRITE_BATCH))
    writer = writer.option(
        "isolationLevel", "READ_COMMITTED" if jdbc.dialect != "sqlite" else "NONE"
    )
    writer.save()


def copy_table(df: DataFrame, url: str | URL, table: str) -> int:
    """Append ``df`` to ``table`` of a PostgreSQL broker with ``COPY`` (no statement to bind
    and plan per batch, as JDBC's INSERTs have): each Spark partition streams its rows as CSV
    (Arrow batches, formatted by pyarrow) into one ``COPY`` in one transaction, from the
    executor's Python worker (psycopg, as the broker itself uses). Returns the rows written,
    each partition counted once however often its task ran: more rows in ``table`` mean a
    task that committed and then failed was run again."""
    from pyspark import cloudpickle
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from airflow_broker.spark import copy_partition

    u = make_url(url) if isinstance(url, str) else url
    if u.get_backend_name() != "postgresql":
        raise ValueError(f"COPY is PostgreSQL's; {u.render_as_string()!r} is not PostgreSQL")
    conninfo = u.set(drivername="postgresql").render_as_string(hide_password=False)
    columns = []
    for f in df.schema.fields:
        column = F.col(f.name)
        if isinstance(f.dataType, T.BinaryType):
            column = F.concat(F.lit("\\x"), F.hex(column))  # bytea's hex input form
        columns.append(column.alias(f.name))
    statement = f"COPY {table} ({', '.join(df.columns)}) FROM STDIN (FORMAT csv)"
    # Shipped by value: the executors need psycopg and pyarrow, not airflow_broker (whose
    # import would cost each Python worker two seconds).
    cloudpickle.register_pickle_by_value(copy_partition)
    written = df.select(*columns).mapInArrow(
        functools.partial(copy_partition.copy_partition, conninfo, statement), "rows long"
    )
    return sum(int(r.rows) for r in written.collect())


__all__ = [
    "DEBIAN_JARS",
    "MAVEN_PACKAGES",
    "Jdbc",
    "copy_table",
    "jdbc_of",
    "pending_query",
    "read_pending",
    "session",
    "write_table",
]
