"""``quiet_monitors``: the batched look of many activation monitors (issue 46), on SQLite and
PostgreSQL.

A trigger holding many queues skips the full look of a monitor that ``quiet_monitors`` finds
would do nothing. So its one promise is checked at every step of a queue's life: whenever it
names a monitor ``IDLE`` or ``QUIET``, that monitor's :meth:`Monitor.check` fires nothing and
writes nothing (``broker_activation`` and ``broker_activation_reader`` unchanged). And the
other way: each thing a full look would act on (a message to fire for, a reader lost, a fire
whose reader never came or whose messages are gone, growth to sample, a missing state row, a
dropped queue) makes the monitor not quiet.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from helpers import BUYER, CONTRACT, ORDER, SUPPLIER, SUPPLIER_QUEUE, declare_pair
from helpers import drain as drain_all
from sqlalchemy import select, update

from airflow_broker import Activation, Broker
from airflow_broker.activation import (
    READER_TIMEOUT_SECONDS,
    START_TIMEOUT_SECONDS,
    Monitor,
    finish_reader,
    register_reader,
)
from airflow_broker.activation.monitor import Outlook, Watched, quiet_monitors
from airflow_broker.storage import schema as s


@pytest.fixture
def pair(broker: Broker) -> Broker:
    declare_pair(broker)
    broker.alter_queue(SUPPLIER_QUEUE, activation=Activation(max_readers=2))
    return broker


def rows(b: Broker) -> tuple[list[Any], list[Any]]:
    with b.engine.connect() as conn:
        monitors = sorted(tuple(r) for r in conn.execute(select(s.activation_monitor)))
        readers = sorted((tuple(r) for r in conn.execute(select(s.activation_reader))), key=repr)
    return monitors, readers


def outlook(b: Broker, monitor: Monitor) -> Outlook | None:
    """What quiet_monitors says of ``monitor``; and if it says anything, that the monitor's
    full look then does nothing, as promised."""
    found = quiet_monitors(b, [monitor.watched()]).get(monitor.watched())
    if found is not None:
        before = rows(b)
        assert monitor.check() is None, f"{found}: yet the full look fired"
        assert rows(b) == before, f"{found}: yet the full look wrote"
    return found


def dialogs(b: Broker, n: int) -> list[Any]:
    with b.transaction() as tx:
        handles = [tx.begin_dialog(BUYER, SUPPLIER, contract=CONTRACT) for _ in range(n)]
        tx.send(handles, message_type=ORDER, body={"n": 1})
    return handles


def more(b: Broker, handles: list[Any]) -> None:
    with b.transaction() as tx:
        tx.send(handles, message_type=ORDER, body={"n": 2})


def age_readers(b: Broker, column: Any, by: float) -> None:
    with b.engine.begin() as conn:
        rows_ = list(conn.execute(select(s.activation_reader.c.reader_id, column)))
        for reader_id, at in rows_:
            if at is not None:
                conn.execute(
                    update(s.activation_reader)
                    .where(s.activation_reader.c.reader_id == reader_id)
                    .values({column.key: at - timedelta(seconds=by)})
                )


def test_a_queue_through_its_life(pair: Broker) -> None:
    b = pair
    monitor = Monitor(b, SUPPLIER_QUEUE, sample_seconds=3600)
    assert monitor.check() is None  # the first look makes the state row
    assert outlook(b, monitor) is Outlook.IDLE

    handles = dialogs(b, 1)
    assert outlook(b, monitor) is None, "a message waits and nobody reads: fire"
    fire = monitor.check()
    assert fire is not None and fire.readers == 1
    assert outlook(b, monitor) is Outlook.QUIET, "the reader fired for is starting"

    reader_id, admitted = register_reader(b, SUPPLIER_QUEUE, fire_id=fire.fire_id)
    assert admitted
    assert outlook(b, monitor) is Outlook.QUIET, "one group, one reader running"

    more(b, handles)  # the same group: still one reader's work
    assert outlook(b, monitor) is Outlook.QUIET

    drain_all(b, SUPPLIER_QUEUE)
    finish_reader(b, reader_id)
    # Empty, no reader, but the last sample said 1: the full look writes depth 0 when due.
    found = outlook(b, monitor)
    assert found in (None, Outlook.QUIET)
    if found is None:
        monitor.check()
    dialogs(b, 1)
    assert outlook(b, monitor) is None, "a new message, nobody reads: fire again"
    assert monitor.check() is not None


def test_a_reader_gone_silent_is_looked_at(pair: Broker) -> None:
    b = pair
    monitor = Monitor(b, SUPPLIER_QUEUE)
    monitor.check()
    dialogs(b, 1)
    fire = monitor.check()
    assert fire is not None
    register_reader(b, SUPPLIER_QUEUE, fire_id=fire.fire_id)
    assert outlook(b, monitor) is Outlook.QUIET
    age_readers(b, s.activation_reader.c.heartbeat_at, READER_TIMEOUT_SECONDS + 5)
    assert outlook(b, monitor) is None, "its heartbeat stopped: the full look counts it lost"
    again = monitor.check()
    assert again is not None and again.running == 0


def test_a_fire_whose_reader_never_came_is_looked_at(pair: Broker) -> None:
    b = pair
    monitor = Monitor(b, SUPPLIER_QUEUE)
    monitor.check()
    dialogs(b, 1)
    assert monitor.check() is not None
    assert outlook(b, monitor) is Outlook.QUIET
    age_readers(b, s.activation_reader.c.fired_at, START_TIMEOUT_SECONDS + 5)
    assert outlook(b, monitor) is None, "the start timeout passed: the full look expires it"
    assert monitor.check() is not None, "and starts another reader"


def test_a_fire_whose_messages_are_gone_is_looked_at(pair: Broker) -> None:
    b = pair
    monitor = Monitor(b, SUPPLIER_QUEUE)
    monitor.check()
    dialogs(b, 1)
    assert monitor.check() is not None
    drain_all(b, SUPPLIER_QUEUE)  # read by someone else: the fire's reader will find nothing
    assert outlook(b, monitor) is None, "the queue is empty with a fire pending: tidy it"
    assert monitor.check() is None
    assert outlook(b, monitor) is not None


def test_growth_is_looked_at(pair: Broker) -> None:
    """Two groups, max_readers 2: with one reader running, a queue that grew since the last
    sample gets a second reader; quiet_monitors must not hide that."""
    b = pair
    monitor = Monitor(b, SUPPLIER_QUEUE, sample_seconds=0.0)
    monitor.check()
    handles = dialogs(b, 2)
    fire = monitor.check()
    assert fire is not None
    register_reader(b, SUPPLIER_QUEUE, fire_id=fire.fire_id)
    assert monitor.check() is None  # samples depth 2
    assert outlook(b, monitor) is Outlook.QUIET
    more(b, handles)
    assert outlook(b, monitor) is None, "growing, room for a second reader"
    second = monitor.check()
    assert second is not None and second.running == 1


@pytest.mark.parametrize("mode", ["depth", "growth"])
def test_other_modes(pair: Broker, mode: str) -> None:
    b = pair
    monitor = Monitor(b, SUPPLIER_QUEUE, mode=mode, min_depth=2, sample_seconds=0.0)
    monitor.check()
    handles = dialogs(b, 1)
    found = outlook(b, monitor)  # depth 1 < min_depth: nothing to fire; a sample to write
    if found is None:
        assert monitor.check() is None
    more(b, handles)
    assert outlook(b, monitor) is None, f"{mode}: two messages now, more than before"
    assert monitor.check() is not None
    assert outlook(b, monitor) is not None


def test_missing_rows_and_dropped_queues_are_looked_at(pair: Broker) -> None:
    b = pair
    monitor = Monitor(b, SUPPLIER_QUEUE)
    monitor.check()
    other = Watched(monitor.watched().queue_id, "nightly", "arrival", 1, None, 1.0)
    assert quiet_monitors(b, [other]) == {}, "no state row for key 'nightly': its look makes one"
    ghost = Watched(10**6, "activation", "arrival", 1, None, 1.0)
    assert quiet_monitors(b, [ghost]) == {}, "no such queue: its look says so"
    assert quiet_monitors(b, []) == {}


def test_many_monitors_in_one_call(pair: Broker) -> None:
    """Idle, quiet and busy monitors sorted out together."""
    b = pair
    with b.definitions() as d:
        for i in range(5):
            d.create_queue(f"many_q{i}")
            d.create_service(f"//many/S{i}", queue=f"many_q{i}", contracts=["DEFAULT"])
    monitors = [Monitor(b, f"many_q{i}") for i in range(5)]
    for m in monitors:
        m.check()
    with b.transaction() as tx:
        for i in (1, 2):
            h = tx.begin_dialog(f"//many/S{i}", f"//many/S{i}", encryption=False)
            tx.send(h, body=b"x")
    assert monitors[1].check() is not None  # fired: quiet now; queue 2 waits to be fired for
    found = quiet_monitors(b, [m.watched() for m in monitors])
    assert found == {
        monitors[0].watched(): Outlook.IDLE,
        monitors[1].watched(): Outlook.QUIET,
        monitors[3].watched(): Outlook.IDLE,
        monitors[4].watched(): Outlook.IDLE,
    }
