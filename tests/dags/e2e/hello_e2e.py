"""The smallest DAG: proves the end-to-end harness runs tasks through the real scheduler."""

from __future__ import annotations

import pendulum
from airflow.sdk import dag, task


@dag(schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def hello_e2e() -> None:
    @task
    def say() -> int:
        return 1

    say()


hello_e2e()
