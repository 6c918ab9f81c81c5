"""The Spark job's pure transforms against expected DataFrames with explicit schemas."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from airflow_broker import routing
from airflow_broker.examples import sales
from airflow_broker.routing import Route
from airflow_broker.spark import transforms

pytestmark = [pytest.mark.xdist_group("spark"), pytest.mark.timeout(300)]

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)
ME = "00000000-0000-0000-0000-00000000000a"
B1 = "00000000-0000-0000-0000-0000000000b1"
B2 = "00000000-0000-0000-0000-0000000000b2"


def assertDataFrameEqual(got: DataFrame, expected: DataFrame) -> None:
    """Same column names and types, same rows in any order. (pyspark.testing's version imports
    pyspark.pandas, which does not load beside pandas 3.)"""
    assert [(f.name, f.dataType) for f in got.schema.fields] == [
        (f.name, f.dataType) for f in expected.schema.fields
    ]
    assert sorted(map(repr, got.collect())) == sorted(map(repr, expected.collect()))


def pending(spark: SparkSession, rows: list[dict[str, Any]]) -> DataFrame:
    """Pending rows with defaults for what a test does not care about."""
    defaults: dict[str, Any] = {
        "id": 0,
        "conversation_handle": None,
        "conversation_id": None,
        "is_initiator": True,
        "from_service_name": "//from",
        "to_service_name": "//to",
        "bound_instance": None,
        "service_contract_name": "DEFAULT",
        "message_type_name": "DEFAULT",
        "message_sequence_number": 0,
        "validation": "N",
        "message_body": None,
        "lifetime_epoch": None,
        "hops": 0,
    }
    full = []
    for i, row in enumerate(rows):
        r = {**defaults, "id": i, **row}
        cid = r["conversation_id"] or str(uuid.uuid5(uuid.NAMESPACE_URL, f"c{i}"))
        r["conversation_id"] = cid
        r["conversation_handle"] = r["conversation_handle"] or cid
        full.append(tuple(r[c] for c in transforms.PENDING_COLUMNS))
    return spark.createDataFrame(full, transforms.pending_schema())


def test_canonical_uuid_reads_both_databases_forms(spark: SparkSession) -> None:
    u = uuid.UUID("6F9619FF-8B86-D011-B42D-00C04FC964FF")
    schema = T.StructType([T.StructField("raw", T.StringType(), False)])
    df = spark.createDataFrame([(u.hex,), (str(u).upper(),), (str(u),)], schema)
    got = df.select(transforms.canonical_uuid(F.col("raw")).alias("id"))
    expected = spark.createDataFrame(
        [(str(u),)] * 3, T.StructType([T.StructField("id", T.StringType(), False)])
    )
    assertDataFrameEqual(got, expected)


def test_dialog_bucket_is_the_python_hash(spark: SparkSession) -> None:
    ids = [str(uuid.UUID(int=(i * 7919) ** 5 % (1 << 128))) for i in range(300)]
    rows = [(d, n) for d in ids for n in (1, 2, 3, 7)]
    schema = T.StructType(
        [T.StructField("id", T.StringType(), False), T.StructField("n", T.IntegerType(), False)]
    )
    df = spark.createDataFrame(rows, schema)
    got = df.select("id", "n", transforms.dialog_bucket(F.col("id"), F.col("n")).alias("bucket"))
    expected = spark.createDataFrame(
        [(d, n, routing.dialog_bucket(d, n)) for d, n in rows],
        T.StructType([*schema.fields, T.StructField("bucket", T.IntegerType(), True)]),
    )
    assertDataFrameEqual(got, expected)


def test_forwarding_rules_discard_past_the_hop_limit_and_the_lifetime(
    spark: SparkSession,
) -> None:
    past = (NOW - timedelta(seconds=1)).timestamp()
    future = (NOW + timedelta(hours=1)).timestamp()
    df = pending(
        spark,
        [
            {"hops": routing.MAX_HOPS - 1},
            {"hops": routing.MAX_HOPS},
            {"lifetime_epoch": past},
            {"lifetime_epoch": future},
            {"lifetime_epoch": NOW.timestamp()},
        ],
    )
    got = transforms.forwarding_rules(df, NOW).select("id", "discard")
    expected = spark.createDataFrame(
        [(0, None), (1, "hops"), (2, "lifetime"), (3, None), (4, "lifetime")],
        T.StructType(
            [
                T.StructField("id", T.LongType(), False),
                T.StructField("discard", T.StringType(), True),
            ]
        ),
    )
    assertDataFrameEqual(got, expected)
    # The same rules as the Python forwarder's.
    assert routing.hops_exceeded(routing.MAX_HOPS) and not routing.hops_exceeded(
        routing.MAX_HOPS - 1
    )
    assert routing.lifetime_over(NOW, NOW)


def classify_case(spark: SparkSession) -> DataFrame:
    one, two, three, bound = (str(uuid.uuid5(uuid.NAMESPACE_DNS, n)) for n in "1234")
    return pending(
        spark,
        [
            # conversation one: its first message names the east region; the second follows
            {"conversation_id": one, "message_sequence_number": 1, "message_body": b'{"r":"x"}'},
            {
                "conversation_id": one,
                "message_sequence_number": 0,
                "message_body": b'{"region": "east"}',
            },
            # conversation two: west
            {"conversation_id": two, "message_body": b'{"region": "west"}'},
            # conversation three: names nothing
            {"conversation_id": three, "message_body": b'{"nothing": 1}'},
            # already bound to a broker: not classified again
            {"conversation_id": bound, "bound_instance": B1, "message_body": b'{"region":"x"}'},
            # another service: not classified
            {"to_service_name": "//other", "message_body": b'{"region": "east"}'},
        ],
    )


CLASSIFIED_SCHEMA = T.StructType(
    [
        T.StructField("id", T.LongType(), False),
        T.StructField("to_service_name", T.StringType(), True),
        T.StructField("classified", T.StringType(), True),
        T.StructField("unclassified", T.BooleanType(), True),
    ]
)
CLASSIFIED = [
    (0, "//sales/East", "//sales/East", False),
    (1, "//sales/East", "//sales/East", False),
    (2, "//sales/West", "//sales/West", False),
    (3, "//to", None, True),
    (4, "//to", None, False),
    (5, "//other", None, False),
]


@pytest.mark.parametrize(
    "spec",
    [sales.REGION_SQL, "python:airflow_broker.examples.sales:region_service"],
    ids=["sql", "python-udf"],
)
def test_classify_routes_new_conversations_by_their_first_message(
    spark: SparkSession, spec: str
) -> None:
    got = transforms.classify(classify_case(spark), spec, "//to")
    assertDataFrameEqual(
        got.select("id", "to_service_name", "classified", "unclassified"),
        spark.createDataFrame(CLASSIFIED, CLASSIFIED_SCHEMA),
    )


def test_a_bad_classifier_fails_on_the_driver_with_the_reason(spark: SparkSession) -> None:
    from airflow_broker.errors import InvalidDefinition

    with pytest.raises(InvalidDefinition, match="no_such_module"):
        transforms.classify(classify_case(spark), "python:no_such_module:f", "//to")


def test_route_joins_each_message_to_its_conversations_decision(spark: SparkSession) -> None:
    routes = [
        Route("to b1", "//lb", B1, "broker://b1"),
        Route("to b2", "//lb", B2, "broker://b2"),
        Route("mirrored", "//m", None, "broker://p", mirror_address="broker://mirror"),
        Route("gone", "//expired", None, "broker://x", expires_at=NOW - timedelta(seconds=1)),
        Route("AutoCreatedLocal", None, None, routing.LOCAL),
    ]
    ids = [str(uuid.uuid5(uuid.NAMESPACE_OID, str(i))) for i in range(40)]
    rows = [{"conversation_id": d, "to_service_name": "//lb"} for d in ids]
    rows += [
        {"to_service_name": "//m"},
        {"to_service_name": "//expired"},
        {"to_service_name": "//here"},
        {"to_service_name": "//lb", "bound_instance": ME},
        {"to_service_name": "//lb", "bound_instance": B2},
    ]
    df = transforms.with_canonical_ids(pending(spark, rows))
    decisions = transforms.decision_table(
        spark, transforms.decision_keys(df), routes, me=ME, now=NOW, hosted=["//here"]
    )
    got = transforms.route(df, decisions).select(
        "id", "kind", "addresses", "target_instance", "step"
    )
    expected_rows = []
    for i, d in enumerate(ids):
        b = routing.pick_broker_instance(d, [B1, B2])
        expected_rows.append((i, "remote", [f"broker://{'b1' if b == B1 else 'b2'}"], b, 3))
    n = len(ids)
    expected_rows += [
        (n, "remote", ["broker://p", "broker://mirror"], None, 2),
        (n + 1, "remote", ["LOCAL"], None, 5)[:0] or (n + 1, "delayed", [], None, 5),
        (n + 2, "local", ["LOCAL"], None, 5),
        (n + 3, "local", ["LOCAL"], ME, 5),
        (n + 4, "remote", ["broker://b2"], B2, 1),
    ]
    schema = T.StructType(
        [
            T.StructField("id", T.LongType(), False),
            T.StructField("kind", T.StringType(), False),
            T.StructField("addresses", T.ArrayType(T.StringType(), False), False),
            T.StructField("target_instance", T.StringType(), True),
            T.StructField("step", T.IntegerType(), False),
        ]
    )
    assertDataFrameEqual(got, spark.createDataFrame(expected_rows, schema))
    # Both broker ids are used: the hash splits the dialogs.
    assert {r[3] for r in expected_rows[:n]} == {B1, B2}


def test_conversations_summarize_each_conversation_by_sequence_number(
    spark: SparkSession,
) -> None:
    """One row per conversation: its lowest row id, first and last sequence numbers, message
    count and (for a classifier) the first message's body by sequence number, not by row id."""
    a, b = (str(uuid.uuid5(uuid.NAMESPACE_URL, name)) for name in ("a", "b"))
    df = pending(
        spark,
        [
            {"conversation_id": a, "message_sequence_number": 5, "message_body": b"third"},
            {"conversation_id": a, "message_sequence_number": 3, "message_body": b"first"},
            {"conversation_id": b, "message_sequence_number": 0, "message_body": b"only"},
            {"conversation_id": a, "message_sequence_number": 4, "message_body": b"second"},
        ],
    )
    schema = T.StructType(
        [
            T.StructField("conversation_id", T.StringType(), False),
            T.StructField("id", T.LongType(), True),
            T.StructField("message_sequence_number", T.LongType(), True),
            T.StructField("last_sequence", T.LongType(), True),
            T.StructField("messages", T.LongType(), False),
            T.StructField("message_body", T.BinaryType(), True),
        ]
    )
    columns = [f.name for f in schema.fields]
    got = transforms.conversations(df, with_body=True).select(*columns)
    expected = [(a, 0, 3, 5, 3, bytearray(b"first")), (b, 2, 0, 0, 1, bytearray(b"only"))]
    assertDataFrameEqual(got, spark.createDataFrame(expected, schema))
    # Without a classifier the bodies stay where they are.
    bare = transforms.conversations(df, with_body=False).select(*columns)
    assertDataFrameEqual(bare, spark.createDataFrame([(*r[:5], None) for r in expected], schema))


