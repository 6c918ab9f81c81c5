"""The purchase-order example (airflow_broker.examples.purchase_order), driven through its
handlers with the engine only, on SQLite and PostgreSQL: the happy path, each compensation path
(refused, timed out, cancelled, no agreement), compensations run twice, and many orders under
concurrent readers (ActivationRunner)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import func, select

from airflow_broker import Broker
from airflow_broker.activation.runner import ActivationRunner
from airflow_broker.examples import purchase_order as po
from airflow_broker.examples.demo import buyer_reader

Handler = Callable[..., Any]
READERS: tuple[tuple[str, Handler], ...] = (
    (po.SUPPLIER_QUEUE, po.supplier_handler),
    (po.BUYER_QUEUE, po.buyer_handler),
)


@pytest.fixture
def shop(broker: Broker) -> Iterator[Broker]:
    po.setup(broker)
    yield broker


def step(broker: Broker, queue: str, handler: Handler) -> int:
    """One reader transaction: RECEIVE one conversation group and handle it."""
    with broker.transaction() as tx:
        messages = tx.receive(queue)
        if messages:
            handler(tx, messages)
    return len(messages)


def drive(broker: Broker, stop: Callable[[], bool] | None = None, limit: int = 200) -> None:
    """Read both queues in turn until neither has anything (or ``stop()`` after a batch)."""
    for _ in range(limit):
        moved = 0
        for queue, handler in READERS:
            while step(broker, queue, handler):
                moved += 1
                if stop is not None and stop():
                    return
        if not moved:
            return
    raise AssertionError("the orders did not settle")


def submit(broker: Broker, item: str, qty: int, price: float, **kw: Any) -> po.Submitted:
    with broker.transaction() as tx:
        return po.submit_purchase_order(tx, item, qty, price, **kw)


def buyer(broker: Broker, number: str) -> dict[str, Any]:
    with broker.engine.connect() as conn:
        row = po.buyer_order(conn, number)
    assert row is not None
    return row


def supplier(broker: Broker, number: str) -> dict[str, Any]:
    with broker.engine.connect() as conn:
        row = po.supplier_order(conn, number)
    assert row is not None
    return row


def endpoint_states(broker: Broker, number: str) -> tuple[str, str]:
    b, s = buyer(broker, number), supplier(broker, number)
    with broker.transaction() as tx:
        return (
            tx.conversation(b["conversation_handle"]).state,
            tx.conversation(s["conversation_handle"]).state,
        )


def stock(broker: Broker) -> dict[str, tuple[int, int]]:
    with broker.engine.connect() as conn:
        return po.stock_levels(conn)


def compensations(broker: Broker, number: str) -> dict[tuple[str, str], str]:
    with broker.engine.connect() as conn:
        return {(c["side"], c["action"]): c["detail"] for c in po.compensations(conn, number)}


def sent(broker: Broker, number: str) -> list[str]:
    """The message types sent on the order's dialog, in order."""
    with broker.engine.connect() as conn:
        return [e["text"].split(":", 1)[0] for e in po.trace(conn, number) if e["kind"] == "send"]


def balance(broker: Broker, side: str, number: str | None = None) -> int:
    with broker.engine.connect() as conn:
        return po.ledger_balance(conn, side, number)


def queues_empty(broker: Broker) -> bool:
    return all(q.depth == 0 for q in broker.queue_status())


def snapshot(broker: Broker) -> dict[str, Any]:
    """Everything the compensations may change."""
    with broker.engine.connect() as conn:
        return {
            table.name: sorted(
                (tuple(str(v) for v in r) for r in conn.execute(select(table))), key=str
            )
            for table in (
                po.po_stock,
                po.po_buyer,
                po.po_supplier,
                po.po_ledger,
                po.po_compensation,
                po.po_event,
            )
        }


# --------------------------------------------------------------------------------------------
# Setup


def test_setup_is_idempotent(broker: Broker) -> None:
    po.setup(broker)
    assert po.declare(broker) == []
    po.setup(broker)  # nothing is created twice, the warehouse is not refilled
    catalog = broker.catalog()
    assert catalog.services[po.SUPPLIER_SERVICE].queue == po.SUPPLIER_QUEUE
    assert catalog.contracts[po.CONTRACT].message_types[po.ORDER] == "initiator"
    activation = catalog.queues[po.SUPPLIER_QUEUE].activation
    assert activation is not None and activation["max_readers"] == po.SUPPLIER_MAX_READERS
    assert stock(broker) == {"widget": (5000, 0), "sprocket": (40, 0), "gizmo": (0, 0)}


