"""End to end: a queue disabled by poison handling becomes an asset event, and the example DAG
scheduled on it (dags/broker_alerts.py, as a user has it) runs, under a real scheduler, DAG
processor and triggerer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import SUPPLIER_QUEUE, declare_pair, poison
from support.airflow_stack import airflow_stack

from airflow_broker import Broker

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.xdist_group("airflow_e2e"), pytest.mark.postgres, pytest.mark.slow]


def test_a_disabled_queue_runs_the_dag_scheduled_on_its_alert(
    tmp_path: Path, make_pg_database: Callable[..., str]
) -> None:
    url = make_pg_database()
    broker = Broker.connect(url)
    declare_pair(broker)
    dags = tmp_path / "dags"
    dags.mkdir()
    shutil.copy(ROOT / "dags" / "broker_alerts.py", dags)
    env = {
        "AIRFLOW_CONN_BROKER_DEFAULT": json.dumps({"conn_type": "broker", "extra": {"url": url}})
    }
    try:
        with airflow_stack(tmp_path, dags, extra_env=env) as af:
            af.wait_for_dags("broker_alerts")
            assert af.runs("broker_alerts") == []
            poison(broker)
            af.wait_for(
                "the alert DAG to run",
                lambda: [r for r in af.runs("broker_alerts") if r.state in ("success", "failed")],
                timeout=180,
            )
            runs = af.runs("broker_alerts")
            events = af.query(
                "SELECT e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id"
                " WHERE a.uri = 'broker-alert://broker_default/queue_disabled'"
            )
            xcoms = af.query(
                "SELECT value FROM xcom WHERE dag_id = 'broker_alerts' AND key = 'return_value'"
            )
    finally:
        broker.dispose()
    assert [r.state for r in runs] == ["success"], runs
    assert len(events) == 1
    extra: Any = events[0][0]
    payload = (extra if isinstance(extra, dict) else json.loads(extra))["payload"]
    assert (payload["kind"], payload["object"]) == ("queue_disabled", SUPPLIER_QUEUE)
    (value,) = [x[0] for x in xcoms]
    reported = value if isinstance(value, list) else json.loads(value)
    assert [a["object"] for a in reported] == [SUPPLIER_QUEUE]
