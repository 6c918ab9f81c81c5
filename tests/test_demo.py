"""`make demo` (``python -m airflow_broker.examples.demo``): the purchase-order saga runs end to end
on the embedded defaults with the in-process ActivationRunner, without Airflow, in seconds, and
prints each order's trace and the compensations that ran."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airflow_broker.examples import demo

#: How each scenario of the demo ends: (buyer, supplier).
OUTCOMES = {
    "PO-1001": "buyer complete, supplier complete",
    "PO-1002": "buyer refused, supplier refused",
    "PO-1003": "buyer timed_out, supplier cancelled",
    "PO-1004": "buyer cancelled, supplier cancelled",
    "PO-1005": "buyer cancelled, supplier cancelled",
}


def sections(out: str) -> dict[str, str]:
    """The output by ``=== NAME`` section (an order's is ``PO-1001:``)."""
    parts = re.split(r"^=== (\S+)", out, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def check_output(out: str) -> None:
    assert "every order is over after" in out
    parts = sections(out)
    for number, outcome in OUTCOMES.items():
        trace = parts[f"{number}:"]
        assert f"outcome: {outcome}" in trace, number
        assert "endpoints: buyer CD (CLOSED), supplier CD (CLOSED)" in trace, number
    happy = parts["PO-1001:"]
    sends = re.findall(r"^\s+\d+\s+\+\s*[\d.]+s\s+(\w+)\s+SEND\s+(\w+):", happy, flags=re.M)
    assert sends == [
        ("buyer", "Order"),
        ("supplier", "Quote"),
        ("buyer", "Counter"),
        ("supplier", "Quote"),
        ("buyer", "Counter"),
        ("supplier", "Quote"),
        ("buyer", "Accept"),
        ("supplier", "ShipNotice"),
        ("buyer", "Receipt"),
        ("supplier", "Invoice"),
        ("buyer", "Payment"),
    ]
    assert re.search(r"supplier END\s+conversation", happy)
    assert re.search(r"buyer\s+END\s+conversation", happy)
    assert "UNDO" not in happy
    # The compensations, each once.
    compensations = parts["compensations"]
    assert "24 ran" in compensations
    for line in [
        "PO-1002  supplier release_reservation nothing reserved",
        "PO-1003  supplier release_reservation released 40 sprocket",
        "PO-1004  buyer    void_payment        voided payment of $1,000.00",
        "PO-1004  supplier void_payment        refunded $1,000.00 to the buyer",
        "PO-1004  supplier cancel_shipment     took back 200 widget",
        "PO-1005  supplier release_reservation released 50 widget",
    ]:
        assert line in compensations, line
    assert "timed_out: deadline passed" in parts["PO-1003:"]
    books = parts["books"]
    assert "widget    on hand  5000 ->  4500, reserved 0" in books
    assert "buyer's ledger: -$2,200.00; supplier's ledger: $2,200.00" in books
    assert "queue po_buyer_queue: depth 0, enabled" in out
    assert "queue po_supplier_queue: depth 0, enabled" in out
    assert "FAILURES" not in out


def test_make_demo_runs_the_saga_end_to_end() -> None:
    """``python -m airflow_broker.examples.demo`` as ``make demo`` runs it: a new SQLite file."""
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "airflow_broker.examples.demo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - began
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "broker database: sqlite:///" in done.stdout
    check_output(done.stdout)
    assert elapsed < 60, f"the demo took {elapsed:.1f} s"


def test_demo_needs_no_airflow() -> None:
    """The demo runs with Airflow unimportable (``make demo`` installs only the engine)."""
    code = (
        "import runpy, sys\n"
        "class NoAirflow:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'airflow' or name.startswith('airflow.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (blocked)')\n"
        "sys.meta_path.insert(0, NoAirflow())\n"
        "sys.argv = ['airflow_broker.examples.demo']\n"
        "runpy.run_module('airflow_broker.examples.demo', run_name='__main__', alter_sys=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    check_output(done.stdout)


def test_demo_on_a_given_database(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--url", f"sqlite:///{tmp_path / 'demo.db'}"]) == 0
    check_output(capsys.readouterr().out)


def test_demo_on_postgresql(pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--url", pg_url]) == 0
    check_output(capsys.readouterr().out)