def test_a_malformed_order_never_reaches_the_supplier(shop: Broker) -> None:
    from airflow_broker import MessageValidationError

    with shop.transaction() as tx:
        h = tx.begin_dialog(po.BUYER_SERVICE, po.SUPPLIER_SERVICE, po.CONTRACT)
        with pytest.raises(MessageValidationError):
            tx.send(h, po.ORDER, {"item": "widget", "qty": 0})


# --------------------------------------------------------------------------------------------
# The happy path


def test_happy_path_ends_with_both_endpoints_closed_and_the_books_balanced(shop: Broker) -> None:
    order = submit(shop, "widget", 500, 4.40, po_number="PO-1")
    drive(shop)

    b, s = buyer(shop, "PO-1"), supplier(shop, "PO-1")
    assert (b["status"], s["status"]) == ("complete", "complete")
    # Two rounds: $5.00 in 21 days -> counter $4.40 in 14 -> $4.67 -> $4.40 -> accepted.
    assert b["rounds"] == 2 and s["rounds"] == 2
    assert (b["unit_price"], b["ship_in_days"]) == (440, 14)
    assert (s["unit_price"], s["ship_in_days"]) == (440, 14)
    assert b["received_qty"] == 500 and s["shipped"] == 500 and s["shipment"] == "delivered"
    assert b["amount_due"] == s["amount_due"] == 220_000
    assert sent(shop, "PO-1") == [
        "Order",
        "Quote",
        "Counter",
        "Quote",
        "Counter",
        "Quote",
        "Accept",
        "ShipNotice",
        "Receipt",
        "Invoice",
        "Payment",
    ]
    assert endpoint_states(shop, "PO-1") == ("CD", "CD")
    assert b["conversation_group_id"] == order.conversation_group_id
    # State keyed by conversation group: the supplier's is its own group on its queue.
    assert s["conversation_group_id"] != order.conversation_group_id
    assert stock(shop)["widget"] == (4500, 0)
    assert balance(shop, po.BUYER) == -220_000 and balance(shop, po.SUPPLIER) == 220_000
    assert compensations(shop, "PO-1") == {}
    assert queues_empty(shop)
    with shop.transaction() as tx:  # END cleared the buyer's deadline timer
        assert tx.conversation(order.conversation_handle).timer_due_at is None


# --------------------------------------------------------------------------------------------
# Compensation paths


def test_supplier_refuses_when_out_of_stock(shop: Broker) -> None:
    submit(shop, "gizmo", 5, 12.00, po_number="PO-2")
    drive(shop)
    b, s = buyer(shop, "PO-2"), supplier(shop, "PO-2")
    assert (b["status"], s["status"]) == ("refused", "refused")
    assert b["reason"] == s["reason"] == "gizmo is out of stock"
    assert sent(shop, "PO-2") == ["Order", "Refuse"]
    assert compensations(shop, "PO-2") == {
        ("supplier", "cancel_shipment"): "nothing shipped",
        ("supplier", "release_reservation"): "nothing reserved",
        ("supplier", "void_payment"): "no payment received",
        ("supplier", "notify"): "sales: order PO-2 refused: gizmo is out of stock",
        ("buyer", "void_payment"): "nothing paid",
        ("buyer", "notify"): "requester: order PO-2 refused: gizmo is out of stock",
    }
    assert endpoint_states(shop, "PO-2") == ("CD", "CD")
    assert stock(shop)["gizmo"] == (0, 0)
    assert queues_empty(shop)


def test_an_unknown_item_is_refused(shop: Broker) -> None:
    submit(shop, "flux capacitor", 1, 100, po_number="PO-X")
    drive(shop)
    assert buyer(shop, "PO-X")["reason"] == "flux capacitor is not an item we sell"
    assert endpoint_states(shop, "PO-X") == ("CD", "CD")


