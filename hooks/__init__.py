"""Airflow-facing hooks of airflow-broker (installed as `airflow_broker.hooks`)."""
