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
import re
import sys
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import URL, make_url

from airflow_broker.transport import deadlines

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from airflow_broker.spark.direct_stream import Source

#: Debian's JDBC drivers (``apt-get install libpostgresql-jdbc-java libxerial-sqlite-jdbc-java``).
DEBIAN_JARS = ("/usr/share/java/postgresql.jar", "/usr/share/java/sqlite-jdbc.jar")
#: The same drivers from Maven Central, for ``spark.jars.packages`` on a cluster.
MAVEN_PACKAGES = "org.postgresql:postgresql:42.5.5,org.xerial:sqlite-jdbc:3.40.1.0"

#: Rows per JDBC batch when writing the staging table.
WRITE_BATCH = 10_000

#: ``work_mem`` of the job's grouping and sorting reads at a PostgreSQL source (the plan's
#: grouped read, and each task's groups and ordered ``COPY``), set for those reads only. With
#: the server's default (4MB) the grouped read sorted 10^6 rows on disk, serially (a JDBC read
#: is a cursor, and the server runs no parallel workers for one): 0.94 s against 0.55 s with
#: 64MB, where it hashes 10^4 groups in memory. A hash that outgrows it spills to disk as before.
SOURCE_WORK_MEM = "64MB"
_MEMORY = re.compile(r"[1-9][0-9]{0,8}(kB|MB|GB)?")


def checked_work_mem(value: str | None) -> str | None:
    """``value`` checked as a PostgreSQL memory size (``64MB``, ``262144`` kilobytes; kB, MB
    or GB), or None (the server's setting)."""
    if value is None:
        return None
    if not _MEMORY.fullmatch(value):
        raise ValueError(
            f"source work_mem {value!r} is not a PostgreSQL memory size such as '64MB' "
            "(a whole number, then kB, MB or GB)"
        )
    return value


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


#: Which rows the job moves. Secure dialogs (sealed bodies, a session key, or encryption
#: required) are the Python pass's: it seals, carries the key exchange, and holds what waits
#: for dialog security. The conditions on the row, and on its endpoint:
_ROW_MOVES = "t.sealed IS NOT TRUE"
_ENDPOINT_MOVES = (
    "e.encryption IS NOT TRUE AND NOT EXISTS "
    "(SELECT 1 FROM broker_dialog_key k WHERE k.conversation_handle = e.conversation_handle)"
)


def _due(dialect: str, due_by: datetime | None) -> str:
    return "" if due_by is None else f" AND t.next_attempt_at <= {_sql_time(dialect, due_by)}"


def moves(dialect: str, due_by: datetime | None) -> str:
    """The condition on ``t`` (the transmission queue) of the rows the job moves, its endpoint's
    conditions as a semi-join the server hashes once (not a join and an anti-join for every
    row): the rows of :func:`pending_query`."""
    return (
        f"{_ROW_MOVES}{_due(dialect, due_by)} AND t.conversation_handle IN "
        f"(SELECT e.conversation_handle FROM broker_conversation_endpoint e "
        f"WHERE {_ENDPOINT_MOVES})"
    )


def _pending_from(dialect: str, due_by: datetime | None, where: str = "") -> str:
    """The FROM and WHERE of the rows the job moves: the due transmission-queue rows joined to
    their endpoint (and ``where``, a condition on them)."""
    return (
        "FROM broker_transmission_queue t "
        "JOIN broker_conversation_endpoint e ON e.conversation_handle = t.conversation_handle "
        f"WHERE {_ROW_MOVES} AND {_ENDPOINT_MOVES}{_due(dialect, due_by)}"
        + (f" AND ({where})" if where else "")
    )


def _text_and_epoch(dialect: str) -> tuple[str, str]:
    """How a uuid becomes text and a timestamp epoch seconds, as format strings."""
    if dialect == "postgresql":
        return "CAST({} AS text)", "CAST(EXTRACT(EPOCH FROM {}) AS double precision)"
    return "{}", "(julianday({}) - 2440587.5) * 86400.0"


