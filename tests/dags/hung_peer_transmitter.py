"""The transmitter DAG of tests/test_e2e_hung_peer.py (copied into that test's DAGs folder): the
one line a user writes, with a short poll and no Spark hand-off."""

from __future__ import annotations

from airflow_broker.provider.transmitter import transmitter_dag

transmitter_dag(spark_threshold=None, poll_interval=1.0)
