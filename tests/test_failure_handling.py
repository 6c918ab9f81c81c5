"""Failure handling per conversation, on both engines: receive counts, retry backoff, and
dead-lettering one poisoned conversation while the rest of the queue goes on."""

from __future__ import annotations

import logging
import time

import pytest
from helpers import (
    BUYER_QUEUE,
    NOTE,
    SUPPLIER_QUEUE,
    begin,
    declare_pair,
    receive,
    send,
)

from airflow_broker import Broker, InvalidDefinition, QueueDisabled, UnknownObject
from airflow_broker.constants import DEAD_LETTERED, ERROR, POISON_THRESHOLD

DLQ = "supplier_dead_letters"


class HandlerFailed(Exception):
    """The handler failed: its transaction rolls back."""


@pytest.fixture(autouse=True)
def pair(broker: Broker) -> None:
    declare_pair(broker)
    broker.create_queue(DLQ)


def fail_once(broker: Broker, **kwargs: object) -> list[int]:
    """One receiving transaction that rolls back; the receive counts it saw."""
    seen: list[int] = []
    with pytest.raises(HandlerFailed), broker.transaction() as tx:
        seen.extend(m.receive_count for m in tx.receive(SUPPLIER_QUEUE, **kwargs))
        raise HandlerFailed
    return seen


def test_receive_count_counts_rolled_back_hand_outs(broker: Broker) -> None:
    send(broker, begin(broker), NOTE, b"a", b"b")
    assert fail_once(broker) == [1, 1]
    assert fail_once(broker, top=1) == [2]
    got = receive(broker, SUPPLIER_QUEUE)
    assert [(m.message_body, m.receive_count) for m in got] == [(b"a", 3), (b"b", 2)]
    assert all(m.dead_letter is None for m in got)


def test_one_poisoned_conversation_among_50_is_dead_lettered(broker: Broker) -> None:
    broker.alter_queue(SUPPLIER_QUEUE, max_receives=3, dead_letter_queue=DLQ)
    handles = [begin(broker) for _ in range(50)]
    for i, h in enumerate(handles):
        send(broker, h, NOTE, f"{i}-first".encode(), f"{i}-second".encode())
    target: set[object] = set()
    processed: list[bytes] = []
    attempts = 0
    for _ in range(500):
        try:
            with broker.transaction() as tx:
                msgs = tx.receive(SUPPLIER_QUEUE)
                if not msgs:
                    break
                if (msgs[0].message_body or b"").startswith(b"17-"):
                    target.add(msgs[0].conversation_handle)
                    attempts += 1
                    raise HandlerFailed
                processed.extend(m.message_body or b"" for m in msgs)
        except HandlerFailed:
            pass
    assert attempts == 3
    [poisoned] = target
    assert sorted(processed) == sorted(
        f"{i}-{w}".encode() for i in range(50) if i != 17 for w in ("first", "second")
    )
    assert broker.catalog().queues[SUPPLIER_QUEUE].status is True
    # The dead letters, in order, with where they came from.
    dead = receive(broker, DLQ)
    assert [m.message_body for m in dead] == [b"17-first", b"17-second"]
    assert {m.message_type_name for m in dead} == {NOTE}
    for m in dead:
        assert m.conversation_handle == poisoned
        assert m.dead_letter is not None
        assert m.dead_letter.queue == SUPPLIER_QUEUE
        assert m.dead_letter.conversation_handle == poisoned
        assert m.dead_letter.receive_count == 3
        assert SUPPLIER_QUEUE in m.dead_letter.reason and "3" in m.dead_letter.reason
    # The far side (the buyer) is told, with the DEAD_LETTERED error.
    errors = [m for m in receive(broker, BUYER_QUEUE) if m.message_type_name == ERROR]
    assert len(errors) == 1 and errors[0].error is not None
    code, description = errors[0].error
    assert code == DEAD_LETTERED
    assert SUPPLIER_QUEUE in description and "3" in description
    events = [e for e in broker.events() if e.event == "dead_lettered"]
    assert [e.object_name for e in events] == [SUPPLIER_QUEUE]
    assert DLQ in events[0].detail


def test_without_max_receives_the_queue_is_disabled_as_before(broker: Broker) -> None:
    send(broker, begin(broker), NOTE, b"poison")
    for _ in range(POISON_THRESHOLD):
        fail_once(broker)
    with pytest.raises(QueueDisabled, match=SUPPLIER_QUEUE):
        receive(broker, SUPPLIER_QUEUE)
    assert receive(broker, DLQ) == []


def test_with_max_receives_the_queue_is_never_disabled(broker: Broker) -> None:
    broker.alter_queue(SUPPLIER_QUEUE, max_receives=POISON_THRESHOLD + 2, dead_letter_queue=DLQ)
    send(broker, begin(broker), NOTE, b"poison")
    for attempt in range(1, POISON_THRESHOLD + 3):
        assert fail_once(broker) == [attempt]
    assert broker.catalog().queues[SUPPLIER_QUEUE].status is True
    assert [m.message_body for m in receive(broker, DLQ)] == [b"poison"]


