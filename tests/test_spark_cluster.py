"""The Spark routing job on a Spark standalone cluster (issue 42), from Airflow.

A master and a worker run from the PySpark installation (tests/support/spark_cluster.py); the
worker's environment has no ``airflow_broker`` (its ``PYSPARK_PYTHON`` is Debian's Python, its
``PATH`` leaves out the virtual environment). A DAG run on a real scheduler submits the job to
``spark://`` twice, as a user would:

- ``route``: :class:`SparkRoutingOperator` with a ``python:`` classifier (a Python UDF on the
  executors, in a module shipped with ``py_files``), PostgreSQL to PostgreSQL: each Spark task
  writes into the far brokers with psycopg and pyarrow (``spark/direct_task.py``);
- ``transmit``: the transmitter (:class:`TransmitOperator`) finds a backlog above its
  ``spark_threshold`` and hands it to the job, without a classifier: each Spark task streams
  the messages from the source into the far brokers (``spark/direct_stream.py``).

Both ship the executors' Python as a packed virtual environment in ``archives``
(``env.tar.gz#environment``) and name ``./environment/bin/python`` as the executors' Python, a
path that exists only where Spark unpacked the archive. The classifier records where it ran:
the executors' ``sys.prefix`` is the unpacked archive in the worker's work directory, and
``airflow_broker`` was imported from there. Every message arrives once, in order, in the
region its body names.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.airflow_stack import BIN, airflow_stack
from support.spark_cluster import (
    ARCHIVE_ALIAS,
    WORKER_PYTHON,
    PackedEnv,
    SparkCluster,
    cluster_conf,
    packed_env,
    spark_cluster,
)
from transport_procs import (
    assert_exactly_once_in_order,
    by_conversation,
    conversation_ids,
    drain_all,
)

from airflow_broker import Broker
from airflow_broker.examples import sales

# With the Spark tests, not the other Airflow deployments: each half of the suite's two
# workers then carries about as much (one Airflow deployment and one Spark job at a time).
pytestmark = [pytest.mark.xdist_group("spark"), pytest.mark.timeout(900)]

DAG_ID = "spark_cluster_routing"
#: Conversations per source, and messages per conversation.
CONVERSATIONS = 1000
PER_CONVERSATION = 3
SPARK_THRESHOLD = 100

CLASSIFIER = '''\
"""The sales classifier, recording where it runs (one file per Python worker process)."""

import json
import os
import sys

RECORDS = {records!r}


def classify(body):
    import airflow_broker
    from airflow_broker.examples.sales import region_service

    path = os.path.join(RECORDS, f"{{os.getpid()}}.json")
    if not os.path.exists(path):
        with open(path, "w") as f:
            json.dump(
                {{
                    "executable": sys.executable,
                    "prefix": sys.prefix,
                    "airflow_broker": airflow_broker.__file__,
                    "cwd": os.getcwd(),
                }},
                f,
            )
    return region_service(body)
'''

DAG = """\
import pendulum
from airflow.sdk import DAG

from airflow_broker.operators.spark import SparkRoutingOperator
from airflow_broker.operators.transmit import TransmitOperator

ARCHIVES = {archives!r}
CONF = {conf!r}

with DAG(
    {dag_id!r},
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
):
    route = SparkRoutingOperator(
        task_id="route",
        broker_conn_id="hq_udf",
        classifier="python:broker_cluster_classifier:classify",
        classify_service={request!r},
        conn_id="spark_cluster",
        archives=ARCHIVES,
        py_files={classifier!r},
        conf=CONF,
        partitions=2,
    )
    transmit = TransmitOperator(
        task_id="transmit",
        broker_conn_id="hq_direct",
        spark_threshold={threshold!r},
        spark_conn_id="spark_cluster",
        spark_kwargs={{"archives": ARCHIVES, "conf": CONF, "partitions": 2}},
    )
    route >> transmit
"""


@pytest.fixture(scope="session")
def executor_env() -> PackedEnv:
    """The executors' packed environment, built once (cached across sessions)."""
    return packed_env()


