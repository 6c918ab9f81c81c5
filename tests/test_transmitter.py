"""The transmitter run (:func:`airflow_broker.activation.transmitter.transmit`), on both engines.

The Airflow side (the trigger that starts runs, the DAG, the Spark hand-off under a scheduler) is
tested end to end in ``test_e2e_transmitter.py``; here the run itself: it delivers until nothing
is due, waits out an unreachable peer without losing anything, does due work and housekeeping,
and runs once per database at a time, even across processes and kills.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import transport_procs as tp
from transport_procs import (
    INIT_QUEUE,
    TARGET_QUEUE,
    UNREACHABLE_URL,
    assert_exactly_once_in_order,
    by_conversation,
    conversation_ids,
    drain_all,
    send_dialogs,
    two_way,
)

from airflow_broker import DIALOG_TIMER, Broker, InvalidDefinition
from airflow_broker.activation import transmitter as tm
from airflow_broker.storage import clock

MP = multiprocessing.get_context("spawn")


def _arrived_once_in_order(net: tp.Net, handles: list[object], count: int) -> None:
    conv_of = conversation_ids(net["a"], handles)  # type: ignore[arg-type]
    expected = {conv_of[h]: range(count) for h in handles}  # type: ignore[index]
    got = by_conversation(net["b"], drain_all(net["b"], TARGET_QUEUE))
    assert_exactly_once_in_order(got, expected, "b")


def test_a_run_delivers_everything_due_exactly_once_in_order(
    network: Callable[..., tp.Net],
) -> None:
    net = network("a", "b")
    two_way(net)
    handles = send_dialogs(net["a"], [20] * 10)
    before = tm.backlog(net["a"])
    assert before.due == before.waiting == 200

    report = tm.transmit(net["a"])
    assert not report.skipped and report.passes >= 1 and report.spark_runs == 0
    assert report.delivery.delivered == 200
    assert report.left == tm.Backlog()
    _arrived_once_in_order(net, handles, 20)
    # Nothing was due any more: a second run makes one pass that moves nothing.
    again = tm.transmit(net["a"])
    assert again.passes == 1 and again.delivery.delivered == 0


def test_an_unreachable_peer_is_waited_for_and_nothing_is_lost(
    network: Callable[..., tp.Net],
) -> None:
    net = network("a", "b")
    two_way(net)
    handles = send_dialogs(net["a"], [5] * 4)
    real = net["a"].resolver["b"]  # type: ignore[index]
    net["a"].resolver["b"] = UNREACHABLE_URL  # type: ignore[index]
    try:
        down = tm.transmit(net["a"])
    finally:
        net["a"].resolver["b"] = real  # type: ignore[index]
    # The run ended: nothing is due, everything waits for its next retry.
    assert down.delivery.delivered == 0
    assert down.left.waiting == 20 and down.left.due == 0
    assert down.left.next_attempt_at is not None
    assert tm.transmit(net["a"]).delivery.delivered == 0  # not due yet
    try:
        clock.advance(3600)
        up = tm.transmit(net["a"])
    finally:
        clock.reset()
    assert up.delivery.delivered == 20 and up.left.waiting == 0
    _arrived_once_in_order(net, handles, 5)


def test_a_large_backlog_goes_to_spark_and_the_rest_to_the_python_pass(
    network: Callable[..., tp.Net],
) -> None:
    net = network("a", "b")
    two_way(net)
    handles = send_dialogs(net["a"], [3] * 5)
    seen: list[tm.Backlog] = []

    def spark(backlog: tm.Backlog) -> None:
        # Stands in for spark-submit only as the hand-off: what the job does is tested in
        # test_spark_job.py and under a scheduler in test_e2e_transmitter.py.
        seen.append(backlog)

    report = tm.transmit(net["a"], spark=spark, spark_threshold=15)
    assert [b.due for b in seen] == [15] and report.spark_runs == 1
    assert report.delivery.delivered == 15  # the Python pass took what the "job" left
    _arrived_once_in_order(net, handles, 3)
    below = tm.transmit(net["a"], spark=spark, spark_threshold=16)
    assert below.spark_runs == 0


def test_a_run_fires_due_timers_of_queues_nobody_reads(network: Callable[..., tp.Net]) -> None:
    net = network("a", "b")
    two_way(net)
    (h,) = send_dialogs(net["a"], [1])
    with net["a"].transaction() as tx:
        tx.begin_conversation_timer(h, 1)
    try:
        clock.advance(5)
        tm.transmit(net["a"])
    finally:
        clock.reset()
    got = drain_all(net["a"], INIT_QUEUE)
    assert [m.message_type_name for m in got] == [DIALOG_TIMER]


def test_a_run_purges_what_is_past_its_retention(broker: Broker) -> None:
    from airflow_broker.messaging.events import record_event
    from airflow_broker.operations.housekeeping import Retention

    with broker.engine.begin() as conn:
        record_event(conn, "test_event", "x", "old enough to go")
    tm.transmit(broker, retention=Retention(events=timedelta(0)))
    assert broker.events() == []


def test_one_transmitter_per_database(broker: Broker) -> None:
    assert not tm.transmitter_running(broker)
    with tm.transmitter_lock(broker) as got:
        assert got
        assert tm.transmitter_running(broker)
        other = Broker.connect(str(broker.engine.url.render_as_string(hide_password=False)))
        try:
            report = tm.transmit(other)
        finally:
            other.dispose()
        assert report.skipped and report.passes == 0
    assert not tm.transmitter_running(broker)


def _hold_the_lock(url: str) -> None:
    broker = Broker.connect(url)
    with tm.transmitter_lock(broker) as got:
        assert got
        print("holding", flush=True)
        time.sleep(600)


def test_a_killed_transmitter_does_not_block_the_next(broker_url: str) -> None:
    broker = Broker.connect(broker_url)
    proc = MP.Process(target=_hold_the_lock, args=(broker_url,), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while not tm.transmitter_running(broker):
            assert time.monotonic() < deadline, "the child never took the lock"
            assert proc.is_alive()
            time.sleep(0.1)
        assert tm.transmit(broker).skipped
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        deadline = time.monotonic() + 10
        while tm.transmitter_running(broker):
            assert time.monotonic() < deadline, "the dead transmitter's lock was never freed"
            time.sleep(0.1)
        assert not tm.transmit(broker).skipped
    finally:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
        broker.dispose()


@pytest.mark.parametrize("threshold", [0, -1])
def test_the_threshold_is_checked(broker: Broker, threshold: int) -> None:
    with pytest.raises(InvalidDefinition, match="spark_threshold"):
        tm.transmit(broker, spark=lambda b: None, spark_threshold=threshold)


def test_a_watcher_starts_one_run_at_a_time(network: Callable[..., tp.Net]) -> None:
    net = network("a", "b")
    two_way(net)
    a = net["a"]
    assert tm.watch(a)[0] is None  # nothing due
    send_dialogs(a, [2] * 3)
    fire, seen = tm.watch(a)
    assert fire is not None and fire.due == seen.due == 6 and fire.fires == 1
    assert fire.payload()["due"] == 6
    # Fired: not again until that run has started and ended (or never started in time).
    assert tm.watch(a)[0] is None
    assert tm.watch(a, start_timeout=30)[0] is None
    lost = tm.watch(a, start_timeout=0)[0]  # that run never started
    assert lost is not None and lost.fires == 2
    # A run that takes the lock and ends lets the next look fire at once.
    with tm.transmitter_lock(a):
        send_dialogs(a, [1])
        assert tm.watch(a)[0] is None  # running
    tm.transmit(a)
    assert tm.watch(a)[0] is None  # it delivered everything: nothing due
    send_dialogs(a, [1])
    again = tm.watch(a)[0]
    assert again is not None and again.fires == 3


def test_two_watchers_fire_once(network: Callable[..., tp.Net]) -> None:
    net = network("a", "b")
    two_way(net)
    send_dialogs(net["a"], [1])
    other = Broker.connect(net.urls["a"], resolver=dict(net.resolver))
    try:
        fires = [tm.watch(b)[0] for b in (net["a"], other)]
    finally:
        other.dispose()
    assert sum(f is not None for f in fires) == 1
