"""The buyer's side of a purchase order as a saga of Airflow tasks, one DAG run per order
(``dags/purchase_order_saga.py``, DAG ``po_saga``): the engine half of it, which imports nothing
from Airflow.

The saga buyer has its own service and queue (:data:`SAGA_BUYER_SERVICE`,
:data:`SAGA_BUYER_QUEUE`, in :data:`DECLARATIONS`); the queue has no activation: each run
RECEIVEs from its own conversation only, after a ``ConversationSensor`` has waited (in the
triggerer) for the supplier's next message. The supplier is the same activated reader
(``supplier_handler``) as in the handler-based example.

Each step applies the buyer's rules of :func:`buyer_handler` (accept or counter a quote, confirm
receipt, pay) in one broker transaction, RECEIVE included, and returns the order's status; the
DAG's branches read it. What the handler does at once when an order goes wrong (void the
payment, notify, send Cancel, END) is left here to the saga's compensating tasks, each its own
function: :func:`release_reservation`, :func:`void_saga_payment`, :func:`notify_requester`,
:func:`end_order`.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from airflow_broker.examples.purchase_order.compensations import notify, void_payment
from airflow_broker.examples.purchase_order.contract import (
    CANCEL,
    FINAL_STATUSES,
    MAX_ROUNDS,
    SAGA_BUYER_QUEUE,
    SAGA_BUYER_SERVICE,
)
from airflow_broker.examples.purchase_order.handlers import _BuyerOrder
from airflow_broker.examples.purchase_order.orders import (
    Submitted,
    _lock_group,
    submit_purchase_order,
)
from airflow_broker.examples.purchase_order.state import po_buyer, po_compensation

if TYPE_CHECKING:
    from decimal import Decimal

    from sqlalchemy.engine import Connection

    from airflow_broker.messaging.transaction import Transaction

#: The error code the saga ENDs its dialog WITH when one of its steps failed (the supplier
#: compensates on the Error, as for any dialog error).
SAGA_STEP_FAILED = 50002

#: The (wait for a quote, decide) pairs of the saga DAG: the first quote, one per counter-offer
#: (``MAX_ROUNDS``), and one for a Backorder (the supplier's first answer when it lacks stock;
#: its quote follows a restock).
QUOTE_SLOTS = MAX_ROUNDS + 2


class _SagaBuyerOrder(_BuyerOrder):
    """The buyer's rules of :func:`buyer_handler`, with the compensations and the END left to
    the saga DAG's own tasks: giving an order up only records why."""

    def compensate(self, reason: str) -> None:
        return None

    def cancel(self, reason: str, status: str = "cancelled") -> None:
        self.transition(status, reason, reason=reason)

    def finish(self) -> None:
        return None


def _order(tx: Transaction, handle: str | uuid.UUID) -> _SagaBuyerOrder:
    """The saga order of conversation ``handle``, its group held and its row locked."""
    h = handle if isinstance(handle, uuid.UUID) else uuid.UUID(str(handle))
    group = tx.connection.execute(
        select(po_buyer.c.conversation_group_id).where(po_buyer.c.conversation_handle == h)
    ).scalar()
    if group is None:
        raise LookupError(f"the buyer has no purchase order on conversation {h}")
    _lock_group(tx.connection, group)
    return _SagaBuyerOrder(tx, h, group)


