"""The engine half of the purchase-order saga DAG (airflow_broker.examples.purchase_order.saga),
driven step by step as the DAG's tasks call it, without Airflow, on SQLite and PostgreSQL: the
supplier is its handler, read until its queue is empty between two steps. The DAG itself, under
a real scheduler and triggerer, is tests/test_e2e_saga.py."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from airflow_broker import Broker
from airflow_broker.examples import purchase_order as po
from airflow_broker.examples.purchase_order import saga


@pytest.fixture
def shop(broker: Broker) -> Broker:
    po.setup(broker)
    return broker


def supplier(b: Broker) -> None:
    """The supplier's reader: until its queue is empty."""
    while True:
        with b.transaction() as tx:
            messages = tx.receive(po.SUPPLIER_QUEUE)
            if not messages:
                return
            po.supplier_handler(tx, messages)


def submit(b: Broker, item: str, qty: int, price: float, deadline: float = 3600) -> uuid.UUID:
    with b.transaction() as tx:
        order = saga.submit_saga_order(
            tx, item, qty, price, po_number="PO-S", deadline_seconds=deadline
        )
    return order.conversation_handle


def negotiate(b: Broker, h: uuid.UUID, before_each: Any = None) -> list[str]:
    """The negotiate group: a decide per quote slot, until the order is accepted or over."""
    path = []
    for slot in range(1, saga.QUOTE_SLOTS + 1):
        supplier(b)
        if before_each is not None:
            before_each(slot)
        with b.transaction() as tx:
            status = saga.decide(tx, h, last=slot == saga.QUOTE_SLOTS)
        path.append(status)
        if status == "accepted" or status in po.FINAL_STATUSES:
            break
    return path


def compensate(b: Broker, h: uuid.UUID) -> list[str]:
    with b.transaction() as tx:
        settled = saga.settle(tx, h)
    if settled is None:
        return []
    done = []
    with b.transaction() as tx:
        done.append(saga.release_reservation(tx, h, failed=settled["failed"]))
    with b.transaction() as tx:
        done.append(saga.void_saga_payment(tx, h))
    with b.transaction() as tx:
        done.append(saga.notify_requester(tx, h))
    with b.transaction() as tx:
        done.append(saga.end_order(tx, h, failed=settled["failed"]))
    supplier(b)
    return done


def books(b: Broker, h: uuid.UUID) -> dict[str, Any]:
    with b.engine.connect() as conn:
        buyer = po.buyer_order(conn, "PO-S")
        sup = po.supplier_order(conn, "PO-S")
        assert buyer is not None and sup is not None
        out = {
            "status": (buyer["status"], sup["status"]),
            "stock": po.stock_levels(conn),
            "ledger": (po.ledger_balance(conn, po.BUYER), po.ledger_balance(conn, po.SUPPLIER)),
            "sent": [
                e["text"].split(":")[0] for e in po.trace(conn, "PO-S") if e["kind"] == "send"
            ],
        }
    with b.transaction() as tx:
        out["endpoints"] = [tx.conversation(x).state for x in (h, sup["conversation_handle"])]
    out["queues"] = {q.name: q.depth for q in b.queue_status()}
    return out


EMPTY = {po.BUYER_QUEUE: 0, po.SUPPLIER_QUEUE: 0, po.SAGA_BUYER_QUEUE: 0}


def test_the_saga_buyer_has_its_own_service_and_a_queue_no_reader_drains(shop: Broker) -> None:
    catalog = shop.catalog()
    assert catalog.services[po.SAGA_BUYER_SERVICE].queue == po.SAGA_BUYER_QUEUE
    assert catalog.queues[po.SAGA_BUYER_QUEUE].activation is None
    assert po.declare(shop) == []


def test_happy_path_step_by_step(shop: Broker) -> None:
    h = submit(shop, "widget", 500, 4.40)
    assert negotiate(shop, h) == ["negotiating", "negotiating", "accepted"]
    for step, expected in ((saga.take_step, "received"), (saga.take_step, "paid")):
        supplier(shop)
        with shop.transaction() as tx:
            assert step(tx, h) == expected
    supplier(shop)
    with shop.transaction() as tx:
        assert saga.close_order(tx, h) == "complete"
    assert compensate(shop, h) == []
    b = books(shop, h)
    assert b["status"] == ("complete", "complete")
    assert b["ledger"] == (-220_000, 220_000)
    assert b["stock"]["widget"] == (4500, 0)
    assert b["endpoints"] == ["CD", "CD"] and b["queues"] == EMPTY


def test_a_refusal_is_compensated_by_the_saga_tasks(shop: Broker) -> None:
    h = submit(shop, "gizmo", 5, 12.0)
    assert negotiate(shop, h) == ["refused"]
    assert compensate(shop, h) == [
        "the supplier had closed the order",
        "nothing paid",
        "requester: order PO-S refused: gizmo is out of stock",
        "ended",
    ]
    b = books(shop, h)
    assert b["status"] == ("refused", "refused") and b["ledger"] == (0, 0)
    assert b["endpoints"] == ["CD", "CD"] and b["queues"] == EMPTY


def test_a_cancel_request_wakes_the_order_with_its_timer(shop: Broker) -> None:
    h = submit(shop, "sprocket", 60, 3.0)

    def cancel(slot: int) -> None:
        if slot == 2:  # waiting for a quote after the backorder
            with shop.transaction() as tx:
                assert saga.request_cancel(tx, "PO-S", "withdrawn")
            shop.run_due()  # what the waiting sensor's trigger does: the DialogTimer arrives

    assert negotiate(shop, h, cancel) == ["backordered", "cancelled"]
    done = compensate(shop, h)
    assert done[0] == "sent Cancel: the supplier releases the reservation"
    assert done[-1] == "ended"
    b = books(shop, h)
    assert b["status"] == ("cancelled", "cancelled")
    assert b["sent"] == ["Order", "Backorder", "Cancel"]
    assert b["stock"]["sprocket"] == (40, 0) and b["ledger"] == (0, 0)
    assert b["endpoints"] == ["CD", "CD"] and b["queues"] == EMPTY
    with shop.transaction() as tx:
        assert not saga.request_cancel(tx, "PO-S", "again")  # over


def test_a_failed_step_ends_with_error_and_the_supplier_compensates(shop: Broker) -> None:
    h = submit(shop, "sprocket", 10, 3.0)
    supplier(shop)  # quoted: 10 reserved; the buyer's step never runs (it failed)
    with shop.engine.connect() as conn:
        assert po.stock_levels(conn)["sprocket"] == (40, 10)
    done = compensate(shop, h)  # settle finds the order open: a step failed
    assert done[-1].startswith(f"ended with error {saga.SAGA_STEP_FAILED}")
    b = books(shop, h)
    assert b["status"] == ("cancelled", "cancelled")
    assert b["stock"]["sprocket"] == (40, 0)
    assert b["endpoints"] == ["CD", "CD"] and b["queues"] == EMPTY


def test_cancel_requests_for_orders_of_the_reader_buyer_are_refused(shop: Broker) -> None:
    with shop.transaction() as tx:
        po.submit_purchase_order(tx, "widget", 5, 5.0, po_number="PO-R")
    with shop.transaction() as tx, pytest.raises(ValueError, match="not a saga's"):
        saga.request_cancel(tx, "PO-R", "no")
