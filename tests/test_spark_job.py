"""The Spark routing job against real broker databases (SQLite files and PostgreSQL), and its
conformance with the Python delivery path on generated routes and messages."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pyspark.sql import SparkSession
from sqlalchemy import text
from transport_procs import (
    INITIATOR,
    TARGET,
    TARGET_QUEUE,
    Net,
    assert_exactly_once_in_order,
    by_conversation,
    deliver_until_empty,
    drain_all,
    host_initiator,
    host_target,
    reply_to_all,
    send_dialogs,
    send_more,
    two_way,
)

from airflow_broker import END_DIALOG, Broker, routing
from airflow_broker.constants import STATUS_NOT_COMPLETE
from airflow_broker.examples import sales
from airflow_broker.routing import Route
from airflow_broker.spark import jdbc, job, transforms
from airflow_broker.transport import routing_service as ddr

pytestmark = [pytest.mark.xdist_group("spark"), pytest.mark.timeout(600)]

Network = Callable[..., Net]


def state(broker: Broker, handle: uuid.UUID) -> str:
    with broker.transaction() as tx:
        return tx.conversation(handle).state


# -- conformance ------------------------------------------------------------------------------

SERVICES = ["//s/a", "//s/b", "//s/c", "broker://gw/svc", "//s/local"]
IDS = [str(uuid.UUID(int=i)) for i in range(1, 5)]
ME = IDS[0]
NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def random_routes(rng: random.Random) -> list[Route]:
    routes = []
    for i in range(rng.randint(0, 9)):
        service = rng.choice([*SERVICES, None])
        instance = rng.choice([None, None, *IDS])
        address = rng.choice(["LOCAL", "TRANSPORT", "broker://x", "broker://y", "broker://z"])
        mirror = rng.choice([None, None, None, "broker://m"]) if address != "LOCAL" else None
        expires = rng.choice([None, None, NOW - timedelta(seconds=1), NOW + timedelta(days=1)])
        routes.append(Route(f"r{i}", service, instance, address, mirror, expires))
    return routes


@pytest.mark.parametrize("seed", range(6))
def test_the_spark_plan_decides_as_the_python_delivery_path(spark: SparkSession, seed: int) -> None:
    """Generated routing tables and messages: every message's decision (kind, addresses in
    order, target broker instance, matching step), load balancing included, is the Python
    path's (:func:`routing.delivery_decision`, which Transport._plan calls)."""
    rng = random.Random(seed)
    routes = random_routes(rng)
    hosted = rng.sample(SERVICES, rng.randint(0, 2))
    dynamic = {s for s in SERVICES if rng.random() < 0.15}
    rows = []
    for i in range(400):
        cid = uuid.UUID(int=rng.getrandbits(128))
        rows.append(
            (
                i,
                # SQLite's form (32 hex digits) half of the time
                cid.hex if i % 2 else str(cid),
                cid.hex if i % 2 else str(cid),
                True,
                "//from",
                rng.choice(SERVICES),
                rng.choice([None, None, None, *IDS]),
                "DEFAULT",
                "DEFAULT",
                0,
                "N",
                None,
                None,
                0,
            )
        )
    df = spark.createDataFrame(rows, transforms.pending_schema())
    planned = transforms.plan(
        df, routes=routes, me=ME, now=NOW, hosted=hosted, dynamic=lambda s: s in dynamic
    )
    got = {
        r.id: (r.kind, tuple(r.addresses), r.target_instance, r.step)
        for r in planned.select("id", "kind", "addresses", "target_instance", "step").collect()
    }
    assert len(got) == len(rows), "a message lost or doubled by the join"
    kinds = set()
    for r in rows:
        d = routing.delivery_decision(
            routes,
            r[5],
            r[6],
            dialog_id=uuid.UUID(r[2]),
            me=ME,
            now=NOW,
            hosted=hosted,
            dynamic_routing=r[5] in dynamic,
        )
        expected = (d.kind, d.addresses, r[6] or d.broker_instance, d.step)
        assert got[r[0]] == expected, f"message {r[0]} to {r[5]!r} bound to {r[6]}"
        kinds.add(d.kind)
    assert len(kinds) >= 2  # the generator reaches more than one outcome


