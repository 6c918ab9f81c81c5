"""Seed 000's sales by region at volume: a backlog of sales requests classified by region and
routed by the Spark routing job to the regional broker databases.

Connections: ``broker_default`` (headquarters, where requests wait), ``sales_east``,
``sales_west`` and ``sales_north`` (one broker database per region; the routes of headquarters
name them ``broker://sales_<region>``), and ``spark_default`` (a Spark connection; its host
``local[*]`` runs the job on the worker, a cluster master URL runs it there).

- ``declare``: the services, contract and routes on every broker (idempotent);
- ``file_backlog``: ``requests`` sales requests, unless a backlog is already waiting;
- ``route``: :class:`SparkRoutingOperator` classifies each new conversation to
  ``//sales/Request`` by the region in its first message (a Spark SQL expression) and delivers
  it to ``//sales/<Region>`` in that region's database, exactly once;
- ``report``: what each region's queue holds; fails if requests are still waiting.

Live requests go to the routing service ``//sales/Router`` instead: ``sales_router``, defined at
the end, is its reader DAG, activated when its queue fills; what it forwards to the regions
leaves through the transmitter DAG (``dags/transmitter.py``).
"""

from __future__ import annotations

import logging

import pendulum
from airflow.sdk import DAG, Param, task

from airflow_broker.examples import sales
from airflow_broker.hooks import BrokerHook
from airflow_broker.operators.spark import SparkRoutingOperator
from airflow_broker.provider.transmitter import routing_service_dag

BROKER_CONN_ID = "broker_default"
log = logging.getLogger(__name__)


def _brokers() -> tuple[object, dict[str, object]]:
    hq = BrokerHook(BROKER_CONN_ID).get_broker()
    regions = {r: BrokerHook(f"sales_{r}").get_broker() for r in sales.REGIONS}
    return hq, regions


def _waiting(hq: object) -> int:
    from sqlalchemy import func, select

    from airflow_broker.storage import schema as s

    with hq.engine.connect() as conn:  # type: ignore[attr-defined]
        return int(
            conn.execute(select(func.count()).select_from(s.transmission_queue)).scalar_one()
        )


with DAG(
    dag_id="sales_by_region",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params={"requests": Param(10_000, type="integer", minimum=0)},
    tags=["airflow-broker", "example", "spark"],
    doc_md=__doc__,
) as dag:

    @task
    def declare() -> None:
        hq, regions = _brokers()
        sales.declare(hq, regions)  # type: ignore[arg-type]

    @task
    def file_backlog(params: dict[str, int] | None = None) -> int:
        hq, _ = _brokers()
        waiting = _waiting(hq)
        if waiting == 0:
            count = int((params or {}).get("requests", 0))
            sales.file_requests(hq, count)  # type: ignore[arg-type]
            waiting = _waiting(hq)
        log.info("%d sales requests wait to be routed", waiting)
        return waiting

    route = SparkRoutingOperator(
        task_id="route",
        broker_conn_id=BROKER_CONN_ID,
        classifier=sales.REGION_SQL,
        classify_service=sales.REQUEST,
        conn_id="spark_default",
    )

    @task
    def report() -> dict[str, int]:
        hq, regions = _brokers()
        depths = sales.depths(regions)  # type: ignore[arg-type]
        log.info("requests per region: %s", depths)
        waiting = _waiting(hq)
        if waiting:
            raise RuntimeError(f"{waiting} requests are still waiting at headquarters")
        return depths

    declare() >> file_backlog() >> route >> report()


# The live road: the routing service's reader DAG, activated by its queue.
routing_service_dag(sales.ROUTER, sales.ROUTER_QUEUE, dag_id="sales_router")
