"""End to end: seed 000's routing service, activated from Airflow, classifies live sales
requests and forwards them across three regional broker databases.

Headquarters and the three regions are PostgreSQL broker databases, each an Airflow connection.
The DAGs folder holds the example files as a user has them: ``sales_by_region.py`` (whose
``sales_router`` DAG is the routing service's activated reader) and ``transmitter.py``. Requests
filed from outside Airflow to ``//sales/Router`` reach the service of their region, each exactly
once, with nobody calling the router or ``deliver()`` by hand.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from support.airflow_stack import airflow_stack
from transport_procs import drain_all

from airflow_broker import Broker
from airflow_broker.examples import sales

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = 60

pytestmark = [pytest.mark.xdist_group("airflow_e2e"), pytest.mark.postgres, pytest.mark.slow]


def _conn(url: str) -> str:
    return json.dumps({"conn_type": "broker", "extra": {"url": url}})


def test_the_activated_routing_service_forwards_requests_to_their_regions(
    tmp_path: Path, make_pg_database: Callable[..., str]
) -> None:
    hq_url = make_pg_database()
    region_urls = {r: make_pg_database() for r in sales.REGIONS}
    resolver = {f"sales_{r}": url for r, url in region_urls.items()}
    hq = Broker.connect(hq_url, resolver=resolver)
    regions = {r: Broker.connect(url) for r, url in region_urls.items()}
    sales.declare(hq, regions)
    dags = tmp_path / "dags"
    dags.mkdir()
    for name in ("sales_by_region.py", "transmitter.py"):
        shutil.copy(ROOT / "dags" / name, dags)
    env = {
        "AIRFLOW_CONN_BROKER_DEFAULT": _conn(hq_url),
        **{f"AIRFLOW_CONN_SALES_{r.upper()}": _conn(url) for r, url in region_urls.items()},
    }
    rng = random.Random(7)
    expected = Counter(rng.choice(sales.REGIONS) for _ in range(REQUESTS))
    try:
        with airflow_stack(tmp_path, dags, extra_env=env) as af:
            af.wait_for_dags("sales_router", "broker_transmitter")
            sales.file_live_requests(hq, REQUESTS, seed=7)
            af.wait_for(
                f"{REQUESTS} requests in the regional queues",
                lambda: sum(sales.depths(regions).values()) >= REQUESTS,
                timeout=300,
            )
            af.wait_for(
                "the router and the transmitter to go idle",
                lambda: (
                    not [
                        r
                        for dag in ("sales_router", "broker_transmitter")
                        for r in af.runs(dag)
                        if r.state in ("queued", "running")
                    ]
                ),
                timeout=120,
            )
            runs = {dag: af.runs(dag) for dag in ("sales_router", "broker_transmitter")}
        got = {r: drain_all(regions[r], sales.queue_of(r)) for r in sales.REGIONS}
    finally:
        hq.dispose()
        for b in regions.values():
            b.dispose()
    assert {r: len(msgs) for r, msgs in got.items()} == {r: expected[r] for r in sales.REGIONS}
    for region, msgs in got.items():
        assert {m.json()["region"] for m in msgs} <= {region}
        assert len({m.conversation_handle for m in msgs}) == len(msgs)  # one dialog each
    for dag, dag_runs in runs.items():
        assert dag_runs, f"{dag} never ran"
        assert all(r.state == "success" for r in dag_runs), (dag, [r.state for r in dag_runs])
