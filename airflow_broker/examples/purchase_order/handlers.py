"""The message handlers: :func:`supplier_handler` and :func:`buyer_handler`, one call per
received conversation group, each side's order as a small state machine.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import (
    Table,
    insert,
    select,
    update,
)

from airflow_broker.constants import DIALOG_TIMER, END_DIALOG, ERROR, SENDABLE_STATES
from airflow_broker.errors import ConversationEnded
from airflow_broker.examples.purchase_order.compensations import (
    cancel_shipment,
    notify,
    release_reservation,
    void_payment,
)
from airflow_broker.examples.purchase_order.contract import (
    ACCEPT,
    BACKORDER,
    BUYER,
    CANCEL,
    COUNTER,
    FINAL_STATUSES,
    INVOICE,
    MALFORMED_MESSAGE,
    MAX_ROUNDS,
    ORDER,
    PAYMENT,
    QUOTE,
    RECEIPT,
    REFUSE,
    SHIP_NOTICE,
    SUPPLIER,
)
from airflow_broker.examples.purchase_order.state import (
    _conversations,
    _insert_once,
    _now,
    describe,
    money,
    po_buyer,
    po_ledger,
    po_stock,
    po_supplier,
    record_event,
    short,
)
from airflow_broker.messaging.objects import Message

if TYPE_CHECKING:
    from airflow_broker.messaging.transaction import Transaction

log = logging.getLogger("airflow_broker.examples.purchase_order")


class _Side:
    """One side's view of one order inside a transaction: its state row (locked for the
    transaction), and what it sends, changes and compensates, all through ``tx``."""

    side: ClassVar[str]
    other: ClassVar[str]
    table: ClassVar[Table]

    def __init__(self, tx: Transaction, handle: uuid.UUID, group: uuid.UUID) -> None:
        self.tx = tx
        self.conn = tx.connection
        self.handle = handle
        self.group = group
        # FOR UPDATE: the readers of this group are serialized by the broker already; this
        # also serializes the application's calls from outside a reader (cancel, restock).
        row = (
            self.conn.execute(
                select(self.table)
                .where(self.table.c.conversation_group_id == group)
                .with_for_update()
            )
            .mappings()
            .first()
        )
        self.row: dict[str, Any] | None = dict(row) if row is not None else None

    @property
    def po_number(self) -> str:
        return str(self.row["po_number"]) if self.row else "?"

    @property
    def status(self) -> str:
        return str(self.row["status"]) if self.row else "new"

    def _insert(self, **values: Any) -> None:
        now = _now()
        values.update(
            conversation_group_id=self.group,
            conversation_handle=self.handle,
            created_at=now,
            updated_at=now,
        )
        self.conn.execute(insert(self.table).values(**values))
        self.row = values

    def set(self, **values: Any) -> None:
        assert self.row is not None
        values["updated_at"] = _now()
        self.conn.execute(
            update(self.table)
            .where(self.table.c.conversation_group_id == self.group)
            .values(**values)
        )
        self.row.update(values)

    def transition(self, status: str, note: str, **values: Any) -> None:
        self.set(status=status, **values)
        self.event("state", f"{status}: {note}")

    def event(self, kind: str, text: str) -> None:
        record_event(self.conn, self.po_number, self.side, kind, text, self.group)

    def send(self, message_type: str, body: dict[str, Any]) -> bool:
        """SEND on the order's dialog; False (and a note) when the far side has ended it:
        what it ended with is in this side's queue and says what happened."""
        try:
            self.tx.send(self.handle, message_type, body)
        except ConversationEnded as exc:
            self.event("note", f"{short(message_type)} not sent: {exc}")
            return False
        self.event("send", f"{short(message_type)}: {describe(message_type, body)}")
        return True

    def end(self) -> None:
        """END CONVERSATION on this side, unless it has already ended."""
        if self.tx.conversation(self.handle).state in ("CD", "DO"):
            return
        self.tx.end_conversation(self.handle)
        self.event("end", "END CONVERSATION")

    def sendable(self) -> bool:
        return self.tx.conversation(self.handle).state in SENDABLE_STATES

    def receive(self, m: Message) -> None:
        """Handle one received message of this order."""
        kind = m.message_type_name
        if self.row is None:
            self.first_message(m)
            return
        if self.status in FINAL_STATUSES:
            if kind not in (END_DIALOG, DIALOG_TIMER, ERROR):
                self.event("note", f"{short(kind)} ignored: the order is {self.status}")
            return
        handlers = self.handlers()
        entry = handlers.get(kind)
        if entry is None:
            self.event("note", f"unexpected {short(kind)} ignored while {self.status}")
            return
        handler, states = entry
        if states and self.status not in states:
            self.event("note", f"{short(kind)} ignored while {self.status}")
            return
        try:
            handler(m)
        except (KeyError, TypeError, ValueError) as exc:
            self.reject(m, exc)

    def reject(self, m: Message, exc: Exception) -> None:
        """A message this side can never use (seed 004's poison message): rolling back would
        only bring it back, five times, and disable the queue. Give the order up instead, and
        END the dialog WITH ERROR so that the other side gives it up too."""
        reason = f"malformed {short(m.message_type_name)} ({type(exc).__name__}: {exc})"
        log.warning("order %s: %s", self.po_number, reason)
        if self.row is not None and self.status not in FINAL_STATUSES:
            self.transition("cancelled", reason, reason=reason[:500])
            self.compensate(reason)
        if self.tx.conversation(self.handle).state not in ("CD", "DO"):
            self.tx.end_conversation(
                self.handle, error_code=MALFORMED_MESSAGE, error_description=reason
            )
            if self.row is not None:
                self.event("end", f"END CONVERSATION WITH ERROR {MALFORMED_MESSAGE}: {reason}")

    def compensate(self, reason: str) -> None:
        raise NotImplementedError

    def first_message(self, m: Message) -> None:
        # Only the supplier gets an order's first message; a buyer's dialog starts with a row.
        log.warning(
            "message %s on conversation %s of no order: ignored",
            m.message_type_name,
            m.conversation_handle,
        )

    def handlers(self) -> dict[str, tuple[Callable[[Message], None], tuple[str, ...]]]:
        raise NotImplementedError

    def finish(self) -> None:
        """After the batch: an order that is over ends its side of the dialog."""
        if self.row is not None and self.status in FINAL_STATUSES:
            self.end()


