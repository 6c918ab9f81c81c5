"""Airflow-facing operators of airflow-broker (installed as `airflow_broker.operators`)."""
