"""The Spark job's writes on PostgreSQL: COPY from the executors, tasks that write straight into
queues and run again or hold part of a conversation, rows a retried task staged twice, and a
crash between the staged commit's parallel transactions."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest
import sqlalchemy as sa
from pyspark.sql import SparkSession
from pyspark.sql import types as T
from transport_procs import (
    TARGET,
    TARGET_QUEUE,
    Net,
    assert_exactly_once_in_order,
    by_conversation,
    drain_all,
    send_dialogs,
    send_more,
    two_way,
)

from airflow_broker import END_DIALOG, Broker
from airflow_broker.spark import commit, direct, direct_task, jdbc, job
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
def test_tasks_that_wrote_into_queues_and_run_again_write_nothing_twice(
    spark: SparkSession, network: Network, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every task of the direct write committed, then ran again (Spark retrying a task whose
    result was lost): the second attempt finds the receive sequence numbers raised and writes
    no message twice; the ended dialogs' messages, staged by both attempts, are committed once
    by the staged commit."""
    net = network("a", "b")
    two_way(net)
    a, b = net["a"], net["b"]
    counts = [1 + i % 6 for i in range(60)]
    handles = send_dialogs(a, counts)
    with a.transaction() as tx:
        for h in handles[:5]:
            tx.end_conversation(h)
    once = direct.write_direct
    attempts: list[direct.Written] = []

    def twice(*args: Any) -> direct.Written:
        attempts.append(once(*args))
        attempts.append(once(*args))
        return attempts[-1]

    monkeypatch.setattr(job, "write_direct", twice)
    report = job.run(a, spark)
    first, second = attempts
    total = sum(counts) + 5  # and an EndDialog on each of five dialogs
    general = sum(counts[:5]) + 5
    assert first.inserted == total - general and second.inserted == 0
    assert first.staged == second.staged == general
    assert report.general == general and report.acknowledged == total
    assert a.transmission_queue() == [] and staged_rows(b) == 0
    msgs = drain_all(b, TARGET_QUEUE)
    assert sum(1 for m in msgs if m.message_type_name == END_DIALOG) == 5
    got = by_conversation(b, [m for m in msgs if m.message_type_name != END_DIALOG])
    assert sorted(len(v) for v in got.values()) == sorted(counts)
    expected = {conv: list(range(len(msgs))) for conv, msgs in got.items()}
    assert_exactly_once_in_order(got, expected, "after every task ran twice")


