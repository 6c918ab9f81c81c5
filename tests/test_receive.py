"""RECEIVE and GET CONVERSATION GROUP: groups, locks, TOP, WAITFOR, rollback, retention."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import (
    BUYER,
    BUYER_QUEUE,
    CONTRACT,
    INVOICE,
    NOTE,
    ORDER,
    SUPPLIER,
    SUPPLIER_QUEUE,
    begin,
    bodies,
    declare_pair,
    drain,
    open_order,
    queue_rows,
    receive,
    send,
)

from airflow_broker import (
    END_DIALOG,
    ERROR,
    Broker,
    QueueDisabled,
    UnknownObject,
)


@pytest.fixture(autouse=True)
def pair(broker: Broker) -> None:
    declare_pair(broker)


def depth(broker: Broker, queue: str) -> int:
    [status] = [s for s in broker.queue_status() if s.name == queue]
    return status.depth


def two_dialogs(broker: Broker) -> tuple[uuid.UUID, uuid.UUID]:
    """Dialog 1 sends notes a1, a2; then dialog 2 sends b1. Two target groups on the supplier."""
    h1, h2 = begin(broker), begin(broker)
    send(broker, h1, NOTE, b"a1", b"a2")
    send(broker, h2, NOTE, b"b1")
    return h1, h2


# --------------------------------------------------------------------------- groups and locking


def test_each_receive_returns_one_group(broker: Broker) -> None:
    two_dialogs(broker)
    with broker.transaction() as tx:
        first = tx.receive(SUPPLIER_QUEUE)
        second = tx.receive(SUPPLIER_QUEUE)
        third = tx.receive(SUPPLIER_QUEUE)
    assert bodies(first) == [b"a1", b"a2"]
    assert bodies(second) == [b"b1"]
    assert third == []
    assert len({m.conversation_group_id for m in first}) == 1
    assert len({m.conversation_group_id for m in second}) == 1
    assert first[0].conversation_group_id != second[0].conversation_group_id


def test_group_locked_by_this_transaction_stays_readable_in_it(broker: Broker) -> None:
    h1, _ = two_dialogs(broker)
    send(broker, h1, NOTE, b"a3")
    # Queued a1, a2 (group A), b1 (group B), a3 (group A).
    with broker.transaction() as tx:
        batches = [bodies(tx.receive(SUPPLIER_QUEUE, top=1)) for _ in range(5)]
    # This transaction's own lock on A never hides A from it: each RECEIVE takes the oldest
    # ready message's group, whichever of its groups this transaction already holds.
    assert batches == [[b"a1"], [b"a2"], [b"b1"], [b"a3"], []]
    assert drain(broker, SUPPLIER_QUEUE) == []


def test_top_limits_the_count(broker: Broker) -> None:
    h = begin(broker)
    send(broker, h, NOTE, b"1", b"2", b"3", b"4", b"5")
    assert bodies(receive(broker, SUPPLIER_QUEUE, top=2)) == [b"1", b"2"]
    assert bodies(receive(broker, SUPPLIER_QUEUE, top=10)) == [b"3", b"4", b"5"]
    assert receive(broker, SUPPLIER_QUEUE, top=10) == []


def one_group_of_two(broker: Broker) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID, uuid.UUID]:
    """Two dialogs whose target endpoints share one group on the supplier: returns (initiator,
    target) handles of the dialog whose target handle sorts *last*, then of the other one."""
    pairs = sorted((open_order(broker), open_order(broker)), key=lambda p: p[1])
    (lo_init, lo_target), (hi_init, hi_target) = pairs
    with broker.transaction() as tx:
        tx.move_conversation(hi_target, tx.conversation(lo_target).conversation_group_id)
    return hi_init, hi_target, lo_init, lo_target


def test_top_starts_with_the_conversation_of_the_oldest_message(broker: Broker) -> None:
    """In a group of several conversations, RECEIVE TOP (n) takes them in the order their
    messages came, not in the order of their handles: the conversation whose handle sorts last
    sent first, so it is received first."""
    late_init, late_target, early_init, early_target = one_group_of_two(broker)
    send(broker, late_init, NOTE, b"late-1", b"late-2")
    send(broker, early_init, NOTE, b"early-1", b"early-2")
    send(broker, late_init, NOTE, b"late-3")
    got = [bodies(receive(broker, SUPPLIER_QUEUE, top=2)) for _ in range(3)]
    assert got == [[b"late-1", b"late-2"], [b"early-1", b"early-2"], [b"late-3"]]
    # Taken whole, the group comes out in its order: each conversation in sequence order, by
    # handle (as before).
    send(broker, late_init, NOTE, b"late-4")
    send(broker, early_init, NOTE, b"early-3")
    both = receive(broker, SUPPLIER_QUEUE, top=10)
    assert bodies(both) == [b"early-3", b"late-4"]
    assert [m.conversation_handle for m in both] == [early_target, late_target]


def test_top_across_conversations_keeps_each_in_order_and_errors_first(broker: Broker) -> None:
    """The oldest conversation goes first, but an Error of another conversation in the group
    still comes before every normal message, and every conversation stays in sequence order."""
    late_init, late_target, early_init, early_target = one_group_of_two(broker)
    send(broker, late_init, NOTE, b"late-1", b"late-2", b"late-3")
    send(broker, early_init, NOTE, b"early-1")
    with broker.transaction() as tx:
        tx.end_conversation(early_init, error_code=50, error_description="cancelled")
    first = receive(broker, SUPPLIER_QUEUE, top=2)
    assert [m.message_type_name for m in first] == [ERROR, NOTE]
    assert first[0].conversation_handle == early_target
    assert (first[1].conversation_handle, first[1].message_body) == (late_target, b"late-1")
    rest = receive(broker, SUPPLIER_QUEUE, top=3)
    assert bodies(rest) == [b"early-1", b"late-2", b"late-3"]
    assert receive(broker, SUPPLIER_QUEUE) == []


def test_top_in_a_group_of_several_priorities(broker: Broker) -> None:
    """A group whose conversations have different priorities: RECEIVE TOP (n) takes the highest
    priority first, then the rest of the group in its order (priority, then handle), and a cut
    never takes a conversation's later message before its earlier one."""
    rush = "//po/RushContract"
    broker.create_contract(rush, {ORDER: "initiator", INVOICE: "target", NOTE: "any"})
    broker.create_service("//po/RushSupplier", queue=SUPPLIER_QUEUE, contracts=[rush])
    broker.create_priority("rush_orders", contract=rush, priority=9)
    broker.create_priority("slow_orders", contract=CONTRACT, priority=2)
    slow = [open_order(broker) for _ in range(2)]
    with broker.transaction() as tx:
        rush_init = tx.begin_dialog(BUYER, "//po/RushSupplier", contract=rush)
        tx.send(rush_init, message_type=ORDER, body=b'{"order": 2}')
    [order] = receive(broker, SUPPLIER_QUEUE)
    rush_target = order.conversation_handle
    with broker.transaction() as tx:
        group = tx.conversation(rush_target).conversation_group_id
        for _, target in slow:
            tx.move_conversation(target, group)
    (a_init, a_target), (b_init, b_target) = slow
    # Oldest first: the slow conversation A, then the rush one, then B.
    send(broker, a_init, NOTE, b"a-1", b"a-2")
    send(broker, rush_init, NOTE, b"rush-1", b"rush-2")
    send(broker, b_init, NOTE, b"b-1")
    by_handle = {a_target: [b"a-1", b"a-2"], b_target: [b"b-1"]}
    first_slow, second_slow = sorted(by_handle)

    got = receive(broker, SUPPLIER_QUEUE, top=3)
    assert [(m.priority, m.message_body) for m in got] == [
        (9, b"rush-1"),
        (9, b"rush-2"),
        (2, by_handle[first_slow][0]),
    ]
    # Taken whole, the rest comes out in the group's order: by handle, each in sequence order.
    rest = bodies(receive(broker, SUPPLIER_QUEUE, top=10))
    assert rest == by_handle[first_slow][1:] + by_handle[second_slow]
    assert receive(broker, SUPPLIER_QUEUE) == []


