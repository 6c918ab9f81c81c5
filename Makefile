# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo demo-spark test test-breadth test-pgbouncer test-oldest oldest lint docs unit install install-dev postgres browser spark pgbouncer redis bench soak clean

$(BIN)/uv:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip uv

# The engine alone: what `make demo` needs.
install: $(BIN)/uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e .

# Everything the test suite talks to: Airflow, Spark provider, psycopg, the benchmark peers.
install-dev: $(BIN)/uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[dev]'

demo: install
	$(BIN)/python -m airflow_broker.examples.demo

# Seed 000 at volume: the example DAG sales_by_region runs the Spark routing job (spark-submit on
# local[*]) from `airflow dags test`, in a throwaway AIRFLOW_HOME on embedded SQLite stores.
demo-spark: install-dev spark
	$(BIN)/python -m airflow_broker.examples.sales_demo --dags-folder dags

# Starts (or installs) PostgreSQL when none answers at BROKER_TEST_POSTGRES_URL.
postgres: install-dev
	$(BIN)/python tests/support/ensure_postgres.py

# Installs Debian's chromium when /usr/bin/chromium is missing (the UI test drives it).
browser: install-dev
	$(BIN)/python tests/support/ensure_browser.py

# Installs Java and Debian's JDBC drivers when missing (the Spark routing job's tests).
spark: install-dev
	$(BIN)/python tests/support/ensure_spark.py

# Installs Debian's redis-server when /usr/bin/redis-server is missing (the CeleryExecutor e2e
# tests start their own on a free port).
redis: install-dev
	$(BIN)/python tests/support/ensure_redis.py

# Installs Debian's pgbouncer when missing (the PostgreSQL subset runs through it).
pgbouncer: install-dev
	$(BIN)/python tests/support/ensure_pgbouncer.py

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

# The guides (docs/*.md) and the API reference from the docstrings (docs/api/), with every
# warning an error: a broken link, a docstring Sphinx cannot read, a page left out of the index.
docs: install-dev
	$(BIN)/sphinx-build -E -W --keep-going -q -b html docs docs/_build/html

# The PostgreSQL tests of the engine, leases, failure handling, delivery, activation and the
# transmitter, run a second time through a PgBouncer in transaction mode that each test process
# starts (tests/support/pgbouncer.py); tests of a direct connection's own mechanics are left out.
PGBOUNCER_TESTS := tests/test_dialogs.py tests/test_receive.py tests/test_empty_receive.py \
	tests/test_send_committed.py tests/test_reader_loop.py tests/test_poison.py \
	tests/test_failure_handling.py tests/test_leases.py tests/test_leases_pg.py \
	tests/test_exact_accounting_pg.py tests/test_rollback_hold.py \
	tests/test_concurrency_pg.py tests/test_transport_pg.py tests/test_delivery_pipeline_pg.py \
	tests/test_activation.py tests/test_runner.py tests/test_transmitter.py tests/test_triggers.py \
	tests/test_hung_peer_pg.py \
	"tests/test_spark_job.py::test_the_job_delivers_every_message_once_in_order_and_replies_come_back" \
	tests/test_spark_job.py::test_postgresql_groups_the_conversations_as_the_spark_transform_does

PGBOUNCER_RUN = BROKER_TEST_VIA_PGBOUNCER=1 $(BIN)/pytest -n 2 --dist loadgroup \
	-m "not direct_connection" -k "not sqlite" $(PGBOUNCER_TESTS)

test-pgbouncer: install-dev postgres pgbouncer
	$(PGBOUNCER_RUN)

# The oldest supported Airflow (docs/airflow.md, "Airflow versions"): a second environment,
# every package pinned by tests/support/oldest-airflow.txt, rebuilt when the pins change.
OLDEST := .venv-oldest
OLDEST_TESTS := tests/test_e2e_activation.py tests/test_e2e_transmitter.py \
	tests/test_e2e_hung_peer.py tests/test_e2e_breadth.py tests/test_plugin_e2e.py \
	tests/test_dbmanager.py tests/test_airflow_versions.py tests/test_e2e_saga.py

oldest: install-dev
	$(BIN)/python tests/support/ensure_oldest_airflow.py

# The Airflow-facing end-to-end set on the oldest supported Airflow (LocalExecutor: the
# CeleryExecutor tests run on the newest only).
OLDEST_RUN = $(OLDEST)/bin/pytest -n 2 --dist loadgroup -k "not under_celery" $(OLDEST_TESTS)

test-oldest: oldest postgres
	$(OLDEST_RUN)

# `make test`'s last step runs these two side by side, their prerequisites made already.
.PHONY: run-pgbouncer run-oldest
run-pgbouncer:
	$(PGBOUNCER_RUN)
run-oldest:
	$(OLDEST_RUN)

# What the tests talk to is installed and started first: PostgreSQL, chromium, Java + JDBC,
# PgBouncer, Redis; then the whole suite on the newest Airflow, the PostgreSQL subset through
# PgBouncer, and the end-to-end set on the oldest Airflow.
test: install-dev postgres browser spark pgbouncer redis oldest lint docs
	$(BIN)/pytest -n 2 --dist loadgroup
	$(MAKE) --no-print-directory -j2 --output-sync=target run-pgbouncer run-oldest

test-breadth: install-dev postgres
	BREADTH_QUEUES=500 $(BIN)/pytest -s tests/test_e2e_breadth.py

# The model-based check at length (the suite runs a bounded profile): thousands of random
# operation sequences against the reference model, on SQLite and PostgreSQL; and a longer stress run.
# (No per-test time limit: the suite's 300 s would stop both long before they are done.)
soak: install-dev postgres spark
	HYPOTHESIS_PROFILE=soak $(BIN)/pytest --timeout 0 tests/test_model_state_machine.py
	BROKER_STRESS_SECONDS=600 $(BIN)/pytest --timeout 0 tests/test_stress_pg.py
	BROKER_SOAK=1 $(BIN)/pytest tests/test_spark_crash.py

bench: install-dev postgres
	$(BIN)/python -m bench.throughput

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info docs/_build
