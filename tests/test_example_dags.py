"""The example DAGs in dags/: every file imports without errors (a DagBag of the folder), uses
only ``airflow.sdk`` and ``airflow_broker`` names, and the purchase-order saga (the happy path
and each compensation path) and the echo probe run with ``dag.test()`` from the DAGs folder.

Each scenario runs in a subprocess (this file, run as a script): Airflow reads its settings
(``AIRFLOW_HOME``, the metadata database, the DAGs folder) when it is first imported, and other
tests import it in this process with other settings. The metadata database is migrated once per
module and copied for each scenario; the broker database behind ``broker_default`` is a fresh
SQLite file, migrated by the ``po_setup`` / ``echo_setup`` DAGs.

``dag.test()`` runs no triggerer: the scenario plays the activation monitor's part itself (due
work, then a reader run when the queue has messages). The real scheduler and triggerer are
exercised by tests/test_e2e_activation.py.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DAGS = ROOT / "dags"
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.xdist_group("example_dags")

# The purchase orders the scenario submits through the submit_purchase_order DAG.
ORDERS: dict[str, dict[str, Any]] = {
    "PO-HAPPY": {"item": "widget", "qty": 500, "price": 4.40},
    "PO-REFUSED": {"item": "gizmo", "qty": 5, "price": 12.0},
    "PO-TIMEOUT": {"item": "sprocket", "qty": 100, "price": 2.50, "deadline_seconds": 2},
    "PO-CANCEL": {"item": "widget", "qty": 200, "price": 5.00},  # cancelled after paying
}
CANCEL_REASON = "the requester withdrew it after paying"


def base_env(home: Path, broker_url: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_BROKER_ADDRESS_"))
    }
    env.update(
        {
            "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW_CONN_BROKER_DEFAULT": json.dumps(
                {"conn_type": "broker", "extra": {"url": broker_url}}
            ),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@pytest.fixture(scope="module")
def metadata_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An Airflow metadata database, migrated once for the module's scenarios."""
    home = tmp_path_factory.mktemp("airflow-template")
    done = subprocess.run(
        [str(BIN / "airflow"), "db", "migrate"],
        env=base_env(home, f"sqlite:///{home / 'unused-broker.db'}"),
        cwd=home,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return home / "airflow.db"


def run_scenario(tmp_path: Path, metadata_db: Path, scenario: str) -> dict[str, Any]:
    """Run ``scenario`` of this file in a subprocess; returns the result it wrote."""
    home = tmp_path / "airflow"
    home.mkdir()
    shutil.copy(metadata_db, home / "airflow.db")
    result = tmp_path / "result.json"
    log = tmp_path / "scenario.log"
    broker_url = f"sqlite:///{tmp_path / 'broker.db'}"
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, __file__, scenario, str(result), broker_url],
            env=base_env(home, broker_url),
            cwd=home,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=280,
        )
    text = log.read_text(errors="replace")
    assert done.returncode == 0, f"scenario {scenario} failed:\n{text[-6000:]}"
    data: dict[str, Any] = json.loads(result.read_text())
    data["log"] = text
    return data


# --------------------------------------------------------------------------------------------
# The DAG files


def test_dag_files_import_only_the_task_sdk_and_airflow_broker() -> None:
    files = sorted(DAGS.glob("*.py"))
    assert {f.name for f in files} >= {"purchase_order.py", "echo.py"}
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "airflow":
                    assert name == "airflow.sdk" or name.startswith("airflow.sdk."), (
                        f"{path.name} imports {name}: DAGs use only airflow.sdk names"
                    )


