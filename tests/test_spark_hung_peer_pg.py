"""The Spark routing job with a far broker that hangs: only that broker's messages wait.

Broker A delivers with the Spark job to B, on a private cluster the test freezes (every server
process SIGSTOPped: connections neither refused nor answered, as in a partition), and to C, on
the shared server. Each test freezes B at a different point of the run:

- after the job found B answering, before its driver's statements there: they are cut at the
  answer timeout, B's conversations wait with the reason, C gets everything;
- after the driver read what the tasks need of B: the tasks cannot connect, fail with
  ``StalledError``, and again C gets everything;
- in the middle of a task's COPY (no Spark: the task's function itself): its connection is
  cut after the answer timeout without progress, and it raises ``StalledError`` instead of
  waiting for TCP.

After B thaws, the next run delivers B's messages, once each.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from support.frozen_cluster import FrozenCluster, frozen_cluster
from transport_procs import INITIATOR, drain_all, host, host_initiator, send_dialogs

from airflow_broker import Broker
from airflow_broker.spark import copy_partition, direct, jdbc, job
from airflow_broker.spark.stall import StalledError

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.xdist_group("spark"),
    pytest.mark.timeout(600),
]

SVC_B, SVC_C = "ServiceB", "ServiceC"
QUEUE_B, QUEUE_C = "queue_b", "queue_c"
#: the run's answer timeout (seconds): short, so that a hang costs the test little
ANSWER = 4.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[FrozenCluster]:
    with frozen_cluster() as c:
        yield c


@pytest.fixture
def brokers(
    cluster: FrozenCluster, postgres_server: Any
) -> Iterator[tuple[Broker, Broker, Broker]]:
    name = f"b_{uuid.uuid4().hex[:8]}"
    cluster.create_database(name)
    urls = {
        "a": postgres_server.create_database(),
        "b": cluster.url(name),
        "c": postgres_server.create_database(),
    }
    made = {n: Broker.connect(u, resolver=dict(urls)) for n, u in urls.items()}
    made["b"].migrate()
    a, b, c = made["a"], made["b"], made["c"]
    host_initiator(a)
    host(b, SVC_B, QUEUE_B)
    host(c, SVC_C, QUEUE_C)
    with a.definitions() as d:
        d.create_route("ToB", SVC_B, None, "broker://b")
        d.create_route("ToC", SVC_C, None, "broker://c")
    try:
        yield a, b, c
    finally:
        cluster.thaw()
        for broker in made.values():
            broker.dispose()


def _send(a: Broker) -> None:
    send_dialogs(a, [3] * 10, from_service=INITIATOR, to_service=SVC_B)
    send_dialogs(a, [3] * 10, from_service=INITIATOR, to_service=SVC_C)


def _statuses(a: Broker) -> list[str]:
    return [r.transmission_status or "" for r in a.transmission_queue()]


def _after_b_thaws(a: Broker, b: Broker, spark: SparkSession, cluster: FrozenCluster) -> None:
    cluster.thaw()
    time.sleep(ANSWER)  # a broker cut at its deadline is not tried again for that long
    report = job.run(a, spark, retry_now=True, answer_timeout=ANSWER)
    assert report.failed == {}, report
    assert a.transmission_queue() == []
    got = drain_all(b, QUEUE_B)
    assert (
        len(got) == 30
        and len({(m.conversation_handle, m.message_sequence_number) for m in got}) == 30
    )


def _freezing_after(
    monkeypatch: pytest.MonkeyPatch,
    module: Any,
    name: str,
    cluster: FrozenCluster,
    when: Callable[..., bool],
) -> None:
    """``module.name`` freezes the cluster after its first call for which ``when`` holds."""
    original = getattr(module, name)
    done: list[bool] = []

    def then_freeze(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if not done and when(*args, **kwargs):
            done.append(True)
            cluster.freeze()
        return out

    monkeypatch.setattr(module, name, then_freeze)


def test_the_driver_cut_at_the_answer_timeout_and_the_other_broker_served(
    brokers: tuple[Broker, Broker, Broker],
    spark: SparkSession,
    cluster: FrozenCluster,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, c = brokers
    _send(a)
    # B answered the job's look, then hangs: its prepare waits for a server that never answers.
    _freezing_after(
        monkeypatch, job, "_reachable", cluster, lambda _s, addresses: "broker://b" in addresses
    )
    started = time.monotonic()
    report = job.run(a, spark, answer_timeout=ANSWER)
    took = time.monotonic() - started
    assert cluster.frozen
    assert list(report.failed) == ["broker://b"], report
    assert "no answer from broker://b" in report.failed["broker://b"]
    assert len(drain_all(c, QUEUE_C)) == 30
    statuses = _statuses(a)
    assert len(statuses) == 30 and all("no answer from broker://b" in st for st in statuses), (
        statuses
    )
    assert took < 120, f"the run took {took:.0f} s"
    _after_b_thaws(a, b, spark, cluster)


def test_tasks_that_cannot_reach_a_hung_broker_fail_alone(
    brokers: tuple[Broker, Broker, Broker],
    spark: SparkSession,
    cluster: FrozenCluster,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, c = brokers
    _send(a)
    # The driver read what the tasks need of B; then B hangs, before the tasks connect.
    port = cluster.port
    _freezing_after(
        monkeypatch, direct, "_far", cluster, lambda target, *_: target.engine.url.port == port
    )
    report = job.run(a, spark, answer_timeout=ANSWER)
    assert cluster.frozen
    assert list(report.failed) == ["broker://b"], report
    assert "cannot connect to the far broker" in report.failed["broker://b"], report.failed
    assert len(drain_all(c, QUEUE_C)) == 30
    assert len(a.transmission_queue()) == 30
    _after_b_thaws(a, b, spark, cluster)


def test_a_task_whose_broker_hangs_mid_copy_is_cut(
    brokers: tuple[Broker, Broker, Broker], cluster: FrozenCluster
) -> None:
    _a, b, _c = brokers
    with b.engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE stall_probe (n bigint)")
    info = jdbc.conninfo(b.engine.url)
    first = pa.RecordBatch.from_pydict({"n": [1, 2, 3]})

    def batches() -> Iterator[pa.RecordBatch]:
        yield first
        cluster.freeze()  # the first batch is in; the server stops answering mid-COPY
        for _ in range(50):  # enough to fill the socket's buffers and block the write
            yield pa.RecordBatch.from_pydict({"n": list(range(100_000))})

    started = time.monotonic()
    with pytest.raises(StalledError, match="no answer from the far broker for 2 s"):
        list(
            copy_partition.copy_partition(
                info, "COPY stall_probe (n) FROM STDIN (FORMAT csv)", batches(), 2.0
            )
        )
    took = time.monotonic() - started
    assert took < 15, f"cut after {took:.1f} s"
    cluster.thaw()
    # Nothing of the cut transaction was committed.
    with psycopg.connect(info) as conn:
        assert conn.execute("SELECT count(*) FROM stall_probe").fetchone() == (0,)
