"""Broker alerts as a DAG: runs whenever poison handling disables a queue or messages wait too
long to leave the broker_default database (see airflow_broker.provider.triggers.alerts).

Each run logs the alerts that started it and returns them. To be paged as well, attach a
notifier of your choice to the DAG, e.g.
``on_success_callback=SlackNotifier(text="{{ ti.xcom_pull('report') }}")`` from the Slack
provider.
"""

from __future__ import annotations

import logging
from typing import Any

import pendulum
from airflow.sdk import dag, task

from airflow_broker.provider.triggers.alerts import alert_asset

log = logging.getLogger(__name__)


@dag(
    schedule=(
        alert_asset("queue_disabled", poll_interval=5.0)
        | alert_asset("transmission_waiting", waiting_threshold_seconds=900, poll_interval=30.0)
    ),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["airflow-broker", "example", "alerts"],
    doc_md=__doc__,
)
def broker_alerts() -> None:
    @task
    def report(triggering_asset_events: Any = None) -> list[dict[str, Any]]:
        alerts = [
            (event.extra or {}).get("payload") or {}
            for events in (triggering_asset_events or {}).values()
            for event in events
        ]
        for alert in alerts:
            log.error(
                "broker alert %s on %s: %s",
                alert.get("kind"),
                alert.get("object"),
                alert.get("detail"),
            )
        return alerts

    report()


broker_alerts()