def _own_columns(epoch: str) -> str:
    """The last columns of both reads of messages: what differs from message to message (the
    lifetime and hops too, the keys of a message's conversation in the plan)."""
    return (
        "t.message_type_name, t.message_sequence_number, t.validation, t.message_body, "
        f"{epoch.format('t.lifetime')} AS lifetime_epoch, 0 AS hops"
    )


def pending_query(dialect: str, due_by: datetime | None, where: str = "") -> str:
    """The transmission queue's rows with what routing needs of their endpoint, ids as text
    and the lifetime as epoch seconds (the same shape from both databases); ``where``: a
    condition on ``t``, the transmission queue."""
    as_text, epoch = _text_and_epoch(dialect)
    return f"""
        SELECT t.id,
               {as_text.format("t.conversation_handle")} AS conversation_handle,
               {as_text.format("t.conversation_id")} AS conversation_id,
               t.is_initiator,
               t.from_service_name,
               e.far_service AS to_service_name,
               e.far_broker_instance AS bound_instance,
               t.service_contract_name,
               {_own_columns(epoch)}
        {_pending_from(dialect, due_by, where)}
    """


def messages_query(dialect: str, due_by: datetime | None, where: str = "") -> str:
    """The rows of :func:`pending_query` with only what is each message's own
    (:data:`transforms.MESSAGE_COLUMNS`): for a job whose plan was made on grouped
    conversations (:func:`conversations_query`), which carries what the messages share and
    gives it back to each of them (:func:`transforms.with_plan`).

    The same rows as :func:`pending_query`, chosen by the same conditions; the endpoint's are a
    hashed semi-join evaluated once, not a join and an anti-join for every message. With four
    fewer text columns, a quarter of 10^6 messages took 0.40-0.58 s in the server against
    0.60-0.82 s."""
    as_text, epoch = _text_and_epoch(dialect)
    return f"""
        SELECT t.id,
               {as_text.format("t.conversation_handle")} AS conversation_handle,
               t.is_initiator,
               {_own_columns(epoch)}
        FROM broker_transmission_queue t
        WHERE {moves(dialect, due_by)}
        {f"AND ({where})" if where else ""}
    """


def conversations_query(dialect: str, due_by: datetime | None) -> str:
    """The rows of :func:`pending_query` as :func:`transforms.conversations` groups them
    (without bodies), grouped by the database: one row per conversation, with its first row id,
    first and last sequence numbers and message count; the conformance tests compare the two.

    It groups the rows by their endpoint and lifetime (``hops`` is 0 for every row read from a
    transmission queue), then joins the endpoint to the groups: the far side's service and
    instance are read from the endpoint row by :func:`pending_query` too, and the conversation
    id, direction, service and contract are copied from it into every row it sends. Grouping
    by all nine keys over the join gave the same rows three times slower: the server, unable
    to tell how few groups they make, sorted 10^6 rows instead of hashing them.
    """
    as_text, epoch = _text_and_epoch(dialect)
    body = "CAST(NULL AS bytea)" if dialect == "postgresql" else "CAST(NULL AS BLOB)"
    return f"""
        SELECT {as_text.format("e.conversation_handle")} AS conversation_handle,
               {as_text.format("e.conversation_id")} AS conversation_id,
               e.is_initiator, e.service_name AS from_service_name,
               e.far_service AS to_service_name, e.far_broker_instance AS bound_instance,
               e.contract_name AS service_contract_name,
               {epoch.format("g.lifetime")} AS lifetime_epoch,
               0 AS hops, g.id, g.message_sequence_number, g.last_sequence, g.messages,
               {body} AS message_body
        FROM (
            SELECT t.conversation_handle, t.lifetime, MIN(t.id) AS id,
                   MIN(t.message_sequence_number) AS message_sequence_number,
                   MAX(t.message_sequence_number) AS last_sequence,
                   COUNT(*) AS messages
            FROM broker_transmission_queue t
            WHERE {_ROW_MOVES}{_due(dialect, due_by)}
            GROUP BY t.conversation_handle, t.lifetime
        ) g
        JOIN broker_conversation_endpoint e ON e.conversation_handle = g.conversation_handle
        WHERE {_ENDPOINT_MOVES}
    """


