"""`make demo` keeps working: the purchase-order dialog runs to the end on SQLite."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_broker import demo


def test_demo_plays_the_whole_purchase_order_dialog(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo.main(["--url", f"sqlite:///{tmp_path / 'demo.db'}"])
    out = capsys.readouterr().out
    received = [line.split(" received ")[1] for line in out.splitlines() if " received " in line]
    kinds = [r.split()[1] for r in received]
    assert kinds == [
        "Order",
        "Quote",
        "Counter",
        "Quote",
        "Accept",
        "ShipNotice",
        "Invoice",
        "Receipt",
        "Payment",
        "EndDialog",
    ]
    assert "endpoints: buyer CD (CLOSED), supplier CD (CLOSED)" in out
    assert "queue BuyerQueue: depth 0, enabled" in out
