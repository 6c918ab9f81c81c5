"""What each Spark task runs to put its conversations straight into a PostgreSQL far broker's
queues: one transaction per task, each message written once (by COPY), with the same checks as
the staged commit's fast path (:mod:`airflow_broker.spark.fast_path`).

Exactly once and in order rest where they rest for every other writer: in one transaction, the
task locks the far endpoints of its conversations (in handle order), reads their receive
sequence numbers, writes only the messages at or above them, and raises them. A task Spark runs
again, or a run after a crash, finds the numbers raised and writes nothing twice; a
conversation's later messages cannot go in before its earlier ones, whichever task holds them.
The read is split by conversation, so a task normally holds whole conversations in order.

A conversation this task cannot take the simple way (a gap, a system message or a type that is
validated or not this side's to send, an endpoint that is not open or waits for a gap, a service
not hosted here...) is written, in the same transaction, to the staging table, where the staged
commit (:func:`airflow_broker.spark.commit.commit`) takes it with the Python path's receiving
code.

Shipped to the executors by value (cloudpickle), like :mod:`~airflow_broker.spark.copy_partition`:
it imports nothing of airflow_broker but :mod:`~airflow_broker.spark.stall`, shipped by value
with it. Keep it that way.

A far broker that stops answering does not hold a task: its connection is cut after
``Far.answer_timeout`` seconds without progress (:mod:`~airflow_broker.spark.stall`), the task
fails, and Spark runs it again.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from airflow_broker.spark.copy_partition import copy_arrow, copy_rows
from airflow_broker.spark.stall import Stall, connect, touch

#: What each task reads of every message (:func:`airflow_broker.spark.direct.write_direct`
#: makes them): only what is the message's own, and the key of its conversation's row in
#: the plan (:data:`PLAN_COLUMNS`), the raw handle and the lifetime (``lifetime_key``: the
#: epoch seconds, -inf for none, so that the key has no nulls).
INPUT_COLUMNS = (
    "raw_handle",
    "lifetime_key",
    "from_initiator",
    "seq",
    "message_type",
    "validation",
    "message_body",  # bytea's hex input form (\x...), or null
)
#: What each task is given of every conversation it may hold (one row each, an Arrow table
#: Spark broadcasts): it joins them to its messages itself, by ``raw_handle`` and
#: ``lifetime_key``, then sorts them by conversation, direction and sequence number.
PLAN_COLUMNS = (
    "raw_handle",
    "lifetime_key",
    "conversation_id",
    "source_handle",
    "from_service",
    "to_service",
    "to_broker_instance",
    "contract",
    "lifetime_epoch",
    "hops",
    "part",
)
_JOIN_KEYS = ["raw_handle", "lifetime_key"]
#: What each task returns: ``ack`` rows (a conversation the far broker has every message of
#: below ``upto``, ``n`` of them new), and one ``staged`` row (``n`` rows staged).
RESULT_SCHEMA = "kind string, source_handle string, upto long, service string, n long"

_QUEUE_COLUMNS = (
    "queue_id",
    "conversation_group_id",
    "conversation_handle",
    "message_sequence_number",
    "status",
    "priority",
    "precedence",
    "service_name",
    "service_contract_name",
    "message_type_name",
    "validation",
    "message_body",
    "enqueued_at",
)
_ENDPOINT_COLUMNS = (
    "conversation_handle",
    "conversation_id",
    "is_initiator",
    "conversation_group_id",
    "queue_id",
    "service_name",
    "far_service",
    "far_broker_instance",
    "contract_name",
    "state",
    "priority",
    "lifetime",
    "send_sequence",
    "receive_sequence",
    "created_at",
)
_GROUP_COLUMNS = ("conversation_group_id", "queue_id")
_STAGED_CONVERSATION_COLUMNS = (
    "run_id",
    "source_instance",
    "conversation_id",
    "from_initiator",
    "source_handle",
    "from_service",
    "to_service",
    "to_broker_instance",
    "contract",
    "lifetime_epoch",
    "hops",
    "part",
)
_STAGING_COLUMNS = (
    "run_id",
    "conversation_id",
    "from_initiator",
    "seq",
    "message_type",
    "validation",
    "message_body",
    "part",
)
#: The job's pause variable (``airflow_broker.spark.job.PAUSE_ENV``): crash tests stop a task
#: at ``task-written`` (before its commit) or ``task-committed``.
PAUSE_ENV = "AIRFLOW_BROKER_SPARK_PAUSE_AT"


@dataclass(frozen=True)
class Service:
    """A service the far broker hosts, as this path needs it."""

    queue_id: int
    enabled: bool
    router: bool
    contracts: frozenset[str]


@dataclass(frozen=True)
class Far:
    """What every task needs to know of the far broker, read once by the driver."""

    conninfo: str
    run_id: str
    #: the far broker's instance id, and the source's
    me: str
    source_instance: str
    services: dict[str, Service]
    #: (contract, from_initiator, message type) this path takes: a type of the contract that
    #: side may send, not validated, not a system message
    fast_types: frozenset[tuple[str, bool, str]]
    #: a new endpoint's priority by (contract, its service, the far service)
    priorities: dict[tuple[str, str, str], int]
    #: the time the messages are enqueued at
    now: datetime
    status_ready: int
    status_not_complete: int
    precedence: int
    validation_none: str
    sendable_states: frozenset[str]
    #: seconds without progress after which a task's connection is cut (spark.stall)
    answer_timeout: float = 300.0


@dataclass
class _Conversation:
    """One conversation and direction of the task's rows (``start``: its first row; ``keys``:
    its rows of the plan, (raw handle, lifetime key), where the task reads its messages from
    the source itself)."""

    conversation_id: str
    from_initiator: bool
    start: int
    count: int
    min_seq: int
    max_seq: int
    source_handle: str
    from_service: str
    to_service: str
    to_broker_instance: str | None
    contract: str
    lifetime_epoch: float | None
    hops: int
    part: int
    keys: tuple[tuple[str, float], ...] = ()


def _conversations(table: Any) -> list[_Conversation]:
    """The task's conversations in the order of its rows, which the job sorted by conversation,
    direction and sequence number: each a run of rows."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = table.num_rows
    cid, ini = table["conversation_id"], table["from_initiator"]
    changed = pc.or_(
        pc.not_equal(cid.slice(1), cid.slice(0, n - 1)),
        pc.not_equal(ini.slice(1), ini.slice(0, n - 1)),
    )
    starts = [0, *(i + 1 for i in pc.indices_nonzero(changed).to_pylist())]
    ends = [*starts[1:], n]
    first = table.take(pa.array(starts, pa.int64())).to_pydict()
    last_seq = table["seq"].take(pa.array([e - 1 for e in ends], pa.int64())).to_pylist()
    return [
        _Conversation(
            first["conversation_id"][i],
            first["from_initiator"][i],
            start,
            ends[i] - start,
            first["seq"][i],
            last_seq[i],
            first["source_handle"][i],
            first["from_service"][i],
            first["to_service"][i],
            first["to_broker_instance"][i],
            first["contract"][i],
            first["lifetime_epoch"][i],
            first["hops"][i],
            first["part"][i],
        )
        for i, start in enumerate(starts)
    ]