def test_deadline_timer_cancels_a_backordered_order_and_releases_the_reservation(
    shop: Broker,
) -> None:
    # The deadline leaves the first exchange time to finish on a loaded machine (0.5 s did not,
    # once, under the full suite): it must fire after the backorder, not during it.
    deadline = 3.0
    submit(shop, "sprocket", 100, 2.50, po_number="PO-3", deadline_seconds=deadline)
    submitted = time.monotonic()  # the timer was set before this
    drive(shop)
    assert buyer(shop, "PO-3")["status"] == supplier(shop, "PO-3")["status"] == "backordered"
    assert stock(shop)["sprocket"] == (40, 40)

    time.sleep(max(0.0, submitted + deadline + 0.1 - time.monotonic()))
    shop.run_due()  # what an activation monitor does: the DialogTimer lands in the buyer's queue
    drive(shop)

    b, s = buyer(shop, "PO-3"), supplier(shop, "PO-3")
    assert (b["status"], s["status"]) == ("timed_out", "cancelled")
    assert b["reason"].startswith("deadline passed")
    assert sent(shop, "PO-3") == ["Order", "Backorder", "Cancel"]
    assert compensations(shop, "PO-3")[("supplier", "release_reservation")] == (
        "released 40 sprocket"
    )
    assert stock(shop)["sprocket"] == (40, 0)
    assert endpoint_states(shop, "PO-3") == ("CD", "CD")
    assert queues_empty(shop)


def paid(broker: Broker, number: str) -> Callable[[], bool]:
    return lambda: buyer(broker, number)["status"] == "paid"


def test_buyer_cancels_after_paying_every_step_is_undone(shop: Broker) -> None:
    submit(shop, "widget", 200, 5.00, po_number="PO-4")
    drive(shop, stop=paid(shop, "PO-4"))
    assert supplier(shop, "PO-4")["status"] == "delivered"  # Payment not read yet
    assert balance(shop, po.BUYER) == -100_000

    with shop.transaction() as tx:
        assert po.cancel_purchase_order(tx, "PO-4", "changed our mind") is True
    drive(shop)

    b, s = buyer(shop, "PO-4"), supplier(shop, "PO-4")
    assert (b["status"], s["status"]) == ("cancelled", "cancelled")
    assert sent(shop, "PO-4")[-2:] == ["Payment", "Cancel"]
    c = compensations(shop, "PO-4")
    assert c[("buyer", "void_payment")] == "voided payment of $1,000.00"
    assert c[("supplier", "void_payment")] == "refunded $1,000.00 to the buyer"
    assert c[("supplier", "cancel_shipment")].startswith("took back 200 widget")
    assert c[("supplier", "release_reservation")] == "nothing reserved"  # shipped already
    assert c[("buyer", "notify")] == "requester: order PO-4 cancelled: changed our mind"
    assert s["shipment"] == "cancelled"
    assert stock(shop)["widget"] == (5000, 0)
    # Each side paid / received once and reversed once.
    assert balance(shop, po.BUYER) == 0 and balance(shop, po.SUPPLIER) == 0
    with shop.engine.connect() as conn:
        entries = conn.execute(
            select(po.po_ledger.c.side, po.po_ledger.c.entry, po.po_ledger.c.amount).order_by(
                po.po_ledger.c.id
            )
        ).all()
    assert sorted(map(tuple, entries)) == sorted(
        [
            ("buyer", "payment", -100_000),
            ("supplier", "payment", 100_000),
            ("buyer", "void", 100_000),
            ("supplier", "refund", -100_000),
        ]
    )
    assert endpoint_states(shop, "PO-4") == ("CD", "CD")
    assert queues_empty(shop)


@pytest.mark.parametrize(
    ("when", "released", "shipment"),
    [
        # The supplier has not read the order yet: it reserves, then reads the Cancel.
        ("submitted", "released 100 widget", "nothing shipped"),
        ("negotiating", "released 100 widget", "nothing shipped"),
        ("accepted", "nothing reserved", "recalled 100 widget"),
    ],
)
def test_buyer_cancels_midway(shop: Broker, when: str, released: str, shipment: str) -> None:
    submit(shop, "widget", 100, 4.40, po_number="PO-5")
    if when != "submitted":
        drive(shop, stop=lambda: buyer(shop, "PO-5")["status"] == when)
    with shop.transaction() as tx:
        assert po.cancel_purchase_order(tx, "PO-5") is True
    drive(shop)
    assert buyer(shop, "PO-5")["status"] == supplier(shop, "PO-5")["status"] == "cancelled"
    c = compensations(shop, "PO-5")
    assert c[("supplier", "release_reservation")] == released
    assert c[("supplier", "cancel_shipment")].startswith(shipment)
    assert stock(shop)["widget"] == (5000, 0)
    assert endpoint_states(shop, "PO-5") == ("CD", "CD")
    assert queues_empty(shop)


