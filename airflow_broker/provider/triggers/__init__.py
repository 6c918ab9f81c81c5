"""Async triggers the Airflow triggerer runs: queue activation and conversation waits."""