def test_dagbag_has_no_import_errors(tmp_path: Path, metadata_db: Path) -> None:
    data = run_scenario(tmp_path, metadata_db, "dagbag")
    assert data["import_errors"] == {}
    dags = data["dags"]
    assert set(dags) == {
        "po_setup",
        "po_supplier_reader",
        "po_buyer_reader",
        "submit_purchase_order",
        "sales_by_region",
        "cancel_purchase_order",
        "restock",
        "echo_setup",
        "echo_reader",
        "echo_probe_reader",
        "echo_probe",
        "sales_router",
        "broker_transmitter",
        "broker_alerts",
        "long_handler_setup",
        "long_handler_submit",
        "long_handler",
        "po_saga",
        "po_saga_cancel",
    }
    # Each reader DAG is activated by its queue's trigger in an AssetWatcher, and runs at most
    # as many times at once as the queue's activation allows.
    for dag_id, queue, max_readers in [
        ("po_supplier_reader", "po_supplier_queue", 3),
        ("po_buyer_reader", "po_buyer_queue", 2),
        ("echo_reader", "echo_queue", 1),
        ("echo_probe_reader", "echo_prober_queue", 1),
        ("sales_router", "sales_router_queue", 1),
    ]:
        d = dags[dag_id]
        assert d["watchers"] == [
            {
                "trigger": "airflow_broker.provider.triggers.activation.QueueActivationTrigger",
                "queue": queue,
                "broker_conn_id": "broker_default",
                "round_trip": True,
            }
        ], dag_id
        assert d["max_active_runs"] == max_readers, dag_id
        assert d["tasks"] == ["route" if dag_id == "sales_router" else "drain"], dag_id
    # The transmitter: one run at a time, started by the transmission queue's watcher.
    assert dags["broker_transmitter"]["watchers"] == [
        {
            "trigger": "airflow_broker.provider.triggers.transmission.TransmissionTrigger",
            "queue": None,
            "broker_conn_id": "broker_default",
            "round_trip": True,
        }
    ]
    assert dags["broker_transmitter"]["max_active_runs"] == 1
    assert dags["broker_transmitter"]["tasks"] == ["transmit"]
    # Alerts: one asset per kind, each watched by its trigger.
    assert (
        sorted(w["trigger"] for w in dags["broker_alerts"]["watchers"])
        == ["airflow_broker.provider.triggers.alerts.BrokerAlertTrigger"] * 2
    )
    assert all(w["round_trip"] for w in dags["broker_alerts"]["watchers"])
    assert set(dags["submit_purchase_order"]["params"]) >= {"item", "qty", "price"}
    assert dags["submit_purchase_order"]["schedule"] is None
    # The saga DAG (dags/purchase_order_saga.py): manual, one run per order, each step a task.
    s = dags["po_saga"]
    assert s["schedule"] is None and s["watchers"] == []
    assert set(s["params"]) >= {"item", "qty", "price", "ship_within_days", "deadline_seconds"}
    assert set(s["tasks"]) >= {
        "submit",
        "negotiate.wait_quote_1",
        "negotiate.decide_1",
        "wait_shipment",
        "confirm_receipt",
        "wait_invoice",
        "pay",
        "wait_end",
        "close",
        "settle",
        "compensate.release_reservation",
        "compensate.void_payment",
        "compensate.notify",
        "compensate.end_conversation",
        "outcome",
    }
    assert dags["po_saga_cancel"]["params"] == ["po_number", "reason"]


# --------------------------------------------------------------------------------------------
# The purchase-order saga


@pytest.fixture(scope="module")
def saga(tmp_path_factory: pytest.TempPathFactory, metadata_db: Path) -> dict[str, Any]:
    """One run of the saga through the DAGs: every order of ORDERS, to its end."""
    return run_scenario(tmp_path_factory.mktemp("saga"), metadata_db, "purchase_orders")


def test_setup_dag_declares_migrates_and_is_idempotent(saga: dict[str, Any]) -> None:
    setups = [r for r in saga["runs"] if r["dag_id"] == "po_setup"]
    assert [r["state"] for r in setups] == ["success", "success"]
    # The queues' activation names the reader DAGs, and allows what their max_active_runs do.
    assert saga["activation"] == {
        "po_buyer_queue": {"max_readers": 2, "reader": "po_buyer_reader"},
        "po_supplier_queue": {"max_readers": 3, "reader": "po_supplier_reader"},
    }


def test_every_dag_run_of_the_saga_succeeded(saga: dict[str, Any]) -> None:
    failed = [r for r in saga["runs"] if r["state"] != "success" and not r.get("expect_failure")]
    assert failed == []
    readers = [r for r in saga["runs"] if r["dag_id"].endswith("_reader")]
    assert len(readers) >= 10  # the dialog spread over many activated runs
    assert {r["dag_id"] for r in saga["runs"]} >= {
        "po_setup",
        "submit_purchase_order",
        "po_supplier_reader",
        "po_buyer_reader",
        "cancel_purchase_order",
    }