def submit_saga_order(
    tx: Transaction,
    item: str,
    qty: int,
    price: float | int | str | Decimal,
    *,
    po_number: str,
    ship_within_days: int = 14,
    deadline_seconds: float,
) -> Submitted:
    """BEGIN DIALOG from the saga buyer, record the order, SEND it and arm the deadline (the
    conversation timer), in ``tx``; an order ``po_number`` the saga buyer has already submitted
    is returned as it is (a retried submit task begins nothing twice)."""
    row = tx.connection.execute(
        select(po_buyer.c.conversation_handle, po_buyer.c.conversation_group_id).where(
            po_buyer.c.po_number == po_number
        )
    ).first()
    if row is not None:
        if tx.conversation(row.conversation_handle).service_name != SAGA_BUYER_SERVICE:
            raise ValueError(f"purchase order {po_number!r} exists and is not a saga's")
        return Submitted(po_number, row.conversation_handle, row.conversation_group_id)
    return submit_purchase_order(
        tx,
        item,
        qty,
        price,
        po_number=po_number,
        ship_within_days=ship_within_days,
        deadline_seconds=deadline_seconds,
        from_service=SAGA_BUYER_SERVICE,
    )


def _take(tx: Transaction, handle: str | uuid.UUID) -> _SagaBuyerOrder:
    """RECEIVE what is ready on the order's conversation and apply the buyer's rules to it."""
    messages = tx.receive(SAGA_BUYER_QUEUE, conversation_handle=handle)
    order = _order(tx, handle)
    for m in messages:
        order.receive(m)
    return order


def take_step(tx: Transaction, handle: str | uuid.UUID) -> str:
    """One step of the saga: RECEIVE the messages ready on the order's conversation, handle
    them as the buyer's reader would (a Quote is accepted or countered, a ShipNotice confirmed
    with a Receipt, an Invoice paid; a Refuse, the deadline's DialogTimer or the supplier's END
    give the order up), and return the order's status."""
    return _take(tx, handle).status


def decide(tx: Transaction, handle: str | uuid.UUID, *, last: bool) -> str:
    """The step after a quote (or a backorder): accept, counter (``negotiating``) or give up.
    In the ``last`` quote slot an order still without a price is given up."""
    order = _take(tx, handle)
    if last and order.status not in FINAL_STATUSES and order.status != "accepted":
        order.cancel(f"no price agreed within {QUOTE_SLOTS} answers of the supplier")
    return order.status


def close_order(tx: Transaction, handle: str | uuid.UUID) -> str:
    """The last step: the supplier's END after the payment completes the order; the buyer ENDs
    its side too."""
    order = _take(tx, handle)
    if order.status == "complete":
        order.end()
    return order.status


def settle(tx: Transaction, handle: str | uuid.UUID) -> dict[str, Any] | None:
    """After the last step, whatever happened: None when the order is complete; else what the
    compensations need (``po_number``, ``status``, ``reason``, ``failed``). An order that is not
    over (a step failed, or a wait timed out) is cancelled here, ``failed`` True."""
    order = _order(tx, handle)
    if order.status == "complete":
        return None
    failed = order.status not in FINAL_STATUSES
    if failed:
        order.cancel(f"a step of the saga failed while the order was {order.status}")
    assert order.row is not None
    return {
        "po_number": order.po_number,
        "status": order.status,
        "reason": order.row.get("reason") or "",
        "failed": failed,
    }


def _detail(conn: Connection, group: uuid.UUID, action: str) -> str:
    pc = po_compensation
    return str(
        conn.execute(
            select(pc.c.detail).where(pc.c.conversation_group_id == group, pc.c.action == action)
        ).scalar()
        or ""
    )


def void_saga_payment(tx: Transaction, handle: str | uuid.UUID) -> str:
    """Compensation: void what the buyer paid for the order, if it paid (once); what it did."""
    order = _order(tx, handle)
    void_payment(tx.connection, order.group)
    return _detail(tx.connection, order.group, "void_payment")


def notify_requester(tx: Transaction, handle: str | uuid.UUID) -> str:
    """Compensation: the requester's notice that the order is off, and why (once)."""
    order = _order(tx, handle)
    assert order.row is not None
    status = order.status.replace("_", " ")
    text = f"requester: order {order.po_number} {status}: {order.row.get('reason') or ''}"
    notify(tx.connection, order.group, text)
    return _detail(tx.connection, order.group, "notify")


