"""A handler that runs for minutes, exactly once, with no idle transaction: leases (the
application is :mod:`airflow_broker.examples.long_jobs`).

- ``long_handler_setup`` (manual): migrates the broker database, declares the broker objects
  and creates the ``long_job_result`` table.
- ``long_handler_submit`` (manual; param ``numbers``): the requester sends a Job.
- ``long_handler``: the worker, activated by its queue's trigger; one conversation group per
  run, at most ``MAX_READERS`` runs at once:

  1. ``receive`` leases the group's messages for ``lease_seconds`` (ReceiveOperator with
     ``lease_seconds``): committed at once, the messages stay in the queue, held by the lease;
  2. ``handle`` works on them for ``work_seconds`` (minutes by default; no transaction open,
     the lease extended while it works), then writes the results, SENDs the replies and
     completes the lease in **one** broker transaction: exactly once;
  3. ``release`` (ReleaseLeaseOperator, trigger rule ``one_failed``, a teardown) gives the lease
     back at once when ``handle`` failed; the run stays failed.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import DAG, Param, task

from airflow_broker.examples import long_jobs
from airflow_broker.hooks import BrokerHook
from airflow_broker.operators.declarations import ApplyDeclarationsOperator
from airflow_broker.operators.dialog import ReceiveOperator
from airflow_broker.operators.lease import ReleaseLeaseOperator
from airflow_broker.provider.triggers.activation import queue_asset
from airflow_broker.provider.xcom import lease_from_xcom

BROKER_CONN_ID = "broker_default"
START = pendulum.datetime(2026, 1, 1, tz="UTC")
TAGS = ["airflow-broker", "example", "lease"]
#: How long a lease holds the group before its messages are handed out again.
LEASE_SECONDS = 600


with DAG(
    dag_id="long_handler_setup",
    schedule=None,
    start_date=START,
    catchup=False,
    tags=TAGS,
    doc_md="Migrate the broker database, declare the long-jobs example's objects, create its "
    "table.",
) as long_handler_setup:

    @task
    def migrate() -> str:
        broker = BrokerHook(BROKER_CONN_ID).get_broker()
        broker.migrate()
        return broker.instance_id

    @task
    def create_table() -> None:
        long_jobs.metadata.create_all(
            BrokerHook(BROKER_CONN_ID).get_broker().engine, checkfirst=True
        )

    (
        migrate()
        >> ApplyDeclarationsOperator(
            task_id="declare", text=long_jobs.DECLARATIONS, broker_conn_id=BROKER_CONN_ID
        )
        >> create_table()
    )


with DAG(
    dag_id="long_handler_submit",
    schedule=None,
    start_date=START,
    catchup=False,
    tags=TAGS,
    params={
        "numbers": Param([1, 2, 3], type="array", description="the Job's numbers"),
        "job_id": Param(None, type=["null", "string"], description="default: generated"),
    },
    doc_md="The requester sends a Job: BEGIN DIALOG to the worker and SEND, in one transaction.",
) as long_handler_submit:

    @task
    def submit(params: dict[str, Any] | None = None) -> str:
        p = params or {}
        broker = BrokerHook(BROKER_CONN_ID).get_broker()
        with broker.transaction() as tx:
            handle = long_jobs.submit_job(tx, p["numbers"], job_id=p.get("job_id") or None)
        return str(handle)

    submit()


with DAG(
    dag_id=long_jobs.HANDLER_DAG,
    schedule=[queue_asset(long_jobs.JOBS_QUEUE, broker_conn_id=BROKER_CONN_ID)],
    start_date=START,
    catchup=False,
    max_active_runs=long_jobs.MAX_READERS,  # the queue's max_readers
    tags=TAGS,
    params={
        "work_seconds": Param(
            180, type="number", minimum=0, description="how long the handler works on a lease"
        ),
    },
    doc_md="The worker: leases one conversation group, works on it for minutes with no "
    "transaction open, then writes, replies and completes the lease in one transaction. A "
    "failed handler's lease is released at once; the run stays failed.",
) as long_handler:
    receive = ReceiveOperator(
        task_id="receive",
        queue=long_jobs.JOBS_QUEUE,
        lease_seconds=LEASE_SECONDS,
        broker_conn_id=BROKER_CONN_ID,
    )

    @task
    def handle(leased: dict[str, Any] | None, params: dict[str, Any] | None = None) -> list[Any]:
        lease = lease_from_xcom(leased)
        if lease is None:
            return []  # the queue was empty
        broker = BrokerHook(BROKER_CONN_ID).get_broker()
        # Minutes of work, no transaction open: the lease holds the group meanwhile.
        outcomes = long_jobs.work(
            lease,
            float((params or {}).get("work_seconds", 180)),
            broker=broker,
            lease_seconds=LEASE_SECONDS,
        )
        # Results, replies and the removal of the messages: one transaction, exactly once.
        with broker.transaction() as tx:
            return long_jobs.finish(tx, lease, outcomes)

    (
        handle(receive.output)
        >> ReleaseLeaseOperator(
            task_id="release", lease=receive.output, broker_conn_id=BROKER_CONN_ID
        )
    )