def test_happy_path_through_the_dags(saga: dict[str, Any]) -> None:
    o = saga["orders"]["PO-HAPPY"]
    assert (o["buyer"]["status"], o["supplier"]["status"]) == ("complete", "complete")
    assert o["buyer"]["unit_price"] == 440 and o["buyer"]["rounds"] == 2
    assert o["sent"] == [
        "Order", "Quote", "Counter", "Quote", "Counter", "Quote", "Accept",
        "ShipNotice", "Receipt", "Invoice", "Payment",
    ]  # fmt: skip
    assert o["endpoints"] == ["CD", "CD"]
    assert o["compensations"] == {}
    assert o["ledger"] == {"buyer": -220_000, "supplier": 220_000}


def test_refused_path_through_the_dags(saga: dict[str, Any]) -> None:
    o = saga["orders"]["PO-REFUSED"]
    assert (o["buyer"]["status"], o["supplier"]["status"]) == ("refused", "refused")
    assert o["endpoints"] == ["CD", "CD"]
    assert set(o["compensations"]) == {
        "buyer/void_payment",
        "buyer/notify",
        "supplier/cancel_shipment",
        "supplier/release_reservation",
        "supplier/void_payment",
        "supplier/notify",
    }


def test_timeout_path_through_the_dags(saga: dict[str, Any]) -> None:
    o = saga["orders"]["PO-TIMEOUT"]
    assert (o["buyer"]["status"], o["supplier"]["status"]) == ("timed_out", "cancelled")
    assert o["sent"] == ["Order", "Backorder", "Cancel"]
    assert o["compensations"]["supplier/release_reservation"] == "released 40 sprocket"
    assert o["endpoints"] == ["CD", "CD"]


def test_cancel_after_paying_path_through_the_dags(saga: dict[str, Any]) -> None:
    o = saga["orders"]["PO-CANCEL"]
    assert (o["buyer"]["status"], o["supplier"]["status"]) == ("cancelled", "cancelled")
    assert o["buyer"]["reason"] == CANCEL_REASON
    assert o["sent"][-2:] == ["Payment", "Cancel"]
    assert o["compensations"]["buyer/void_payment"] == "voided payment of $1,000.00"
    assert o["compensations"]["supplier/void_payment"] == "refunded $1,000.00 to the buyer"
    assert o["compensations"]["supplier/cancel_shipment"].startswith("took back 200 widget")
    assert o["ledger"] == {"buyer": 0, "supplier": 0}
    assert o["endpoints"] == ["CD", "CD"]


def test_cancelling_a_finished_order_fails_its_dag_run(saga: dict[str, Any]) -> None:
    late = [r for r in saga["runs"] if r.get("expect_failure")]
    assert [(r["dag_id"], r["state"]) for r in late] == [("cancel_purchase_order", "failed")]
    assert saga["orders"]["PO-HAPPY"]["buyer"]["status"] == "complete"


def test_the_saga_leaves_the_books_balanced(saga: dict[str, Any]) -> None:
    assert saga["stock"] == {
        "widget": [4500, 0],
        "sprocket": [40, 0],
        "gizmo": [0, 0],
    }
    assert saga["queues"] == {
        "po_buyer_queue": 0,
        "po_supplier_queue": 0,
        "po_saga_buyer_queue": 0,  # the saga DAG's buyer (po_saga), unused here
    }


# --------------------------------------------------------------------------------------------
# The echo service


def test_echo_dags(tmp_path: Path, metadata_db: Path) -> None:
    data = run_scenario(tmp_path, metadata_db, "echo")
    states = {r["label"]: r["state"] for r in data["runs"]}
    assert states == {
        "echo_setup": "success",
        "echo_reader": "success",
        "echo_probe_reader": "success",
        "echo_probe (echo alive)": "success",
        "echo_probe (echo down)": "failed",
    }
    # A probe sent from outside, answered by the echo_reader DAG, recorded by the prober's.
    assert data["outside"]["status"] == "alive"
    assert data["outside"]["endpoints"] == ["CD", "CD"]
    # The echo_probe DAG against a live echo service, then against none.
    assert data["alive"]["status"] == "alive"
    assert data["down"]["status"] == "no_answer"


# --------------------------------------------------------------------------------------------
# The scenarios (run in a subprocess: `python tests/test_example_dags.py SCENARIO OUT URL`)


