"""The transmitter DAG of tests/test_e2e_transmitter.py: the one line a user writes, with a low
Spark threshold (E2E_SPARK_THRESHOLD) and a short poll so that the test runs quickly."""

from __future__ import annotations

import os

from airflow_broker.provider.transmitter import transmitter_dag

transmitter_dag(
    spark_threshold=int(os.environ.get("E2E_SPARK_THRESHOLD", "1000000")),
    poll_interval=1.0,
    spark_kwargs={"partitions": 2},
)