def test_no_agreement_within_max_rounds_cancels(shop: Broker) -> None:
    submit(shop, "widget", 50, 3.50, po_number="PO-6")
    drive(shop)
    b, s = buyer(shop, "PO-6"), supplier(shop, "PO-6")
    assert (b["status"], s["status"]) == ("cancelled", "cancelled")
    assert b["rounds"] == po.MAX_ROUNDS
    assert b["reason"].startswith(f"no agreement after {po.MAX_ROUNDS} rounds")
    assert sent(shop, "PO-6").count("Counter") == po.MAX_ROUNDS
    assert compensations(shop, "PO-6")[("supplier", "release_reservation")] == (
        "released 50 widget"
    )
    assert stock(shop)["widget"] == (5000, 0)
    assert endpoint_states(shop, "PO-6") == ("CD", "CD")


def test_cancel_racing_a_reader_of_the_same_order_waits_for_it(shop: Broker) -> None:
    """The buyer's reader holds the order's conversation group (it has RECEIVEd a Quote) when
    the buyer cancels: the cancel waits for the reader's commit, then cancels what the reader
    left (no deadlock, nothing lost), and the supplier undoes it all."""
    import threading

    submit(shop, "widget", 100, 5.00, po_number="PO-R")
    assert step(shop, po.SUPPLIER_QUEUE, po.supplier_handler)  # the Quote is on its way
    received, errors = threading.Event(), []

    def reader() -> None:
        try:
            with shop.transaction() as tx:
                messages = tx.receive(po.BUYER_QUEUE)
                received.set()
                time.sleep(0.5)  # the cancel starts meanwhile
                po.buyer_handler(tx, messages)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    assert received.wait(10)
    with shop.transaction() as tx:
        assert po.cancel_purchase_order(tx, "PO-R", "race") is True
    thread.join(10)
    assert errors == []
    drive(shop)
    assert buyer(shop, "PO-R")["status"] == supplier(shop, "PO-R")["status"] == "cancelled"
    assert sent(shop, "PO-R")[-2:] == ["Counter", "Cancel"] or sent(shop, "PO-R")[-2:] == [
        "Accept",
        "Cancel",
    ]
    assert stock(shop)["widget"] == (5000, 0)
    assert endpoint_states(shop, "PO-R") == ("CD", "CD")
    assert all(q.status for q in shop.queue_status())


def test_restock_racing_a_reader_of_a_backordered_order_waits_for_it(shop: Broker) -> None:
    """The supplier's reader holds a backordered order (its Cancel just arrived, and releasing
    the reservation updates the stock row) while goods arrive: restock waits for the reader,
    then finds the order cancelled and quotes nothing."""
    import threading

    submit(shop, "sprocket", 100, 2.50, po_number="PO-S")
    drive(shop)
    with shop.transaction() as tx:
        assert po.cancel_purchase_order(tx, "PO-S", "found another supplier")
    received, errors = threading.Event(), []

    def reader() -> None:
        try:
            with shop.transaction() as tx:
                messages = tx.receive(po.SUPPLIER_QUEUE)
                received.set()
                time.sleep(0.5)  # restock starts meanwhile
                po.supplier_handler(tx, messages)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    assert received.wait(10)
    with shop.transaction() as tx:
        assert po.restock(tx, "sprocket", 60) == []
    thread.join(10)
    assert errors == []
    assert supplier(shop, "PO-S")["status"] == "cancelled"
    assert stock(shop)["sprocket"] == (100, 0)
    assert endpoint_states(shop, "PO-S") == ("CD", "CD")


def test_cancel_is_refused_once_the_order_is_over(shop: Broker) -> None:
    submit(shop, "widget", 10, 5.00, po_number="PO-7")
    drive(shop)
    before = snapshot(shop)
    with shop.transaction() as tx:
        assert po.cancel_purchase_order(tx, "PO-7") is False
    after = snapshot(shop)
    assert {k: v for k, v in after.items() if k != "po_event"} == {
        k: v for k, v in before.items() if k != "po_event"
    }
    with shop.engine.connect() as conn:
        last = po.trace(conn, "PO-7")[-1]
    assert len(after["po_event"]) == len(before["po_event"]) + 1
    assert (last["kind"], last["text"]) == ("note", "cancel refused: the order is already complete")
    with pytest.raises(LookupError), shop.transaction() as tx:
        po.cancel_purchase_order(tx, "PO-none")


