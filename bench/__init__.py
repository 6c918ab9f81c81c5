"""Benchmarks of airflow-broker against its peers (pgmq, pgqueuer) on the same PostgreSQL server.

Each benchmark is a module run as ``python -m bench.NAME``: it prints its table, then one line per
target, ``target NAME: RATIO (goal >= G)``. Every workload runs in a scratch database that the
benchmark creates and drops; ``BROKER_BENCH_POSTGRES_URL`` names the server (default
``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``).
"""
