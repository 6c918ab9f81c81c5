"""Airflow-facing sensors of airflow-broker (installed as `airflow_broker.sensors`)."""