def test_rollback_puts_messages_back(broker: Broker) -> None:
    h = begin(broker)
    send(broker, h, NOTE, b"1", b"2")
    taken: list[tuple[int, bytes | None]] = []
    with pytest.raises(RuntimeError, match="reader failed"), broker.transaction() as tx:
        got = tx.receive(SUPPLIER_QUEUE)
        taken.extend((m.message_sequence_number, m.message_body) for m in got)
        raise RuntimeError("reader failed")
    assert [body for _, body in taken] == [b"1", b"2"]
    assert depth(broker, SUPPLIER_QUEUE) == 2
    again = receive(broker, SUPPLIER_QUEUE)
    assert [(m.message_sequence_number, m.message_body) for m in again] == taken
    assert depth(broker, SUPPLIER_QUEUE) == 0


def test_receive_unknown_queue(broker: Broker) -> None:
    with pytest.raises(UnknownObject, match="no_such_queue"):
        receive(broker, "no_such_queue")


def test_disabled_queue_raises_queue_disabled(broker: Broker) -> None:
    h = begin(broker)
    send(broker, h, NOTE, b"1")
    broker.alter_queue(SUPPLIER_QUEUE, status=False)
    with pytest.raises(QueueDisabled, match=SUPPLIER_QUEUE):
        receive(broker, SUPPLIER_QUEUE)
    with pytest.raises(QueueDisabled, match=SUPPLIER_QUEUE), broker.transaction() as tx:
        tx.get_conversation_group(SUPPLIER_QUEUE)
    broker.create_queue("born_disabled", status=False)
    with pytest.raises(QueueDisabled, match="born_disabled"):
        receive(broker, "born_disabled")
    broker.alter_queue(SUPPLIER_QUEUE, status=True)
    assert bodies(receive(broker, SUPPLIER_QUEUE)) == [b"1"]