def read_pending(
    spark: SparkSession,
    url: str | URL,
    *,
    due_by: datetime | None,
    bounds: tuple[int, int] | None = None,
    partitions: int,
    by_conversation: bool = False,
    own_columns: bool = False,
) -> DataFrame:
    """The due rows of a broker's transmission queue, read in ``partitions`` parallel JDBC
    queries: ``by_conversation``, each holding whole conversations (ranges of the conversation
    id); otherwise split on the row id between ``bounds`` (inclusive; None: one query).
    ``own_columns``: only :data:`transforms.MESSAGE_COLUMNS` (:func:`messages_query`), the
    rest to be taken from a plan made on grouped conversations."""
    jdbc = jdbc_of(url)
    query = messages_query if own_columns else pending_query
    if by_conversation and partitions > 1:
        # One query a range, each scanning the queue once for its range: Spark's JDBC
        # ``predicates`` would filter the text ids of the query's output instead of the raw
        # column (2.5 times the time of each scan, measured).
        frames = [
            _reader(spark, jdbc, query(jdbc.dialect, due_by, where)).load()
            for where in conversation_ranges(jdbc.dialect, partitions)
        ]
        return functools.reduce(lambda a, b: a.union(b), frames)
    reader = _reader(spark, jdbc, query(jdbc.dialect, due_by))
    if bounds is not None and partitions > 1 and bounds[1] > bounds[0]:
        reader = (
            reader.option("partitionColumn", "id")
            .option("lowerBound", str(bounds[0]))
            .option("upperBound", str(bounds[1] + 1))
            .option("numPartitions", str(partitions))
        )
    return reader.load()


def _reader(spark: SparkSession, jdbc: Jdbc, query: str) -> Any:
    reader = spark.read.format("jdbc").options(**jdbc.options())
    return reader.option("dbtable", f"({query}) pending").option("fetchsize", "10000")