@pytest.mark.parametrize("seed", range(2))
def test_classification_conforms_to_the_python_router(spark: SparkSession, seed: int) -> None:
    """The json: classifier in Spark names the service the data-dependent routing service's
    classifier names, for generated bodies (valid, invalid, nested, missing)."""
    rng = random.Random(seed)
    spec = "json:$.route.to"
    bodies: list[bytes | None] = [None, b"not json", b"{}", b'{"route": 3}']
    for _ in range(200):
        doc: Any = {"route": {"to": rng.choice(["//s/a", "//s/b", "", 7, None, ["x"]])}}
        if rng.random() < 0.2:
            doc = {"other": doc}
        bodies.append(json.dumps(doc).encode())
    rows = [
        (
            i,
            str(uuid.UUID(int=i + 1)),
            str(uuid.UUID(int=i + 1)),
            True,
            "//f",
            "//router",
            None,
            "DEFAULT",
            "DEFAULT",
            0,
            "N",
            body,
            None,
            0,
        )
        for i, body in enumerate(bodies)
    ]
    df = spark.createDataFrame(rows, transforms.pending_schema())
    got = {r.id: r.classified for r in transforms.classify(df, spec, "//router").collect()}
    classify = ddr.compile_classifier(spec)
    for i, body in enumerate(bodies):
        try:
            expected: str | None = classify(body)
        except ddr.NotClassified:
            expected = None
        assert got[i] == expected, f"body {body!r}"


# -- the job against real databases -----------------------------------------------------------


@pytest.mark.parametrize("new_db", ["sqlite", "postgres"], indirect=True)
def test_the_job_delivers_every_message_once_in_order_and_replies_come_back(
    spark: SparkSession, network: Network
) -> None:
    net = network("a", "b")
    two_way(net)
    a, b = net["a"], net["b"]
    counts = [1 + i % 7 for i in range(120)]
    handles = send_dialogs(a, counts)
    report = job.run(a, spark)
    assert report.read == sum(counts)
    assert report.delivered == sum(counts) and report.acknowledged == sum(counts)
    assert report.general == 0 and report.waiting == {}
    assert report.targets == {net.id("b"): sum(counts)}
    assert a.transmission_queue() == []
    got = by_conversation(b, drain_all(b, TARGET_QUEUE))
    assert len(got) == len(handles)
    # bodies {"n": k} for k < count, each once, in order (keyed by the receiving side)
    expected = {conv: list(range(len(msgs))) for conv, msgs in got.items()}
    assert sorted(len(v) for v in expected.values()) == sorted(counts)
    assert_exactly_once_in_order(got, expected, "after the Spark job")
    # More messages on the same dialogs: the far endpoints exist now (the other fast case).
    send_more(a, handles[:30], 100, 3)
    again = job.run(a, spark)
    assert again.delivered == 90 and again.acknowledged == 90
    more = by_conversation(b, drain_all(b, TARGET_QUEUE))
    assert sorted(len(v) for v in more.values()) == [3] * 30
    # A second run finds nothing; the conversations are bound to b, and b's replies travel
    # back by the Python path.
    assert job.run(a, spark).read == 0
    reply_to_all(b, [m for ms in got.values() for m in ms], {"reply": 1})
    deliver_until_empty(b)
    assert len(drain_all(a, "initiator_q")) == len(handles)


@pytest.mark.parametrize("new_db", ["postgres"], indirect=True)
def test_the_far_broker_priority_of_each_conversation_holds_on_the_direct_write(
    spark: SparkSession, network: Network
) -> None:
    """The far broker's own priorities, looked up once per (contract, its service, the remote
    service) for the whole write, as its side of the conversation sees them: its service is
    the local one. A lookup that swapped the two services would match ``wrong_way``."""
    net = network("a", "b")
    two_way(net)
    a, b = net["a"], net["b"]
    with b.definitions() as d:
        d.create_priority(
            "rush", contract="DEFAULT", local_service=TARGET, remote_service=INITIATOR, priority=8
        )
        d.create_priority("wrong_way", remote_service=TARGET, priority=2)
    counts = [3] * 12
    send_dialogs(a, counts)
    report = job.run(a, spark)
    assert report.delivered == sum(counts) and report.general == 0
    got = drain_all(b, TARGET_QUEUE)
    assert len(got) == sum(counts)
    assert {m.priority for m in got} == {8}
    with b.transaction() as tx:
        assert {tx.conversation(m.conversation_handle).priority for m in got} == {8}


