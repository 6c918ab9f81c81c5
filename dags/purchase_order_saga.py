"""The purchase order as a saga you can see in the graph: one DAG run per order, for the buyer.

``po_saga`` (manual; params ``item``, ``qty``, ``price``, ``ship_within_days``,
``deadline_seconds``, optional ``po_number``) runs one order from the buyer's side, each step a
task::

    submit >> negotiate.wait_quote_1 >> negotiate.decide_1 >> ... >> wait_shipment
        >> confirm_receipt >> wait_invoice >> pay >> wait_end >> close
        >> settle >> compensate.release_reservation >> compensate.void_payment
        >> compensate.notify >> compensate.end_conversation >> outcome

- ``submit``: BEGIN DIALOG from the saga buyer's service, the order's row, SEND Order and the
  deadline (the conversation timer), in one transaction.
- ``wait_*``: a deferrable ``ConversationSensor`` on the order's conversation: the run waits in
  the triggerer, holding no worker slot, for as long as the supplier takes; the deadline's
  DialogTimer wakes it too.
- ``negotiate.decide_N`` (branches): RECEIVE the quote and accept it (on to ``wait_shipment``),
  counter it (on to the next ``wait_quote``), or give the order up (no branch: every later step
  is skipped), by the rule of ``buyer_handler``. A DAG is acyclic: the rounds are
  :data:`~airflow_broker.examples.purchase_order.saga.QUOTE_SLOTS` fixed (wait, decide) pairs,
  the unused ones skipped.
- ``confirm_receipt`` (ShipNotice -> Receipt), ``pay`` (Invoice -> Payment), ``close`` (the
  supplier's END -> END): each the same way; a Refuse, the deadline or a cancellation found by
  any step gives the order up.
- ``settle`` (trigger rule ``all_done``: it runs however the steps ended) skips the
  compensations when the order is complete; otherwise (given up, a step failed, a wait timed
  out) the compensations run, each after the one before whatever it did (``none_skipped``):
  ``compensate.release_reservation`` (SEND Cancel: the supplier releases the reservation,
  recalls a shipment, refunds; after a failed step nothing, the Error below does it),
  ``compensate.void_payment``, ``compensate.notify`` (the requester's notice) and
  ``compensate.end_conversation`` (END, or END WITH ERROR after a failed step).
- ``outcome`` (``all_done``) fails the run unless the order is complete: a red run is an order
  that did not go through (the task's log says why).

``po_saga_cancel`` (manual; params ``po_number``, ``reason``) cancels a saga order that is not
over: it records the cancellation and re-arms the order's conversation timer to fire now, so
that the run's waiting sensor wakes and its compensations run.

The supplier is the activated reader ``po_supplier_reader`` of ``dags/purchase_order.py``;
``po_setup`` there declares the saga buyer's service and queue with the rest. Every task
reaches the broker through the ``broker_default`` connection.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import pendulum
from airflow.sdk import DAG, Param, TaskGroup, TriggerRule, task

from airflow_broker.examples import purchase_order as po
from airflow_broker.examples.purchase_order import saga
from airflow_broker.hooks import BrokerHook
from airflow_broker.provider.compat import AirflowFailException, AirflowSkipException
from airflow_broker.sensors import ConversationSensor

BROKER_CONN_ID = "broker_default"
START = pendulum.datetime(2026, 1, 1, tz="UTC")
TAGS = ["airflow-broker", "example", "purchase-order", "saga"]

#: Orders open at once: each is a running DAG run for its whole life (days, deferred).
MAX_OPEN_ORDERS = 500

#: The longest a sensor waits before it fails (and the compensations run): longer than any
#: deadline the buyer sets, which gives the order up first.
WAIT_TIMEOUT_SECONDS = 60 * 24 * 3600

#: The order's conversation handle, from ``submit``'s XCom (the sensors' template).
HANDLE = "{{ ti.xcom_pull(task_ids='submit')['conversation_handle'] }}"

T = TypeVar("T")


def _in_transaction(work: Callable[[Any], T]) -> T:
    """``work(tx)`` in one transaction of the ``broker_default`` broker."""
    hook = BrokerHook(BROKER_CONN_ID)
    try:
        with hook.get_broker().transaction() as tx:
            return work(tx)
    finally:
        hook.close()


def _handle(ti: Any) -> str:
    """The order's conversation handle (``submit``'s XCom)."""
    submitted = ti.xcom_pull(task_ids="submit")
    if not submitted:
        raise AirflowFailException("no order: the submit task did not complete")
    return str(submitted["conversation_handle"])


def _wait(task_id: str, doc: str, **kwargs: Any) -> ConversationSensor:
    return ConversationSensor(
        task_id=task_id,
        queue=po.SAGA_BUYER_QUEUE,
        conversation_handle=HANDLE,
        broker_conn_id=BROKER_CONN_ID,
        timeout=WAIT_TIMEOUT_SECONDS,
        doc_md=doc,
        **kwargs,
    )


def _next(status: str, expect: str, then: str) -> list[str]:
    """The branch after a step: on to ``then`` when the order is ``expect``; none (every later
    step skipped, the compensations run) when it is over; fail on anything else."""
    if status == expect:
        return [then]
    if status in po.FINAL_STATUSES:
        return []
    raise RuntimeError(f"the order is {status!r} after this step, expected {expect!r}")


with DAG(
    dag_id="po_saga",
    schedule=None,
    start_date=START,
    catchup=False,
    max_active_runs=MAX_OPEN_ORDERS,
    tags=TAGS,
    params={
        "item": Param("widget", type="string", description="what to buy"),
        "qty": Param(500, type="integer", minimum=1),
        "price": Param(4.40, type="number", exclusiveMinimum=0, description="most per unit, $"),
        "ship_within_days": Param(14, type="integer", minimum=0),
        "deadline_seconds": Param(
            po.DEFAULT_DEADLINE_SECONDS,
            type="number",
            exclusiveMinimum=0,
            description="the order is given up (and compensated) if it is not over by then",
        ),
        "po_number": Param(
            None, type=["null", "string"], description="default: derived from the run id"
        ),
    },
    doc_md=__doc__,
) as po_saga:

    @task
    def submit(params: dict[str, Any] | None = None, run_id: str | None = None) -> dict[str, str]:
        """BEGIN DIALOG from the saga buyer, the order's row, SEND Order, arm the deadline."""
        p = params or {}
        number = p.get("po_number") or (
            "PO-" + hashlib.sha256(str(run_id).encode()).hexdigest()[:10].upper()
        )
        order = _in_transaction(
            lambda tx: saga.submit_saga_order(
                tx,
                p["item"],
                int(p["qty"]),
                p["price"],
                po_number=number,
                ship_within_days=int(p["ship_within_days"]),
                deadline_seconds=float(p["deadline_seconds"]),
            )
        )
        return {
            "po_number": order.po_number,
            "conversation_handle": str(order.conversation_handle),
            "conversation_group_id": str(order.conversation_group_id),
        }

    @task.branch
    def decide(slot: int, ti: Any = None) -> list[str]:
        """Accept the quote, counter it, or give the order up (the rule of buyer_handler)."""
        handle = _handle(ti)
        last = slot == saga.QUOTE_SLOTS
        status = _in_transaction(lambda tx: saga.decide(tx, handle, last=last))
        if status == "accepted":
            return ["wait_shipment"]
        if status in po.FINAL_STATUSES:
            return []
        return [f"negotiate.wait_quote_{slot + 1}"]

    @task.branch
    def confirm_receipt(ti: Any = None) -> list[str]:
        """The goods are announced: take them in and SEND Receipt."""
        handle = _handle(ti)
        status = _in_transaction(lambda tx: saga.take_step(tx, handle))
        return _next(status, "received", "wait_invoice")

    @task.branch
    def pay(ti: Any = None) -> list[str]:
        """The invoice: book the payment and SEND Payment."""
        handle = _handle(ti)
        status = _in_transaction(lambda tx: saga.take_step(tx, handle))
        return _next(status, "paid", "wait_end")

    @task
    def close(ti: Any = None) -> str:
        """The supplier ENDs the paid order: it is complete; END the buyer's side."""
        handle = _handle(ti)
        status = _in_transaction(lambda tx: saga.close_order(tx, handle))
        if status == "complete":
            return status
        if status in po.FINAL_STATUSES:
            raise AirflowSkipException(f"the order is {status}")
        raise RuntimeError(f"the order is {status!r} after the supplier's END, expected complete")

    @task.short_circuit(trigger_rule=TriggerRule.ALL_DONE, ignore_downstream_trigger_rules=False)
    def settle(ti: Any = None) -> dict[str, Any] | None:
        """However the steps ended: nothing to undo when the order is complete (the
        compensations are skipped); else what they need. An order still open here (a step
        failed, a wait timed out) is cancelled."""
        if not ti.xcom_pull(task_ids="submit"):
            return None  # submit rolled back: nothing was done
        handle = _handle(ti)
        return _in_transaction(lambda tx: saga.settle(tx, handle))

    def _failed(ti: Any) -> bool:
        """Whether ``settle`` found a step failed (then the dialog ends with an error)."""
        return bool((ti.xcom_pull(task_ids="settle") or {}).get("failed"))

    @task
    def release_reservation(ti: Any = None) -> str:
        """SEND Cancel while the supplier has not closed the order: it releases the
        reservation, recalls a shipment, refunds (after a failed step the Error does it)."""
        handle, failed = _handle(ti), _failed(ti)
        return _in_transaction(lambda tx: saga.release_reservation(tx, handle, failed=failed))

    @task(trigger_rule=TriggerRule.NONE_SKIPPED)
    def void_payment(ti: Any = None) -> str:
        """Void what the buyer paid, if it paid."""
        handle = _handle(ti)
        return _in_transaction(lambda tx: saga.void_saga_payment(tx, handle))

    @task(trigger_rule=TriggerRule.NONE_SKIPPED)
    def notify(ti: Any = None) -> str:
        """The requester's notice that the order is off, and why."""
        handle = _handle(ti)
        return _in_transaction(lambda tx: saga.notify_requester(tx, handle))

    @task(trigger_rule=TriggerRule.NONE_SKIPPED)
    def end_conversation(ti: Any = None) -> str:
        """END the buyer's side; END WITH ERROR after a failed step."""
        handle, failed = _handle(ti), _failed(ti)
        return _in_transaction(lambda tx: saga.end_order(tx, handle, failed=failed))

    @task(trigger_rule=TriggerRule.ALL_DONE)
    def outcome(ti: Any = None) -> dict[str, Any]:
        """The order's end: the run fails unless it is complete."""
        handle = _handle(ti)
        hook = BrokerHook(BROKER_CONN_ID)
        try:
            with hook.get_broker().engine.connect() as conn:
                row = saga.saga_order(conn, handle)
        finally:
            hook.close()
        summary = {
            "po_number": row["po_number"],
            "status": row["status"],
            "reason": row["reason"],
            "unit_price": row["unit_price"],
        }
        if row["status"] != "complete":
            raise AirflowFailException(
                f"order {row['po_number']} {row['status']}: {row['reason'] or 'no reason'}"
            )
        return summary

    submitted = submit()
    wait_shipment = _wait(
        "wait_shipment",
        "Wait for the ShipNotice.",
        trigger_rule=TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS,
    )
    with TaskGroup("negotiate", tooltip="quotes and counter-offers"):
        previous: Any = submitted
        for slot in range(1, saga.QUOTE_SLOTS + 1):
            waited = _wait(f"wait_quote_{slot}", "Wait for the supplier's quote.")
            decided = decide.override(task_id=f"decide_{slot}")(slot)
            previous >> waited >> decided >> wait_shipment
            previous = decided

    received = confirm_receipt()
    paid = pay()
    closed = close()
    settled = settle()
    with TaskGroup("compensate", tooltip="undo the order: skipped when it completes"):
        released = release_reservation()
        ended = end_conversation()
        released >> void_payment() >> notify() >> ended
    (
        wait_shipment
        >> received
        >> _wait("wait_invoice", "Wait for the Invoice.")
        >> paid
        >> _wait("wait_end", "Wait for the supplier to close the paid order.")
        >> closed
        >> settled
        >> released
    )
    ended >> outcome()


with DAG(
    dag_id="po_saga_cancel",
    schedule=None,
    start_date=START,
    catchup=False,
    tags=TAGS,
    params={
        "po_number": Param(type="string", minLength=1),
        "reason": Param("cancelled by the buyer", type="string"),
    },
    doc_md="Cancel a po_saga order that is not over: the order is marked cancelled and its "
    "conversation timer fires now, which wakes the run's waiting sensor; the run's "
    "compensations then undo the order. Fails when the order is already over.",
) as po_saga_cancel:

    @task
    def request_cancel(params: dict[str, Any] | None = None) -> str:
        p = params or {}
        done = _in_transaction(lambda tx: saga.request_cancel(tx, p["po_number"], p["reason"]))
        if not done:
            raise AirflowFailException(f"{p['po_number']} is already over: nothing to cancel")
        return str(p["po_number"])

    request_cancel()
