"""SparkRoutingOperator from a DAG run on a real scheduler: the example DAG sales_by_region
launches the Spark job through spark-submit in local mode; the brokers' URLs (one with a
password) reach it only in its environment, never in the task log or rendered fields."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.airflow_stack import airflow_stack

from airflow_broker import Broker
from airflow_broker.examples import sales

# With the Spark tests, not the other Airflow deployments: each half of the suite's two
# workers then carries about as much (one Airflow deployment and one Spark job at a time).
pytestmark = [pytest.mark.xdist_group("spark"), pytest.mark.timeout(900)]

DAGS = Path(__file__).parent.parent / "dags"
SECRET = "s3cret-Pa55"


def test_the_example_dag_routes_the_backlog_with_spark_submit(
    tmp_path: Path, postgres_server: object
) -> None:
    # Headquarters on PostgreSQL (trust auth accepts the password we give it: it must never
    # show), the regions in SQLite files.
    hq_url = postgres_server.create_database()  # type: ignore[attr-defined]
    hq_url = hq_url.replace("postgres@", f"postgres:{SECRET}@")
    urls = {r: f"sqlite:///{tmp_path / f'sales_{r}.db'}" for r in sales.REGIONS}
    for url in urls.values():
        b = Broker.connect(url)
        b.migrate()
        b.dispose()
    dags = tmp_path / "dags"
    dags.mkdir()
    shutil.copy(DAGS / "sales_by_region.py", dags)
    env = {
        "AIRFLOW_CONN_BROKER_DEFAULT": json.dumps(
            {"conn_type": "broker", "extra": {"url": hq_url}}
        ),
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[2]"}),
        **{
            f"AIRFLOW_CONN_SALES_{r.upper()}": json.dumps(
                {"conn_type": "broker", "extra": {"url": url}}
            )
            for r, url in urls.items()
        },
    }
    with airflow_stack(
        tmp_path, dags, components=("api-server", "scheduler", "dag-processor"), extra_env=env
    ) as af:
        af.wait_for_dags("sales_by_region")
        af.airflow("dags", "trigger", "sales_by_region", "--conf", json.dumps({"requests": 600}))
        af.wait_for(
            "the sales_by_region run to finish",
            lambda: [r for r in af.runs("sales_by_region") if r.state in ("success", "failed")],
            timeout=600,
            every=2,
        )
        [run] = af.runs("sales_by_region")
        logs = "\n".join(
            p.read_text(errors="replace") for p in (af.home / "logs").rglob("*") if p.is_file()
        )
        assert run.state == "success", logs[-6000:]
        rendered = af.query("SELECT rendered_fields FROM rendered_task_instance_fields")
    assert "spark-submit" in logs.lower() or "Spark-Submit cmd" in logs
    assert "AIRFLOW_BROKER_SPARK_REPORT" in logs
    assert SECRET not in logs, "a broker password reached the task log"
    assert all(SECRET not in str(r.rendered_fields) for r in rendered)
    regions = {r: Broker.connect(url) for r, url in urls.items()}
    depths = sales.depths(regions)
    assert sum(depths.values()) == 600 and all(depths.values()), depths
    hq = Broker.connect(hq_url)
    assert hq.transmission_queue() == []
    hq.dispose()