# --------------------------------------------------------------------------- WHERE


def test_get_conversation_group_then_receive_it(broker: Broker) -> None:
    with broker.transaction() as tx:
        assert tx.get_conversation_group(SUPPLIER_QUEUE) is None
    two_dialogs(broker)
    with broker.transaction() as tx:
        g = tx.get_conversation_group(SUPPLIER_QUEUE)
        assert isinstance(g, uuid.UUID)
        got = tx.receive(SUPPLIER_QUEUE, conversation_group=g)
    assert bodies(got) == [b"a1", b"a2"]
    assert {m.conversation_group_id for m in got} == {g}
    with broker.transaction() as tx:
        g2 = tx.get_conversation_group(SUPPLIER_QUEUE)
        got2 = tx.receive(SUPPLIER_QUEUE, conversation_group=g2)
    assert g2 != g
    assert bodies(got2) == [b"b1"]
    with broker.transaction() as tx:
        assert tx.get_conversation_group(SUPPLIER_QUEUE) is None


def test_receive_by_conversation_handle_and_group(broker: Broker) -> None:
    h1 = begin(broker)
    h2 = begin(broker, related_conversation=h1)
    send(broker, h1, ORDER, {"n": 1})
    send(broker, h2, ORDER, {"n": 2})
    targets = {m.json()["n"]: m.conversation_handle for m in drain(broker, SUPPLIER_QUEUE)}
    send(broker, targets[1], INVOICE, {"n": 1})
    send(broker, targets[2], INVOICE, {"n": 2})
    # Dialog 1's invoice is older, but the WHERE asks for dialog 2.
    only_two = receive(broker, BUYER_QUEUE, conversation_handle=h2)
    assert [(m.conversation_handle, m.json()) for m in only_two] == [(h2, {"n": 2})]
    with broker.transaction() as tx:
        group = tx.conversation(h1).conversation_group_id
    rest = receive(broker, BUYER_QUEUE, conversation_group=group)
    assert [(m.conversation_handle, m.json()) for m in rest] == [(h1, {"n": 1})]


def test_receive_by_conversation_group_on_empty_group_returns_nothing(broker: Broker) -> None:
    h1, _ = two_dialogs(broker)
    with broker.transaction() as tx:
        initiator_group = tx.conversation(h1).conversation_group_id
    # The initiator's group is on the buyer queue and has no messages.
    assert receive(broker, BUYER_QUEUE, conversation_group=initiator_group) == []
    assert receive(broker, SUPPLIER_QUEUE, conversation_group=uuid.uuid4()) == []
    assert depth(broker, SUPPLIER_QUEUE) == 3


# --------------------------------------------------------------------------- WAITFOR


def test_wait_seconds_returns_empty_after_timeout(broker: Broker) -> None:
    start = time.monotonic()
    got = receive(broker, SUPPLIER_QUEUE, wait_seconds=1)
    elapsed = time.monotonic() - start
    assert got == []
    assert 0.9 <= elapsed < 3.0


def test_wait_seconds_returns_when_a_message_arrives(broker: Broker) -> None:
    h = begin(broker)

    def later() -> None:
        time.sleep(0.3)
        send(broker, h, NOTE, b"wake up")

    sender = threading.Thread(target=later)
    start = time.monotonic()
    sender.start()
    try:
        got = receive(broker, SUPPLIER_QUEUE, wait_seconds=10)
    finally:
        sender.join(timeout=15)
    elapsed = time.monotonic() - start
    assert bodies(got) == [b"wake up"]
    assert 0.25 <= elapsed < 3.0


# --------------------------------------------------------------------------- retention