def _body(m: Message) -> dict[str, Any]:
    body = m.json()
    return body if isinstance(body, dict) else {}


class _SupplierOrder(_Side):
    side, other, table = SUPPLIER, BUYER, po_supplier

    def handlers(self) -> dict[str, tuple[Callable[[Message], None], tuple[str, ...]]]:
        return {
            COUNTER: (self.on_counter, ("quoted",)),
            ACCEPT: (self.on_accept, ("quoted",)),
            RECEIPT: (self.on_receipt, ("shipped",)),
            PAYMENT: (self.on_payment, ("delivered",)),
            CANCEL: (self.on_cancel, ()),
            END_DIALOG: (self.on_end_dialog, ()),
            ERROR: (self.on_error, ()),
            DIALOG_TIMER: (lambda m: None, ()),
        }

    def first_message(self, m: Message) -> None:
        if m.message_type_name != ORDER:
            log.warning(
                "%s without an order on conversation %s: ending it",
                short(m.message_type_name),
                m.conversation_handle,
            )
            if self.tx.conversation(self.handle).state not in ("CD", "DO"):
                self.tx.end_conversation(self.handle)
            return
        self.on_order(m)

    def _stock(self, item: str) -> dict[str, Any] | None:
        row = (
            self.conn.execute(select(po_stock).where(po_stock.c.item == item).with_for_update())
            .mappings()
            .first()
        )
        return dict(row) if row is not None else None

    def _reserve(self, item: str, qty: int) -> None:
        self.conn.execute(
            update(po_stock)
            .where(po_stock.c.item == item)
            .values(reserved=po_stock.c.reserved + qty)
        )

    def on_order(self, m: Message) -> None:
        b = _body(m)
        item, qty = str(b["item"]), int(b["qty"])
        self._insert(
            po_number=str(b["po_number"]),
            item=item,
            qty=qty,
            reserved=0,
            shipped=0,
            rounds=0,
            status="received",
        )
        self.event("state", f"received: order for {qty} {item}")
        stock = self._stock(item)
        available = 0 if stock is None else stock["on_hand"] - stock["reserved"]
        if stock is None or available <= 0:
            reason = f"{item} is out of stock" if stock else f"{item} is not an item we sell"
            self.transition("refused", reason, reason=reason)
            self.compensate(reason)
            self.send(REFUSE, {"po_number": self.po_number, "reason": reason})
            return
        if available < qty:
            self._reserve(item, available)
            self.transition(
                "backordered",
                f"reserved {available} {item}, {qty - available} to come",
                reserved=available,
            )
            self.send(
                BACKORDER,
                {"po_number": self.po_number, "reserved": available, "missing": qty - available},
            )
            return
        self._reserve(item, qty)
        self.set(reserved=qty)
        self.quote(stock["list_price"], stock["lead_days"], f"reserved {qty} {item}")

    def quote(self, price: int, days: int, note: str) -> None:
        if self.status != "quoted":
            self.transition("quoted", note, ask_price=price, ship_in_days=days)
        else:
            self.set(ask_price=price, ship_in_days=days)
        self.send(
            QUOTE,
            {
                "po_number": self.po_number,
                "unit_price": price,
                "ship_in_days": days,
                "round": self.row["rounds"] if self.row else 0,
            },
        )

    def on_counter(self, m: Message) -> None:
        assert self.row is not None
        b = _body(m)
        stock = self._stock(self.row["item"])
        assert stock is not None
        rounds = self.row["rounds"] + 1
        # The supplier concedes a share of its margin each round, never below its floor, and
        # takes the buyer's offer once it reaches that.
        concession = (stock["list_price"] - stock["floor_price"]) * rounds // MAX_ROUNDS
        ask = max(stock["floor_price"], stock["list_price"] - concession)
        offer = int(b.get("unit_price", 0))
        price = offer if offer >= ask else ask
        days = max(int(b.get("ship_within_days", stock["lead_days"])), stock["rush_days"])
        self.set(rounds=rounds)
        self.quote(price, days, "")

    def on_accept(self, m: Message) -> None:
        row = self.row
        assert row is not None
        # The agreement is the supplier's own last quote, whatever the body repeats.
        qty, item = row["reserved"], row["item"]
        tracking = f"TRK-{self.group.hex[:10].upper()}"
        self.conn.execute(
            update(po_stock)
            .where(po_stock.c.item == item)
            .values(on_hand=po_stock.c.on_hand - qty, reserved=po_stock.c.reserved - qty)
        )
        self.transition(
            "shipped",
            f"accepted at {money(row['ask_price'])}/unit; {qty} {item} shipped",
            unit_price=row["ask_price"],
            reserved=0,
            shipped=qty,
            shipment="in_transit",
            tracking=tracking,
        )
        self.send(
            SHIP_NOTICE,
            {
                "po_number": self.po_number,
                "qty": qty,
                "tracking": tracking,
                "ship_in_days": row["ship_in_days"],
            },
        )

    def on_receipt(self, m: Message) -> None:
        row = self.row
        assert row is not None
        amount = row["unit_price"] * row["shipped"]
        invoice = f"INV-{self.po_number}"
        self.transition(
            "delivered",
            f"the buyer received {_body(m).get('qty')}; invoiced {money(amount)}",
            shipment="delivered",
            invoice=invoice,
            amount_due=amount,
        )
        self.send(INVOICE, {"po_number": self.po_number, "invoice": invoice, "amount": amount})

    def on_payment(self, m: Message) -> None:
        b = _body(m)
        amount = int(b.get("amount", 0))
        _insert_once(
            self.conn,
            po_ledger,
            {
                "conversation_group_id": self.group,
                "side": SUPPLIER,
                "po_number": self.po_number,
                "entry": "payment",
                "amount": amount,
                "reference": b.get("payment_ref"),
                "at": _now(),
            },
        )
        self.transition("paid", f"received {money(amount)} ({b.get('payment_ref')})")

    def on_cancel(self, m: Message) -> None:
        reason = str(_body(m).get("reason") or "cancelled by the buyer")
        self.transition("cancelled", f"the buyer cancelled: {reason}", reason=reason)
        self.compensate(reason)

    def on_end_dialog(self, m: Message) -> None:
        reason = "the buyer ended the dialog"
        self.transition("cancelled", reason, reason=reason)
        self.compensate(reason)

    def on_error(self, m: Message) -> None:
        code, text = m.error or (0, "")
        reason = f"the dialog failed ({code}: {text})"
        self.transition("cancelled", reason, reason=reason)
        self.compensate(reason)

    def compensate(self, reason: str) -> None:
        cancel_shipment(self.conn, self.group)
        release_reservation(self.conn, self.group)
        void_payment(self.conn, self.group)
        notify(self.conn, self.group, f"sales: order {self.po_number} {self.status}: {reason}")

    def finish(self) -> None:
        if self.row is not None and self.status == "paid":
            self.transition("complete", "paid in full; the order is closed")
        super().finish()