def test_cancel_is_refused_once_the_supplier_has_closed(shop: Broker) -> None:
    """The supplier read the Payment and ENDed; the buyer has not read that END yet."""
    submit(shop, "widget", 10, 5.00, po_number="PO-8")
    drive(shop, stop=paid(shop, "PO-8"))
    assert step(shop, po.SUPPLIER_QUEUE, po.supplier_handler)
    assert supplier(shop, "PO-8")["status"] == "complete"
    with shop.transaction() as tx:
        assert po.cancel_purchase_order(tx, "PO-8") is False
    drive(shop)
    assert buyer(shop, "PO-8")["status"] == "complete"
    assert compensations(shop, "PO-8") == {}
    assert endpoint_states(shop, "PO-8") == ("CD", "CD")


def test_restock_quotes_backordered_orders(shop: Broker) -> None:
    submit(shop, "sprocket", 100, 2.50, po_number="PO-9", ship_within_days=30)
    drive(shop)
    assert buyer(shop, "PO-9")["status"] == "backordered"
    with shop.transaction() as tx:
        assert po.restock(tx, "sprocket", 50) == []  # still 10 short
    with shop.transaction() as tx:
        assert po.restock(tx, "sprocket", 10) == ["PO-9"]
    drive(shop)
    assert buyer(shop, "PO-9")["status"] == supplier(shop, "PO-9")["status"] == "complete"
    assert stock(shop)["sprocket"] == (0, 0)
    assert endpoint_states(shop, "PO-9") == ("CD", "CD")


def test_messages_after_the_end_of_an_order_are_ignored(shop: Broker) -> None:
    """A Counter that crosses the supplier's END (refusal) is noted, not acted on."""
    order = submit(shop, "gizmo", 1, 12.00, po_number="PO-10")
    with shop.transaction() as tx:  # the buyer sends again before it reads the refusal
        tx.send(order.conversation_handle, po.COUNTER, {"unit_price": 1, "ship_within_days": 1})
    drive(shop)
    assert supplier(shop, "PO-10")["status"] == "refused"
    with shop.engine.connect() as conn:
        notes = [e["text"] for e in po.trace(conn, "PO-10") if e["kind"] == "note"]
    assert notes == ["Counter ignored: the order is refused"]
    assert endpoint_states(shop, "PO-10") == ("CD", "CD")


def test_a_malformed_message_ends_the_dialog_with_an_error_not_a_poisoned_queue(
    shop: Broker,
) -> None:
    """A Quote without a price (from a supplier that is not this example's) can never be
    used: the buyer gives the order up and ENDs WITH ERROR instead of rolling back."""
    submit(shop, "widget", 10, 5.00, po_number="PO-M")
    with shop.transaction() as tx:  # a foreign supplier: no state, a bad quote
        (order,) = tx.receive(po.SUPPLIER_QUEUE)
        tx.send(order.conversation_handle, po.QUOTE, {"po_number": "PO-M", "ship_in_days": 3})
    assert step(shop, po.BUYER_QUEUE, po.buyer_handler) == 1  # committed, not rolled back
    b = buyer(shop, "PO-M")
    assert b["status"] == "cancelled"
    assert b["reason"] == "malformed Quote (KeyError: 'unit_price')"
    assert compensations(shop, "PO-M")[("buyer", "notify")].endswith(
        "malformed Quote (KeyError: 'unit_price')"
    )
    with shop.transaction() as tx:
        (error,) = tx.receive(po.SUPPLIER_QUEUE)
        assert error.error == (po.MALFORMED_MESSAGE, b["reason"])
        tx.end_conversation(error.conversation_handle)
    with shop.transaction() as tx:
        assert tx.conversation(b["conversation_handle"]).state == "CD"
    assert all(q.status for q in shop.queue_status())
    assert queues_empty(shop)


# --------------------------------------------------------------------------------------------
# Compensations are idempotent


