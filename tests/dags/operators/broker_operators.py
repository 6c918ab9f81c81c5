"""Test-only DAG: every dialog operator and the declarations operator in one run, with XComs
passed through templates and natively (``begin.output``). Run by
tests/test_operators.py::test_operators_run_in_a_dag with ``airflow dags test``."""

from __future__ import annotations

from airflow.sdk import DAG, chain

from airflow_broker.operators import (
    ApplyDeclarationsOperator,
    BeginDialogOperator,
    EndConversationOperator,
    ReceiveOperator,
    SendOperator,
)

DECLARATIONS = """
message_types:
  - {name: //dag/Order, validation: json}
  - {name: //dag/Quote, validation: json}
contracts:
  - name: //dag/Contract
    message_types: {//dag/Order: initiator, //dag/Quote: target}
queues:
  - name: DagBuyerQueue
  - name: DagSupplierQueue
services:
  - {name: //dag/Buyer, queue: DagBuyerQueue}
  - {name: //dag/Supplier, queue: DagSupplierQueue, contracts: [//dag/Contract]}
"""

# The supplier's side of the conversation, pulled from what it received.
RECEIVED = "ti.xcom_pull(task_ids='supplier_receives')[0]"

with DAG(
    dag_id="broker_operators",
    schedule=None,
    params={"buyer": "//dag/Buyer", "price": 50},
    tags=["test"],
):
    declare = ApplyDeclarationsOperator(task_id="declare", text=DECLARATIONS)
    begin = BeginDialogOperator(
        task_id="begin",
        from_service="{{ params.buyer }}",
        to_service="//dag/Supplier",
        contract="//dag/Contract",
        message_type="//dag/Order",
        body={"po": 1001, "qty": 5},
    )
    supplier_receives = ReceiveOperator(
        task_id="supplier_receives", queue="DagSupplierQueue", wait_seconds=5
    )
    supplier_answers = SendOperator(
        task_id="supplier_answers",
        conversation_handle="{{ " + RECEIVED + "['conversation_handle'] }}",
        message_type="//dag/Quote",
        body='{"po": {{ ' + RECEIVED + "['body_json']['po'] }}, \"price\": {{ params.price }}}",
    )
    supplier_ends = EndConversationOperator(
        task_id="supplier_ends",
        conversation_handle="{{ " + RECEIVED + "['conversation_handle'] }}",
    )
    buyer_receives = ReceiveOperator(
        task_id="buyer_receives", queue="DagBuyerQueue", conversation_handle=begin.output, top=1
    )
    buyer_receives_end = ReceiveOperator(
        task_id="buyer_receives_end", queue="DagBuyerQueue", conversation_handle=begin.output
    )
    buyer_ends = EndConversationOperator(task_id="buyer_ends", conversation_handle=begin.output)

    chain(
        declare,
        begin,
        supplier_receives,
        supplier_answers,
        supplier_ends,
        buyer_receives,
        buyer_receives_end,
        buyer_ends,
    )