def test_retention_keeps_received_and_sent_messages_until_the_end(
    broker: Broker, broker_url: str
) -> None:
    broker.alter_queue(BUYER_QUEUE, retention=True)
    broker.alter_queue(SUPPLIER_QUEUE, retention=True)
    h = begin(broker)
    send(broker, h, ORDER, b'{"n": 1}')
    assert queue_rows(broker_url, BUYER_QUEUE) == [(3, ORDER, b'{"n": 1}')]
    assert queue_rows(broker_url, SUPPLIER_QUEUE) == [(1, ORDER, b'{"n": 1}')]

    [m] = receive(broker, SUPPLIER_QUEUE)
    assert m.message_body == b'{"n": 1}'
    assert queue_rows(broker_url, SUPPLIER_QUEUE) == [(0, ORDER, b'{"n": 1}')]
    assert receive(broker, SUPPLIER_QUEUE) == []
    assert depth(broker, SUPPLIER_QUEUE) == 0

    target = m.conversation_handle
    with broker.transaction() as tx:
        tx.end_conversation(h)
    [end] = receive(broker, SUPPLIER_QUEUE)
    assert end.message_type_name == END_DIALOG
    with broker.transaction() as tx:
        tx.end_conversation(target)
    assert queue_rows(broker_url, BUYER_QUEUE) == []
    assert queue_rows(broker_url, SUPPLIER_QUEUE) == []


# --------------------------------------------------------------------------- priority


def test_priority_orders_groups(broker: Broker) -> None:
    rush = "//po/RushContract"
    broker.create_contract(rush, {ORDER: "initiator", INVOICE: "target", NOTE: "any"})
    broker.create_service("//po/RushSupplier", queue=SUPPLIER_QUEUE, contracts=[rush])
    broker.create_priority("rush_orders", contract=rush, priority=9)
    broker.create_priority("slow_orders", contract=CONTRACT, priority=2)

    normal = begin(broker)
    send(broker, normal, NOTE, b"normal 1", b"normal 2")
    with broker.transaction() as tx:
        urgent = tx.begin_dialog(BUYER, "//po/RushSupplier", contract=rush)
        tx.send(urgent, message_type=NOTE, body=b"rush")
    with broker.transaction() as tx:
        assert tx.conversation(urgent).priority == 9
        assert tx.conversation(normal).priority == 2

    first = receive(broker, SUPPLIER_QUEUE)
    second = receive(broker, SUPPLIER_QUEUE)
    assert [(m.message_body, m.priority) for m in first] == [(b"rush", 9)]
    assert [(m.message_body, m.priority) for m in second] == [(b"normal 1", 2), (b"normal 2", 2)]
    assert {m.service_name for m in first} == {"//po/RushSupplier"}
    assert {m.service_name for m in second} == {SUPPLIER}


def test_priority_by_local_service(broker: Broker) -> None:
    broker.create_priority("buyer_high", local_service=BUYER, priority=8)
    h1 = begin(broker)
    send(broker, h1, ORDER, {"n": 1})
    [order] = receive(broker, SUPPLIER_QUEUE)
    # The supplier's endpoint matches no priority: default 5; the buyer's matches: 8.
    assert order.priority == 5
    with broker.transaction() as tx:
        assert tx.conversation(order.conversation_handle).priority == 5
        assert tx.conversation(h1).priority == 8
    send(broker, order.conversation_handle, INVOICE, {"n": 1})
    [invoice] = receive(broker, BUYER_QUEUE)
    assert invoice.priority == 8


# --------------------------------------------------------------------------- PostgreSQL concurrency


def test_concurrent_reader_skips_locked_group_and_senders_still_enqueue(
    pg_broker: Broker,
) -> None:
    """Two open transactions at once: only PostgreSQL has concurrent writers."""
    declare_pair(pg_broker)
    h1, _ = two_dialogs(pg_broker)
    with ThreadPoolExecutor(max_workers=2) as pool, pg_broker.transaction() as tx:
        mine = tx.receive(SUPPLIER_QUEUE, top=1)
        assert bodies(mine) == [b"a1"]
        # Another reader does not get the group this transaction holds, even though it has
        # the oldest ready message (a2): it gets the other group at once.
        theirs = pool.submit(receive, pg_broker, SUPPLIER_QUEUE).result(timeout=10)
        assert bodies(theirs) == [b"b1"]
        # A sender to the locked group is not blocked by the lock.
        pool.submit(send, pg_broker, h1, NOTE, b"a3").result(timeout=10)
        nothing = pool.submit(receive, pg_broker, SUPPLIER_QUEUE).result(timeout=10)
        assert nothing == []
    assert bodies(receive(pg_broker, SUPPLIER_QUEUE)) == [b"a2", b"a3"]
