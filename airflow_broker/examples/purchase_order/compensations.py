"""Compensating actions: undo a shipment, a reservation or a payment, once per conversation group
and action (recorded in the same transaction as the effect).
"""

from __future__ import annotations

import uuid

from sqlalchemy import (
    func,
    insert,
    select,
    update,
)
from sqlalchemy.engine import Connection

from airflow_broker.examples.purchase_order.contract import BUYER, SUPPLIER
from airflow_broker.examples.purchase_order.state import (
    _insert_once,
    _now,
    _order_of,
    money,
    po_compensation,
    po_ledger,
    po_stock,
    po_supplier,
    record_event,
)


def _compensated(
    conn: Connection, group: uuid.UUID, side: str, po_number: str, action: str, detail: str
) -> bool:
    """Record that ``action`` ran for this order; False when it already had (do nothing then)."""
    done = _insert_once(
        conn,
        po_compensation,
        {
            "conversation_group_id": group,
            "action": action,
            "side": side,
            "po_number": po_number,
            "detail": detail[:500],
            "at": _now(),
        },
    )
    if done:
        record_event(conn, po_number, side, "compensation", f"{action}: {detail}", group)
    return done


def cancel_shipment(conn: Connection, group: uuid.UUID) -> bool:
    """Supplier: bring back what was shipped for the order (recall the truck, or take the goods
    back) into the warehouse. True when it ran now, False when it had run before."""
    side, row = _order_of(conn, group)
    if side != SUPPLIER:
        raise LookupError(f"conversation group {group} is a buyer's: only a supplier ships")
    shipped = row["shipped"] if row["shipment"] in ("in_transit", "delivered") else 0
    if not shipped:
        detail = "nothing shipped"
    elif row["shipment"] == "in_transit":
        detail = f"recalled {shipped} {row['item']} ({row['tracking']}) to the warehouse"
    else:
        detail = f"took back {shipped} {row['item']} ({row['tracking']}) into the warehouse"
    if not _compensated(conn, group, side, row["po_number"], "cancel_shipment", detail):
        return False
    if shipped:
        conn.execute(
            update(po_stock)
            .where(po_stock.c.item == row["item"])
            .values(on_hand=po_stock.c.on_hand + shipped)
        )
        conn.execute(
            update(po_supplier)
            .where(po_supplier.c.conversation_group_id == group)
            .values(shipment="cancelled", updated_at=_now())
        )
    return True


def release_reservation(conn: Connection, group: uuid.UUID) -> bool:
    """Supplier: give the stock held for the order back to the warehouse."""
    side, row = _order_of(conn, group)
    if side != SUPPLIER:
        raise LookupError(f"conversation group {group} is a buyer's: only a supplier reserves")
    held = row["reserved"]
    detail = f"released {held} {row['item']}" if held else "nothing reserved"
    if not _compensated(conn, group, side, row["po_number"], "release_reservation", detail):
        return False
    if held:
        conn.execute(
            update(po_stock)
            .where(po_stock.c.item == row["item"])
            .values(reserved=po_stock.c.reserved - held)
        )
        conn.execute(
            update(po_supplier)
            .where(po_supplier.c.conversation_group_id == group)
            .values(reserved=0, updated_at=_now())
        )
    return True


def void_payment(conn: Connection, group: uuid.UUID) -> bool:
    """Either side: reverse the order's payment in this side's ledger. The buyer voids what it
    paid (the money comes back), the supplier refunds what it received."""
    side, row = _order_of(conn, group)
    balance = conn.execute(
        select(func.coalesce(func.sum(po_ledger.c.amount), 0)).where(
            po_ledger.c.conversation_group_id == group
        )
    ).scalar_one()
    moved = -balance if side == BUYER else balance  # what this side paid / received
    if side == BUYER:
        detail = f"voided payment of {money(moved)}" if moved else "nothing paid"
    else:
        detail = f"refunded {money(moved)} to the buyer" if moved else "no payment received"
    if not _compensated(conn, group, side, row["po_number"], "void_payment", detail):
        return False
    if moved:
        conn.execute(
            insert(po_ledger).values(
                conversation_group_id=group,
                side=side,
                po_number=row["po_number"],
                entry="void" if side == BUYER else "refund",
                amount=-balance,
                reference=row.get("payment_ref") or row.get("invoice"),
                at=_now(),
            )
        )
    return True


def notify(conn: Connection, group: uuid.UUID, text: str) -> bool:
    """Either side: send the order's cancellation notice (to the buyer's requester, to the
    supplier's sales desk): recorded as the action's detail, for a mailer to pick up."""
    side, row = _order_of(conn, group)
    return _compensated(conn, group, side, row["po_number"], "notify", text)