@pytest.fixture(scope="session")
def standalone_spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    # The executors' environment is built (when not cached) while the JVMs start.
    with spark_cluster(tmp_path_factory.mktemp("spark_cluster"), meanwhile=packed_env) as cluster:
        yield cluster


def _broker_conn(url: str) -> str:
    return json.dumps({"conn_type": "broker", "extra": {"url": url}})


def _file(hq: Broker, to_service: Callable[[str], str], seed: int) -> list[Any]:
    """:data:`CONVERSATIONS` conversations of :data:`PER_CONVERSATION` messages
    ``{"region", "n"}``, each about one region (at random), to ``to_service(region)``; one
    batched SEND per region and message number. The conversation handles."""
    rng = random.Random(seed)
    handles: list[Any] = []
    for start in range(0, CONVERSATIONS, 500):
        regions = [rng.choice(sales.REGIONS) for _ in range(min(500, CONVERSATIONS - start))]
        with hq.transaction() as tx:
            new = [
                tx.begin_dialog(
                    sales.CLIENT, to_service(r), contract=sales.CONTRACT, encryption=False
                )
                for r in regions
            ]
            for region in sales.REGIONS:
                mine = [h for h, r in zip(new, regions, strict=True) if r == region]
                for n in range(PER_CONVERSATION):
                    if mine:
                        tx.send(
                            mine, message_type=sales.REQUEST_TYPE, body={"region": region, "n": n}
                        )
        handles += new
    return handles


def _reports(af: Any, task_id: str) -> list[dict[str, Any]]:
    rows = af.query(
        "SELECT value FROM xcom WHERE dag_id = :d AND task_id = :t AND key = 'return_value'",
        d=DAG_ID,
        t=task_id,
    )
    return [v if isinstance(v, dict) else json.loads(v) for (v,) in rows]