class Scenario:
    """The Airflow side of a scenario: a DagBag of dags/ and ``dag.test()`` runs."""

    def __init__(self, broker_url: str) -> None:
        from airflow.dag_processing.dagbag import DagBag

        from airflow_broker import Broker

        self.bag = DagBag(dag_folder=str(DAGS))
        self.runs: list[dict[str, Any]] = []
        self.broker = Broker.connect(broker_url)

    def run(self, dag_id: str, label: str | None = None, **conf: Any) -> str:
        started = time.monotonic()
        dag_run = self.bag.dags[dag_id].test(run_conf=conf or None)
        state = str(getattr(dag_run.state, "value", dag_run.state))
        self.runs.append(
            {
                "dag_id": dag_id,
                "label": label or dag_id,
                "conf": conf,
                "state": state,
                "seconds": round(time.monotonic() - started, 2),
            }
        )
        print(f"=== dag.test {dag_id} {conf} -> {state}", flush=True)
        return state

    def depth(self) -> dict[str, int]:
        return {q.name: q.depth for q in self.broker.queue_status()}


def scenario_dagbag(broker_url: str) -> dict[str, Any]:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(DAGS))
    dags: dict[str, Any] = {}
    for dag_id, dag in bag.dags.items():
        watchers = []
        condition = getattr(dag.timetable, "asset_condition", None)
        for asset in getattr(condition, "objects", ()):
            for w in getattr(asset, "watchers", ()):
                classpath, kwargs = w.trigger.serialize()
                again = type(w.trigger)(**kwargs).serialize()
                watchers.append(
                    {
                        "trigger": classpath,
                        "queue": kwargs.get("queue"),
                        "broker_conn_id": kwargs.get("broker_conn_id"),
                        "round_trip": again == (classpath, kwargs),
                    }
                )
        dags[dag_id] = {
            "max_active_runs": dag.max_active_runs,
            "tasks": sorted(t.task_id for t in dag.tasks),
            "watchers": watchers,
            "params": sorted(dag.params.keys()),
            "schedule": None if type(dag.timetable).__name__ == "NullTimetable" else "set",
        }
    return {"import_errors": {str(k): str(v) for k, v in bag.import_errors.items()}, "dags": dags}


def scenario_purchase_orders(broker_url: str) -> dict[str, Any]:
    from airflow_broker.examples import purchase_order as po

    s = Scenario(broker_url)
    s.run("po_setup")
    s.run("po_setup")  # again: changes nothing
    for number, params in ORDERS.items():
        # Every param given: in one process, dag.test() lets one run's conf leak into the
        # params of the next run of the same DAG object.
        conf = {"ship_within_days": 14, "deadline_seconds": 3600, **params}
        s.run("submit_purchase_order", po_number=number, **conf)

    def status(number: str) -> str | None:
        with s.broker.engine.connect() as conn:
            row = po.buyer_order(conn, number)
        return None if row is None else str(row["status"])

    def over() -> bool:
        with s.broker.engine.connect() as conn:
            for number in ORDERS:
                b, sup = po.buyer_order(conn, number), po.supplier_order(conn, number)
                if b is None or sup is None:
                    return False
                if b["status"] not in po.FINAL_STATUSES or sup["status"] not in po.FINAL_STATUSES:
                    return False
        return not any(s.depth().values())

    cancelled = False
    deadline = time.monotonic() + 150
    while not over():
        assert time.monotonic() < deadline, "the orders did not finish"
        # The activation monitor's part: due work (the buyer's deadline timer), then a reader
        # run for each queue that has messages.
        s.broker.run_due()
        depth = s.depth()
        ran = False
        for queue, reader in (
            (po.SUPPLIER_QUEUE, po.SUPPLIER_READER_DAG),
            (po.BUYER_QUEUE, po.BUYER_READER_DAG),
        ):
            if depth[queue]:
                s.run(reader)
                ran = True
        if not cancelled and status("PO-CANCEL") == "paid":
            s.run("cancel_purchase_order", po_number="PO-CANCEL", reason=CANCEL_REASON)
            cancelled = True
        if not ran:
            time.sleep(0.2)
    # Too late: the happy order is over.
    s.run("cancel_purchase_order", po_number="PO-HAPPY", reason="too late")
    s.runs[-1]["expect_failure"] = True

    orders: dict[str, Any] = {}
    with s.broker.engine.connect() as conn:
        for number in ORDERS:
            b, sup = po.buyer_order(conn, number), po.supplier_order(conn, number)
            assert b is not None and sup is not None
            orders[number] = {
                "buyer": {k: b[k] for k in ("status", "reason", "unit_price", "rounds")},
                "supplier": {k: sup[k] for k in ("status", "reason", "unit_price")},
                "handles": [b["conversation_handle"], sup["conversation_handle"]],
                "sent": [
                    e["text"].split(":", 1)[0]
                    for e in po.trace(conn, number)
                    if e["kind"] == "send"
                ],
                "compensations": {
                    f"{c['side']}/{c['action']}": c["detail"]
                    for c in po.compensations(conn, number)
                },
                "ledger": {
                    side: po.ledger_balance(conn, side, number) for side in (po.BUYER, po.SUPPLIER)
                },
            }
        stock = {item: list(levels) for item, levels in po.stock_levels(conn).items()}
    with s.broker.transaction() as tx:
        for o in orders.values():
            o["endpoints"] = [tx.conversation(h).state for h in o.pop("handles")]
    catalog = s.broker.catalog()
    activation = {
        q: {k: catalog.queues[q].activation[k] for k in ("max_readers", "reader")}  # type: ignore[index]
        for q in (po.BUYER_QUEUE, po.SUPPLIER_QUEUE)
    }
    return {
        "runs": s.runs,
        "orders": orders,
        "stock": stock,
        "queues": {k: v for k, v in s.depth().items() if k.startswith("po_")},
        "activation": activation,
    }


