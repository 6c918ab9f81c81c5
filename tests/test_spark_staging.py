"""The Spark job's staging and commit on PostgreSQL: COPY from the executors, rows a retried task
wrote twice, and a crash between the commit's parallel transactions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from pyspark.sql import SparkSession
from pyspark.sql import types as T
from transport_procs import (
    TARGET_QUEUE,
    Net,
    assert_exactly_once_in_order,
    by_conversation,
    drain_all,
    send_dialogs,
    two_way,
)

from airflow_broker import Broker
from airflow_broker.spark import commit, jdbc, job
from airflow_broker.storage import schema as s

pytestmark = [pytest.mark.xdist_group("spark"), pytest.mark.timeout(600)]

Network = Callable[..., Net]

TRICKY_TEXT = ["plain", 'a "quoted", comma', "new\nline", "back\\slash", "", "é ✓", "\\x41"]
TRICKY_BYTES = [b"", b"\x00\x01\xff", b'"quoted",\n', b"\\x41", None, bytes(range(256))]


def test_copy_table_writes_every_value_as_it_was(spark: SparkSession, postgres_server: Any) -> None:
    """Quotes, commas, newlines, backslashes, empty strings against NULLs, every byte value:
    each comes out of PostgreSQL as it went into COPY, and the rows are counted."""
    url = postgres_server.create_database()
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE TABLE t (k bigint, s text, n text, b bytea, f boolean, "
                "x double precision, p smallint)"
            )
        )
    rows = []
    for k in range(300):
        rows.append(
            (
                k,
                TRICKY_TEXT[k % len(TRICKY_TEXT)],
                None if k % 3 else TRICKY_TEXT[(k + 1) % len(TRICKY_TEXT)],
                TRICKY_BYTES[k % len(TRICKY_BYTES)],
                k % 2 == 0,
                None if k % 5 == 0 else k / 7,
                k % 3,
            )
        )
    schema = T.StructType(
        [
            T.StructField("k", T.LongType(), False),
            T.StructField("s", T.StringType(), False),
            T.StructField("n", T.StringType(), True),
            T.StructField("b", T.BinaryType(), True),
            T.StructField("f", T.BooleanType(), False),
            T.StructField("x", T.DoubleType(), True),
            T.StructField("p", T.ShortType(), False),
        ]
    )
    df = spark.createDataFrame(rows, schema).repartition(3)
    assert jdbc.copy_table(df, url, "t") == len(rows)
    with engine.connect() as conn:
        got = [tuple(r) for r in conn.execute(sa.text("SELECT * FROM t ORDER BY k"))]
    engine.dispose()
    expected = [
        (k, st, n, None if b is None else bytes(b), f, x, p) for k, st, n, b, f, x, p in rows
    ]
    got = [(k, st, n, None if b is None else bytes(b), f, x, p) for k, st, n, b, f, x, p in got]
    assert got == expected


def test_copy_table_refuses_a_sqlite_url(spark: SparkSession, tmp_path: Any) -> None:
    df = spark.createDataFrame([(1,)], "k long")
    with pytest.raises(ValueError, match="not PostgreSQL"):
        jdbc.copy_table(df, f"sqlite:///{tmp_path}/x.db", "t")


def staged_rows(broker: Broker, table: sa.Table = s.spark_staging) -> int:
    with broker.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


@pytest.mark.parametrize("new_db", ["postgres"], indirect=True)
def test_rows_a_retried_task_staged_twice_are_committed_once(
    spark: SparkSession, network: Network, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every partition's COPY committed twice (a task that committed, failed and ran again),
    counted once: the commit notices the surplus and takes each sequence number once, and each
    staged conversation once."""
    net = network("a", "b")
    two_way(net)
    a, b = net["a"], net["b"]
    counts = [1 + i % 6 for i in range(60)]
    send_dialogs(a, counts)
    copy_once = jdbc.copy_table
    seen: dict[str, int] = {}

    def copy_twice(df: Any, url: Any, table: str) -> int:
        n = copy_once(df, url, table)
        copy_once(df, url, table)
        seen[table] = staged_rows(b, s.metadata.tables[table])
        return n

    monkeypatch.setattr(jdbc, "copy_table", copy_twice)
    report = job.run(a, spark)
    # The staging tables really held every row twice.
    assert seen == {
        s.spark_staged_conversation.name: 2 * len(counts),
        s.spark_staging.name: 2 * sum(counts),
    }
    assert report.delivered == report.acknowledged == sum(counts)
    assert a.transmission_queue() == [] and staged_rows(b) == 0
    assert staged_rows(b, s.spark_staged_conversation) == 0
    got = by_conversation(b, drain_all(b, TARGET_QUEUE))
    assert sorted(len(v) for v in got.values()) == sorted(counts)
    expected = {conv: list(range(len(msgs))) for conv, msgs in got.items()}
    assert_exactly_once_in_order(got, expected, "after a doubled staging write")


@pytest.mark.parametrize("new_db", ["postgres"], indirect=True)
def test_a_crash_between_the_commits_parallel_transactions_loses_and_doubles_nothing(
    spark: SparkSession, network: Network, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Part 0 of the commit commits, part 1 dies, nothing is acknowledged at the source; the
    next run brings every message again and each arrives once, in order."""
    net = network("a", "b")
    two_way(net)
    a, b = net["a"], net["b"]
    counts = [2 + i % 5 for i in range(80)]
    send_dialogs(a, counts)
    fast = commit._fast

    def part_one_dies(*args: Any, part: int, **kwargs: Any) -> Any:
        if part == 1:
            raise RuntimeError("killed in part 1 of the commit")
        return fast(*args, part=part, **kwargs)

    monkeypatch.setattr(commit, "_fast", part_one_dies)
    with pytest.raises(RuntimeError, match="killed in part 1"):
        job.run(a, spark, commit_parallelism=2)
    first = by_conversation(b, drain_all(b, TARGET_QUEUE))
    assert 0 < len(first) < len(counts), "part 0 alone should have committed some dialogs"
    assert len(a.transmission_queue()) == sum(counts)  # nothing acknowledged
    monkeypatch.setattr(commit, "_fast", fast)
    report = job.run(a, spark, commit_parallelism=2)
    assert report.acknowledged == sum(counts)
    assert report.delivered == sum(counts) - sum(len(v) for v in first.values())
    assert a.transmission_queue() == [] and staged_rows(b) == 0
    assert staged_rows(b, s.spark_staged_conversation) == 0
    second = by_conversation(b, drain_all(b, TARGET_QUEUE))
    got: dict[Any, list[Any]] = {}
    for part in (first, second):
        for conv, msgs in part.items():
            got.setdefault(conv, []).extend(msgs)
    assert sorted(len(v) for v in got.values()) == sorted(counts)
    expected = {conv: list(range(len(msgs))) for conv, msgs in got.items()}
    assert_exactly_once_in_order(got, expected, "after a crash between commit parts")


def test_commit_parallelism_must_be_positive(spark: SparkSession) -> None:
    with pytest.raises(ValueError, match="commit_parallelism"):
        job.run(None, spark, commit_parallelism=0)  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        job.parse_args(["--source", "a", "--commit-parallelism", "0"])