def test_backoff_doubles_up_to_the_max(broker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    # While the failed group waits, another conversation's message is received.
    caplog.set_level(logging.INFO, logger="airflow_broker")
    broker.alter_queue(SUPPLIER_QUEUE, retry_delay=0.8, retry_delay_max=2.0)
    h = begin(broker)
    other = begin(broker)
    taken: list[float] = []  # when each attempt received the message
    failed: list[float] = []  # when each failed attempt had been counted
    send(broker, h, NOTE, b"slow")
    for _ in range(5):
        with pytest.raises(HandlerFailed), broker.transaction() as tx:
            got = tx.receive(SUPPLIER_QUEUE, wait_seconds=5)
            assert [m.message_body for m in got] == [b"slow"]
            taken.append(time.monotonic())
            raise HandlerFailed
        failed.append(time.monotonic())
        send(broker, other, NOTE, b"unaffected")
        assert [m.message_body for m in receive(broker, SUPPLIER_QUEUE)] == [b"unaffected"]
    # Each failed attempt holds the group for retry_delay * 2 ** (n - 1), at most the max ...
    held = [
        float(m.split(" waits ")[1].split(" s ")[0])
        for m in caplog.messages
        if "before its next attempt" in m
    ]
    expected = [0.8, 1.6, 2.0, 2.0, 2.0]
    assert held == expected
    # ... and the next attempt comes neither before the hold ends (which begins after the
    # message was taken) nor long after it (bounded by the waiting RECEIVE's slice, with room
    # for a loaded machine).
    for i, want in enumerate(expected[:-1]):
        early, late = taken[i + 1] - taken[i], taken[i + 1] - failed[i]
        assert early >= want - 0.05, (i, early, want)
        assert late <= want + 1.0, (i, late, want)


def test_new_messages_wait_behind_a_held_group(broker: Broker) -> None:
    broker.alter_queue(SUPPLIER_QUEUE, retry_delay=30)
    h = begin(broker)
    send(broker, h, NOTE, b"first")
    with pytest.raises(HandlerFailed), broker.transaction() as tx:
        [first] = tx.receive(SUPPLIER_QUEUE)
        raise HandlerFailed
    send(broker, h, NOTE, b"second")
    assert receive(broker, SUPPLIER_QUEUE) == []
    assert receive(broker, SUPPLIER_QUEUE, conversation_handle=first.conversation_handle) == []
    group = first.conversation_group_id
    assert receive(broker, SUPPLIER_QUEUE, conversation_group=group) == []


def test_queue_options_are_checked(broker: Broker) -> None:
    with pytest.raises(InvalidDefinition, match="max_receives and dead_letter_queue"):
        broker.create_queue("q1", max_receives=3)
    with pytest.raises(UnknownObject, match="'nowhere'"):
        broker.create_queue("q1", max_receives=3, dead_letter_queue="nowhere")
    with pytest.raises(InvalidDefinition, match="own dead_letter_queue"):
        broker.create_queue("q1", max_receives=3, dead_letter_queue="q1")
    with pytest.raises(InvalidDefinition, match="retry_delay must be"):
        broker.create_queue("q1", retry_delay=-1)
    with pytest.raises(InvalidDefinition, match="less than retry_delay"):
        broker.create_queue("q1", retry_delay=5, retry_delay_max=1)
    with pytest.raises(InvalidDefinition, match="max_receives must be"):
        broker.create_queue("q1", max_receives=0, dead_letter_queue=DLQ)
    broker.create_queue("q1", max_receives=2, dead_letter_queue=DLQ, retry_delay=1)
    with pytest.raises(InvalidDefinition, match="used by queue"):
        broker.drop_queue(DLQ)
    broker.alter_queue("q1", max_receives=None, dead_letter_queue=None)
    broker.drop_queue(DLQ)
    row = broker.catalog().queues["q1"]
    assert row is not None


def test_dead_letters_survive_the_purge_of_closed_endpoints(broker: Broker) -> None:
    import datetime as dt

    from airflow_broker.operations.housekeeping import Retention

    broker.alter_queue(SUPPLIER_QUEUE, max_receives=1, dead_letter_queue=DLQ)
    h = begin(broker)
    send(broker, h, NOTE, b"x")
    fail_once(broker)
    broker.purge(Retention(closed_endpoints=dt.timedelta(0)))
    [dead] = receive(broker, DLQ)
    assert dead.message_body == b"x"
    assert broker.check() == []


def test_apply_yaml_sets_the_options_with_a_dead_letter_queue_declared_later(
    broker: Broker,
) -> None:
    from airflow_broker.operations.declarations.apply import apply_declarations

    text = """
queues:
  - name: orders
    retry_delay: 0.5
    retry_delay_max: 30
    max_receives: 4
    dead_letter_queue: orders_dead
  - name: orders_dead
"""
    apply_declarations(broker, text, "failure.yaml")
    q = broker.catalog().queues["orders"]
    assert (q.retry_delay, q.retry_delay_max, q.max_receives, q.dead_letter_queue) == (
        0.5,
        30.0,
        4,
        "orders_dead",
    )
    # Unchanged the second time; null turns an option off.
    apply_declarations(broker, text, "failure.yaml")
    apply_declarations(
        broker,
        "queues:\n  - name: orders\n    max_receives: null\n    dead_letter_queue: null\n",
        "off.yaml",
    )
    q = broker.catalog().queues["orders"]
    assert (q.retry_delay, q.max_receives, q.dead_letter_queue) == (0.5, None, None)


def test_apply_yaml_reports_an_unknown_dead_letter_queue(broker: Broker) -> None:
    from airflow_broker.operations.declarations.apply import apply_declarations

    text = "queues:\n  - name: orders\n    max_receives: 2\n    dead_letter_queue: nowhere\n"
    with pytest.raises(InvalidDefinition) as caught:
        apply_declarations(broker, text, "bad.yaml")
    [line] = caught.value.lines()  # type: ignore[attr-defined]
    assert "bad.yaml:4" in line and "dead_letter_queue 'nowhere'" in line