#: action -> (the buyer's status to stop at, whose group, what it changes)
LIVE_ORDER: dict[str, tuple[str, str]] = {
    "release_reservation": ("negotiating", "supplier"),  # 300 widget reserved
    "cancel_shipment": ("received", "supplier"),  # 300 widget in transit
    "void_payment": ("paid", "buyer"),  # the buyer paid $1,500.00
    "notify": ("accepted", "supplier"),
}


def effect(broker: Broker, action: str) -> Any:
    """What ``action`` changes besides its own record."""
    return {
        "release_reservation": lambda: stock(broker)["widget"],
        "cancel_shipment": lambda: stock(broker)["widget"],
        "void_payment": lambda: balance(broker, po.BUYER),
        "notify": lambda: compensations(broker, "PO-11"),
    }[action]()


@pytest.mark.parametrize("action", list(LIVE_ORDER))
def test_each_compensation_twice_is_a_no_op(shop: Broker, action: str) -> None:
    """On a live order where the action has something to undo: twice in one transaction and
    once more in another, only the first call acts, and it is recorded once."""
    stop_at, side = LIVE_ORDER[action]
    submit(shop, "widget", 300, 5.00, po_number="PO-11")
    drive(shop, stop=lambda: buyer(shop, "PO-11")["status"] == stop_at)
    row = buyer(shop, "PO-11") if side == "buyer" else supplier(shop, "PO-11")
    group = row["conversation_group_id"]

    def run(conn: Any) -> bool:
        if action == "notify":
            return po.notify(conn, group, "order withdrawn")
        fn: Callable[[Any, uuid.UUID], bool] = getattr(po, action)
        return fn(conn, group)

    before, effect_before = snapshot(shop), effect(shop, action)
    with shop.transaction() as tx:
        assert run(tx.connection) is True
        assert run(tx.connection) is False
    once, effect_once = snapshot(shop), effect(shop, action)
    assert effect_once != effect_before
    assert once != before
    with shop.transaction() as tx:
        assert run(tx.connection) is False
    assert snapshot(shop) == once
    expected = {
        "release_reservation": (5000, 0),
        "cancel_shipment": (5000, 0),  # 300 came back; none is reserved since shipping
        "void_payment": 0,
    }
    if action in expected:
        assert effect_once == expected[action]
    with shop.engine.connect() as conn:
        rows = conn.execute(
            select(func.count())
            .select_from(po.po_compensation)
            .where(
                po.po_compensation.c.conversation_group_id == group,
                po.po_compensation.c.action == action,
            )
        ).scalar_one()
    assert rows == 1


@pytest.mark.parametrize(
    ("number", "item", "qty", "price", "extra"),
    [
        ("PO-12", "gizmo", 1, 12.00, {}),
        ("PO-13", "sprocket", 100, 2.50, {"deadline_seconds": 0.3}),
        ("PO-14", "widget", 250, 5.00, {}),
    ],
)
def test_all_compensations_of_a_finished_saga_run_twice_change_nothing(
    shop: Broker, number: str, item: str, qty: int, price: float, extra: dict[str, Any]
) -> None:
    """Refused, timed out, cancelled after paying: afterwards, every compensation of both sides
    run again (twice) changes nothing: stock, ledgers, orders, records, trace."""
    submit(shop, item, qty, price, po_number=number, **extra)
    if number == "PO-14":
        drive(shop, stop=paid(shop, number))
        with shop.transaction() as tx:
            po.cancel_purchase_order(tx, number)
    drive(shop)
    if extra:
        time.sleep(0.35)
        shop.run_due()
        drive(shop)
    assert buyer(shop, number)["status"] in po.FINAL_STATUSES
    assert supplier(shop, number)["status"] in po.FINAL_STATUSES
    before = snapshot(shop)
    groups = (
        buyer(shop, number)["conversation_group_id"],
        supplier(shop, number)["conversation_group_id"],
    )
    for _ in range(2):
        with shop.transaction() as tx:
            conn = tx.connection
            assert not po.void_payment(conn, groups[0])
            assert not po.notify(conn, groups[0], "again")
            assert not po.cancel_shipment(conn, groups[1])
            assert not po.release_reservation(conn, groups[1])
            assert not po.void_payment(conn, groups[1])
            assert not po.notify(conn, groups[1], "again")
    assert snapshot(shop) == before


