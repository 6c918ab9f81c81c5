"""`make demo-spark` (``python -m airflow_broker.examples.sales_demo``): the example DAG
sales_by_region runs under ``airflow dags test`` with ``spark_default`` on ``local[*]``; the
Spark job (a real spark-submit) routes every request to its region's SQLite database."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_broker import Broker
from airflow_broker.examples import sales

pytestmark = [pytest.mark.xdist_group("spark"), pytest.mark.timeout(600)]

DAGS = Path(__file__).resolve().parents[1] / "dags"
REQUESTS = 400


def test_the_spark_demo_routes_every_request_to_its_region(tmp_path: Path) -> None:
    home = tmp_path / "home"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "airflow_broker.examples.sales_demo",
            "--requests",
            str(REQUESTS),
            "--dags-folder",
            str(DAGS),
            "--home",
            str(home),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-4000:]
    assert f"{REQUESTS} of {REQUESTS} requests arrived" in out
    assert re.search(rf"the Spark job read {REQUESTS} messages, delivered {REQUESTS}", out), out
    # What the demo printed is what the regions' databases hold, every region some.
    printed = {
        region: int(re.search(rf"{re.escape(sales.service_of(region))}\s+(\d+) requests", out)[1])  # type: ignore[index]
        for region in sales.REGIONS
    }
    regions = {r: Broker.connect(f"sqlite:///{home / f'sales_{r}.db'}") for r in sales.REGIONS}
    try:
        assert sales.depths(regions) == printed
    finally:
        for b in regions.values():
            b.dispose()
    assert all(printed.values()) and sum(printed.values()) == REQUESTS
    # Headquarters is the embedded store, its transmission queue now empty.
    hq = Broker.connect(f"sqlite:///{home / 'broker.db'}")
    try:
        assert hq.transmission_queue() == []
    finally:
        hq.dispose()