def release_reservation(tx: Transaction, handle: str | uuid.UUID, *, failed: bool = False) -> str:
    """Compensation: ask the supplier to undo its side. While the supplier has not closed the
    order, SEND Cancel: the supplier releases the reservation, recalls a shipment, refunds a
    payment, and ENDs. After a failed step nothing is sent here: :func:`end_order` ENDs WITH
    ERROR (:data:`SAGA_STEP_FAILED`) and the supplier compensates on the Error. What it did."""
    order = _order(tx, handle)
    assert order.row is not None
    if tx.conversation(order.handle).state in ("CD", "DO"):
        return "the buyer's side was already closed"
    if failed:
        return "nothing sent: the dialog ends with an error, on which the supplier compensates"
    reason = str(order.row.get("reason") or order.status)
    if order.sendable() and order.send(CANCEL, {"po_number": order.po_number, "reason": reason}):
        return "sent Cancel: the supplier releases the reservation"
    return "the supplier had closed the order"


def end_order(tx: Transaction, handle: str | uuid.UUID, *, failed: bool = False) -> str:
    """Compensation, last: close the buyer's side of the order's dialog: END, or after a failed
    step END WITH ERROR (:data:`SAGA_STEP_FAILED`). What it did."""
    order = _order(tx, handle)
    assert order.row is not None
    if tx.conversation(order.handle).state in ("CD", "DO"):
        return "the buyer's side was already closed"
    if failed and order.sendable():
        reason = str(order.row.get("reason") or order.status)
        tx.end_conversation(order.handle, error_code=SAGA_STEP_FAILED, error_description=reason)
        order.event("end", f"END CONVERSATION WITH ERROR {SAGA_STEP_FAILED}: {reason}")
        return f"ended with error {SAGA_STEP_FAILED}: {reason}"
    order.end()
    return "ended"


def request_cancel(tx: Transaction, po_number: str, reason: str) -> bool:
    """The ``po_saga_cancel`` DAG: cancel a saga order that is not over. Records the
    cancellation and re-arms the order's conversation timer to fire now: the run's waiting
    sensor wakes on the DialogTimer, its step finds the order cancelled and the run's
    compensations run. False (and a note) when the order is already over."""
    row = tx.connection.execute(
        select(po_buyer.c.conversation_handle).where(po_buyer.c.po_number == po_number)
    ).first()
    if row is None:
        raise LookupError(f"the buyer has no purchase order {po_number!r}")
    if tx.conversation(row.conversation_handle).service_name != SAGA_BUYER_SERVICE:
        raise ValueError(
            f"purchase order {po_number!r} is not a saga's: cancel it with cancel_purchase_order"
        )
    order = _order(tx, row.conversation_handle)
    if order.status in FINAL_STATUSES:
        order.event("note", f"cancel refused: the order is already {order.status}")
        return False
    if tx.conversation(order.handle).state in ("CD", "DO", "ER"):
        order.event("note", "cancel refused: the buyer's side is closed")
        return False
    order.cancel(reason)
    tx.begin_conversation_timer(order.handle, 0)
    return True


def saga_order(conn: Connection, handle: str | uuid.UUID) -> dict[str, Any]:
    """The buyer's row of the saga order of conversation ``handle``."""
    h = handle if isinstance(handle, uuid.UUID) else uuid.UUID(str(handle))
    row = conn.execute(select(po_buyer).where(po_buyer.c.conversation_handle == h)).mappings()
    found = row.first()
    if found is None:
        raise LookupError(f"the buyer has no purchase order on conversation {h}")
    return dict(found)


__all__ = [
    "QUOTE_SLOTS",
    "SAGA_STEP_FAILED",
    "close_order",
    "decide",
    "end_order",
    "notify_requester",
    "release_reservation",
    "request_cancel",
    "saga_order",
    "settle",
    "submit_saga_order",
    "take_step",
    "void_saga_payment",
]
