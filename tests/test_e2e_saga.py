"""End to end: the purchase-order saga DAG (``po_saga``, dags/purchase_order_saga.py) under a real
scheduler, DAG processor, triggerer and API server, one run per order, the supplier being the
activated reader ``po_supplier_reader`` (dags/purchase_order.py; both files are copied into the
deployment's DAGs folder).

Four orders: one that completes (three quotes, two counter-offers), one the supplier refuses
(no stock), one cancelled by ``po_saga_cancel`` while its run waits (deferred) for a quote after
a backorder, and one whose deadline (the conversation timer) fires while its run waits. For each:
the task states a user sees in the grid (read from the metadata database, as the other e2e tests
do), the run's state, and the broker database afterwards: nothing reserved, nothing charged
(the completed order charged once), both endpoints closed, nothing left in the saga's queue.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.airflow_stack import AirflowStack, airflow_stack

from airflow_broker import Broker
from airflow_broker.examples import purchase_order as po
from airflow_broker.examples.purchase_order import saga

ROOT = Path(__file__).resolve().parents[1]
DAG_FILES = ("purchase_order.py", "purchase_order_saga.py")
SAGA, CANCEL = "po_saga", "po_saga_cancel"

pytestmark = [pytest.mark.xdist_group("airflow_e2e"), pytest.mark.postgres, pytest.mark.slow]

#: Items of this module's warehouse besides the example's (one per backorder scenario, so that
#: each scenario's stock is its own): 40 on hand, and the orders ask for 60.
BACKORDER_ITEMS = ("sprocket-cancel", "sprocket-deadline")

SLOTS = range(1, saga.QUOTE_SLOTS + 1)
STEPS = ("wait_shipment", "confirm_receipt", "wait_invoice", "pay", "wait_end", "close")
COMPENSATIONS = (
    "compensate.release_reservation",
    "compensate.void_payment",
    "compensate.notify",
    "compensate.end_conversation",
)


def _grid(quotes: int, *, completed: bool) -> dict[str, str]:
    """The task states of a run that got ``quotes`` answers (quote or backorder) from the
    supplier before it accepted (``completed``) or gave the order up."""
    grid = {"submit": "success"}
    for slot in SLOTS:
        state = "success" if slot <= quotes else "skipped"
        grid[f"negotiate.wait_quote_{slot}"] = grid[f"negotiate.decide_{slot}"] = state
    grid.update(dict.fromkeys(STEPS, "success" if completed else "skipped"))
    grid["settle"] = "success"
    grid.update(dict.fromkeys(COMPENSATIONS, "skipped" if completed else "success"))
    grid["outcome"] = "success" if completed else "failed"
    return grid


@pytest.fixture(scope="module")
def shop(
    tmp_path_factory: pytest.TempPathFactory, postgres_server: Any
) -> Iterator[tuple[AirflowStack, Broker]]:
    """One deployment for the module: the broker database set up as ``po_setup`` does (the
    declarations, with the saga buyer's service and queue; the tables; the warehouse)."""
    broker_url = postgres_server.create_database()
    broker = Broker.connect(broker_url)
    po.setup(broker)
    po.seed_stock(
        broker,
        [
            po.StockItem(item, 40, list_price=250, floor_price=200, lead_days=10, rush_days=5)
            for item in BACKORDER_ITEMS
        ],
    )
    tmp = tmp_path_factory.mktemp("saga")
    dags = tmp / "dags"
    dags.mkdir()
    for name in DAG_FILES:
        shutil.copy(ROOT / "dags" / name, dags)
    env = {
        "AIRFLOW_CONN_BROKER_DEFAULT": json.dumps(
            {"conn_type": "broker", "extra": {"url": broker_url}}
        )
    }
    metadata_url = postgres_server.create_database(migrated=False)
    with airflow_stack(tmp, dags, metadata_url=metadata_url, extra_env=env) as af:
        af.wait_for_dags(SAGA, CANCEL, po.SUPPLIER_READER_DAG)
        yield af, broker
        # The saga's queue is read by its runs only: the buyer's reader never started.
        assert af.runs(po.BUYER_READER_DAG) == []
    broker.dispose()


# --------------------------------------------------------------------------------------------
# Helpers


def _trigger(af: AirflowStack, dag_id: str, run_id: str, conf: dict[str, Any]) -> None:
    af.airflow("dags", "trigger", dag_id, "--run-id", run_id, "--conf", json.dumps(conf))


def _run_state(af: AirflowStack, dag_id: str, run_id: str) -> str | None:
    rows = af.query(
        "SELECT state FROM dag_run WHERE dag_id = :d AND run_id = :r", d=dag_id, r=run_id
    )
    return str(rows[0].state) if rows else None


def _finished(af: AirflowStack, dag_id: str, run_id: str, timeout: float = 300) -> str:
    return str(
        af.wait_for(
            f"{dag_id} run {run_id} to finish",
            lambda: (s := _run_state(af, dag_id, run_id)) in ("success", "failed") and s,
            timeout=timeout,
        )
    )


def _tasks(af: AirflowStack, run_id: str) -> dict[str, str | None]:
    rows = af.query(
        "SELECT task_id, state FROM task_instance WHERE dag_id = :d AND run_id = :r",
        d=SAGA,
        r=run_id,
    )
    return {r.task_id: r.state for r in rows}


def _deferred(af: AirflowStack, run_id: str, task_id: str) -> bool:
    return _tasks(af, run_id).get(task_id) == "deferred"


def _order(broker: Broker, po_number: str) -> dict[str, Any]:
    """The order as the broker database has it afterwards, on both sides."""
    with broker.engine.connect() as conn:
        buyer = po.buyer_order(conn, po_number)
        supplier = po.supplier_order(conn, po_number)
        assert buyer is not None
        out = {
            "buyer": buyer,
            "supplier": supplier,
            "sent": [
                e["text"].split(":", 1)[0] for e in po.trace(conn, po_number) if e["kind"] == "send"
            ],
            "trace": [f"{e['side']} {e['kind']} {e['text']}" for e in po.trace(conn, po_number)],
            "compensations": {
                f"{c['side']}/{c['action']}": c["detail"] for c in po.compensations(conn, po_number)
            },
            "ledger": {
                side: po.ledger_balance(conn, side, po_number) for side in (po.BUYER, po.SUPPLIER)
            },
            "stock": po.stock_levels(conn),
        }
    with broker.transaction() as tx:
        handles = [buyer["conversation_handle"]]
        if supplier is not None:
            handles.append(supplier["conversation_handle"])
        out["endpoints"] = [tx.conversation(h).state for h in handles]
    return out


def _closed(broker: Broker, po_number: str) -> dict[str, Any] | None:
    """The order once both endpoints are CLOSED and the saga's queue is empty, else None."""
    o = _order(broker, po_number)
    depth = {q.name: q.depth for q in broker.queue_status()}
    if o["endpoints"] == ["CD", "CD"] and depth[po.SAGA_BUYER_QUEUE] == 0:
        return o
    return None


def _settled(af: AirflowStack, broker: Broker, po_number: str) -> dict[str, Any]:
    o = af.wait_for(
        f"both endpoints of {po_number} to close", lambda: _closed(broker, po_number), timeout=120
    )
    assert isinstance(o, dict)
    return o


def _check_grid(af: AirflowStack, run_id: str, expected: dict[str, str], o: Any) -> None:
    tasks = _tasks(af, run_id)
    assert tasks == expected, "\n".join(o["trace"]) if isinstance(o, dict) else o


# --------------------------------------------------------------------------------------------
# The four orders


@pytest.mark.timeout(900)
def test_happy_path_completes_and_skips_the_compensations(
    shop: tuple[AirflowStack, Broker],
) -> None:
    af, broker = shop
    run_id, number = "happy", "PO-SAGA-HAPPY"
    _trigger(af, SAGA, run_id, {"item": "widget", "qty": 500, "price": 4.40, "po_number": number})
    assert _finished(af, SAGA, run_id) == "success"
    o = _settled(af, broker, number)

    _check_grid(af, run_id, _grid(quotes=3, completed=True), o)
    assert (o["buyer"]["status"], o["supplier"]["status"]) == ("complete", "complete")
    assert o["buyer"]["unit_price"] == 440 and o["buyer"]["rounds"] == 2
    assert o["sent"] == [
        "Order", "Quote", "Counter", "Quote", "Counter", "Quote", "Accept",
        "ShipNotice", "Receipt", "Invoice", "Payment",
    ]  # fmt: skip
    assert o["compensations"] == {}
    assert o["ledger"] == {"buyer": -220_000, "supplier": 220_000}  # charged once
    assert o["stock"]["widget"] == (4500, 0)  # shipped, nothing left reserved
    assert o["endpoints"] == ["CD", "CD"]


@pytest.mark.timeout(900)
def test_a_refusal_skips_the_steps_and_runs_the_compensations(
    shop: tuple[AirflowStack, Broker],
) -> None:
    af, broker = shop
    run_id, number = "refusal", "PO-SAGA-REFUSED"
    _trigger(af, SAGA, run_id, {"item": "gizmo", "qty": 5, "price": 12.0, "po_number": number})
    assert _finished(af, SAGA, run_id) == "failed"  # the order did not go through
    o = _settled(af, broker, number)

    _check_grid(af, run_id, _grid(quotes=1, completed=False), o)
    assert (o["buyer"]["status"], o["supplier"]["status"]) == ("refused", "refused")
    assert o["sent"] == ["Order", "Refuse"]  # the supplier had closed: no Cancel
    assert o["compensations"]["buyer/void_payment"] == "nothing paid"
    assert o["compensations"]["buyer/notify"] == (
        f"requester: order {number} refused: gizmo is out of stock"
    )
    assert o["compensations"]["supplier/release_reservation"] == "nothing reserved"
    assert o["ledger"] == {"buyer": 0, "supplier": 0}
    assert o["stock"]["gizmo"] == (0, 0)
    assert o["endpoints"] == ["CD", "CD"]


@pytest.mark.timeout(900)
def test_a_cancellation_while_the_run_waits_wakes_it_and_compensates(
    shop: tuple[AirflowStack, Broker],
) -> None:
    af, broker = shop
    run_id, number, item = "cancel", "PO-SAGA-CANCEL", "sprocket-cancel"
    _trigger(af, SAGA, run_id, {"item": item, "qty": 60, "price": 3.0, "po_number": number})
    # The supplier backorders (40 of 60 reserved); the run waits for a quote, in the triggerer.
    af.wait_for(
        "the run to wait (deferred) for a quote after the backorder",
        lambda: _deferred(af, run_id, "negotiate.wait_quote_2"),
        timeout=240,
    )
    with broker.engine.connect() as conn:
        assert po.stock_levels(conn)[item] == (40, 40)  # reserved while the run waits
    _trigger(af, CANCEL, "cancel-it", {"po_number": number, "reason": "the requester withdrew it"})
    assert _finished(af, CANCEL, "cancel-it") == "success"
    assert _finished(af, SAGA, run_id) == "failed"
    o = _settled(af, broker, number)

    _check_grid(af, run_id, _grid(quotes=2, completed=False), o)
    assert (o["buyer"]["status"], o["supplier"]["status"]) == ("cancelled", "cancelled")
    assert o["buyer"]["reason"] == "the requester withdrew it"
    assert o["sent"] == ["Order", "Backorder", "Cancel"]
    assert o["compensations"]["supplier/release_reservation"] == f"released 40 {item}"
    assert o["compensations"]["buyer/void_payment"] == "nothing paid"
    assert o["ledger"] == {"buyer": 0, "supplier": 0}
    assert o["stock"][item] == (40, 0)  # nothing reserved any more
    assert o["endpoints"] == ["CD", "CD"]

    # A second cancel of the same order fails: it is over.
    _trigger(af, CANCEL, "cancel-again", {"po_number": number, "reason": "again"})
    assert _finished(af, CANCEL, "cancel-again") == "failed"


@pytest.mark.timeout(900)
def test_the_deadline_fires_while_the_run_waits_and_compensates(
    shop: tuple[AirflowStack, Broker],
) -> None:
    af, broker = shop
    run_id, number, item = "deadline", "PO-SAGA-DEADLINE", "sprocket-deadline"
    conf = {"item": item, "qty": 60, "price": 3.0, "po_number": number, "deadline_seconds": 90}
    _trigger(af, SAGA, run_id, conf)
    af.wait_for(
        "the run to wait (deferred) for a quote after the backorder",
        lambda: _deferred(af, run_id, "negotiate.wait_quote_2"),
        timeout=80,  # before the deadline
    )
    assert _finished(af, SAGA, run_id) == "failed"
    o = _settled(af, broker, number)

    _check_grid(af, run_id, _grid(quotes=2, completed=False), o)
    assert (o["buyer"]["status"], o["supplier"]["status"]) == ("timed_out", "cancelled")
    assert o["buyer"]["reason"].startswith("deadline passed")
    assert o["sent"] == ["Order", "Backorder", "Cancel"]
    assert o["compensations"]["supplier/release_reservation"] == f"released 40 {item}"
    assert o["ledger"] == {"buyer": 0, "supplier": 0}
    assert o["stock"][item] == (40, 0)
    assert o["endpoints"] == ["CD", "CD"]