def test_the_operator_and_the_transmitter_route_on_a_standalone_cluster(
    tmp_path: Path,
    make_pg_database: Callable[..., str],
    standalone_spark: SparkCluster,
    executor_env: PackedEnv,
) -> None:
    cluster = standalone_spark
    urls = {"hq_udf": make_pg_database(), "hq_direct": make_pg_database()}
    urls |= {f"sales_{r}": make_pg_database() for r in sales.REGIONS}
    brokers = {name: Broker.connect(url) for name, url in urls.items()}
    regions = {r: brokers[f"sales_{r}"] for r in sales.REGIONS}
    sales.declare(brokers["hq_udf"], regions)
    sales.declare(brokers["hq_direct"], regions)
    seeding = time.monotonic()
    # To the classified service (the classifier picks the region), and straight to a region.
    classified = _file(brokers["hq_udf"], lambda region: sales.REQUEST, seed=1)
    direct = _file(brokers["hq_direct"], sales.service_of, seed=2)
    print(f"seeding: {time.monotonic() - seeding:.1f} s")
    for b in brokers.values():
        b.dispose()  # no idle connections held while the jobs run: the server's are shared
    assert len(classified) == len(direct) == CONVERSATIONS

    records = tmp_path / "records"
    records.mkdir()
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    classifier = shipped / "broker_cluster_classifier.py"
    classifier.write_text(CLASSIFIER.format(records=str(records)))
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "spark_cluster_routing.py").write_text(
        DAG.format(
            archives=executor_env.spark_archives,
            conf=cluster_conf(),
            dag_id=DAG_ID,
            request=sales.REQUEST,
            classifier=str(classifier),
            threshold=SPARK_THRESHOLD,
        )
    )
    env = {
        "AIRFLOW_CONN_SPARK_CLUSTER": json.dumps(
            {"conn_type": "spark", "host": "spark://127.0.0.1", "port": cluster.port}
        ),
        **{f"AIRFLOW_CONN_{name.upper()}": _broker_conn(url) for name, url in urls.items()},
    }
    started = time.monotonic()
    with airflow_stack(
        tmp_path, dags, components=("api-server", "scheduler", "dag-processor"), extra_env=env
    ) as af:
        af.wait_for_dags(DAG_ID)
        af.airflow("dags", "trigger", DAG_ID)
        af.wait_for(
            f"the {DAG_ID} run to finish",
            lambda: [r for r in af.runs(DAG_ID) if r.state in ("success", "failed")],
            timeout=600,
            every=2,
        )
        [run] = af.runs(DAG_ID)
        logs = "\n".join(
            p.read_text(errors="replace") for p in (af.home / "logs").rglob("*") if p.is_file()
        )
        assert run.state == "success", f"{logs[-8000:]}\n{cluster.executor_logs()[-4000:]}"
        transmitted = _reports(af, "transmit")
    print(f"DAG run on the cluster: {time.monotonic() - started:.1f} s")

    # Both jobs went to the standalone master, with the archive, and ran there.
    assert logs.count(f"--master {cluster.master_url}") >= 2, logs[-4000:]
    assert logs.count(f"--archives {executor_env.spark_archives}") >= 2
    assert logs.count("AIRFLOW_BROKER_SPARK_REPORT") >= 2
    apps = cluster.state()["completedapps"]
    # (named by the job's session, jdbc.session: the operator's ``name`` does not reach it)
    routing = [a for a in apps if a["name"] == "airflow-broker routing"]
    assert len(routing) == 2, apps
    unpacked = {
        p.parents[3].name for p in cluster.work_dir.glob(f"app-*/*/{ARCHIVE_ALIAS}/bin/python")
    }
    assert unpacked == {a["id"] for a in routing}, unpacked
    # The transmitter handed its whole backlog to Spark: its own pass had nothing left.
    [report] = transmitted
    assert report["spark_runs"] == 1 and report["delivered"] == 0, report
    assert report["left_waiting"] == 0, report

    # The Python UDF ran on the executors, from the unpacked archive, not from this venv.
    seen = [json.loads(p.read_text()) for p in records.glob("*.json")]
    assert seen, "the classifier never ran"
    work = str(cluster.work_dir.resolve())
    for where in seen:
        prefix = where["prefix"]
        assert prefix.startswith(work) and prefix.endswith(f"/{ARCHIVE_ALIAS}"), where
        assert where["airflow_broker"].startswith(f"{prefix}/lib/"), where
        assert where["executable"] == f"{prefix}/bin/python", where

    # Every message arrived once, in order, in its region.
    brokers = {name: Broker.connect(url) for name, url in urls.items()}
    regions = {r: brokers[f"sales_{r}"] for r in sales.REGIONS}
    expected: dict[uuid.UUID, range] = {}
    for name, handles in (("hq_udf", classified), ("hq_direct", direct)):
        assert brokers[name].transmission_queue() == []
        ids = conversation_ids(brokers[name], handles)
        expected |= {ids[h]: range(PER_CONVERSATION) for h in handles}
    got: dict[uuid.UUID, list[Any]] = {}
    for region, broker in regions.items():
        received = by_conversation(broker, drain_all(broker, sales.queue_of(region)))
        for msgs in received.values():
            assert {m.json()["region"] for m in msgs} == {region}
        got |= received
    assert sum(len(m) for m in got.values()) == 2 * CONVERSATIONS * PER_CONVERSATION
    assert_exactly_once_in_order(got, expected, "the regions")
    for b in brokers.values():
        b.dispose()


def test_without_the_archive_the_executors_cannot_run_the_job(
    tmp_path: Path, standalone_spark: SparkCluster
) -> None:
    """What the archive is for: the Python the worker has cannot import the engine."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from pyspark.sql import SparkSession\n"
        "s = SparkSession.builder.getOrCreate()\n"
        "def f(_):\n"
        "    import airflow_broker.spark.direct_task\n"
        "    yield 1\n"
        "print(s.sparkContext.parallelize([1], 1).mapPartitions(f).collect())\n"
    )
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        [
            str(BIN / "spark-submit"), "--master", standalone_spark.master_url,
            "--conf", f"spark.pyspark.python={WORKER_PYTHON}",
            "--conf", f"spark.pyspark.driver.python={sys.executable}",
            "--conf", "spark.executor.memory=512m", "--conf", "spark.task.maxFailures=1",
            "--conf", "spark.ui.enabled=false", str(probe),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    assert "No module named 'airflow_broker'" in done.stdout + done.stderr
