"""What the example's users do: submit, cancel and look at orders, restock, and read the trace,
the compensations, stock levels and the ledger.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    func,
    select,
    update,
)
from sqlalchemy.engine import Connection

from airflow_broker.errors import InvalidDefinition
from airflow_broker.examples.purchase_order.contract import (
    BUYER_SERVICE,
    CONTRACT,
    DEFAULT_DEADLINE_SECONDS,
    FINAL_STATUSES,
    ORDER,
    SUPPLIER_SERVICE,
)
from airflow_broker.examples.purchase_order.handlers import _BuyerOrder, _SupplierOrder
from airflow_broker.examples.purchase_order.state import (
    money,
    po_buyer,
    po_compensation,
    po_event,
    po_ledger,
    po_stock,
    po_supplier,
    to_cents,
)
from airflow_broker.storage import schema as broker_schema

if TYPE_CHECKING:
    from airflow_broker.messaging.transaction import Transaction


def _lock_group(conn: Connection, group: uuid.UUID) -> None:
    """Hold the order's conversation group as a reader does, waiting for a reader that holds
    it (RECEIVE skips a group held here). Work on an order from outside a reader must take the
    group before the order's row: a reader holds the group (and the messages it received)
    before it asks for the row, so the other order could deadlock (END deletes the
    conversation's queued messages). ``FOR NO KEY UPDATE``, as RECEIVE's own lock: SENDs into
    the group still enqueue. (SQLite runs one writer at a time: nothing to lock.)"""
    cg = broker_schema.conversation_group
    conn.execute(
        select(cg.c.conversation_group_id)
        .where(cg.c.conversation_group_id == group)
        .with_for_update(key_share=True)
    )


@dataclass(frozen=True, slots=True)
class Submitted:
    """A purchase order the buyer has sent."""

    po_number: str
    conversation_handle: uuid.UUID
    conversation_group_id: uuid.UUID


def submit_purchase_order(
    tx: Transaction,
    item: str,
    qty: int,
    price: float | int | str | Decimal,
    *,
    po_number: str | None = None,
    ship_within_days: int = 14,
    deadline_seconds: float = DEFAULT_DEADLINE_SECONDS,
    from_service: str = BUYER_SERVICE,
) -> Submitted:
    """Buyer (the initiator): begin the order's dialog, record the order and send it, and arm
    the buyer's deadline (a conversation timer): all in ``tx``.

    :param price: the most the buyer pays per unit, in dollars; it opens 10% lower.
    :param deadline_seconds: when the order is not over by then, the buyer cancels it.
    :param from_service: the buyer's service: the reader-driven buyer's by default, the saga
        DAG's (``SAGA_BUYER_SERVICE``) for an order run by ``po_saga``.
    """
    if not isinstance(qty, int) or isinstance(qty, bool) or qty < 1:
        raise InvalidDefinition(f"qty must be a whole number >= 1, not {qty!r}")
    if not isinstance(ship_within_days, int) or ship_within_days < 0:
        raise InvalidDefinition(f"ship_within_days must be >= 0, not {ship_within_days!r}")
    if deadline_seconds <= 0:
        raise InvalidDefinition(f"deadline_seconds must be positive, not {deadline_seconds!r}")
    limit = to_cents(price)
    offer = max(1, limit * 9 // 10)
    number = po_number or f"PO-{uuid.uuid4().hex[:8].upper()}"
    handle = tx.begin_dialog(from_service, SUPPLIER_SERVICE, CONTRACT)
    group = tx.conversation(handle).conversation_group_id
    order = _BuyerOrder(tx, handle, group)
    order._insert(
        po_number=number,
        item=item,
        qty=qty,
        limit_price=limit,
        ship_within_days=ship_within_days,
        deadline_seconds=float(deadline_seconds),
        offer_price=offer,
        rounds=0,
        status="submitted",
    )
    order.event(
        "state",
        f"submitted: {qty} {item}, limit {money(limit)}/unit, ship within {ship_within_days} "
        f"days, deadline {deadline_seconds:g} s",
    )
    order.send(
        ORDER,
        {
            "po_number": number,
            "item": item,
            "qty": qty,
            "unit_price": offer,
            "ship_within_days": ship_within_days,
        },
    )
    tx.begin_conversation_timer(handle, deadline_seconds)
    return Submitted(number, handle, group)


def cancel_purchase_order(
    tx: Transaction, po_number: str, reason: str = "cancelled by the buyer"
) -> bool:
    """Buyer: cancel an order that is not over: void the payment if made, notify, send Cancel
    and END. False (and nothing changes but a note) when the order is already over, or the
    supplier has already closed it (a paid and completed order is returned, not cancelled)."""
    found = tx.connection.execute(
        select(po_buyer.c.conversation_handle, po_buyer.c.conversation_group_id).where(
            po_buyer.c.po_number == po_number
        )
    ).first()
    if found is None:
        raise LookupError(f"the buyer has no purchase order {po_number!r}")
    _lock_group(tx.connection, found.conversation_group_id)
    order = _BuyerOrder(tx, found.conversation_handle, found.conversation_group_id)
    if order.status in FINAL_STATUSES:
        order.event("note", f"cancel refused: the order is already {order.status}")
        return False
    if not order.sendable():
        order.event("note", "cancel refused: the supplier has already closed the order")
        return False
    order.cancel(reason)
    order.finish()
    return True


def restock(tx: Transaction, item: str, qty: int) -> list[str]:
    """Supplier: ``qty`` more ``item`` arrive. Backordered orders of that item, oldest first,
    get what they were missing reserved and a quote. Returns their PO numbers."""
    conn = tx.connection
    waiting = conn.execute(
        select(po_supplier.c.conversation_handle, po_supplier.c.conversation_group_id)
        .where(po_supplier.c.item == item, po_supplier.c.status == "backordered")
        .order_by(po_supplier.c.created_at, po_supplier.c.conversation_group_id)
    ).all()
    # The orders' groups before the stock row, as a reader takes them (see _lock_group).
    for _handle, group in waiting:
        _lock_group(conn, group)
    stock = (
        conn.execute(select(po_stock).where(po_stock.c.item == item).with_for_update())
        .mappings()
        .first()
    )
    if stock is None:
        raise LookupError(f"the supplier does not sell {item!r}")
    conn.execute(
        update(po_stock).where(po_stock.c.item == item).values(on_hand=po_stock.c.on_hand + qty)
    )
    available = stock["on_hand"] + qty - stock["reserved"]
    quoted: list[str] = []
    for handle, group in waiting:
        order = _SupplierOrder(tx, handle, group)
        row = order.row
        if row is None or order.status != "backordered":
            continue  # cancelled meanwhile
        missing = row["qty"] - row["reserved"]
        if missing > available:
            break
        order._reserve(item, missing)
        available -= missing
        order.set(reserved=row["qty"])
        order.quote(stock["list_price"], stock["lead_days"], f"restocked: reserved {missing} more")
        quoted.append(order.po_number)
    return quoted


def buyer_order(conn: Connection, po_number: str) -> dict[str, Any] | None:
    """The buyer's row of an order."""
    row = conn.execute(select(po_buyer).where(po_buyer.c.po_number == po_number)).mappings().first()
    return dict(row) if row is not None else None


def supplier_order(conn: Connection, po_number: str) -> dict[str, Any] | None:
    """The supplier's row of an order (None until the supplier has received it)."""
    row = (
        conn.execute(select(po_supplier).where(po_supplier.c.po_number == po_number))
        .mappings()
        .first()
    )
    return dict(row) if row is not None else None


def trace(conn: Connection, po_number: str | None = None) -> list[dict[str, Any]]:
    """The trace in order: what each side sent, its state changes, compensations and ENDs."""
    stmt = select(po_event).order_by(po_event.c.id)
    if po_number is not None:
        stmt = stmt.where(po_event.c.po_number == po_number)
    return [dict(r) for r in conn.execute(stmt).mappings()]


def compensations(conn: Connection, po_number: str | None = None) -> list[dict[str, Any]]:
    """The compensating actions that ran, in order."""
    stmt = select(po_compensation).order_by(po_compensation.c.at, po_compensation.c.side)
    if po_number is not None:
        stmt = stmt.where(po_compensation.c.po_number == po_number)
    return [dict(r) for r in conn.execute(stmt).mappings()]


def stock_levels(conn: Connection) -> dict[str, tuple[int, int]]:
    """item -> (on hand, reserved)."""
    return {
        r.item: (r.on_hand, r.reserved)
        for r in conn.execute(select(po_stock.c.item, po_stock.c.on_hand, po_stock.c.reserved))
    }


def ledger_balance(conn: Connection, side: str, po_number: str | None = None) -> int:
    """Net cents into ``side``'s account (negative: it paid)."""
    stmt = select(func.coalesce(func.sum(po_ledger.c.amount), 0)).where(po_ledger.c.side == side)
    if po_number is not None:
        stmt = stmt.where(po_ledger.c.po_number == po_number)
    return int(conn.execute(stmt).scalar_one())