def test_with_plan_gives_each_message_its_conversations_decision(spark: SparkSession) -> None:
    """Every message of a planned conversation gets its decision and canonical ids (SQLite's
    32-digit form becomes dashed); messages of conversations not in the plan rows given are
    left out (the job passes one far broker's rows at a time)."""
    routes = [
        Route("to b1", "//east", B1, "broker://b1"),
        Route("to b2", "//west", B2, "broker://b2"),
    ]
    east, west = (uuid.uuid5(uuid.NAMESPACE_URL, name) for name in ("east", "west"))
    df = pending(
        spark,
        [
            *(
                {
                    "conversation_id": east.hex,
                    "to_service_name": "//east",
                    "message_sequence_number": n,
                }
                for n in range(3)
            ),
            {"conversation_id": str(west), "to_service_name": "//west"},
        ],
    )
    planned = transforms.conversation_plan(
        transforms.conversations(df, with_body=False), routes=routes, me=ME, now=NOW, hosted=[]
    )
    to_b1 = planned.where(F.col("target_instance") == B1)
    got = transforms.with_plan(df, to_b1).select(
        "id",
        "conversation_id",
        "conversation_handle",
        "message_sequence_number",
        "kind",
        "addresses",
        "target_instance",
        "outcome",
    )
    schema = T.StructType(
        [
            T.StructField("id", T.LongType(), False),
            T.StructField("conversation_id", T.StringType(), True),
            T.StructField("conversation_handle", T.StringType(), True),
            T.StructField("message_sequence_number", T.LongType(), False),
            T.StructField("kind", T.StringType(), False),
            T.StructField("addresses", T.ArrayType(T.StringType(), False), False),
            T.StructField("target_instance", T.StringType(), True),
            T.StructField("outcome", T.StringType(), True),
        ]
    )
    expected = [
        (n, str(east), str(east), n, "remote", ["broker://b1"], B1, "remote") for n in range(3)
    ]
    assertDataFrameEqual(got, spark.createDataFrame(expected, schema))
