"""Seed 004's purchase order as Airflow DAGs: a long-running dialog spread over many activated
DAG runs, with the application state keyed by conversation group id and idempotent
compensations (the application itself is :mod:`airflow_broker.examples.purchase_order`).

- ``po_setup`` (manual): migrates the broker database, declares the broker objects
  (``ApplyDeclarationsOperator``), then creates the application tables and the supplier's
  warehouse. Run it once; running it again changes nothing.
- ``po_supplier_reader`` and ``po_buyer_reader``: each queue's reader. Scheduled on an asset
  whose watcher is the queue's ``QueueActivationTrigger``: when messages arrive a run starts,
  while the queue keeps growing more start, never more than the queue's ``max_readers``
  (``max_active_runs``); each run drains the queue with ``DrainQueueOperator``, one
  conversation group per transaction, and exits.
- ``submit_purchase_order`` (manual; params ``item``, ``qty``, ``price``): the buyer begins the
  dialog, records the order, sends it and arms its deadline, in one transaction.
- ``cancel_purchase_order`` (manual; params ``po_number``, ``reason``): the buyer cancels an
  order that is not over.
- ``restock`` (manual; params ``item``, ``qty``): the supplier's goods arrive; backordered
  orders are quoted.

Every task reaches the broker through the ``broker_default`` connection.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import DAG, Param, task

from airflow_broker.examples import purchase_order as po
from airflow_broker.hooks import BrokerHook
from airflow_broker.operators.declarations import ApplyDeclarationsOperator
from airflow_broker.operators.reader import DrainQueueOperator
from airflow_broker.provider.triggers.activation import queue_asset

BROKER_CONN_ID = "broker_default"
START = pendulum.datetime(2026, 1, 1, tz="UTC")
TAGS = ["airflow-broker", "example", "purchase-order"]


def _reader(dag_id: str, queue: str, handler: str, max_readers: int, doc: str) -> DAG:
    """A queue's reader DAG: activated by the queue's trigger, one drain per run."""
    with DAG(
        dag_id=dag_id,
        schedule=[queue_asset(queue, broker_conn_id=BROKER_CONN_ID)],
        start_date=START,
        catchup=False,
        max_active_runs=max_readers,
        tags=TAGS,
        doc_md=doc,
    ) as dag:
        DrainQueueOperator(
            task_id="drain",
            queue=queue,
            handler=handler,
            broker_conn_id=BROKER_CONN_ID,
        )
    return dag


supplier_reader = _reader(
    po.SUPPLIER_READER_DAG,
    po.SUPPLIER_QUEUE,
    "airflow_broker.examples.purchase_order:supplier_handler",
    po.SUPPLIER_MAX_READERS,
    "The supplier: reserves stock and quotes (or refuses), negotiates, ships, invoices, and "
    "undoes what it did when the buyer cancels.",
)

buyer_reader = _reader(
    po.BUYER_READER_DAG,
    po.BUYER_QUEUE,
    "airflow_broker.examples.purchase_order:buyer_handler",
    po.BUYER_MAX_READERS,
    "The buyer's response service: accepts or counters quotes, confirms receipt, pays, and "
    "cancels when its deadline (a conversation timer) passes.",
)


with DAG(
    dag_id="po_setup",
    schedule=None,
    start_date=START,
    catchup=False,
    tags=TAGS,
    doc_md="Migrate the broker database, declare the example's broker objects, create its tables "
    "and fill the warehouse.",
) as po_setup:

    @task
    def migrate() -> str:
        broker = BrokerHook(BROKER_CONN_ID).get_broker()
        broker.migrate()
        return broker.instance_id

    @task
    def create_tables() -> dict[str, list[int]]:
        broker = BrokerHook(BROKER_CONN_ID).get_broker()
        po.create_tables(broker)
        po.seed_stock(broker)
        with broker.engine.connect() as conn:
            return {item: list(levels) for item, levels in po.stock_levels(conn).items()}

    (
        migrate()
        >> ApplyDeclarationsOperator(
            task_id="declare", text=po.DECLARATIONS, broker_conn_id=BROKER_CONN_ID
        )
        >> create_tables()
    )


with DAG(
    dag_id="submit_purchase_order",
    schedule=None,
    start_date=START,
    catchup=False,
    tags=TAGS,
    params={
        "item": Param("widget", type="string", description="what to buy"),
        "qty": Param(500, type="integer", minimum=1),
        "price": Param(4.40, type="number", exclusiveMinimum=0, description="most per unit, $"),
        "po_number": Param(None, type=["null", "string"], description="default: generated"),
        "ship_within_days": Param(14, type="integer", minimum=0),
        "deadline_seconds": Param(
            po.DEFAULT_DEADLINE_SECONDS,
            type="number",
            exclusiveMinimum=0,
            description="the buyer cancels the order if it is not over by then",
        ),
    },
    doc_md="The buyer submits a purchase order: BEGIN DIALOG, the order's state row, SEND "
    "Order and the deadline timer, in one transaction.",
) as submit_purchase_order:

    @task
    def submit(params: dict[str, Any] | None = None) -> dict[str, str]:
        p = params or {}
        broker = BrokerHook(BROKER_CONN_ID).get_broker()
        with broker.transaction() as tx:
            order = po.submit_purchase_order(
                tx,
                p["item"],
                int(p["qty"]),
                p["price"],
                po_number=p.get("po_number") or None,
                ship_within_days=int(p["ship_within_days"]),
                deadline_seconds=float(p["deadline_seconds"]),
            )
        return {
            "po_number": order.po_number,
            "conversation_handle": str(order.conversation_handle),
            "conversation_group_id": str(order.conversation_group_id),
        }

    submit()


with DAG(
    dag_id="cancel_purchase_order",
    schedule=None,
    start_date=START,
    catchup=False,
    tags=TAGS,
    params={
        "po_number": Param(type="string", minLength=1),
        "reason": Param("cancelled by the buyer", type="string"),
    },
    doc_md="The buyer cancels an order that is not over: void its payment, notify, send "
    "Cancel and END. Fails when the order is already over.",
) as cancel_purchase_order:

    @task
    def cancel(params: dict[str, Any] | None = None) -> str:
        p = params or {}
        broker = BrokerHook(BROKER_CONN_ID).get_broker()
        with broker.transaction() as tx:
            cancelled = po.cancel_purchase_order(tx, p["po_number"], p["reason"])
        if not cancelled:
            raise RuntimeError(f"{p['po_number']} is already over: nothing to cancel")
        return str(p["po_number"])

    cancel()


with DAG(
    dag_id="restock",
    schedule=None,
    start_date=START,
    catchup=False,
    tags=TAGS,
    params={
        "item": Param("sprocket", type="string"),
        "qty": Param(100, type="integer", minimum=1),
    },
    doc_md="Goods arrive at the supplier: backordered orders of the item are quoted.",
) as restock:

    @task
    def receive_goods(params: dict[str, Any] | None = None) -> list[str]:
        p = params or {}
        broker = BrokerHook(BROKER_CONN_ID).get_broker()
        with broker.transaction() as tx:
            return po.restock(tx, p["item"], int(p["qty"]))

    receive_goods()