@pytest.mark.parametrize("new_db", ["postgres"], indirect=True)
def test_tasks_streaming_from_the_source_write_what_follows_the_far_side_and_nothing_else(
    spark: SparkSession, network: Network
) -> None:
    """From PostgreSQL to PostgreSQL each task reads its conversations from the source itself
    (spark.direct_stream). It copies exactly the sequence numbers it decided on: of a dialog
    whose far side already has messages 0-2 of 0-4, only 3 and 4 (once, in order); a dialog
    with a lifetime whole; a dialog that requires encryption not at all (the Python pass's).
    A dialog whose far side waits for a message the source no longer holds is staged whole,
    and the staged commit holds it."""
    net = network("a", "b")
    two_way(net)
    a, b = net["a"], net["b"]
    ahead, gap = send_dialogs(a, [2, 1])
    assert job.run(a, spark).delivered == 3
    assert len(drain_all(b, TARGET_QUEUE)) == 3
    send_more(a, [ahead], 2, 3)  # sequence numbers 2-4 at the source
    send_more(a, [gap], 1, 2)  # 1-2
    send_dialogs(a, [4], lifetime_seconds=3600)
    secure = send_dialogs(a, [2], encryption=True)[0]
    with b.engine.begin() as conn:
        # The far side of `ahead` has 2 already (as if the Python pass had brought it); that of
        # `gap` expects 0 again, which the source no longer holds.
        for handle, upto in ((ahead, 3), (gap, 0)):
            with a.transaction() as tx:
                far_id = tx.conversation(handle).conversation_id
            conn.execute(
                text(
                    "UPDATE broker_conversation_endpoint SET receive_sequence = :n "
                    "WHERE conversation_id = :c AND NOT is_initiator"
                ),
                {"n": upto, "c": far_id},
            )
    report = job.run(a, spark)
    assert report.read == 3 + 2 + 4
    got = drain_all(b, TARGET_QUEUE)
    by_far = by_conversation(b, got)
    assert sorted(len(v) for v in by_far.values()) == [2, 4]
    assert_exactly_once_in_order(
        by_far, {c: ([3, 4] if len(v) == 2 else [0, 1, 2, 3]) for c, v in by_far.items()}, "ahead"
    )
    # `gap` went to the staged commit, whose receiving code keeps its two messages behind the
    # missing one; everything but `secure` was acknowledged.
    assert report.general == 2 and report.delivered == 2 + 4 + 2
    with b.engine.connect() as conn:
        behind = conn.execute(
            text("SELECT count(*) FROM broker_message WHERE status = :s"),
            {"s": STATUS_NOT_COMPLETE},
        ).scalar_one()
    assert behind == 2
    assert {r.conversation_handle for r in a.transmission_queue()} == {secure}


@pytest.mark.parametrize("new_db", ["postgres"], indirect=True)
def test_the_transmission_queue_is_read_in_parallel_partitions(
    spark: SparkSession, network: Network
) -> None:
    """JDBC reads split on the row id: four queries, every row once."""
    net = network("a", "b")
    two_way(net)
    a = net["a"]
    send_dialogs(a, [5] * 40)
    bounds = job._bounds(a, None)
    assert bounds is not None
    df = jdbc.read_pending(spark, a.engine.url, due_by=None, bounds=bounds, partitions=4)
    assert df.rdd.getNumPartitions() == 4
    per_partition = df.rdd.mapPartitions(lambda rows: [sum(1 for _ in rows)]).collect()
    assert len(per_partition) == 4 and all(per_partition), per_partition
    ids = [r.id for r in df.select("id").collect()]
    assert len(ids) == len(set(ids)) == 200


@pytest.mark.parametrize("new_db", ["sqlite", "postgres"], indirect=True)
def test_the_read_split_by_conversation_gives_each_conversation_to_one_task(
    spark: SparkSession, network: Network
) -> None:
    """Four queries on ranges of the conversation id: every row once, every conversation's
    rows in one partition (what lets a task write whole conversations)."""
    net = network("a", "b")
    two_way(net)
    a = net["a"]
    send_dialogs(a, [5] * 40)
    df = jdbc.read_pending(spark, a.engine.url, due_by=None, partitions=4, by_conversation=True)
    assert df.rdd.getNumPartitions() == 4
    per_partition = df.rdd.mapPartitions(
        lambda rows: [sorted({r.conversation_id for r in rows})]
    ).collect()
    assert all(per_partition), per_partition
    conversations = [c for part in per_partition for c in part]
    assert len(conversations) == len(set(conversations)) == 40
    ids = [r.id for r in df.select("id").collect()]
    assert len(ids) == len(set(ids)) == 200


