"""What each Spark task runs when the source broker is on PostgreSQL too: it reads its share of
the conversations' messages from the source itself and streams them into the far broker's
queues, ``COPY ... TO STDOUT`` into ``COPY ... FROM STDIN``, so that no message passes through
Spark. Spark plans (:mod:`airflow_broker.spark.transforms`, on the conversations the source
grouped), runs one task per range of conversation ids, and acknowledges what they report.

Through Spark, each message is read over JDBC into the JVM, turned into Arrow, handed to the
task's Python worker, joined to its conversation and formatted as CSV, and the task holds its
whole partition before its ``COPY`` begins. Streamed, the source formats each row once, the far
server parses it once, and the task holds one row per conversation. 10^6 messages, alternating
in one SparkSession on clones of the same databases: the write 8.9 and 9.7 s streamed against
10.5 and 10.6 s through Spark.

The task decides what it writes as the Spark path does, under the same locks
(:func:`~airflow_broker.spark.direct_task.into_far`): it first reads, per conversation, the
first and last sequence numbers, the count and the message types of its due messages, in a
``REPEATABLE READ`` transaction at the source, and then copies, in that same snapshot, exactly
the sequence numbers it decided on (the far side checks the count it received against them).
A message that comes in after the snapshot waits for the next run.

Shipped to the executors by value, as :mod:`~airflow_broker.spark.direct_task` is, whose names
it uses: it imports nothing else of airflow_broker.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from airflow_broker.spark.direct_task import (
    _QUEUE_COLUMNS,
    _STAGING_COLUMNS,
    Far,
    _Conversation,
    _Decided,
    into_far,
    result_batch,
)
from airflow_broker.spark.stall import touch

#: Bytes of COPY rows handed to the far broker at a time.
_PIPE_CHUNK = 1 << 18


@dataclass(frozen=True)
class Source:
    """Where and what the tasks read at the source, made by the driver
    (:func:`airflow_broker.spark.jdbc.stream_source`)."""

    conninfo: str
    #: the condition on ``t`` (the transmission queue) of the rows the job moves
    moves: str
    #: ``t``'s lifetime as the plan's key (epoch seconds, -infinity for none)
    lifetime_key: str
    #: one condition on ``t`` per task: its range of conversation ids
    ranges: tuple[str, ...]
    #: ``work_mem`` of the reading transaction (None: the server's), for its sorts and groups
    work_mem: str | None = None


def stream_shared(far: Far, source: Source, plan: Any, tasks: Iterator[int]) -> Iterator[Any]:
    """:func:`stream_part` for each task index of a Spark partition, with the plan Spark
    broadcast (``plan.value``); yields the result rows as dicts."""
    for index in tasks:
        yield from stream_part(far, source, plan.value, index).to_pylist()


def stream_part(far: Far, source: Source, plan: Any, index: int) -> Any:
    """The conversations of range ``index`` that are in ``plan`` (an Arrow table of
    :data:`~airflow_broker.spark.direct_task.PLAN_COLUMNS`) into the far broker's queues (the
    general ones into its staging table), in one transaction there. Returns the
    :data:`~airflow_broker.spark.direct_task.RESULT_SCHEMA` batch."""
    import psycopg

    from_tq = f"FROM broker_transmission_queue t WHERE {source.moves}"
    # prepare_threshold=None: nothing prepared on a server process a pooler may hand to others
    with psycopg.connect(source.conninfo, prepare_threshold=None) as src:
        src.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        src.read_only = True
        if source.work_mem is not None:
            src.execute("SELECT set_config('work_mem', %s, true)", (source.work_mem,))
        groups = src.execute(
            f"SELECT t.conversation_handle::text, {source.lifetime_key}, t.is_initiator, "
            "MIN(t.message_sequence_number), MAX(t.message_sequence_number), COUNT(*), "
            f"array_agg(DISTINCT t.message_type_name) {from_tq} AND {source.ranges[index]} "
            "GROUP BY 1, 2, 3"
        ).fetchall()
        conversations, types = _conversations(groups, plan)
        if not conversations:
            return result_batch([])
        other_types = {
            (c.conversation_id, c.from_initiator)
            for c in conversations
            if any(
                (c.contract, c.from_initiator, t) not in far.fast_types
                for t in types[(c.conversation_id, c.from_initiator)]
            )
        }

        def queue_rows(cur: Any, decided: _Decided) -> int:
            keys: list[tuple[Any, ...]] = []
            for order, (c, skip, i) in enumerate(decided.slices):
                far_side = decided.plan[i]  # queue, group, handle, priority, service, contract
                keys.extend(
                    (h, lt, c.min_seq + skip, c.max_seq, order, *far_side) for h, lt in c.keys
                )
            if not keys:
                return 0
            query = (
                f"COPY (SELECT v.queue_id, v.grp, v.handle, t.message_sequence_number, "
                f"{far.status_ready}, v.priority, {far.precedence}, v.service, v.contract, "
                "t.message_type_name, %s, t.message_body, %s "
                "FROM broker_transmission_queue t JOIN unnest(%s::uuid[], %s::float8[], "
                "%s::bigint[], %s::bigint[], %s::int[], %s::int[], %s::uuid[], %s::uuid[], "
                "%s::smallint[], %s::text[], %s::text[]) "
                "AS v(h, lt, lo, hi, ord, queue_id, grp, handle, priority, service, contract) "
                f"ON t.conversation_handle = v.h AND {source.lifetime_key} = v.lt "
                "AND t.message_sequence_number BETWEEN v.lo AND v.hi "
                f"WHERE {source.moves} ORDER BY v.ord, t.message_sequence_number) TO STDOUT"
            )
            params = (far.validation_none, far.now, *_arrays(keys))
            return _pipe(src, query, params, cur, "broker_message", _QUEUE_COLUMNS)

        def staged_rows(cur: Any, decided: _Decided) -> int:
            keys = [(h, lt, c.conversation_id, c.part) for c in decided.general for h, lt in c.keys]
            if not keys:
                return 0
            query = (
                "COPY (SELECT %s, v.cid, t.is_initiator, t.message_sequence_number, "
                "t.message_type_name, t.validation, t.message_body, v.part "
                "FROM broker_transmission_queue t JOIN unnest(%s::uuid[], %s::float8[], "
                "%s::uuid[], %s::smallint[]) AS v(h, lt, cid, part) "
                f"ON t.conversation_handle = v.h AND {source.lifetime_key} = v.lt "
                f"WHERE {source.moves}) TO STDOUT"
            )
            params = (far.run_id, *_arrays(keys))
            return _pipe(src, query, params, cur, "broker_spark_staging", _STAGING_COLUMNS)

        return into_far(far, conversations, other_types, queue_rows, staged_rows)


def _conversations(
    groups: list[tuple[Any, ...]], plan: Any
) -> tuple[list[_Conversation], dict[tuple[str, bool], set[str]]]:
    """The source's groups (handle, lifetime key, direction, first and last sequence number,
    count, types) that are in ``plan``, as conversations in the order the Spark path sorts its
    rows (conversation id, direction), and each one's message types. A conversation whose
    messages have two lifetimes (two rows of the plan) is one conversation with two keys, as
    its sorted rows are on the Spark path, and what it shares is taken from the row of its
    first message, as there."""
    import pyarrow as pa

    columns = (
        ("raw_handle", pa.string()),
        ("lifetime_key", pa.float64()),
        ("from_initiator", pa.bool_()),
        ("lo", pa.int64()),
        ("hi", pa.int64()),
        ("n", pa.int64()),
    )
    found = pa.table(
        {
            **{
                name: pa.array([g[k] for g in groups], type)
                for k, (name, type) in enumerate(columns)
            },
            # the types stay out of the join (Arrow joins no list columns): found by row
            "row": pa.array(range(len(groups)), pa.int64()),
        }
    )
    joined = found.join(
        plan, keys=["raw_handle", "lifetime_key"], join_type="inner", use_threads=False
    ).sort_by(
        [("conversation_id", "ascending"), ("from_initiator", "ascending"), ("lo", "ascending")]
    )
    conversations: list[_Conversation] = []
    types: dict[tuple[str, bool], set[str]] = {}
    for r in joined.to_pylist():
        key = (r["conversation_id"], r["from_initiator"])
        last = conversations[-1] if conversations else None
        if last is not None and (last.conversation_id, last.from_initiator) == key:
            last.count += r["n"]
            last.min_seq = min(last.min_seq, r["lo"])
            last.max_seq = max(last.max_seq, r["hi"])
            last.keys = (*last.keys, (r["raw_handle"], r["lifetime_key"]))
            types[key].update(groups[r["row"]][6])
            continue
        conversations.append(
            _Conversation(
                r["conversation_id"],
                r["from_initiator"],
                0,
                r["n"],
                r["lo"],
                r["hi"],
                r["source_handle"],
                r["from_service"],
                r["to_service"],
                r["to_broker_instance"],
                r["contract"],
                r["lifetime_epoch"],
                r["hops"],
                r["part"],
                ((r["raw_handle"], r["lifetime_key"]),),
            )
        )
        types[key] = set(groups[r["row"]][6])
    return conversations, types


def _arrays(rows: list[tuple[Any, ...]]) -> list[list[Any]]:
    """``rows`` as one list per column (the arrays a query unnests)."""
    return [list(column) for column in zip(*rows, strict=True)]


def _pipe(
    src: Any, query: str, params: tuple[Any, ...], cur: Any, table: str, columns: tuple[str, ...]
) -> int:
    """The rows ``query`` (a ``COPY ... TO STDOUT`` at the source) gives, into ``table`` of the
    far broker through ``cur``, as they come; returns how many."""
    with (
        src.cursor() as out_cur,
        out_cur.copy(query, params) as out,
        cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as into,
    ):
        # The source sends a row at a time: written a row at a time, each a trip through
        # psycopg's machinery, the rows cost the task more Python than the COPYs themselves.
        chunk = bytearray()
        for data in out:
            chunk += data
            if len(chunk) >= _PIPE_CHUNK:
                into.write(chunk)
                touch()
                chunk = bytearray()
        if chunk:
            into.write(chunk)
    return int(cur.rowcount)


__all__ = ["Source", "stream_part", "stream_shared"]
