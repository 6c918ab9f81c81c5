"""The purchase-order saga of seed 004, end to end, on the embedded SQLite store.

``python -m airflow_broker.examples.demo [--url URL]`` (``make demo``) sets up the example of
:mod:`airflow_broker.examples.purchase_order` in a new broker database (a SQLite file in a
temporary directory unless ``--url`` names another), starts an
:class:`~airflow_broker.activation.runner.ActivationRunner` on the buyer's and on the supplier's
queue (activation as seed 004 describes it: readers start when messages arrive, up to the queue's
``max_readers``, and exit when it is empty), submits five purchase orders and waits until every
one is over:

- PO-1001 is negotiated over two rounds, shipped, received, invoiced, paid and closed;
- PO-1002 is refused: the supplier has no gizmos;
- PO-1003 waits on a backorder until the buyer's deadline (a conversation timer) passes;
- PO-1004 is cancelled by the buyer's requester right after it was paid;
- PO-1005 finds no price both sides accept within three rounds.

It then prints each order's trace (who sent what, the state changes, the compensations that ran,
the ENDs) from the application's own tables, the compensations, and the books. Nothing here
imports Airflow: the same handlers run in Airflow's reader DAGs (``dags/purchase_order.py``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from airflow_broker import Broker, Message
from airflow_broker.activation.runner import ActivationRunner
from airflow_broker.examples import purchase_order as po
from airflow_broker.storage import schema as broker_schema

if TYPE_CHECKING:
    from airflow_broker.messaging.transaction import Transaction

#: Seconds the demo waits for every order to be over before it gives up (exit status 1).
TIMEOUT = 90.0


@dataclass(frozen=True, slots=True)
class Scenario:
    po_number: str
    title: str
    item: str
    qty: int
    price: float
    deadline_seconds: float = 600
    cancel_after_paying: bool = False


SCENARIOS = (
    Scenario("PO-1001", "happy path: negotiated, shipped, paid, closed", "widget", 500, 4.40),
    Scenario("PO-1002", "refused: the supplier has no gizmos", "gizmo", 20, 12.00),
    Scenario(
        "PO-1003",
        "timed out: backordered, the buyer's 1.5 s deadline passes",
        "sprocket",
        100,
        2.50,
        deadline_seconds=1.5,
    ),
    Scenario(
        "PO-1004",
        "cancelled by the buyer after paying",
        "widget",
        200,
        5.00,
        cancel_after_paying=True,
    ),
    Scenario("PO-1005", "no agreement on price within 3 rounds", "widget", 50, 3.50),
)

CANCEL_REASON = "the requester withdrew the order after it was paid"


def buyer_reader(cancel_after_paying: set[str]) -> Any:
    """The buyer's handler, plus the buyer's requester of the demo: it withdraws the orders in
    ``cancel_after_paying`` in the transaction that pays them (so the supplier gets Payment and
    then Cancel, whatever the timing of the readers)."""

    def handle(tx: Transaction, messages: Sequence[Message]) -> None:
        po.buyer_handler(tx, messages)
        for group in {m.conversation_group_id for m in messages}:
            row = tx.connection.execute(
                select(po.po_buyer.c.po_number, po.po_buyer.c.status).where(
                    po.po_buyer.c.conversation_group_id == group
                )
            ).first()
            if row is not None and row.po_number in cancel_after_paying and row.status == "paid":
                po.cancel_purchase_order(tx, row.po_number, CANCEL_REASON)

    return handle


def _over(broker: Broker, numbers: Sequence[str]) -> bool:
    """Every order final on both sides, and both endpoints of every dialog closed."""
    e = broker_schema.conversation_endpoint
    with broker.engine.connect() as conn:
        buyers = {
            r.po_number: r
            for r in conn.execute(select(po.po_buyer).where(po.po_buyer.c.po_number.in_(numbers)))
        }
        suppliers = {
            r.po_number: r
            for r in conn.execute(
                select(po.po_supplier).where(po.po_supplier.c.po_number.in_(numbers))
            )
        }
        handles = [r.conversation_handle for r in [*buyers.values(), *suppliers.values()]]
        states = list(
            conn.execute(select(e.c.state).where(e.c.conversation_handle.in_(handles))).scalars()
        )
    return (
        len(buyers) == len(numbers)
        and len(suppliers) == len(numbers)
        and all(r.status in po.FINAL_STATUSES for r in buyers.values())
        and all(r.status in po.FINAL_STATUSES for r in suppliers.values())
        and len(states) == 2 * len(numbers)
        and all(s == "CD" for s in states)
    )


VERB = {"send": "SEND ", "state": "state", "compensation": "UNDO ", "end": "END  ", "note": "note "}


def _seconds(at: datetime, start: datetime) -> float:
    return (at.replace(tzinfo=None) - start.replace(tzinfo=None)).total_seconds()


def print_trace(broker: Broker, scenario: Scenario) -> None:
    with broker.engine.connect() as conn:
        events = po.trace(conn, scenario.po_number)
        buyer = po.buyer_order(conn, scenario.po_number)
        supplier = po.supplier_order(conn, scenario.po_number)
    print()
    print(
        f"=== {scenario.po_number}: {scenario.title} "
        f"({scenario.qty} {scenario.item}, limit {po.money(po.to_cents(scenario.price))}/unit)"
    )
    start = events[0]["at"] if events else datetime.now()
    for n, ev in enumerate(events, 1):
        text = "conversation" if ev["kind"] == "end" else ev["text"]
        print(
            f"  {n:2}  +{_seconds(ev['at'], start):5.2f}s  {ev['side']:<8} "
            f"{VERB.get(ev['kind'], ev['kind'])} {text}"
        )
    with broker.transaction() as tx:
        ends = [
            tx.conversation(r["conversation_handle"]) for r in (buyer, supplier) if r is not None
        ]
    shown = ", ".join(
        f"{'buyer' if ep.is_initiator else 'supplier'} {ep.state} ({ep.state_desc})" for ep in ends
    )
    print(f"  endpoints: {shown}")
    print(
        f"  outcome: buyer {buyer['status'] if buyer else '-'}, "
        f"supplier {supplier['status'] if supplier else '-'}"
    )


def print_compensations(broker: Broker) -> None:
    with broker.engine.connect() as conn:
        done = po.compensations(conn)
    print()
    print(f"=== compensations ({len(done)} ran, each once: keyed by conversation group + action)")
    for c in done:
        print(f"  {c['po_number']}  {c['side']:<8} {c['action']:<19} {c['detail']}")


def print_books(broker: Broker, before: dict[str, tuple[int, int]]) -> None:
    with broker.engine.connect() as conn:
        after = po.stock_levels(conn)
        paid = po.ledger_balance(conn, po.BUYER)
        received = po.ledger_balance(conn, po.SUPPLIER)
    print()
    print("=== books")
    for item, (on_hand, reserved) in sorted(after.items()):
        print(
            f"  warehouse {item:<9} on hand {before[item][0]:>5} -> {on_hand:>5}, "
            f"reserved {reserved}"
        )
    print(f"  buyer's ledger: {po.money(paid)}; supplier's ledger: {po.money(received)}")


def run(broker: Broker, scenarios: Sequence[Scenario] = SCENARIOS) -> bool:
    """Play ``scenarios`` with a runner on each queue; True when every order ended in time."""
    with broker.engine.connect() as conn:
        before = po.stock_levels(conn)
    print("warehouse: " + ", ".join(f"{qty} {item}" for item, (qty, _) in sorted(before.items())))
    cancel = {s.po_number for s in scenarios if s.cancel_after_paying}
    buyer = ActivationRunner(
        broker,
        po.BUYER_QUEUE,
        buyer_reader(cancel),
        max_readers=po.BUYER_MAX_READERS,
        poll_interval=0.05,
    )
    supplier = ActivationRunner(
        broker,
        po.SUPPLIER_QUEUE,
        po.supplier_handler,
        max_readers=po.SUPPLIER_MAX_READERS,
        poll_interval=0.05,
    )
    print(
        f"readers: ActivationRunner on {po.BUYER_QUEUE} (up to {po.BUYER_MAX_READERS}) and "
        f"{po.SUPPLIER_QUEUE} (up to {po.SUPPLIER_MAX_READERS})"
    )
    numbers = [s.po_number for s in scenarios]
    began = time.monotonic()
    with buyer, supplier:
        for s in scenarios:
            with broker.transaction() as tx:
                po.submit_purchase_order(
                    tx,
                    s.item,
                    s.qty,
                    s.price,
                    po_number=s.po_number,
                    deadline_seconds=s.deadline_seconds,
                )
        print(f"submitted {len(scenarios)} purchase orders; the readers take it from here")
        while not (finished := _over(broker, numbers)):
            if time.monotonic() - began > TIMEOUT:
                break
            time.sleep(0.05)
    elapsed = time.monotonic() - began
    if finished:
        print(f"every order is over after {elapsed:.1f} s")
    else:
        print(f"NOT every order is over after {elapsed:.1f} s", file=sys.stderr)
    for s in scenarios:
        print_trace(broker, s)
    print_compensations(broker)
    print_books(broker, before)
    print()
    for name, r in ((po.BUYER_QUEUE, buyer.report), (po.SUPPLIER_QUEUE, supplier.report)):
        print(
            f"runner {name}: {r.readers_started} readers started, at most {r.max_concurrent} at "
            f"once, {r.batches} transactions, {r.messages} messages"
            + (f", FAILURES: {r.failures}" if r.failures else "")
        )
    for q in broker.queue_status():
        print(f"queue {q.name}: depth {q.depth}, {'enabled' if q.status else 'DISABLED'}")
    return finished and not buyer.report.failures and not supplier.report.failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", help="broker database (default: a new SQLite file)")
    args = parser.parse_args(argv)
    url = args.url
    if url is None:
        path = Path(tempfile.mkdtemp(prefix="airflow-broker-demo-")) / "broker.db"
        url = f"sqlite:///{path}"
    broker = Broker.connect(url)
    try:
        print(f"broker database: {url}")
        broker.migrate()
        po.setup(broker)
        print(f"broker instance: {broker.instance_id}; purchase-order example set up")
        ok = run(broker)
    finally:
        broker.dispose()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