def test_compensations_name_the_order_they_need(shop: Broker) -> None:
    with shop.transaction() as tx, pytest.raises(LookupError):
        po.release_reservation(tx.connection, uuid.uuid4())
    order = submit(shop, "widget", 1, 5.00)
    with shop.transaction() as tx, pytest.raises(LookupError, match="only a supplier"):
        po.cancel_shipment(tx.connection, order.conversation_group_id)


# --------------------------------------------------------------------------------------------
# Concurrent readers


def test_concurrent_readers_finish_every_order_exactly_once(shop: Broker) -> None:
    """Many orders of every kind, read by ActivationRunners (up to 3 readers per queue): every
    order reaches one final state once on each side, every dialog is closed, the warehouse and
    the ledgers add up."""
    plan: dict[str, tuple[str, int, float, str]] = {}
    count = 40
    for i in range(count):
        kind = ("happy", "refused", "no_agreement", "cancel_after_paying")[i % 4]
        item, qty, price = {
            "happy": ("widget", 20 + i, 5.00),
            "refused": ("gizmo", 3, 12.00),
            "no_agreement": ("widget", 10, 3.50),
            "cancel_after_paying": ("widget", 30, 5.00),
        }[kind]
        plan[f"PO-{i:03d}"] = (item, qty, price, kind)
    plan["PO-T"] = ("sprocket", 100, 2.50, "timed_out")
    cancel = {n for n, (*_, kind) in plan.items() if kind == "cancel_after_paying"}

    runners = [
        ActivationRunner(
            shop, po.BUYER_QUEUE, buyer_reader(cancel), max_readers=3, poll_interval=0.05
        ),
        ActivationRunner(
            shop, po.SUPPLIER_QUEUE, po.supplier_handler, max_readers=3, poll_interval=0.05
        ),
    ]
    with runners[0], runners[1]:
        for number, (item, qty, price, kind) in plan.items():
            deadline = 1.0 if kind == "timed_out" else 600
            submit(shop, item, qty, price, po_number=number, deadline_seconds=deadline)
        deadline_at = time.monotonic() + 120
        while time.monotonic() < deadline_at:
            with shop.engine.connect() as conn:
                open_orders = (
                    conn.execute(
                        select(func.count())
                        .select_from(po.po_buyer)
                        .where(po.po_buyer.c.status.not_in(po.FINAL_STATUSES))
                    ).scalar_one()
                    + conn.execute(
                        select(func.count())
                        .select_from(po.po_supplier)
                        .where(po.po_supplier.c.status.not_in(po.FINAL_STATUSES))
                    ).scalar_one()
                )
                suppliers = conn.execute(
                    select(func.count()).select_from(po.po_supplier)
                ).scalar_one()
            if open_orders == 0 and suppliers == len(plan) and queues_empty(shop):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"{open_orders} orders still open")
    for r in runners:
        assert r.report.failures == []
        assert 1 <= r.report.max_concurrent <= 3

    expected = {
        "happy": ("complete", "complete"),
        "refused": ("refused", "refused"),
        "no_agreement": ("cancelled", "cancelled"),
        "cancel_after_paying": ("cancelled", "cancelled"),
        "timed_out": ("timed_out", "cancelled"),
    }
    with shop.engine.connect() as conn:
        finals = conn.execute(
            select(po.po_event.c.po_number, po.po_event.c.side, po.po_event.c.text).where(
                po.po_event.c.kind == "state"
            )
        ).all()
    final_events: dict[tuple[str, str], int] = {}
    for number, side, text in finals:
        if text.split(":", 1)[0] in po.FINAL_STATUSES:
            final_events[(number, side)] = final_events.get((number, side), 0) + 1
    shipped = paid_total = 0
    for number, (_item, qty, _price, kind) in plan.items():
        b, s = buyer(shop, number), supplier(shop, number)
        assert (b["status"], s["status"]) == expected[kind], number
        assert final_events[(number, "buyer")] == 1, number
        assert final_events[(number, "supplier")] == 1, number
        assert endpoint_states(shop, number) == ("CD", "CD"), number
        if kind == "happy":
            shipped += qty
            paid_total += s["amount_due"]
        if kind != "happy":
            assert len(compensations(shop, number)) == 6, number
    assert stock(shop) == {"widget": (5000 - shipped, 0), "sprocket": (40, 0), "gizmo": (0, 0)}
    assert balance(shop, po.SUPPLIER) == paid_total
    assert balance(shop, po.BUYER) == -paid_total
    assert queues_empty(shop)
