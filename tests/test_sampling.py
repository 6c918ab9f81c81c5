"""Queue depth history (airflow_broker.operations.sampling): one set-based sample per queue, at most
once per interval across processes, retention in bounded batches, on SQLite and PostgreSQL."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    BUYER_QUEUE,
    NOTE,
    SUPPLIER_QUEUE,
    Recorder,
    begin,
    declare_pair,
    receive,
    send,
)
from sqlalchemy import event, func, insert, select

from airflow_broker import Broker, metrics
from airflow_broker.activation import due_step
from airflow_broker.errors import InvalidDefinition, UnknownObject
from airflow_broker.operations import monitoring as mon
from airflow_broker.operations import sampling
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow

qs = s.queue_sample


def rows(broker: Broker) -> list[tuple[str, int]]:
    """Every sample as (queue name, depth), oldest first."""
    with broker.engine.connect() as conn:
        return [
            (r.name, r.depth)
            for r in conn.execute(
                select(s.queue.c.name, qs.c.depth)
                .join(qs, qs.c.queue_id == s.queue.c.queue_id)
                .order_by(qs.c.sampled_at, s.queue.c.name)
            )
        ]


def count(broker: Broker) -> int:
    with broker.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(qs)).scalar_one())


@pytest.fixture
def pair(broker: Broker) -> Broker:
    declare_pair(broker)
    return broker


def test_one_sample_per_queue_in_one_statement(pair: Broker) -> None:
    h = begin(pair)
    send(pair, h, NOTE, "a", "b", "c")
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(pair.engine, "before_cursor_execute", seen)
    try:
        report = sampling.sample_queue_depths(pair)
    finally:
        event.remove(pair.engine, "before_cursor_execute", seen)
    assert report is not None and report.queues == 2 and report.deleted == 0
    assert rows(pair) == [(BUYER_QUEUE, 0), (SUPPLIER_QUEUE, 3)]
    inserts = [x for x in statements if x.lstrip().upper().startswith("INSERT")]
    assert len(inserts) == 1 and "GROUP BY" in inserts[0].upper()


def test_depth_counts_ready_messages_only(broker: Broker) -> None:
    """Messages a queue keeps for RETENTION (the sender's copies) are not waiting to be read."""
    declare_pair(broker, buyer_retention=True)
    send(broker, begin(broker), NOTE, "a", "b")
    with broker.engine.connect() as conn:
        kept = conn.execute(
            select(func.count())
            .select_from(s.message.join(s.queue, s.queue.c.queue_id == s.message.c.queue_id))
            .where(s.queue.c.name == BUYER_QUEUE)
        ).scalar_one()
    assert kept == 2
    sampling.sample_queue_depths(broker)
    assert rows(broker) == [(BUYER_QUEUE, 0), (SUPPLIER_QUEUE, 2)]


def test_at_most_one_pass_per_interval(pair: Broker) -> None:
    t0 = utcnow()
    assert sampling.sample_queue_depths(pair, now=t0) is not None
    assert sampling.sample_queue_depths(pair, now=t0) is None
    assert sampling.sample_queue_depths(pair, now=t0 + timedelta(seconds=14.9)) is None
    assert sampling.sample_queue_depths(pair, now=t0 - timedelta(minutes=5)) is None
    assert count(pair) == 2
    assert sampling.sample_queue_depths(pair, now=t0 + timedelta(seconds=15)) is not None
    assert count(pair) == 4
    # A shorter interval is the caller's choice.
    later = t0 + timedelta(seconds=16)
    assert sampling.sample_queue_depths(pair, now=later, min_interval=1) is not None
    assert count(pair) == 6


def test_many_processes_sample_once_per_interval(broker_url: str) -> None:
    brokers = [Broker.connect(broker_url) for _ in range(4)]
    try:
        declare_pair(brokers[0])
        barrier = threading.Barrier(len(brokers))
        results: list[Any] = []
        errors: list[BaseException] = []

        def one(b: Broker) -> None:
            try:
                barrier.wait(10)
                results.append(sampling.sample_queue_depths(b))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(b,)) for b in brokers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        assert len([r for r in results if r is not None]) == 1
        assert count(brokers[0]) == 2
    finally:
        for b in brokers:
            b.dispose()