@pytest.mark.parametrize("new_db", ["postgres"], indirect=True)
def test_postgresql_groups_the_conversations_as_the_spark_transform_does(
    spark: SparkSession, network: Network
) -> None:
    """The job plans on conversations grouped by the source's own query
    (``jdbc.conversations_query``); they must be the rows ``transforms.conversations``
    makes of the messages: same keys, first id and sequence, last sequence, count, types."""
    net = network("a", "b")
    two_way(net)
    a = net["a"]
    handles = send_dialogs(a, [1 + i % 9 for i in range(60)])
    send_more(a, handles[:10], 100, 2)
    # A lifetime: one of the keys (NULL on the other dialogs).
    send_dialogs(a, [2], lifetime_seconds=3600)
    pending = jdbc.read_pending(
        spark, a.engine.url, due_by=None, bounds=job._bounds(a, None), partitions=3
    )
    by_spark = transforms.conversations(pending, with_body=False)
    by_sql = jdbc.read_conversations(spark, a.engine.url, due_by=None)
    assert by_sql.schema.simpleString() == by_spark.schema.simpleString()
    expected = sorted(tuple(r) for r in by_spark.collect())
    got = sorted(tuple(r) for r in by_sql.collect())
    assert len(got) == 61 and got == expected
    assert sum(r.messages for r in by_sql.collect()) == sum(1 + i % 9 for i in range(60)) + 22


@pytest.mark.parametrize("new_db", ["postgres"], indirect=True)
def test_messages_read_with_their_own_columns_get_the_rest_from_the_plan(
    spark: SparkSession, network: Network
) -> None:
    """A plan made on grouped conversations gives each message what it shares with its
    conversation (``read_pending(..., own_columns=True)`` reads only its own columns): joined
    to the plan, the rows are the full read's, column for column. Both reads leave the same
    rows to the Python pass: those of a dialog that requires encryption."""
    net = network("a", "b")
    two_way(net)
    a = net["a"]
    plain = send_dialogs(a, [1 + i % 4 for i in range(20)])
    plain += send_dialogs(a, [3], lifetime_seconds=3600)
    secure = send_dialogs(a, [2], encryption=True)
    with a.engine.connect() as conn:
        waiting = conn.execute(
            text("SELECT count(*) FROM broker_transmission_queue WHERE conversation_handle = :h"),
            {"h": secure[0]},
        ).scalar_one()
    assert waiting == 2  # in the transmission queue, for the Python pass
    with a.engine.connect() as conn:
        me = a.instance_id_on(conn)
        routes = job.routes_of(a, conn)
    planned = transforms.conversation_plan(
        jdbc.read_conversations(spark, a.engine.url, due_by=None),
        routes=routes,
        me=me,
        now=datetime.now(UTC),
        hosted=[],
    )
    chosen = planned.where(planned.outcome == "remote")
    columns = [*transforms.PENDING_COLUMNS, *transforms.PLAN_COLUMNS]

    def rows(own_columns: bool) -> list[tuple[Any, ...]]:
        pending = jdbc.read_pending(
            spark,
            a.engine.url,
            due_by=None,
            partitions=3,
            by_conversation=True,
            own_columns=own_columns,
        )
        if own_columns:
            assert set(pending.columns) == set(transforms.MESSAGE_COLUMNS)
        # The read itself leaves the secure dialog's rows, not only the join to the plan.
        read = {r.conversation_handle for r in pending.select("conversation_handle").collect()}
        assert read == {str(h) for h in plain}, own_columns
        return sorted(
            tuple(r) for r in transforms.with_plan(pending, chosen).select(*columns).collect()
        )

    full, own = rows(False), rows(True)
    assert own == full
    assert len(own) == sum(1 + i % 4 for i in range(20)) + 3


@pytest.mark.parametrize("new_db", ["sqlite", "postgres"], indirect=True)
def test_end_dialog_takes_the_general_path_and_ends_the_far_side(
    spark: SparkSession, network: Network
) -> None:
    net = network("a", "b")
    two_way(net)
    a, b = net["a"], net["b"]
    handles = send_dialogs(a, [2, 2, 2])
    with a.transaction() as tx:
        tx.end_conversation(handles[0])
    report = job.run(a, spark)
    assert report.read == 7 and report.acknowledged == 7
    assert report.general == 3  # the ended dialog's messages, EndDialog included
    msgs = drain_all(b, TARGET_QUEUE)
    ended = [m for m in msgs if m.message_type_name == END_DIALOG]
    assert len(ended) == 1 and len(msgs) == 7
    with b.transaction() as tx:
        assert tx.conversation(ended[0].conversation_handle).state == "DI"