def conversation_ranges(dialect: str, partitions: int) -> list[str]:
    """``partitions`` conditions on the transmission queue's ``t.conversation_id`` that split
    the uuid space into equal ranges (every row in exactly one): uuids on PostgreSQL, the
    lower-case hex text SQLite stores them as."""
    cuts = [uuid.UUID(int=(i << 128) // partitions) for i in range(1, partitions)]
    column = "t.conversation_id"
    literals = [f"'{c if dialect == 'postgresql' else c.hex}'" for c in cuts]
    lows: list[str | None] = [None, *literals]
    highs: list[str | None] = [*literals, None]
    ranges = []
    for low, high in zip(lows, highs, strict=True):
        conditions = []
        if low is not None:
            conditions.append(f"{column} >= {low}")
        if high is not None:
            conditions.append(f"{column} < {high}")
        ranges.append(" AND ".join(conditions))
    return ranges


def read_conversations(
    spark: SparkSession,
    url: str | URL,
    *,
    due_by: datetime | None,
    work_mem: str | None = SOURCE_WORK_MEM,
) -> DataFrame:
    """PostgreSQL: the due rows of a broker's transmission queue grouped into one row per
    conversation by the database itself (:func:`conversations_query`), in one JDBC query: only
    the groups travel. ``work_mem``: the read's session's (see :data:`SOURCE_WORK_MEM`)."""
    jdbc = jdbc_of(url)
    if jdbc.dialect != "postgresql":
        raise ValueError(
            "the grouped read is PostgreSQL's (SQLite's JDBC driver types aggregates loosely)"
        )
    sql = conversations_query(jdbc.dialect, due_by)
    reader = spark.read.format("jdbc").options(**jdbc.options())
    memory = checked_work_mem(work_mem)
    if memory is not None:
        reader = reader.option("sessionInitStatement", f"SET work_mem = '{memory}'")
    return reader.option("dbtable", f"({sql}) conversations").option("fetchsize", "10000").load()


def stream_source(
    url: str | URL,
    *,
    due_by: datetime | None,
    partitions: int,
    work_mem: str | None = SOURCE_WORK_MEM,
) -> Source:
    """What the tasks of a direct write read at a PostgreSQL source themselves
    (:mod:`airflow_broker.spark.direct_stream`): the rows :func:`messages_query` reads, split
    into the same ``partitions`` ranges of conversation ids, with ``work_mem`` for each task's
    reading transaction (see :data:`SOURCE_WORK_MEM`)."""
    from airflow_broker.spark.direct_stream import Source

    _, epoch = _text_and_epoch("postgresql")
    return Source(
        conninfo=conninfo(url),
        moves=moves("postgresql", due_by),
        lifetime_key=f"COALESCE({epoch.format('t.lifetime')}, CAST('-Infinity' AS float8))",
        ranges=tuple(conversation_ranges("postgresql", partitions)),
        work_mem=checked_work_mem(work_mem),
    )


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


def conninfo(url: str | URL) -> str:
    """The libpq connection string (password included) of a PostgreSQL broker's URL, for
    psycopg in the executors: with a connect timeout and TCP keepalives (the far broker's
    :func:`~airflow_broker.transport.deadlines.connect_args`) unless the URL sets its own."""
    u = make_url(url) if isinstance(url, str) else url
    if u.get_backend_name() != "postgresql":
        raise ValueError(f"COPY is PostgreSQL's; {u.render_as_string()!r} is not PostgreSQL")
    bounded = {k: str(v) for k, v in deadlines.connect_args(str(u), deadlines.Limits()).items()}
    return (
        u.set(drivername="postgresql")
        .update_query_dict(bounded)
        .render_as_string(hide_password=False)
    )


def bytea_text(column: Any) -> Any:
    """A binary column as bytea's hex input form (``\\x...``), for COPY's CSV."""
    from pyspark.sql import functions as F

    return F.concat(F.lit("\\x"), F.hex(column))


#: Seconds a far broker may go without answering the driver's statements or a task's writes
#: (:mod:`~airflow_broker.spark.stall`); the job sets it for its run.
answer_timeout: ContextVar[float] = ContextVar("answer_timeout", default=300.0)


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

    from airflow_broker.spark import copy_partition, stall

    info = conninfo(url)
    columns = []
    for f in df.schema.fields:
        column = F.col(f.name)
        if isinstance(f.dataType, T.BinaryType):
            column = bytea_text(column)
        columns.append(column.alias(f.name))
    statement = f"COPY {table} ({', '.join(df.columns)}) FROM STDIN (FORMAT csv)"
    # Shipped by value: the executors need psycopg and pyarrow, not airflow_broker (whose
    # import would cost each Python worker two seconds).
    cloudpickle.register_pickle_by_value(copy_partition)
    cloudpickle.register_pickle_by_value(stall)
    written = df.select(*columns).mapInArrow(
        functools.partial(
            copy_partition.copy_partition, info, statement, answer_timeout=answer_timeout.get()
        ),
        "rows long",
    )
    return sum(int(r.rows) for r in written.collect())


__all__ = [
    "DEBIAN_JARS",
    "MAVEN_PACKAGES",
    "Jdbc",
    "bytea_text",
    "conninfo",
    "conversation_ranges",
    "copy_table",
    "jdbc_of",
    "messages_query",
    "moves",
    "pending_query",
    "read_pending",
    "session",
    "stream_source",
    "write_table",
]