@pytest.mark.parametrize("new_db", ["postgres"], indirect=True)
def test_a_conversation_split_between_tasks_goes_in_once_and_in_order(
    spark: SparkSession, network: Network
) -> None:
    """Rows read through Spark (not by the tasks themselves, which read whole conversations)
    and split by row id, not by conversation, on dialogs open at the far broker: each of four
    tasks holds two of every dialog's eight messages, and tasks lock the same endpoints in
    whatever order they run. Each checks the sequence numbers under the lock, so none puts
    later messages in before earlier ones, and none twice."""
    net = network("a", "b")
    two_way(net)
    a, b = net["a"], net["b"]
    handles = send_dialogs(a, [1] * 40)
    job.run(a, spark)
    send_more(a, handles, 1, 8)  # one batched SEND per sequence number: ids interleave
    plain = jdbc.read_pending

    def by_row_id(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(by_conversation=False, bounds=job._bounds(a, None))
        return plain(*args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(jdbc, "read_pending", by_row_id)
        # Through Spark's read: the tasks' own reads from the source (spark.direct_stream)
        # take whole ranges of conversations.
        m.setattr(jdbc, "stream_source", lambda *args, **kwargs: None)
        for _ in range(8):
            job.run(a, spark, partitions=4)
            if not a.transmission_queue():
                break
    assert a.transmission_queue() == [] and staged_rows(b) == 0
    got = by_conversation(b, drain_all(b, TARGET_QUEUE))
    assert sorted(len(v) for v in got.values()) == [9] * 40
    expected = {conv: list(range(len(msgs))) for conv, msgs in got.items()}
    assert_exactly_once_in_order(got, expected, "with conversations split between tasks")


#: The types of direct_task.PLAN_COLUMNS, as Spark gives them (none is Arrow's null type).
PLAN = pa.schema(
    [
        ("raw_handle", pa.string()),
        ("lifetime_key", pa.float64()),
        ("conversation_id", pa.string()),
        ("source_handle", pa.string()),
        ("from_service", pa.string()),
        ("to_service", pa.string()),
        ("to_broker_instance", pa.string()),
        ("contract", pa.string()),
        ("lifetime_epoch", pa.float64()),
        ("hops", pa.int32()),
        ("part", pa.int16()),
    ]
)


@pytest.mark.parametrize("new_db", ["postgres"], indirect=True)
def test_a_task_writes_only_what_follows_the_far_receive_sequence(
    spark: SparkSession, network: Network
) -> None:
    """One task's work, without Spark: of messages 1-3 of a dialog whose far endpoint has 0-1,
    2 and 3 go into the queue; messages 5-6 (4 missing) go to the staging table, not the
    queue, and the receive sequence number stays where it was."""
    net = network("a", "b")
    two_way(net)
    a, b = net["a"], net["b"]
    first, second = send_dialogs(a, [2, 2])
    job.run(a, spark)
    message_type = drain_all(b, TARGET_QUEUE)[0].message_type_name
    rows, plan = [], []
    with a.transaction() as tx:
        for handle, seqs in ((first, (1, 2, 3)), (second, (5, 6))):
            c = tx.conversation(handle)
            key = {"raw_handle": str(handle), "lifetime_key": float("-inf")}
            plan.append(
                {
                    **key,
                    "conversation_id": str(c.conversation_id),
                    "source_handle": str(handle),
                    "from_service": c.service_name,
                    "to_service": c.far_service,
                    "to_broker_instance": None,
                    "contract": c.contract_name,
                    "lifetime_epoch": None,
                    "hops": 0,
                    "part": 0,
                }
            )
            for seq in seqs:
                rows.append(
                    {
                        **key,
                        "from_initiator": True,
                        "seq": seq,
                        "message_type": message_type,
                        "validation": "N",
                        "message_body": "\\x" + (b'{"n":%d}' % seq).hex(),
                    }
                )
    # A conversation the plan does not give this task: its messages are not written.
    rows.append({**rows[0], "raw_handle": str(uuid.uuid4()), "seq": 0})
    assert [tuple(r) for r in rows[:1]] == [direct_task.INPUT_COLUMNS]
    assert tuple(plan[0]) == tuple(PLAN.names) == direct_task.PLAN_COLUMNS
    plan_table = pa.Table.from_pylist(plan, PLAN)
    far = direct._far(b, plan_table, "r1", net.id("a"))
    batch = pa.RecordBatch.from_pylist(rows)
    out = pa.Table.from_batches(
        list(direct_task.write_partition(far, plan_table, iter([batch])))
    ).to_pylist()
    assert out == [
        {"kind": "ack", "source_handle": str(first), "upto": 4, "service": TARGET, "n": 2},
        {"kind": "staged", "source_handle": None, "upto": 0, "service": None, "n": 2},
    ]
    got = by_conversation(b, drain_all(b, TARGET_QUEUE))
    assert_exactly_once_in_order(got, {c: [2, 3] for c in got}, "one task")
    assert len(got) == 1 and staged_rows(b) == 2
    assert staged_rows(b, s.spark_staged_conversation) == 1
    with b.engine.connect() as conn:
        assert sorted(
            conn.execute(
                sa.select(s.conversation_endpoint.c.receive_sequence).where(
                    s.conversation_endpoint.c.is_initiator.is_(False)
                )
            ).scalars()
        ) == [2, 4]


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
    report = job.run(a, spark, direct=False)
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
        job.run(a, spark, commit_parallelism=2, direct=False)
    first = by_conversation(b, drain_all(b, TARGET_QUEUE))
    assert 0 < len(first) < len(counts), "part 0 alone should have committed some dialogs"
    assert len(a.transmission_queue()) == sum(counts)  # nothing acknowledged
    monkeypatch.setattr(commit, "_fast", fast)
    report = job.run(a, spark, commit_parallelism=2, direct=False)
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
