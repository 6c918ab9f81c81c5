"""The broker's metrics (airflow_broker.metrics): what the engine counts, on both engines, and
that they reach a real StatsD listener through Airflow's Stats when Airflow's metrics are on."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from helpers import (
    BUYER,
    BUYER_QUEUE,
    NOTE,
    SUPPLIER_QUEUE,
    Recorder,
    begin,
    declare_pair,
    poison,
    receive,
    send,
)

from airflow_broker import Broker, metrics
from airflow_broker.constants import DEFAULT
from airflow_broker.operations import sampling

TESTS = Path(__file__).parent


class Failed(Exception):
    pass


# -- the engine's counts, through a recording sink ---------------------------------------------


def test_no_sink_no_metrics_work(broker: Broker) -> None:
    assert metrics.installed() is None and not metrics.enabled()
    declare_pair(broker)
    send(broker, begin(broker), NOTE, "a")
    with broker.transaction() as tx:
        assert len(tx.receive(SUPPLIER_QUEUE)) == 1
        assert tx._received == {}  # nothing counted per queue while metrics are off
    metrics.gauge("x", 1)  # no sink: nothing happens
    metrics.incr("x")


def test_sent_and_received_count_on_commit(broker: Broker, recorder: Recorder) -> None:
    declare_pair(broker)
    h = begin(broker)
    send(broker, h, NOTE, "a", "b", "c")
    assert recorder.calls == [("incr", metrics.MESSAGES_SENT, 3, None)]
    with pytest.raises(Failed), broker.transaction() as tx:  # rolled back: sent nothing
        tx.send(h, NOTE, "lost")
        raise Failed
    with pytest.raises(Failed), broker.transaction() as tx:  # rolled back: received nothing
        tx.receive(SUPPLIER_QUEUE, top=1)
        raise Failed
    assert recorder.total(metrics.MESSAGES_SENT) == 3
    assert recorder.total(metrics.MESSAGES_RECEIVED) == 0
    with broker.transaction() as tx:
        got = tx.receive(SUPPLIER_QUEUE)
        tx.send(got[0].conversation_handle, NOTE, "answer")
    assert recorder.calls[-2:] == [
        ("incr", metrics.MESSAGES_SENT, 1, None),
        ("incr", metrics.MESSAGES_RECEIVED, 3, {"queue": SUPPLIER_QUEUE}),
    ]
    assert receive(broker, BUYER_QUEUE)
    assert recorder.calls[-1] == ("incr", metrics.MESSAGES_RECEIVED, 1, {"queue": BUYER_QUEUE})


def test_a_queue_disabled_by_poison_handling_counts(broker: Broker, recorder: Recorder) -> None:
    declare_pair(broker)
    poison(broker)
    assert [c for c in recorder.calls if c[1] == metrics.QUEUES_DISABLED] == [
        ("incr", metrics.QUEUES_DISABLED, 1, {"queue": SUPPLIER_QUEUE})
    ]


def test_a_dead_lettered_conversation_counts(broker: Broker, recorder: Recorder) -> None:
    declare_pair(broker)
    broker.create_queue("dead_letters")
    broker.alter_queue(SUPPLIER_QUEUE, max_receives=2, dead_letter_queue="dead_letters")
    send(broker, begin(broker), NOTE, b"poison")
    for _ in range(2):
        with pytest.raises(Failed), broker.transaction() as tx:
            assert tx.receive(SUPPLIER_QUEUE)
            raise Failed
    assert [c for c in recorder.calls if c[1] == metrics.DEAD_LETTERED] == [
        ("incr", metrics.DEAD_LETTERED, 1, {"queue": SUPPLIER_QUEUE})
    ]


def test_completed_leases_count_as_received_on_commit(broker: Broker, recorder: Recorder) -> None:
    declare_pair(broker)
    send(broker, begin(broker), NOTE, b"a", b"b")
    lease = broker.lease(SUPPLIER_QUEUE, lease_seconds=60)
    assert lease is not None
    with pytest.raises(Failed), broker.transaction() as tx:
        tx.complete(lease.token)
        raise Failed
    assert recorder.total(metrics.MESSAGES_RECEIVED) == 0
    with broker.transaction() as tx:
        tx.complete(lease.token)
    assert recorder.calls[-1] == ("incr", metrics.MESSAGES_RECEIVED, 2, {"queue": SUPPLIER_QUEUE})


def test_delivery_failures_count(broker: Broker, recorder: Recorder, tmp_path: Path) -> None:
    """A far broker that cannot be reached (transport_failed, the messages wait), and one that
    refuses the conversation (delivery_failed: it fails with an Error)."""
    declare_pair(broker)
    far = Broker.connect(f"sqlite:///{tmp_path / 'far.db'}")
    far.migrate()
    far.create_queue("strict_queue")
    far.create_service("//far/Missing", "strict_queue", contracts=[])  # accepts no contract
    try:
        broker.resolver = {"far": far, "nowhere": f"sqlite:///{tmp_path / 'no' / 'such.db'}"}
        broker.create_route("to_far", service_name="//far/Missing", address="broker://far")
        broker.create_route("to_nowhere", service_name="//x/Nowhere", address="broker://nowhere")
        with broker.transaction() as tx:
            lost = tx.begin_dialog(BUYER, "//x/Nowhere", contract=DEFAULT, encryption=False)
            tx.send(lost, DEFAULT, "a")
            tx.send(lost, DEFAULT, "b")
            refused = tx.begin_dialog(BUYER, "//far/Missing", contract=DEFAULT, encryption=False)
            tx.send(refused, DEFAULT, "c")
        report = broker.deliver()
        assert report.failed == 1
        assert recorder.total(metrics.TRANSPORT_FAILED) == 2
        assert recorder.total(metrics.DELIVERY_FAILED) == 1
    finally:
        far.dispose()


def test_a_failing_sink_never_fails_the_broker(broker: Broker) -> None:
    class Broken:
        def gauge(self, *args: object) -> None:
            raise RuntimeError("sink down")

        def incr(self, *args: object) -> None:
            raise RuntimeError("sink down")

    previous = metrics.install(Broken())
    try:
        declare_pair(broker)
        send(broker, begin(broker), NOTE, "a")
        assert receive(broker, SUPPLIER_QUEUE)
        assert sampling.sample_queue_depths(broker) is not None
    finally:
        metrics.install(previous)


# -- through Airflow's Stats to a real StatsD listener -----------------------------------------

SCRIPT = textwrap.dedent(
    """
    import sys

    # what every Airflow process loads: installs Airflow's Stats
    import airflow_broker.provider.plugin
    from airflow_broker import Broker, metrics
    from airflow_broker.operations import sampling
    from airflow_broker.constants import DEFAULT, POISON_THRESHOLD
    from helpers import BUYER, NOTE, SUPPLIER_QUEUE, begin, declare_pair, send

    print("sink", metrics.installed(), flush=True)
    if sys.argv[1] == "off":
        sys.exit(0)
    b = Broker.connect("sqlite:///broker.db")
    b.migrate()
    declare_pair(b)
    h = begin(b)
    send(b, h, NOTE, "a", "b", "c")
    with b.transaction() as tx:
        assert len(tx.receive(SUPPLIER_QUEUE)) == 3
    send(b, h, NOTE, "d", "e")
    sampling.sample_queue_depths(b)

    far = Broker.connect("sqlite:///far.db")
    far.migrate()
    far.create_queue("strict_queue")
    far.create_service("//far/Missing", "strict_queue", contracts=[])  # accepts no contract
    b.resolver = {"far": far, "nowhere": "sqlite:///no/such/dir/x.db"}
    b.create_route("to_far", service_name="//far/Missing", address="broker://far")
    b.create_route("to_nowhere", service_name="//x/Nowhere", address="broker://nowhere")
    with b.transaction() as tx:
        lost = tx.begin_dialog(BUYER, "//x/Nowhere", contract=DEFAULT, encryption=False)
        tx.send(lost, DEFAULT, "x")
        refused = tx.begin_dialog(BUYER, "//far/Missing", contract=DEFAULT, encryption=False)
        tx.send(refused, DEFAULT, "y")
    b.deliver()

    for _ in range(POISON_THRESHOLD):
        try:
            with b.transaction() as tx:
                tx.receive(SUPPLIER_QUEUE, top=1)
                raise RuntimeError("the reader fails")
        except RuntimeError:
            pass
    print("done", flush=True)
    """
)


def statsd_env(home: Path, port: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW__", "AIRFLOW_CONN_"))}
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home / 'airflow.db'}",
        PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    if port is not None:
        env.update(
            AIRFLOW__METRICS__STATSD_ON="True",
            AIRFLOW__METRICS__STATSD_HOST="127.0.0.1",
            AIRFLOW__METRICS__STATSD_PORT=str(port),
            AIRFLOW__METRICS__STATSD_PREFIX="brokertest",
        )
    return env


def run_script(home: Path, port: int | None) -> str:
    script = home / "emit.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), "on" if port is not None else "off"],
        env=statsd_env(home, port),
        cwd=home,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def read_statsd(sock: socket.socket) -> list[str]:
    """Every metric line received (the subprocess has exited: what it sent has arrived or is
    about to)."""
    lines: list[str] = []
    sock.settimeout(1.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65535)
        except TimeoutError:
            break
        lines += [x for x in data.decode().splitlines() if x]
    return lines


def test_metrics_reach_statsd_through_airflow_stats(tmp_path: Path) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    try:
        out = run_script(tmp_path, sock.getsockname()[1])
        assert "sink AirflowStats(" in out and "done" in out, out
        lines = read_statsd(sock)
    finally:
        sock.close()
    counters: dict[str, int] = defaultdict(int)
    gauges: dict[str, float] = {}
    for line in lines:
        name, _, rest = line.partition(":")
        value, _, kind = rest.partition("|")
        if not name.startswith("brokertest.broker."):
            continue  # Airflow's own
        if kind.startswith("c"):
            counters[name] += int(value)
        elif kind.startswith("g"):
            gauges[name] = float(value)
    assert 0 <= gauges.pop("brokertest.broker.queue_oldest_age.supplier_queue") < 60, lines
    assert gauges == {
        "brokertest.broker.queue_depth.buyer_queue": 0,
        "brokertest.broker.queue_depth.supplier_queue": 2,
        "brokertest.broker.queue_held.buyer_queue": 0,
        "brokertest.broker.queue_held.supplier_queue": 0,
        "brokertest.broker.queue_leased.buyer_queue": 0,
        "brokertest.broker.queue_leased.supplier_queue": 0,
        "brokertest.broker.queue_oldest_age.buyer_queue": 0,
        "brokertest.broker.transmission_queue.depth": 0,
        "brokertest.broker.transmission_queue.oldest_age": 0,
    }, lines
    assert dict(counters) == {
        "brokertest.broker.messages_sent": 3 + 2 + 2,
        "brokertest.broker.messages_received": 3,
        "brokertest.broker.transport_failed": 1,
        "brokertest.broker.delivery_failed": 1,
        "brokertest.broker.queues_disabled": 1,
    }, lines


def test_no_sink_when_airflow_metrics_are_off(tmp_path: Path) -> None:
    out = run_script(tmp_path, None)
    assert "sink None" in out, out


def test_queue_names_in_metric_names_are_stable() -> None:
    name = f"q.{uuid.uuid4().hex}"
    assert metrics.queue_stat(metrics.QUEUE_DEPTH, name) == metrics.queue_stat(
        metrics.QUEUE_DEPTH, name
    )
    assert "." not in metrics.stat_part(name)