class _BuyerOrder(_Side):
    side, other, table = BUYER, SUPPLIER, po_buyer

    def handlers(self) -> dict[str, tuple[Callable[[Message], None], tuple[str, ...]]]:
        return {
            QUOTE: (self.on_quote, ("submitted", "negotiating", "backordered")),
            BACKORDER: (self.on_backorder, ("submitted",)),
            REFUSE: (self.on_refuse, ()),
            SHIP_NOTICE: (self.on_ship_notice, ("accepted",)),
            INVOICE: (self.on_invoice, ("received",)),
            END_DIALOG: (self.on_end_dialog, ()),
            ERROR: (self.on_error, ()),
            DIALOG_TIMER: (self.on_timer, ()),
        }

    def on_quote(self, m: Message) -> None:
        row = self.row
        assert row is not None
        b = _body(m)
        price, days = int(b["unit_price"]), int(b["ship_in_days"])
        self.set(quoted_price=price, quoted_ship_days=days)
        if price <= row["limit_price"] and days <= row["ship_within_days"]:
            self.transition(
                "accepted",
                f"{money(price)}/unit, shipping in {days} days",
                unit_price=price,
                ship_in_days=days,
            )
            self.send(
                ACCEPT, {"po_number": self.po_number, "unit_price": price, "ship_in_days": days}
            )
            return
        if row["rounds"] >= MAX_ROUNDS:
            self.cancel(
                f"no agreement after {MAX_ROUNDS} rounds: best quote {money(price)}/unit "
                f"in {days} days, limit {money(row['limit_price'])} "
                f"within {row['ship_within_days']} days"
            )
            return
        rounds = row["rounds"] + 1
        # Move halfway towards the quote, never past the limit; keep asking for the date.
        offer = (
            price
            if price <= row["limit_price"]
            else min(row["limit_price"], max(row["offer_price"], (row["offer_price"] + price) // 2))
        )
        note = f"round {rounds}: offering {money(offer)}/unit"
        self.transition("negotiating", note, rounds=rounds, offer_price=offer)
        self.send(
            COUNTER,
            {
                "po_number": self.po_number,
                "unit_price": offer,
                "ship_within_days": row["ship_within_days"],
                "round": rounds,
            },
        )

    def on_backorder(self, m: Message) -> None:
        b = _body(m)
        self.transition(
            "backordered",
            f"the supplier holds {b.get('reserved')} and waits for {b.get('missing')} more",
        )

    def on_refuse(self, m: Message) -> None:
        reason = str(_body(m).get("reason") or "refused")
        self.transition("refused", f"the supplier refused: {reason}", reason=reason)
        self.compensate(reason)

    def on_ship_notice(self, m: Message) -> None:
        b = _body(m)
        qty = int(b.get("qty", 0))
        # The example's dock takes the goods in as soon as they are announced.
        self.transition(
            "received",
            f"{qty} {self.row['item'] if self.row else ''} arrived ({b.get('tracking')})",
            tracking=b.get("tracking"),
            received_qty=qty,
        )
        self.send(RECEIPT, {"po_number": self.po_number, "qty": qty})

    def on_invoice(self, m: Message) -> None:
        b = _body(m)
        amount = int(b.get("amount", 0))
        ref = f"PAY-{self.group.hex[:10].upper()}"
        _insert_once(
            self.conn,
            po_ledger,
            {
                "conversation_group_id": self.group,
                "side": BUYER,
                "po_number": self.po_number,
                "entry": "payment",
                "amount": -amount,
                "reference": ref,
                "at": _now(),
            },
        )
        self.transition(
            "paid",
            f"paid {b.get('invoice')}: {money(amount)}",
            invoice=b.get("invoice"),
            amount_due=amount,
            payment_ref=ref,
        )
        self.send(PAYMENT, {"po_number": self.po_number, "amount": amount, "payment_ref": ref})

    def on_end_dialog(self, m: Message) -> None:
        if self.status == "paid":
            self.transition("complete", "the supplier closed the order")
            return
        reason = "the supplier ended the dialog"
        self.transition("cancelled", reason, reason=reason)
        self.compensate(reason)

    def on_error(self, m: Message) -> None:
        code, text = m.error or (0, "")
        reason = f"the dialog failed ({code}: {text})"
        self.transition("cancelled", reason, reason=reason)
        self.compensate(reason)

    def on_timer(self, m: Message) -> None:
        assert self.row is not None
        self.cancel(
            f"deadline passed: no conclusion within {self.row['deadline_seconds']:g} s",
            status="timed_out",
        )

    def cancel(self, reason: str, status: str = "cancelled") -> None:
        """Give the order up: compensate this side, tell the supplier why, END."""
        self.transition(status, reason, reason=reason)
        self.compensate(reason)
        self.send(CANCEL, {"po_number": self.po_number, "reason": reason})

    def compensate(self, reason: str) -> None:
        void_payment(self.conn, self.group)
        status = self.status.replace("_", " ")
        notify(self.conn, self.group, f"requester: order {self.po_number} {status}: {reason}")


def supplier_handler(tx: Transaction, messages: Sequence[Message]) -> None:
    """The supplier's reader: handle what one RECEIVE returned (one conversation group) in
    ``tx``. Use as ``DrainQueueOperator(handler="airflow_broker.examples.purchase_order:
    supplier_handler")`` or ``ActivationRunner(broker, SUPPLIER_QUEUE, supplier_handler)``."""
    for handle, group, batch in _conversations(messages):
        order = _SupplierOrder(tx, handle, group)
        for m in batch:
            order.receive(m)
        order.finish()


def buyer_handler(tx: Transaction, messages: Sequence[Message]) -> None:
    """The buyer's reader (the response service of seed 004): handle quotes, notices and
    invoices, the supplier's END, and the buyer's own deadline (DialogTimer)."""
    for handle, group, batch in _conversations(messages):
        order = _BuyerOrder(tx, handle, group)
        for m in batch:
            order.receive(m)
        order.finish()
