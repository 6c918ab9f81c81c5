"""An echo service that answers liveness probes, as Airflow DAGs (the application is
:mod:`airflow_broker.operations.echo`).

- ``echo_setup`` (manual): migrates the broker database, declares the broker objects and
  creates the ``echo_probe`` table.
- ``echo_reader``: the echo service's reader, activated by its queue's trigger; each message
  goes back with the same body, then the echo ENDs the dialog.
- ``echo_probe_reader``: the prober's reader, activated the same way; records each probe's
  outcome (``alive`` with its round trip, or ``no_answer`` when the probe's timer fires first).
- ``echo_probe`` (manual; give it a schedule to probe periodically): sends a probe and waits
  for its outcome; the run fails when the echo service did not answer in time.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import DAG, Param, PokeReturnValue, task

from airflow_broker.hooks import BrokerHook
from airflow_broker.operations import echo
from airflow_broker.operators.declarations import ApplyDeclarationsOperator
from airflow_broker.operators.reader import DrainQueueOperator
from airflow_broker.provider.triggers.activation import queue_asset

BROKER_CONN_ID = "broker_default"
START = pendulum.datetime(2026, 1, 1, tz="UTC")
TAGS = ["airflow-broker", "example", "echo"]


def _reader(dag_id: str, queue: str, handler: str, doc: str) -> DAG:
    with DAG(
        dag_id=dag_id,
        schedule=[queue_asset(queue, broker_conn_id=BROKER_CONN_ID)],
        start_date=START,
        catchup=False,
        max_active_runs=1,  # the queue's max_readers
        tags=TAGS,
        doc_md=doc,
    ) as dag:
        DrainQueueOperator(
            task_id="drain", queue=queue, handler=handler, broker_conn_id=BROKER_CONN_ID
        )
    return dag


echo_reader = _reader(
    echo.ECHO_READER_DAG,
    echo.ECHO_QUEUE,
    "airflow_broker.operations.echo:echo_handler",
    "The echo service: any message comes back with the same body, then END.",
)

probe_reader = _reader(
    echo.PROBER_READER_DAG,
    echo.PROBER_QUEUE,
    "airflow_broker.operations.echo:probe_reply_handler",
    "The prober's reader: records each probe's echo (or its timeout) and ENDs.",
)


with DAG(
    dag_id="echo_setup",
    schedule=None,
    start_date=START,
    catchup=False,
    tags=TAGS,
    doc_md="Migrate the broker database, declare the echo example's objects, create its table.",
) as echo_setup:

    @task
    def migrate() -> str:
        broker = BrokerHook(BROKER_CONN_ID).get_broker()
        broker.migrate()
        return broker.instance_id

    @task
    def create_table() -> None:
        echo.metadata.create_all(BrokerHook(BROKER_CONN_ID).get_broker().engine, checkfirst=True)

    (
        migrate()
        >> ApplyDeclarationsOperator(
            task_id="declare", text=echo.DECLARATIONS, broker_conn_id=BROKER_CONN_ID
        )
        >> create_table()
    )


with DAG(
    dag_id="echo_probe",
    schedule=None,
    start_date=START,
    catchup=False,
    tags=TAGS,
    params={"timeout_seconds": Param(60, type="number", exclusiveMinimum=0)},
    doc_md="Probe the echo service: send a Ping, wait for the prober's reader to record the "
    "echo. Fails when no echo came within timeout_seconds.",
) as echo_probe:

    @task
    def send_probe(params: dict[str, Any] | None = None) -> str:
        timeout = float((params or {}).get("timeout_seconds", echo.DEFAULT_TIMEOUT_SECONDS))
        broker = BrokerHook(BROKER_CONN_ID).get_broker()
        with broker.transaction() as tx:
            return echo.send_probe(tx, timeout_seconds=timeout).probe_id

    @task.sensor(poke_interval=1, timeout=600, mode="reschedule")
    def await_echo(probe_id: str) -> PokeReturnValue:
        broker = BrokerHook(BROKER_CONN_ID).get_broker()
        with broker.engine.connect() as conn:
            probe = echo.probe_status(conn, probe_id)
        if probe is None:
            raise RuntimeError(f"probe {probe_id} is not recorded")
        if probe["status"] == "waiting":
            return PokeReturnValue(is_done=False)
        if probe["status"] != "alive":
            raise RuntimeError(f"echo service not alive: {probe['status']}: {probe['detail']}")
        return PokeReturnValue(is_done=True, xcom_value=probe["round_trip_ms"])

    await_echo(send_probe())