def test_retention_deletes_old_samples_in_bounded_batches(pair: Broker) -> None:
    now = utcnow()
    with pair.engine.begin() as conn:
        ids = [r.queue_id for r in conn.execute(select(s.queue.c.queue_id))]
        conn.execute(
            insert(qs),
            [
                {"queue_id": q, "sampled_at": now - timedelta(days=8, minutes=i), "depth": i}
                for q in ids
                for i in range(25)
            ]
            + [{"queue_id": q, "sampled_at": now - timedelta(days=6), "depth": 7} for q in ids],
        )
    assert count(pair) == 52
    # 50 old rows, 4 per DELETE, at most 10 DELETEs a pass: 40 go now, the rest next time.
    report = sampling.sample_queue_depths(pair, now=now, batch=4)
    assert report is not None and report.deleted == 40
    assert count(pair) == 52 - 40 + 2
    report = sampling.sample_queue_depths(pair, now=now + timedelta(seconds=15), batch=4)
    assert report is not None and report.deleted == 10
    with pair.engine.connect() as conn:
        oldest = conn.execute(select(func.min(qs.c.depth)).where(qs.c.depth > 0)).scalar()
    assert oldest == 7  # the six-day-old samples are kept
    assert count(pair) == 2 + 2 + 2
    assert sampling.delete_old_samples(pair, now + timedelta(days=30)) == 6


def test_dropping_a_queue_drops_its_samples(broker: Broker) -> None:
    broker.create_queue("gone")
    broker.create_queue("kept")
    sampling.sample_queue_depths(broker)
    broker.drop_queue("gone")
    assert rows(broker) == [("kept", 0)]


def test_history_of_one_queue(pair: Broker) -> None:
    t0 = utcnow() - timedelta(minutes=30)
    h = begin(pair)
    for i in range(3):
        send(pair, h, NOTE, f"m{i}")
        assert sampling.sample_queue_depths(pair, now=t0 + timedelta(minutes=10 * i)) is not None
    history = mon.queue_depth_history(pair, SUPPLIER_QUEUE, 60)
    assert (history.queue, history.minutes) == (SUPPLIER_QUEUE, 60)
    assert [p.depth for p in history.samples] == [1, 2, 3]
    assert [p.at for p in history.samples] == sorted(p.at for p in history.samples)
    assert all(p.at.tzinfo is not None for p in history.samples)
    # The last 15 minutes hold only the newest sample.
    assert [p.depth for p in mon.queue_depth_history(pair, SUPPLIER_QUEUE, 15).samples] == [3]
    assert mon.queue_depth_history(pair, BUYER_QUEUE, 60).samples[-1].depth == 0
    assert mon.to_json(mon.queue_depth_history(pair, SUPPLIER_QUEUE, 15)) == {
        "queue": SUPPLIER_QUEUE,
        "minutes": 15,
        "samples": [
            {"at": history.samples[-1].at.isoformat(), "depth": 3},
        ],
    }


@pytest.mark.parametrize("minutes", [0, -1, 10081, 1.5, True, "60"])
def test_history_refuses_bad_minutes(pair: Broker, minutes: Any) -> None:
    with pytest.raises(InvalidDefinition, match="minutes"):
        mon.queue_depth_history(pair, SUPPLIER_QUEUE, minutes)


def test_history_of_an_unknown_queue(pair: Broker) -> None:
    with pytest.raises(UnknownObject, match="queue 'NoSuchQueue' does not exist"):
        mon.queue_depth_history(pair, "NoSuchQueue", 60)


def test_sample_step_throttles_per_process(pair: Broker) -> None:
    assert sampling.sample_step(pair) is not None
    assert sampling.sample_step(pair) is None  # no query at all: looked just now
    pair.next_depth_sample = 0.0
    assert sampling.sample_step(pair) is None  # looked at the database: sampled just now
    assert count(pair) == 2