def scenario_echo(broker_url: str) -> dict[str, Any]:
    from sqlalchemy import select

    from airflow_broker.activation.runner import ActivationRunner
    from airflow_broker.operations import echo
    from airflow_broker.storage import schema

    s = Scenario(broker_url)
    s.run("echo_setup")

    def probe(probe_id: str | None = None) -> dict[str, Any]:
        with s.broker.engine.connect() as conn:
            if probe_id is None:  # the latest
                probe_id = conn.execute(
                    select(echo.echo_probe.c.probe_id)
                    .order_by(echo.echo_probe.c.sent_at.desc())
                    .limit(1)
                ).scalar_one()
            row = echo.probe_status(conn, probe_id)
        assert row is not None
        return {"status": row["status"], "handle": row["conversation_handle"]}

    # 1. A probe sent from outside Airflow; the reader DAGs answer and record it.
    with s.broker.transaction() as tx:
        sent = echo.send_probe(tx, timeout_seconds=60)
    s.run("echo_reader")
    s.run("echo_probe_reader")
    outside = probe(sent.probe_id)
    e = schema.conversation_endpoint
    with s.broker.engine.connect() as conn:
        outside["endpoints"] = [
            conn.execute(select(e.c.state).where(condition)).scalar_one()
            for condition in (
                e.c.conversation_handle == sent.conversation_handle,  # the prober's
                e.c.far_handle == sent.conversation_handle,  # the echo service's
            )
        ]
    outside.pop("handle")

    # 2. The echo_probe DAG while the echo service runs (ActivationRunners with the reader
    #    DAGs' handlers stand in for the triggerer-activated reader runs).
    with (
        ActivationRunner(s.broker, echo.ECHO_QUEUE, echo.echo_handler, poll_interval=0.1),
        ActivationRunner(s.broker, echo.PROBER_QUEUE, echo.probe_reply_handler, poll_interval=0.1),
    ):
        s.run("echo_probe", label="echo_probe (echo alive)", timeout_seconds=30)
    alive = probe()

    # 3. The echo service down: only the prober's reader runs; the probe's timer fires.
    with ActivationRunner(s.broker, echo.PROBER_QUEUE, echo.probe_reply_handler, poll_interval=0.1):
        s.run("echo_probe", label="echo_probe (echo down)", timeout_seconds=1)
    down = probe()
    return {
        "runs": s.runs,
        "outside": outside,
        "alive": {"status": alive["status"]},
        "down": {"status": down["status"]},
    }


SCENARIOS = {
    "dagbag": scenario_dagbag,
    "purchase_orders": scenario_purchase_orders,
    "echo": scenario_echo,
}


def main(argv: list[str]) -> int:
    scenario, out, broker_url = argv
    result = SCENARIOS[scenario](broker_url)
    Path(out).write_text(json.dumps(result, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