@pytest.mark.parametrize("new_db", ["sqlite"], indirect=True)
def test_load_balancing_sends_each_dialog_where_the_python_path_would(
    spark: SparkSession, network: Network
) -> None:
    """Seed 003: two brokers host the target service; routes with broker ids; the dialog id's
    hash picks one, the same one :func:`routing.pick_broker_instance` picks."""
    net = network("a", "b", "c")
    a = net["a"]
    host_initiator(a)
    for name in ("b", "c"):
        host_target(net[name])
        a.create_route(f"to_{name}", TARGET, net.id(name), f"broker://{name}")
    handles = send_dialogs(a, [2] * 60)
    report = job.run(a, spark)
    assert report.acknowledged == 120
    with a.transaction() as tx:
        cids = {h: tx.conversation(h).conversation_id for h in handles}
    where: dict[uuid.UUID, str] = {}
    for name in ("b", "c"):
        for m in drain_all(net[name], TARGET_QUEUE):
            with net[name].transaction() as tx:
                where[tx.conversation(m.conversation_handle).conversation_id] = net.id(name)
    assert len(where) == 60
    ids = [net.id("b"), net.id("c")]
    for cid in cids.values():
        assert where[cid] == routing.pick_broker_instance(cid, ids)
    assert set(where.values()) == set(ids)


@pytest.mark.parametrize("new_db", ["sqlite"], indirect=True)
def test_an_unreachable_broker_leaves_the_messages_waiting_with_the_reason(
    spark: SparkSession, network: Network
) -> None:
    net = network("a", unreachable=("b",))
    a = net["a"]
    host_initiator(a)
    a.create_route("ToTarget", TARGET, None, "broker://b")
    send_dialogs(a, [1, 1])
    report = job.run(a, spark)
    assert report.waiting == {"unreachable": 2} and report.acknowledged == 0
    rows = a.transmission_queue()
    assert len(rows) == 2
    assert all("cannot deliver to broker://b" in r.transmission_status for r in rows)
    assert all(r.attempts == 1 for r in rows)


@pytest.mark.parametrize("new_db", ["sqlite", "postgres"], indirect=True)
@pytest.mark.parametrize(
    "classifier",
    [sales.REGION_SQL, "python:airflow_broker.examples.sales:region_service"],
    ids=["sql", "python-udf"],
)
def test_sales_requests_are_classified_by_region_to_the_regional_brokers(
    spark: SparkSession, network: Network, classifier: str
) -> None:
    """Seed 000 at volume: requests to //sales/Request go to //sales/<Region> in that region's
    database; one with no region waits, saying why."""
    net = network("hq", *(f"sales_{r}" for r in sales.REGIONS))
    hq = net["hq"]
    regions = {r: net[f"sales_{r}"] for r in sales.REGIONS}
    sales.declare(hq, regions)
    handles = sales.file_requests(hq, 90, per_conversation=2, seed=3)
    with hq.transaction() as tx:
        stray = tx.begin_dialog(
            sales.CLIENT, sales.REQUEST, contract=sales.CONTRACT, encryption=False
        )
        tx.send(stray, message_type="//sales/SalesRequest", body={"quarter": "2026Q3"})
    report = job.run(hq, spark, classifier=classifier, classify_service=sales.REQUEST)
    assert report.acknowledged == 90 and report.waiting == {"unclassified": 1}
    depths = sales.depths(regions)
    assert sum(depths.values()) == 90 and all(depths.values()), depths
    for region, broker in regions.items():
        for m in drain_all(broker, sales.queue_of(region)):
            assert m.service_name == sales.service_of(region)
            assert m.json()["region"] == region
    with hq.transaction() as tx:
        far = {tx.conversation(h).far_service for h in handles}
    assert far == {sales.service_of(r) for r in sales.REGIONS}
    [waiting] = hq.transmission_queue()
    assert "classifier named no service" in waiting.transmission_status


