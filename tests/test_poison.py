"""Poison-message handling, in-process: five consecutive rolled-back receives disable a queue."""

from __future__ import annotations

import pytest
from helpers import NOTE, SUPPLIER_QUEUE, begin, bodies, declare_pair, receive, send

from airflow_broker import Broker, QueueDisabled
from airflow_broker.constants import POISON_THRESHOLD


class ReaderFailed(Exception):
    """The reader's processing failed: its transaction rolls back."""


@pytest.fixture(autouse=True)
def pair(broker: Broker) -> None:
    declare_pair(broker)


def failed_receive(broker: Broker) -> list[bytes | None]:
    """One receiving transaction that rolls back; returns what it had received."""
    got: list[bytes | None] = []
    with pytest.raises(ReaderFailed), broker.transaction() as tx:
        got.extend(bodies(tx.receive(SUPPLIER_QUEUE, top=1)))
        raise ReaderFailed
    return got


def enabled(broker: Broker) -> bool:
    return broker.catalog().queues[SUPPLIER_QUEUE].status


def rollback_count(broker: Broker) -> int:
    [status] = [s for s in broker.queue_status() if s.name == SUPPLIER_QUEUE]
    return status.rollback_count


def disabled_events(broker: Broker) -> list[str]:
    return [e.object_name for e in broker.events() if e.event == "queue_disabled"]


def test_five_rolled_back_receives_disable_the_queue(broker: Broker) -> None:
    send(broker, begin(broker), NOTE, b"poison")
    for attempt in range(1, 5):
        assert failed_receive(broker) == [b"poison"]
        assert enabled(broker) is True
        assert rollback_count(broker) == attempt
    assert disabled_events(broker) == []

    assert failed_receive(broker) == [b"poison"]
    assert enabled(broker) is False
    with pytest.raises(QueueDisabled, match=SUPPLIER_QUEUE):
        receive(broker, SUPPLIER_QUEUE)
    assert disabled_events(broker) == [SUPPLIER_QUEUE]
    # The poison message is kept, not dropped.
    [status] = [s for s in broker.queue_status() if s.name == SUPPLIER_QUEUE]
    assert (status.status, status.depth) == (False, 1)


def test_a_commit_in_between_resets_the_count(broker: Broker) -> None:
    send(broker, begin(broker), NOTE, b"1", b"2", b"3")
    for _ in range(4):
        assert failed_receive(broker) == [b"1"]
    assert rollback_count(broker) == 4
    assert bodies(receive(broker, SUPPLIER_QUEUE, top=1)) == [b"1"]
    assert rollback_count(broker) == 0
    for _ in range(4):
        assert failed_receive(broker) == [b"2"]
    assert enabled(broker) is True
    assert disabled_events(broker) == []
    # Five in a row now: disabled.
    failed_receive(broker)
    assert enabled(broker) is False
    assert disabled_events(broker) == [SUPPLIER_QUEUE]


def test_poison_handling_off_never_disables(broker: Broker) -> None:
    broker.alter_queue(SUPPLIER_QUEUE, poison_message_handling=False)
    send(broker, begin(broker), NOTE, b"poison")
    for _ in range(POISON_THRESHOLD + 3):
        assert failed_receive(broker) == [b"poison"]
    assert enabled(broker) is True
    assert disabled_events(broker) == []
    assert bodies(receive(broker, SUPPLIER_QUEUE)) == [b"poison"]


def test_alter_queue_status_on_re_enables(broker: Broker) -> None:
    send(broker, begin(broker), NOTE, b"poison", b"next")
    for _ in range(POISON_THRESHOLD):
        failed_receive(broker)
    assert enabled(broker) is False

    broker.alter_queue(SUPPLIER_QUEUE, status=True)
    assert enabled(broker) is True
    # Re-enabled with a fresh count: one more failure does not disable it again.
    assert failed_receive(broker) == [b"poison"]
    assert enabled(broker) is True
    assert bodies(receive(broker, SUPPLIER_QUEUE)) == [b"poison", b"next"]
    assert disabled_events(broker) == [SUPPLIER_QUEUE]


def test_other_queues_are_not_affected(broker: Broker) -> None:
    send(broker, begin(broker), NOTE, b"poison")
    for _ in range(POISON_THRESHOLD):
        failed_receive(broker)
    assert enabled(broker) is False
    assert broker.catalog().queues["buyer_queue"].status is True
    assert receive(broker, "buyer_queue") == []