def _with_other_types(table: Any, far: Far) -> set[tuple[str, bool]]:
    """Conversations with a message of a type this path does not take."""
    triples = (
        table.group_by(
            ["conversation_id", "from_initiator", "contract", "message_type"], use_threads=False
        )
        .aggregate([])
        .to_pylist()
    )
    return {
        (t["conversation_id"], t["from_initiator"])
        for t in triples
        if (t["contract"], t["from_initiator"], t["message_type"]) not in far.fast_types
    }


def write_shared(far: Far, plan: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """:func:`write_partition` with the plan Spark broadcast (``plan.value``)."""
    return write_partition(far, plan.value, batches)


def write_partition(far: Far, plan: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """One Spark partition's messages (:data:`INPUT_COLUMNS`) into the far broker's queues (the
    general conversations into its staging table), in one transaction; ``plan``: an Arrow
    table of :data:`PLAN_COLUMNS`, the conversations the messages may belong to (a message
    whose conversation is not in it is not written). Yields :data:`RESULT_SCHEMA` rows."""
    import pyarrow as pa

    chunks = [b for b in batches if b.num_rows]
    if not chunks:
        yield result_batch([])
        return
    # Joined to the plan and sorted here by Arrow, not by Spark before the task: Spark's join
    # and the columns every message of a conversation repeats took the read 5.3 s instead of
    # 3.7 for 10^6 messages; sorting in Spark made the task's wait a third longer.
    table = (
        pa.Table.from_batches(chunks)
        .join(plan, keys=_JOIN_KEYS, join_type="inner", use_threads=False)
        .sort_by(
            [
                ("conversation_id", "ascending"),
                ("from_initiator", "ascending"),
                ("seq", "ascending"),
            ]
        )
    )
    if not table.num_rows:
        yield result_batch([])
        return

    def queue_rows(cur: Any, decided: _Decided) -> int:
        rows = decided.messages(table, far)
        copy_arrow(cur, "broker_message", _QUEUE_COLUMNS, rows)
        return int(rows.num_rows)

    def staged_rows(cur: Any, decided: _Decided) -> int:
        staged = decided.staged(table, far)
        copy_arrow(cur, "broker_spark_staging", _STAGING_COLUMNS, staged)
        return int(staged.num_rows)

    conversations = _conversations(table)
    other_types = _with_other_types(table, far)
    yield into_far(far, conversations, other_types, queue_rows, staged_rows)


def result_batch(rows: list[dict[str, Any]]) -> Any:
    """Rows of :data:`RESULT_SCHEMA` as an Arrow batch."""
    import pyarrow as pa

    schema = pa.schema(
        [
            ("kind", pa.string()),
            ("source_handle", pa.string()),
            ("upto", pa.int64()),
            ("service", pa.string()),
            ("n", pa.int64()),
        ]
    )
    return pa.RecordBatch.from_pylist(rows, schema=schema)


def into_far(
    far: Far,
    conversations: list[_Conversation],
    other_types: set[tuple[str, bool]],
    queue_rows: Callable[[Any, _Decided], int],
    staged_rows: Callable[[Any, _Decided], int],
) -> Any:
    """The far broker's transaction for ``conversations`` (in conversation order): lock their
    endpoints, decide, create what is new, write the messages that go into queues
    (``queue_rows``) and stage the rest (``staged_rows``; both return how many rows they
    wrote), raise the receive sequence numbers. Returns the :data:`RESULT_SCHEMA` batch."""
    with (
        connect(far.conninfo, "the far broker") as conn,
        Stall(conn, far.answer_timeout, "the far broker"),
        conn.cursor() as cur,
    ):
        # The far endpoints, locked in handle order until the messages are in.
        cur.execute(
            "SELECT e.conversation_id::text, e.is_initiator, e.conversation_handle::text, "
            "e.conversation_group_id::text, e.queue_id, e.priority, e.service_name, e.state, "
            "e.far_broker_instance, e.receive_sequence "
            "FROM broker_conversation_endpoint e "
            "JOIN unnest(%s::uuid[], %s::boolean[]) AS k(cid, ini) "
            "ON e.conversation_id = k.cid AND e.is_initiator = k.ini "
            "ORDER BY e.conversation_handle FOR UPDATE OF e",
            (
                [c.conversation_id for c in conversations],
                [not c.from_initiator for c in conversations],
            ),
        )
        endpoints = {(r[0], not r[1]): r for r in cur.fetchall()}
        touch()
        cur.execute(
            "SELECT DISTINCT conversation_handle::text FROM broker_message "
            "WHERE status = %s AND conversation_handle = ANY(%s::uuid[])",
            (far.status_not_complete, [r[2] for r in endpoints.values()]),
        )
        waiting_here = {r[0] for r in cur.fetchall()}
        touch()
        decided = _decide(far, conversations, other_types, endpoints, waiting_here)
        copy_rows(cur, "broker_conversation_group", _GROUP_COLUMNS, decided.new_groups)
        copy_rows(cur, "broker_conversation_endpoint", _ENDPOINT_COLUMNS, decided.new_endpoints)
        expected = sum(c.count - skip for c, skip, _ in decided.slices)
        written = queue_rows(cur, decided)
        if written != expected:  # the source changed under a read that should not see it
            raise RuntimeError(f"{written} messages written into queues, {expected} expected")
        # Conversations before messages: the next run from this source finds a dead run's
        # staged messages by its conversations (commit.prepare).
        copy_rows(
            cur,
            "broker_spark_staged_conversation",
            _STAGED_CONVERSATION_COLUMNS,
            decided.staged_conversations(far),
        )
        staged = staged_rows(cur, decided)
        if decided.raised:
            cur.execute(
                "UPDATE broker_conversation_endpoint e SET receive_sequence = v.upto "
                "FROM unnest(%s::uuid[], %s::bigint[]) AS v(handle, upto) "
                "WHERE e.conversation_handle = v.handle",
                (list(decided.raised), list(decided.raised.values())),
            )
        if decided.bindings:
            cur.execute(
                "UPDATE broker_conversation_endpoint SET far_broker_instance = %s "
                "WHERE conversation_handle = ANY(%s::uuid[]) AND far_broker_instance IS NULL",
                (far.source_instance, decided.bindings),
            )
        _checkpoint("task-written")
        conn.commit()  # under the guard: a far broker that hangs in the commit is cut too
    _checkpoint("task-committed")
    rows = [
        {"kind": "ack", "source_handle": h, "upto": upto, "service": svc, "n": n}
        for h, upto, svc, n in decided.acks
    ]
    rows.append({"kind": "staged", "source_handle": None, "upto": 0, "service": None, "n": staged})
    return result_batch(rows)


def _checkpoint(name: str) -> None:
    """A point a crash test may stop a task at (as the job's own checkpoints)."""
    import os
    import sys
    import time

    wanted, _, seconds = os.environ.get(PAUSE_ENV, "").partition(":")
    if wanted == name:
        print(f"checkpoint {name}", file=sys.stderr, flush=True)
        time.sleep(float(seconds or 3600))


class _Decided:
    """What one task does with each of its conversations."""

    def __init__(self) -> None:
        #: (conversation, how many of its first messages the far side has, plan index) of the
        #: messages that go into queues
        self.slices: list[tuple[_Conversation, int, int]] = []
        #: per plan index: queue, group, handle, priority, service, contract
        self.plan: list[tuple[int, str, str, int, str, str]] = []
        #: conversations for the staged commit
        self.general: list[_Conversation] = []
        self.new_groups: list[tuple[str, int]] = []
        self.new_endpoints: list[tuple[Any, ...]] = []
        self.raised: dict[str, int] = {}
        self.bindings: list[str] = []
        #: (source handle, upto, far service, messages new here)
        self.acks: list[tuple[str, int, str, int]] = []

    def messages(self, table: Any, far: Far) -> Any:
        """The queue rows: each taken row with its conversation's endpoint here."""
        import pyarrow as pa

        rows: list[int] = []
        which: list[int] = []
        for c, skip, i in self.slices:
            rows.extend(range(c.start + skip, c.start + c.count))
            which.extend([i] * (c.count - skip))
        taken = table.select(["seq", "message_type", "message_body"]).take(
            pa.array(rows, pa.int64())
        )
        plan = pa.table(
            {
                name: pa.array([p[k] for p in self.plan])
                for k, name in enumerate(
                    (
                        "queue_id",
                        "conversation_group_id",
                        "conversation_handle",
                        "priority",
                        "service_name",
                        "service_contract_name",
                    )
                )
            }
        ).take(pa.array(which, pa.int64()))
        n = len(rows)
        columns = {
            "queue_id": plan["queue_id"],
            "conversation_group_id": plan["conversation_group_id"],
            "conversation_handle": plan["conversation_handle"],
            "message_sequence_number": taken["seq"],
            "status": pa.repeat(far.status_ready, n),
            "priority": plan["priority"],
            "precedence": pa.repeat(far.precedence, n),
            "service_name": plan["service_name"],
            "service_contract_name": plan["service_contract_name"],
            "message_type_name": taken["message_type"],
            "validation": pa.repeat(far.validation_none, n),
            "message_body": taken["message_body"],
            "enqueued_at": pa.repeat(far.now.isoformat(), n),
        }
        return pa.table([columns[c] for c in _QUEUE_COLUMNS], names=list(_QUEUE_COLUMNS))

    def staged_conversations(self, far: Far) -> list[tuple[Any, ...]]:
        """The staged conversation rows of the conversations left to the staged commit."""
        return [
            (
                far.run_id,
                far.source_instance,
                c.conversation_id,
                c.from_initiator,
                c.source_handle,
                c.from_service,
                c.to_service,
                c.to_broker_instance,
                c.contract,
                c.lifetime_epoch,
                c.hops,
                c.part,
            )
            for c in self.general
        ]

    def staged(self, table: Any, far: Far) -> Any:
        """The staging rows of the conversations left to the staged commit."""
        import pyarrow as pa

        rows: list[int] = []
        for c in self.general:
            rows.extend(range(c.start, c.start + c.count))
        taken = table.select(list(_STAGING_COLUMNS[1:])).take(pa.array(rows, pa.int64()))
        return pa.table(
            [pa.repeat(far.run_id, len(rows)), *taken.columns],
            names=list(_STAGING_COLUMNS),
        )


def _decide(
    far: Far,
    conversations: list[_Conversation],
    other_types: set[tuple[str, bool]],
    endpoints: dict[tuple[str, bool], Any],
    waiting_here: set[str],
) -> _Decided:
    """Each conversation the simple way or to the staged commit, as the fast path decides."""
    d = _Decided()
    for c in conversations:
        key = (c.conversation_id, c.from_initiator)
        contiguous = c.count == c.max_seq - c.min_seq + 1
        if key in other_types or not contiguous or c.to_broker_instance not in (None, far.me):
            d.general.append(c)
            continue
        ep = endpoints.get(key)
        if ep is None:
            svc = far.services.get(c.to_service)
            priority = far.priorities.get((c.contract, c.to_service, c.from_service))
            if (
                c.min_seq != 0
                or svc is None
                or svc.router
                or not svc.enabled
                or c.contract not in svc.contracts
                or priority is None
            ):
                d.general.append(c)
                continue
            handle, group = str(uuid.uuid4()), str(uuid.uuid4())
            d.new_groups.append((group, svc.queue_id))
            lifetime = (
                None if c.lifetime_epoch is None else datetime.fromtimestamp(c.lifetime_epoch, UTC)
            )
            d.new_endpoints.append(
                (
                    handle,
                    c.conversation_id,
                    not c.from_initiator,
                    group,
                    svc.queue_id,
                    c.to_service,
                    c.from_service,
                    far.source_instance,
                    c.contract,
                    "CO",
                    priority,
                    lifetime,
                    0,
                    c.max_seq + 1,
                    far.now,
                )
            )
            d.slices.append((c, 0, len(d.plan)))
            d.plan.append((svc.queue_id, group, handle, priority, c.to_service, c.contract))
            d.acks.append((c.source_handle, c.max_seq + 1, c.to_service, c.count))
            continue
        _cid, _ini, handle, group, queue_id, priority, service, state, bound, recv = ep
        if (
            state not in far.sendable_states
            or bound not in (None, far.source_instance)
            or handle in waiting_here
            or c.min_seq > recv
        ):
            d.general.append(c)
            continue
        upto = max(recv, c.max_seq + 1)
        if upto > recv:
            skip = recv - c.min_seq if recv > c.min_seq else 0
            d.slices.append((c, skip, len(d.plan)))
            d.plan.append((queue_id, group, handle, priority, service, c.contract))
            d.raised[handle] = upto
        if bound is None:
            d.bindings.append(handle)
        d.acks.append((c.source_handle, upto, service, upto - recv))
    return d