def test_a_password_on_the_command_line_is_refused() -> None:
    with pytest.raises(SystemExit, match="password"):
        job.source_url("postgresql+psycopg://u:secret@db/x")


@pytest.mark.parametrize("new_db", ["postgres"], indirect=True)
def test_a_conversation_past_its_lifetime_waits_with_the_reason_while_the_rest_move(
    spark: SparkSession, network: Network
) -> None:
    """The plan's summary decides whether the job looks for the conversations that wait: with
    one past its lifetime among others that move, it is found, counted and given its reason."""
    net = network("a", "b")
    a, b = net["a"], net["b"]
    host_initiator(a)
    host_target(b)
    a.create_route("ToTarget", TARGET, None, "broker://b")
    send_dialogs(a, [2, 3])
    (expired,) = send_dialogs(a, [4], lifetime_seconds=60)
    report = job.run(a, spark, now=datetime.now(UTC) + timedelta(hours=1))
    assert report.acknowledged == 5 and report.waiting == {"discard": 4}
    rows = a.transmission_queue()
    assert {r.conversation_handle for r in rows} == {expired} and len(rows) == 4
    assert all("lifetime is over" in r.transmission_status for r in rows)
    assert len(drain_all(b, TARGET_QUEUE)) == 5


def test_the_source_work_mem_must_be_a_memory_size() -> None:
    """``--source-work-mem``: a PostgreSQL memory size, or ``server`` for the server's own
    setting; anything else is refused before a connection is made, naming the value."""
    assert jdbc.checked_work_mem("64MB") == "64MB" and jdbc.checked_work_mem(None) is None
    assert job.parse_args(["--source", "a"]).source_work_mem == jdbc.SOURCE_WORK_MEM
    assert job.parse_args(["--source", "a", "--source-work-mem", "server"]).source_work_mem is None
    assert (
        job.parse_args(["--source", "a", "--source-work-mem", "256kB"]).source_work_mem == "256kB"
    )
    for bad in ("lots", "0", "64 MB", "64MB'; DROP TABLE broker_queue; --", "1TB"):
        with pytest.raises(ValueError, match="not a PostgreSQL memory size"):
            jdbc.checked_work_mem(bad)
    with pytest.raises(SystemExit):
        job.parse_args(["--source", "a", "--source-work-mem", "lots"])


@pytest.mark.parametrize("new_db", ["postgres"], indirect=True)
def test_the_source_work_mem_reaches_the_grouped_read_and_the_tasks_and_a_refused_one_moves_nothing(
    spark: SparkSession, network: Network, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's work_mem is set on the source's grouped read and in each task's reading
    transaction: a size the server refuses (below its 64kB minimum) fails the run at either,
    with the server's reason, before anything moves."""
    net = network("a", "b")
    two_way(net)
    a, b = net["a"], net["b"]
    send_dialogs(a, [3, 2])
    with pytest.raises(Exception, match="work_mem"):
        jdbc.read_conversations(spark, a.engine.url, due_by=None, work_mem="1kB").collect()
    with pytest.raises(Exception, match="work_mem"):
        job.run(a, spark, source_work_mem="1kB")
    # Only the tasks get the refused size: the grouped read keeps the server's.
    read = jdbc.read_conversations
    with monkeypatch.context() as m:
        m.setattr(
            jdbc, "read_conversations", lambda *args, **kw: read(*args, **kw | {"work_mem": None})
        )
        with pytest.raises(Exception, match="work_mem"):
            job.run(a, spark, source_work_mem="1kB")
    assert len(a.transmission_queue()) == 5
    assert drain_all(b, TARGET_QUEUE) == []
    assert job.run(a, spark).delivered == 5
    assert len(drain_all(b, TARGET_QUEUE)) == 5


def test_the_operator_passes_the_source_work_mem_to_the_job() -> None:
    from airflow_broker.operators.spark import SparkRoutingOperator

    def args(**kwargs: Any) -> list[str]:
        return list(SparkRoutingOperator(task_id="route", **kwargs).application_args or [])

    assert "--source-work-mem" not in args()
    assert args(source_work_mem="256MB")[-2:] == ["--source-work-mem", "256MB"]
    assert args(source_work_mem=None)[-2:] == ["--source-work-mem", "server"]
    assert job.parse_args(args(source_work_mem=None)).source_work_mem is None
    with pytest.raises(ValueError, match="SparkRoutingOperator: source work_mem 'lots'"):
        args(source_work_mem="lots")
