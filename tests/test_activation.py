"""Activation (seed 004): the monitor's decisions, its state in the broker database, and reader
registration, on SQLite and PostgreSQL.

The decisions are pure and checked table by table. The monitor and the readers are checked
against real broker databases: one arrival fires once however often the monitor looks, a
restarted monitor (a new one with the same key) does not fire again for messages already fired
for, racing monitors fire once between them, and readers beyond ``max_readers`` or beyond the
conversation groups with messages are refused.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from helpers import BUYER, CONTRACT, ORDER, SUPPLIER, SUPPLIER_QUEUE, declare_pair
from sqlalchemy import select, update

from airflow_broker import Broker, InvalidDefinition, QueueDisabled, UnknownObject
from airflow_broker.activation import (
    READER_TIMEOUT_SECONDS,
    START_TIMEOUT_SECONDS,
    Activation,
    Monitor,
    MonitorState,
    QueueObservation,
    ReaderSlot,
    decide,
    drain,
    finish_reader,
    readers,
    readers_to_start,
    register_reader,
    resolve_handler,
)
from airflow_broker.storage import schema as s

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)

# --------------------------------------------------------------------------- readers_to_start


@pytest.mark.parametrize(
    ("running", "groups", "depth", "previous", "max_readers", "expected", "why"),
    [
        (0, 0, 0, None, 4, 0, "empty queue"),
        (0, 1, 1, None, 4, 1, "a message arrives, no reader: start one"),
        (0, 5, 100, 100, 4, 1, "messages wait, no reader (not growing): start one"),
        (0, 3, 7, 9, 1, 1, "shrinking but nobody reads: start one"),
        (1, 5, 10, 10, 4, 0, "a reader runs, not growing: no more"),
        (1, 5, 10, None, 4, 0, "a reader runs, growth unknown: no more"),
        (1, 5, 11, 10, 4, 1, "growing, room left: one more"),
        (1, 5, 50, 10, 4, 1, "growing fast: still one per decision"),
        (3, 5, 11, 10, 4, 1, "growing, 3 of 4 run: one more"),
        (4, 5, 11, 10, 4, 0, "growing but max_readers run"),
        (5, 9, 20, 10, 4, 0, "more than max_readers (started elsewhere): none"),
        (1, 1, 11, 10, 4, 0, "growing but one group: one reader is enough"),
        (2, 2, 30, 10, 8, 0, "as many readers as groups: none"),
        (2, 3, 30, 10, 8, 1, "a group more than readers, growing: one more"),
        (0, 1, 1, 0, 1, 1, "max_readers 1: the first"),
        (1, 9, 30, 10, 1, 0, "max_readers 1: never a second"),
    ],
)
def test_readers_to_start(
    running: int,
    groups: int,
    depth: int,
    previous: int | None,
    max_readers: int,
    expected: int,
    why: str,
) -> None:
    got = readers_to_start(
        running=running,
        groups_ready=groups,
        depth=depth,
        previous_depth=previous,
        max_readers=max_readers,
    )
    assert got == expected, why


# --------------------------------------------------------------------------- decide


def obs(
    depth: int = 0,
    groups: int = 0,
    high: int | None = None,
    *,
    enabled: bool = True,
    activation: Activation | None = None,
) -> QueueObservation:
    return QueueObservation(
        queue_id=1,
        enabled=enabled,
        activation=activation or Activation(max_readers=4),
        depth=depth,
        groups_ready=groups,
        high_water=high,
        low_water=None if high is None else 1,
    )


def state(
    cursor: int = 0, last_depth: int | None = None, seen_ago: float | None = None
) -> MonitorState:
    return MonitorState(
        cursor=cursor,
        last_depth=last_depth,
        observed_at=None if seen_ago is None else NOW - timedelta(seconds=seen_ago),
    )


@pytest.mark.parametrize(
    ("mode", "o", "st", "running", "min_depth", "fire", "readers", "sample", "why"),
    [
        ("arrival", obs(1, 1, 1), state(), 0, 1, True, 1, True, "first arrival"),
        ("arrival", obs(0, 0), state(), 0, 1, False, 0, True, "nothing waits"),
        ("arrival", obs(1, 1, 1), state(1, 1, 5), 1, 1, False, 0, True, "fired, starting"),
        ("arrival", obs(9, 3, 9), state(1, 1, 5), 1, 1, True, 1, True, "grew since sample"),
        ("arrival", obs(9, 3, 9), state(1, 1, 0.2), 1, 1, False, 0, False, "grew, not sampled"),
        ("arrival", obs(9, 1, 9), state(1, 1, 5), 1, 1, False, 0, True, "grew, one group"),
        ("arrival", obs(9, 9, 9), state(1, 1, 5), 4, 1, False, 0, True, "grew, at max"),
        ("arrival", obs(3, 3, 3), state(), 0, 5, False, 0, True, "below min_depth"),
        ("arrival", obs(5, 3, 5), state(), 0, 5, True, 1, True, "min_depth reached"),
        (
            "arrival",
            obs(3, 3, 3, enabled=False),
            state(),
            0,
            1,
            False,
            0,
            True,
            "queue disabled (poison): no reader would read",
        ),
        (
            "arrival",
            obs(3, 3, 3, activation=Activation(status=False)),
            state(),
            0,
            1,
            False,
            0,
            True,
            "activation status off",
        ),
        ("depth", obs(5, 1, 5), state(0), 0, 5, True, 0, True, "depth reached"),
        ("depth", obs(4, 1, 4), state(0), 0, 5, False, 0, True, "below the depth"),
        ("depth", obs(7, 1, 7), state(7, 7, 5), 0, 5, False, 0, True, "nothing new"),
        ("depth", obs(8, 1, 8), state(7, 7, 5), 0, 5, True, 0, True, "above, and new"),
        ("growth", obs(3, 1, 3), state(), 0, 1, False, 0, True, "first look: a baseline"),
        ("growth", obs(4, 1, 4), state(3, 3, 5), 0, 1, True, 0, True, "grew"),
        ("growth", obs(3, 1, 3), state(3, 3, 5), 0, 1, False, 0, True, "same depth"),
        ("growth", obs(4, 1, 4), state(3, 3, 0.1), 0, 1, False, 0, False, "too soon to judge"),
    ],
)
def test_decide(
    mode: str,
    o: QueueObservation,
    st: MonitorState,
    running: int,
    min_depth: int,
    fire: bool,
    readers: int,
    sample: bool,
    why: str,
) -> None:
    d = decide(
        mode,
        o,
        st,
        running=running,
        max_readers=4,
        min_depth=min_depth,
        now=NOW,
        sample_seconds=1.0,
    )
    assert (d.fire, d.readers, d.sample) == (fire, readers, sample), why


def test_decide_refuses_unknown_mode() -> None:
    with pytest.raises(InvalidDefinition, match="mode"):
        decide(
            "often",
            obs(),
            state(),
            running=0,
            max_readers=1,
            min_depth=1,
            now=NOW,
            sample_seconds=1,
        )
    with pytest.raises(InvalidDefinition, match="mode"):
        Monitor(None, "q", mode="often")  # type: ignore[arg-type]
    with pytest.raises(InvalidDefinition, match="min_depth"):
        Monitor(None, "q", min_depth=0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the monitor


def monitor(broker: Broker, **kwargs: Any) -> Monitor:
    """A monitor of the supplier queue that samples growth on every look (no clock in tests)."""
    kwargs.setdefault("sample_seconds", 0)
    return Monitor(broker, SUPPLIER_QUEUE, **kwargs)


@pytest.fixture
def pair(broker: Broker) -> Broker:
    declare_pair(broker)
    broker.alter_queue(SUPPLIER_QUEUE, activation=Activation(max_readers=3))
    return broker


def dialogs(broker: Broker, groups: int, per_group: int = 1) -> list[uuid.UUID]:
    """``groups`` new dialogs (each its own conversation group) with ``per_group`` orders."""
    with broker.transaction() as tx:
        handles = [tx.begin_dialog(BUYER, SUPPLIER, contract=CONTRACT) for _ in range(groups)]
        for i in range(per_group):
            tx.send(handles, message_type=ORDER, body={"line": i})
    return handles


def more(broker: Broker, handles: list[uuid.UUID], n: int = 1) -> None:
    with broker.transaction() as tx:
        for i in range(n):
            tx.send(handles, message_type=ORDER, body={"more": i})


def take_all(broker: Broker) -> int:
    return drain(broker, SUPPLIER_QUEUE, lambda tx, msgs: None).messages


def test_one_arrival_fires_once_however_often_the_monitor_looks(pair: Broker) -> None:
    m = monitor(pair)
    assert m.check() is None  # empty
    dialogs(pair, 1)
    fire = m.check()
    assert fire is not None
    assert (fire.queue, fire.depth, fire.groups_ready, fire.readers, fire.running) == (
        SUPPLIER_QUEUE,
        1,
        1,
        1,
        0,
    )
    assert fire.fire_id is not None
    assert [m.check() for _ in range(5)] == [None] * 5
    [row] = readers(pair, SUPPLIER_QUEUE)
    assert (str(row.reader_id), row.state) == (fire.fire_id, "starting")


def test_a_restarted_monitor_does_not_fire_again_for_the_same_messages(pair: Broker) -> None:
    dialogs(pair, 2)
    first = monitor(pair).check()
    assert first is not None
    # A new monitor with the same key (a restarted triggerer), even a new Broker object:
    again = Broker.connect(str(pair.engine.url.render_as_string(hide_password=False)))
    try:
        assert monitor(again).check() is None
        assert monitor(again).state().cursor == first.cursor
        assert monitor(again).state().fires == 1
    finally:
        again.dispose()


def test_racing_monitors_fire_once_between_them(pair: Broker) -> None:
    dialogs(pair, 3)
    n = 8
    barrier = threading.Barrier(n)
    fired: list[Any] = []
    errors: list[BaseException] = []

    def look() -> None:
        try:
            barrier.wait()
            fire = monitor(pair).check()
            if fire is not None:
                fired.append(fire)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=look) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(fired) == 1
    assert len([r for r in readers(pair, SUPPLIER_QUEUE) if r.state == "starting"]) == 1


def test_monitors_with_other_keys_see_the_same_readers(pair: Broker) -> None:
    dialogs(pair, 2)
    assert monitor(pair, key="a").check() is not None
    assert monitor(pair, key="b").check() is None  # a reader is starting for these messages


def test_fires_again_after_the_reader_drained_and_new_messages_arrive(pair: Broker) -> None:
    m = monitor(pair)
    handles = dialogs(pair, 1)
    first = m.check()
    assert first is not None
    with ReaderSlot(pair, SUPPLIER_QUEUE, fire_id=first.fire_id) as slot:
        assert slot.admitted
        assert str(slot.reader_id) == first.fire_id  # took the monitor's place for it
        assert m.check() is None  # running
        assert take_all(pair) == 1
    assert m.check() is None  # empty
    more(pair, handles)
    second = m.check()
    assert second is not None
    assert second.cursor >= first.cursor or pair.dialect == "sqlite"
    assert [r.outcome for r in readers(pair, SUPPLIER_QUEUE)] == ["drained", None]


def test_more_readers_while_the_queue_grows_up_to_max_readers(pair: Broker) -> None:
    m = monitor(pair)  # max_readers 3 (the queue's activation)
    handles = dialogs(pair, 5)
    for expected_running in range(3):
        fire = m.check()
        assert fire is not None, f"reader {expected_running + 1}"
        assert fire.running == expected_running
        assert m.check() is None  # not growing since the fire
        reader_id, admitted = register_reader(pair, SUPPLIER_QUEUE, fire_id=fire.fire_id)
        assert admitted and str(reader_id) == fire.fire_id
        more(pair, handles)  # the queue grows
    assert m.check() is None  # growing, but 3 = max_readers run


def test_never_more_readers_than_groups_with_messages(pair: Broker) -> None:
    m = monitor(pair, max_readers=10)
    handles = dialogs(pair, 2)
    fires = 0
    for _ in range(6):
        fire = m.check()
        if fire is not None:
            fires += 1
            assert register_reader(pair, SUPPLIER_QUEUE, fire_id=fire.fire_id)[1]
        more(pair, handles)
    assert fires == 2


def test_a_killed_reader_does_not_block_activation(pair: Broker) -> None:
    pair.alter_queue(SUPPLIER_QUEUE, activation=Activation(max_readers=1))
    dialogs(pair, 1)
    reader_id, admitted = register_reader(pair, SUPPLIER_QUEUE)
    assert admitted
    m = monitor(pair)
    assert m.check() is None  # a reader runs
    # ... and is killed: its heartbeat stops.
    late = datetime.now(UTC) - timedelta(seconds=READER_TIMEOUT_SECONDS + 1)
    with pair.engine.begin() as conn:
        conn.execute(update(s.activation_reader).values(heartbeat_at=late))
    fire = m.check()
    assert fire is not None
    outcomes = {r.reader_id: r.outcome for r in readers(pair, SUPPLIER_QUEUE)}
    assert outcomes[reader_id] == "lost"


def test_a_reader_that_never_came_does_not_block_activation(pair: Broker) -> None:
    dialogs(pair, 1)
    m = monitor(pair)
    assert m.check() is not None
    assert m.check() is None
    long_ago = datetime.now(UTC) - timedelta(seconds=START_TIMEOUT_SECONDS + 1)
    with pair.engine.begin() as conn:
        conn.execute(update(s.activation_reader).values(fired_at=long_ago))
    assert m.check() is not None
    assert sorted(str(r.outcome) for r in readers(pair, SUPPLIER_QUEUE)) == ["None", "expired"]


def test_a_fire_whose_messages_another_reader_took_stops_counting(pair: Broker) -> None:
    handles = dialogs(pair, 1)
    m = monitor(pair)
    assert m.check() is not None
    assert take_all(pair) == 1  # read by someone that is not the reader fired for
    more(pair, handles)
    assert m.check() is not None


def test_no_reader_for_a_disabled_queue(pair: Broker) -> None:
    dialogs(pair, 1)
    pair.alter_queue(SUPPLIER_QUEUE, status=False)
    assert monitor(pair).check() is None
    pair.alter_queue(SUPPLIER_QUEUE, status=True)
    assert monitor(pair).check() is not None


def test_unknown_queue(pair: Broker) -> None:
    with pytest.raises(UnknownObject, match="nope"):
        Monitor(pair, "nope").check()


def test_depth_mode_fires_for_new_messages_at_the_depth(pair: Broker) -> None:
    m = monitor(pair, key="depth", mode="depth", min_depth=3)
    handles = dialogs(pair, 1)
    assert m.check() is None
    more(pair, handles, 2)
    fire = m.check()
    assert fire is not None
    assert (fire.depth, fire.readers, fire.fire_id) == (3, 0, None)
    assert m.check() is None  # nothing new
    more(pair, handles)
    assert m.check() is not None
    # After the queue empties (SQLite then reuses queuing_order numbers), still seen as new.
    assert take_all(pair) == 4
    assert m.check() is None
    more(pair, handles, 3)
    assert m.check() is not None


def test_growth_mode_fires_when_deeper_than_at_the_last_look(pair: Broker) -> None:
    m = monitor(pair, key="growth", mode="growth")
    handles = dialogs(pair, 1)
    assert m.check() is None  # the baseline
    assert m.check() is None  # same depth
    more(pair, handles)
    assert m.check() is not None
    assert m.check() is None


def test_dropping_the_queue_drops_its_monitors_and_readers(pair: Broker) -> None:
    with pair.definitions() as d:
        d.create_queue("scratch")
        d.create_service("//t/Scratch", queue="scratch", contracts=["DEFAULT"])
    with pair.transaction() as tx:
        tx.send(tx.begin_dialog(BUYER, "//t/Scratch"), body=b"x")
    assert Monitor(pair, "scratch").check() is not None
    register_reader(pair, "scratch")
    pair.drop_service("//t/Scratch")
    pair.drop_queue("scratch")
    with pair.engine.connect() as conn:
        assert conn.execute(select(s.activation_monitor)).all() == []
        assert conn.execute(select(s.activation_reader)).all() == []


# --------------------------------------------------------------------------- readers


def test_registration_refuses_beyond_max_readers_and_groups(pair: Broker) -> None:
    dialogs(pair, 2)
    first = register_reader(pair, SUPPLIER_QUEUE, max_readers=1)
    assert first[1]
    assert register_reader(pair, SUPPLIER_QUEUE, max_readers=1)[1] is False
    second = register_reader(pair, SUPPLIER_QUEUE, max_readers=5)
    assert second[1]
    assert register_reader(pair, SUPPLIER_QUEUE, max_readers=5)[1] is False  # 2 groups
    finish_reader(pair, first[0])
    assert register_reader(pair, SUPPLIER_QUEUE, max_readers=5)[1]
    states = sorted((r.state, str(r.outcome)) for r in readers(pair, SUPPLIER_QUEUE))
    assert states == [
        ("finished", "drained"),
        ("finished", "refused"),
        ("finished", "refused"),
        ("running", "None"),
        ("running", "None"),
    ]


def test_registration_refuses_on_an_empty_queue(pair: Broker) -> None:
    assert register_reader(pair, SUPPLIER_QUEUE)[1] is False
    with ReaderSlot(pair, SUPPLIER_QUEUE) as slot:
        assert not slot.admitted


def test_a_failing_reader_is_recorded_and_its_messages_go_back(pair: Broker) -> None:
    dialogs(pair, 1, per_group=2)

    def boom(tx: Any, msgs: Any) -> None:
        raise RuntimeError("handler failed")

    with (
        pytest.raises(RuntimeError, match="handler failed"),
        ReaderSlot(pair, SUPPLIER_QUEUE) as slot,
    ):
        drain(pair, SUPPLIER_QUEUE, boom)
    [row] = readers(pair, SUPPLIER_QUEUE)
    assert (row.reader_id, row.outcome) == (slot.reader_id, "failed")
    assert take_all(pair) == 2


def test_drain_reads_one_group_per_transaction_until_empty(pair: Broker) -> None:
    dialogs(pair, 3, per_group=4)
    groups: list[set[Any]] = []

    def handle(tx: Any, msgs: Any) -> None:
        groups.append({m.conversation_group_id for m in msgs})

    report = drain(pair, SUPPLIER_QUEUE, handle)
    assert (report.batches, report.messages, report.drained) == (3, 12, True)
    assert all(len(g) == 1 for g in groups)
    assert len(set().union(*groups)) == 3


def test_drain_stops_after_max_batches(pair: Broker) -> None:
    dialogs(pair, 3, per_group=2)
    report = drain(pair, SUPPLIER_QUEUE, lambda tx, msgs: None, top=1, max_batches=4)
    assert (report.batches, report.messages, report.drained) == (4, 4, False)
    assert take_all(pair) == 2


def test_drain_on_a_disabled_queue_raises(pair: Broker) -> None:
    pair.alter_queue(SUPPLIER_QUEUE, status=False)
    with pytest.raises(QueueDisabled):
        drain(pair, SUPPLIER_QUEUE, lambda tx, msgs: None)


def test_heartbeat_brings_a_late_reader_back(pair: Broker) -> None:
    from airflow_broker.activation import heartbeat_reader

    dialogs(pair, 1)
    reader_id, _ = register_reader(pair, SUPPLIER_QUEUE)
    late = datetime.now(UTC) - timedelta(seconds=READER_TIMEOUT_SECONDS + 1)
    with pair.engine.begin() as conn:
        conn.execute(update(s.activation_reader).values(heartbeat_at=late))
    assert monitor(pair).check() is not None  # counted as lost
    heartbeat_reader(pair, reader_id)
    [back] = [r for r in readers(pair, SUPPLIER_QUEUE) if r.reader_id == reader_id]
    assert (back.state, back.outcome) == ("running", None)


def test_a_reader_slot_keeps_its_heartbeat(pair: Broker) -> None:
    dialogs(pair, 1)

    def beat(reader_id: Any) -> Any:
        [row] = [r for r in readers(pair, SUPPLIER_QUEUE) if r.reader_id == reader_id]
        return row.heartbeat_at

    with ReaderSlot(pair, SUPPLIER_QUEUE, heartbeat_seconds=0.05) as slot:
        assert slot.admitted
        first = beat(slot.reader_id)
        deadline = time.monotonic() + 15
        while beat(slot.reader_id) == first:  # the heartbeat thread writes within 0.05 s
            assert time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.01)
    assert slot._thread is not None and not slot._thread.is_alive()
    [row] = readers(pair, SUPPLIER_QUEUE)
    assert (row.state, row.outcome) == ("finished", "drained")


def handler_for_tests(tx: Any, messages: Any) -> None:
    """Resolved by name in test_resolve_handler."""


def test_resolve_handler() -> None:
    assert resolve_handler("test_activation:handler_for_tests") is handler_for_tests
    assert resolve_handler(handler_for_tests) is handler_for_tests
    with pytest.raises(InvalidDefinition, match="cannot be imported"):
        resolve_handler("test_activation:nope")
    with pytest.raises(InvalidDefinition, match="module:function"):
        resolve_handler("no_colon")
