"""A purchase-order dialog between a buyer and a supplier, on the embedded SQLite store.

``python -m airflow_broker.demo [--url URL]`` (``make demo``) declares the two services, then
plays the conversation of seed 004 step by step, each side in its own transactions as two
separate applications would: the buyer submits a purchase order, the supplier reserves stock and
quotes, they agree on price and ship date, the supplier ships and invoices, the buyer confirms
receipt and pays, and both sides end the dialog. It prints every message as it is received and
the state of both conversation endpoints along the way.
"""

from __future__ import annotations

import argparse
import tempfile
import uuid
from pathlib import Path
from typing import Any

from airflow_broker import END_DIALOG, Broker, Transaction

PO = "//airflow-broker/demo/purchase-order"
BUYER, SUPPLIER = f"{PO}/Buyer", f"{PO}/Supplier"
CONTRACT = f"{PO}/Contract"

#: message type -> who may send it
MESSAGE_TYPES = {
    f"{PO}/Order": "initiator",
    f"{PO}/Quote": "target",
    f"{PO}/Counter": "initiator",
    f"{PO}/Accept": "initiator",
    f"{PO}/ShipNotice": "target",
    f"{PO}/Receipt": "initiator",
    f"{PO}/Invoice": "target",
    f"{PO}/Payment": "initiator",
}


def declare(broker: Broker) -> None:
    with broker.definitions() as d:
        for mt in MESSAGE_TYPES:
            d.create_message_type(mt, validation="json")
        d.create_contract(CONTRACT, MESSAGE_TYPES)
        d.create_queue("BuyerQueue")
        d.create_queue("SupplierQueue")
        d.create_service(BUYER, queue="BuyerQueue")
        d.create_service(SUPPLIER, queue="SupplierQueue", contracts=[CONTRACT])


def short(name: str) -> str:
    return name.rsplit("/", 1)[-1]


class Trace:
    def __init__(self) -> None:
        self.step = 0

    def received(self, who: str, tx: Transaction, queue: str) -> list[Any]:
        msgs = tx.receive(queue)
        for m in msgs:
            self.step += 1
            body = "" if m.message_type_name == END_DIALOG else f" {m.json()}"
            print(
                f"{self.step:2}. {who:<8} received #{m.message_sequence_number} "
                f"{short(m.message_type_name)}{body}"
            )
        return msgs


def states(broker: Broker, buyer: uuid.UUID, supplier: uuid.UUID | None) -> str:
    with broker.transaction() as tx:
        b = tx.conversation(buyer)
        s = tx.conversation(supplier) if supplier else None
    far = f"{s.state} ({s.state_desc})" if s else "-"
    return f"    endpoints: buyer {b.state} ({b.state_desc}), supplier {far}"


def run(broker: Broker) -> None:
    trace = Trace()
    send = f"{PO}/"
    with broker.transaction() as tx:
        buyer_h = tx.begin_dialog(BUYER, SUPPLIER, CONTRACT, lifetime_seconds=30 * 24 * 3600)
        tx.send(buyer_h, send + "Order", {"po": "PO-1001", "item": "widget", "qty": 500})
    print(f"buyer began dialog {buyer_h} and sent Order PO-1001")
    print(states(broker, buyer_h, None))

    with broker.transaction() as tx:
        (order,) = trace.received("supplier", tx, "SupplierQueue")
        supplier_h = order.conversation_handle
        tx.send(supplier_h, send + "Quote", {"po": "PO-1001", "reserved": 500, "unit_price": 4.1})
    print(states(broker, buyer_h, supplier_h))

    with broker.transaction() as tx:
        trace.received("buyer", tx, "BuyerQueue")
        tx.send(buyer_h, send + "Counter", {"po": "PO-1001", "unit_price": 3.9})
    with broker.transaction() as tx:
        trace.received("supplier", tx, "SupplierQueue")
        tx.send(supplier_h, send + "Quote", {"po": "PO-1001", "unit_price": 4.0, "ship": "12-01"})
    with broker.transaction() as tx:
        trace.received("buyer", tx, "BuyerQueue")
        tx.send(buyer_h, send + "Accept", {"po": "PO-1001", "unit_price": 4.0, "ship": "12-01"})
    with broker.transaction() as tx:
        trace.received("supplier", tx, "SupplierQueue")
        tx.send(supplier_h, send + "ShipNotice", {"po": "PO-1001", "tracking": "TRK-77"})
        tx.send(supplier_h, send + "Invoice", {"po": "PO-1001", "amount": 2000.0})
    with broker.transaction() as tx:
        trace.received("buyer", tx, "BuyerQueue")
        tx.send(buyer_h, send + "Receipt", {"po": "PO-1001", "received": 500})
        tx.send(buyer_h, send + "Payment", {"po": "PO-1001", "amount": 2000.0})
    with broker.transaction() as tx:
        trace.received("supplier", tx, "SupplierQueue")
        tx.end_conversation(supplier_h)
    print("supplier ended the dialog")
    print(states(broker, buyer_h, supplier_h))
    with broker.transaction() as tx:
        trace.received("buyer", tx, "BuyerQueue")
        tx.end_conversation(buyer_h)
    print("buyer ended the dialog")
    print(states(broker, buyer_h, supplier_h))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="broker database (default: a new SQLite file)")
    args = parser.parse_args(argv)
    url = args.url
    if url is None:
        path = Path(tempfile.mkdtemp(prefix="airflow-broker-demo-")) / "broker.db"
        url = f"sqlite:///{path}"
    broker = Broker.connect(url)
    print(f"broker database: {url}")
    broker.migrate()
    print(f"broker instance: {broker.instance_id}")
    declare(broker)
    run(broker)
    for q in broker.queue_status():
        print(f"queue {q.name}: depth {q.depth}, {'enabled' if q.status else 'DISABLED'}")
    broker.dispose()


if __name__ == "__main__":
    main()