def test_sample_step_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    empty = Broker.connect(f"sqlite:///{tmp_path / 'empty.db'}")
    try:
        with caplog.at_level(logging.WARNING, logger="airflow_broker"):
            assert sampling.sample_step(empty) is None
        assert "queue depth sampling failed" in caplog.text
    finally:
        empty.dispose()


def test_monitors_sample_as_they_run(pair: Broker) -> None:
    """Triggers, sensors and the in-process runner all call due_step in their loops."""
    send(pair, begin(pair), NOTE, "x")
    due_step(pair)
    assert rows(pair) == [(BUYER_QUEUE, 0), (SUPPLIER_QUEUE, 1)]
    receive(pair, SUPPLIER_QUEUE)
    due_step(pair)  # within the interval: nothing new
    assert count(pair) == 2


def test_a_pass_sets_the_depth_and_age_gauges(pair: Broker, recorder: Recorder) -> None:
    send(pair, begin(pair), NOTE, "x", "y")
    pair.create_queue("team.orders/eu")
    recorder.calls.clear()
    sampling.sample_queue_depths(pair, now=utcnow() + timedelta(seconds=60))
    gauges = {(name, value) for _, name, value, _ in recorder.calls}
    tags = {name: tag for _, name, _, tag in recorder.calls}
    ages = {name: value for name, value in gauges if "oldest_age" in name}
    assert {(n, v) for n, v in gauges if "oldest_age" not in n} == {
        ("broker.queue_depth.buyer_queue", 0),
        ("broker.queue_depth.supplier_queue", 2),
        ("broker.queue_depth.team__orders_eu", 0),
        ("broker.transmission_queue.depth", 0),
        # held and leased messages are counted apart from the depth (none here)
        ("broker.queue_held.buyer_queue", 0),
        ("broker.queue_held.supplier_queue", 0),
        ("broker.queue_held.team__orders_eu", 0),
        ("broker.queue_leased.buyer_queue", 0),
        ("broker.queue_leased.supplier_queue", 0),
        ("broker.queue_leased.team__orders_eu", 0),
    }
    assert 59 <= ages.pop("broker.queue_oldest_age.supplier_queue") < 70
    assert ages == {
        "broker.queue_oldest_age.buyer_queue": 0,
        "broker.queue_oldest_age.team__orders_eu": 0,
        "broker.transmission_queue.oldest_age": 0,
    }
    assert tags["broker.queue_oldest_age.team__orders_eu"] == {"queue": "team.orders/eu"}
    assert tags["broker.transmission_queue.depth"] is None
    recorder.calls.clear()
    assert sampling.sample_queue_depths(pair) is None
    assert recorder.calls == []


def test_the_transmission_gauges_show_what_waits_to_leave(pair: Broker, recorder: Recorder) -> None:
    pair.alter_queue(SUPPLIER_QUEUE, status=False)  # SENDs wait in the transmission queue
    send(pair, begin(pair), NOTE, "x", "y", "z")
    recorder.calls.clear()
    sampling.sample_queue_depths(pair, now=utcnow() + timedelta(seconds=120))
    gauges = {name: value for _, name, value, _ in recorder.calls}
    assert gauges["broker.transmission_queue.depth"] == 3
    assert 119 <= gauges["broker.transmission_queue.oldest_age"] < 130
    assert gauges["broker.queue_depth.supplier_queue"] == 0


def test_queue_stat_names() -> None:
    assert metrics.queue_stat("broker.queue_depth", "q1") == "broker.queue_depth.q1"
    assert metrics.queue_stat("b", "//po/Sup plier") == "b.__po_Sup_plier"
    a = metrics.queue_stat("b", "x" * 300 + "a")
    b = metrics.queue_stat("b", "x" * 300 + "b")
    assert len(a) == len(b) == metrics.MAX_NAME and a != b
