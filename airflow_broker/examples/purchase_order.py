"""Seed 004's purchase order: a long-running dialog between a buyer and a supplier.

"Processing a purchase order typically involves a long-running exchange of messages between the
purchaser and supplier, as prices are negotiated, delivery dates agreed upon, status
communicated, delivery confirmed, and payment exchanged. This whole exchange can be a single
Service Broker dialog" (Architecting Service Broker Applications). This module is that
application, as plain engine code:

- **Declarations** (:data:`DECLARATIONS`, the ``airflow-broker apply`` format): the message
  types, one contract, a queue and a service for each side.
- **Application state** in tables of the broker database (:data:`metadata`: ``po_buyer``,
  ``po_supplier``, ``po_stock``, ``po_ledger``, ``po_compensation``, ``po_event``), keyed by
  **conversation group id**, the key any received message carries, and written through
  ``tx.connection`` in the same transaction as the messages: a state change and the messages it
  causes commit together or not at all. Only one reader holds a conversation group at a time, so
  each order is handled by one reader at a time however many run.
- **Message handlers** :func:`buyer_handler` and :func:`supplier_handler`, with the signature
  ``handler(tx, messages)`` that ``DrainQueueOperator`` (Airflow) and ``ActivationRunner``
  (outside Airflow) call once per received conversation group.
- **Compensating actions** (:func:`cancel_shipment`, :func:`release_reservation`,
  :func:`void_payment`, :func:`notify`): a business transaction spans many database
  transactions and cannot be rolled back, so when the supplier refuses, the buyer's deadline
  (a conversation timer) passes, or the buyer cancels, each side undoes what it did. Each action
  is recorded under (conversation group id, action) with a unique key in the same transaction as
  its effect: running it again does nothing.

The dialog (contract ``//airflow-broker/examples/po/Contract``)::

    buyer                                        supplier
    Order (item, qty, offer, ship within)    ->
                                             <-  Quote (price, ship in)     stock reserved
                                             <-  Backorder (reserved, missing)
                                             <-  Refuse (reason), END       no stock
    Counter (price, ship within)             ->                             at most MAX_ROUNDS
                                             <-  Quote (price, ship in)
    Accept (price, ship in)                  ->
                                             <-  ShipNotice (tracking)      the goods leave
    Receipt (quantity received)              ->
                                             <-  Invoice (amount)
    Payment (amount)                         ->
                                             <-  END                        order complete
    END (both sides closed)

    Cancel (reason), END                     ->  any time before the supplier closes: on the
                                                 buyer's deadline, when the buyer cancels, or
                                                 when no price is agreed within MAX_ROUNDS

Amounts are integers in cents. Nothing here imports Airflow.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any, ClassVar

import yaml
from sqlalchemy import (
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    UniqueConstraint,
    Uuid,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from airflow_broker import schema as broker_schema
from airflow_broker.constants import DIALOG_TIMER, END_DIALOG, ERROR, SENDABLE_STATES
from airflow_broker.errors import ConversationEnded, InvalidDefinition
from airflow_broker.examples import apply_declarations
from airflow_broker.objects import Message
from airflow_broker.schema import NAMING_CONVENTION

if TYPE_CHECKING:
    from airflow_broker.broker import Broker
    from airflow_broker.transaction import Transaction

log = logging.getLogger("airflow_broker.examples.purchase_order")

# ---------------------------------------------------------------------------------------------
# Broker objects
# ---------------------------------------------------------------------------------------------

PREFIX = "//airflow-broker/examples/po"
BUYER_SERVICE = f"{PREFIX}/Buyer"
SUPPLIER_SERVICE = f"{PREFIX}/Supplier"
CONTRACT = f"{PREFIX}/Contract"
BUYER_QUEUE = "po_buyer_queue"
SUPPLIER_QUEUE = "po_supplier_queue"
#: The most readers at once on each queue (the queue's activation ``max_readers``, and the
#: reader DAG's ``max_active_runs``).
BUYER_MAX_READERS = 2
SUPPLIER_MAX_READERS = 3
#: The reader DAGs of dags/purchase_order.py (the queues' activation ``reader``).
BUYER_READER_DAG = "po_buyer_reader"
SUPPLIER_READER_DAG = "po_supplier_reader"

ORDER = f"{PREFIX}/Order"
QUOTE = f"{PREFIX}/Quote"
BACKORDER = f"{PREFIX}/Backorder"
REFUSE = f"{PREFIX}/Refuse"
COUNTER = f"{PREFIX}/Counter"
ACCEPT = f"{PREFIX}/Accept"
SHIP_NOTICE = f"{PREFIX}/ShipNotice"
RECEIPT = f"{PREFIX}/Receipt"
INVOICE = f"{PREFIX}/Invoice"
PAYMENT = f"{PREFIX}/Payment"
CANCEL = f"{PREFIX}/Cancel"

#: Who may send each message type on the contract.
SENT_BY = {
    ORDER: "initiator",
    COUNTER: "initiator",
    ACCEPT: "initiator",
    RECEIPT: "initiator",
    PAYMENT: "initiator",
    CANCEL: "initiator",
    QUOTE: "target",
    BACKORDER: "target",
    REFUSE: "target",
    SHIP_NOTICE: "target",
    INVOICE: "target",
}

#: The Order is checked by the broker (validation ``json_schema``): a malformed order never
#: reaches the supplier. The other bodies must be JSON.
ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["po_number", "item", "qty", "unit_price", "ship_within_days"],
    "properties": {
        "po_number": {"type": "string", "minLength": 1},
        "item": {"type": "string", "minLength": 1},
        "qty": {"type": "integer", "minimum": 1},
        "unit_price": {"type": "integer", "minimum": 0},
        "ship_within_days": {"type": "integer", "minimum": 0},
    },
}


def _declarations() -> str:
    doc = {
        "version": 1,
        "message_types": [
            {"name": ORDER, "validation": "json_schema", "json_schema": ORDER_SCHEMA},
            *({"name": mt, "validation": "json"} for mt in SENT_BY if mt != ORDER),
        ],
        "contracts": [{"name": CONTRACT, "message_types": dict(SENT_BY)}],
        "queues": [
            {
                "name": BUYER_QUEUE,
                "activation": {"max_readers": BUYER_MAX_READERS, "reader": BUYER_READER_DAG},
            },
            {
                "name": SUPPLIER_QUEUE,
                "activation": {
                    "max_readers": SUPPLIER_MAX_READERS,
                    "reader": SUPPLIER_READER_DAG,
                },
            },
        ],
        "services": [
            # The initiator's service needs no contract: replies come back on the dialog.
            {"name": BUYER_SERVICE, "queue": BUYER_QUEUE},
            {"name": SUPPLIER_SERVICE, "queue": SUPPLIER_QUEUE, "contracts": [CONTRACT]},
        ],
    }
    return "# The purchase-order example (airflow_broker.examples.purchase_order).\n" + (
        yaml.safe_dump(doc, sort_keys=False, width=100)
    )


#: The broker objects of the example, in the ``airflow-broker apply`` format.
DECLARATIONS = _declarations()

#: Counter-offers the buyer makes before it gives up on a price.
MAX_ROUNDS = 3
#: How long the buyer waits for the whole order by default (its conversation timer).
DEFAULT_DEADLINE_SECONDS = 7 * 24 * 3600
#: An order in one of these states is over; later messages of its dialog are ignored.
FINAL_STATUSES = frozenset({"complete", "refused", "cancelled", "timed_out"})
BUYER, SUPPLIER = "buyer", "supplier"
#: The error code a side ENDs the dialog WITH when a message of it can never be used.
MALFORMED_MESSAGE = 50001

# ---------------------------------------------------------------------------------------------
# Application tables (in the broker database, beside the broker's own)
# ---------------------------------------------------------------------------------------------

#: The example's tables: their own MetaData, created by :func:`create_tables`.
metadata = MetaData(naming_convention=NAMING_CONVENTION)
Timestamp = DateTime(timezone=True)

po_stock = Table(
    "po_stock",
    metadata,
    Column("item", String(64), primary_key=True),
    Column("on_hand", Integer, nullable=False, comment="units in the warehouse"),
    Column("reserved", Integer, nullable=False, comment="units of on_hand promised to orders"),
    Column("list_price", Integer, nullable=False, comment="cents per unit: the first ask"),
    Column("floor_price", Integer, nullable=False, comment="cents per unit: the lowest ask"),
    Column("lead_days", Integer, nullable=False, comment="days to ship, normally"),
    Column("rush_days", Integer, nullable=False, comment="days to ship, at the fastest"),
    comment="The supplier's warehouse.",
)

po_buyer = Table(
    "po_buyer",
    metadata,
    Column("conversation_group_id", Uuid, primary_key=True),
    Column("conversation_handle", Uuid, nullable=False, unique=True),
    Column("po_number", String(64), nullable=False, unique=True),
    Column("item", String(64), nullable=False),
    Column("qty", Integer, nullable=False),
    Column("limit_price", Integer, nullable=False, comment="the most it pays, cents per unit"),
    Column("ship_within_days", Integer, nullable=False),
    Column("deadline_seconds", Float, nullable=False),
    Column("offer_price", Integer, nullable=False, comment="its latest offer"),
    Column("rounds", Integer, nullable=False, comment="counter-offers made"),
    Column("quoted_price", Integer),
    Column("quoted_ship_days", Integer),
    Column("unit_price", Integer, comment="agreed"),
    Column("ship_in_days", Integer, comment="agreed"),
    Column("tracking", String(64)),
    Column("received_qty", Integer),
    Column("invoice", String(64)),
    Column("amount_due", Integer),
    Column("payment_ref", String(64)),
    Column("status", String(32), nullable=False),
    Column("reason", String(500)),
    Column("created_at", Timestamp, nullable=False),
    Column("updated_at", Timestamp, nullable=False),
    comment="The buyer's purchase orders, one per conversation group of the buyer's queue.",
)

po_supplier = Table(
    "po_supplier",
    metadata,
    Column("conversation_group_id", Uuid, primary_key=True),
    Column("conversation_handle", Uuid, nullable=False, unique=True),
    Column("po_number", String(64), nullable=False, comment="the buyer's number"),
    Column("item", String(64), nullable=False),
    Column("qty", Integer, nullable=False),
    Column("reserved", Integer, nullable=False, comment="units held for this order"),
    Column("shipped", Integer, nullable=False, comment="units sent to the buyer"),
    Column("shipment", String(16), comment="in_transit | delivered | cancelled"),
    Column("tracking", String(64)),
    Column("ask_price", Integer, comment="its latest quote, cents per unit"),
    Column("ship_in_days", Integer),
    Column("rounds", Integer, nullable=False),
    Column("unit_price", Integer, comment="agreed"),
    Column("invoice", String(64)),
    Column("amount_due", Integer),
    Column("status", String(32), nullable=False),
    Column("reason", String(500)),
    Column("created_at", Timestamp, nullable=False),
    Column("updated_at", Timestamp, nullable=False),
    comment="The supplier's orders, one per conversation group of the supplier's queue.",
)
Index("ix_po_supplier_item_status", po_supplier.c.item, po_supplier.c.status)

po_ledger = Table(
    "po_ledger",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("conversation_group_id", Uuid, nullable=False),
    Column("side", String(8), nullable=False),
    Column("po_number", String(64), nullable=False),
    Column("entry", String(16), nullable=False, comment="payment | void | refund"),
    Column("amount", Integer, nullable=False, comment="cents, + into this side's account"),
    Column("reference", String(64)),
    Column("at", Timestamp, nullable=False),
    # One payment and one reversal per order and side, whatever runs twice.
    UniqueConstraint("conversation_group_id", "entry"),
    comment="Money each side paid, received, voided and refunded.",
)

po_compensation = Table(
    "po_compensation",
    metadata,
    Column("conversation_group_id", Uuid, nullable=False),
    Column("action", String(32), nullable=False),
    Column("side", String(8), nullable=False),
    Column("po_number", String(64), nullable=False),
    Column("detail", String(500), nullable=False),
    Column("at", Timestamp, nullable=False),
    # The idempotency key: an action runs once per order and side (each side has its own
    # conversation group), in the transaction that writes this row.
    PrimaryKeyConstraint("conversation_group_id", "action"),
    comment="Compensating actions that ran (notify's detail is the notice sent).",
)

po_event = Table(
    "po_event",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", Timestamp, nullable=False),
    Column("po_number", String(64), nullable=False, index=True),
    Column("side", String(8), nullable=False),
    Column("conversation_group_id", Uuid),
    Column("kind", String(16), nullable=False, comment="send | state | compensation | end | note"),
    Column("text", String(1000), nullable=False),
    comment="The trace: what each side sent, its state changes and compensations, in order.",
)


@dataclass(frozen=True, slots=True)
class StockItem:
    """One line of the supplier's warehouse (prices in cents per unit)."""

    item: str
    on_hand: int
    list_price: int
    floor_price: int
    lead_days: int
    rush_days: int


#: What :func:`setup` puts in the warehouse: plenty of widgets, few sprockets, no gizmos.
DEFAULT_STOCK = (
    StockItem("widget", on_hand=5000, list_price=500, floor_price=400, lead_days=21, rush_days=7),
    StockItem("sprocket", on_hand=40, list_price=250, floor_price=200, lead_days=10, rush_days=5),
    StockItem("gizmo", on_hand=0, list_price=1200, floor_price=1000, lead_days=30, rush_days=14),
)


def declare(broker: Broker) -> list[str]:
    """Apply :data:`DECLARATIONS` (idempotent); returns what changed."""
    return apply_declarations(broker, DECLARATIONS, "purchase_order.DECLARATIONS")


def create_tables(broker: Broker) -> None:
    """Create the application tables in the broker database, if missing."""
    metadata.create_all(broker.engine, checkfirst=True)


def seed_stock(broker: Broker, stock: Sequence[StockItem] = DEFAULT_STOCK) -> None:
    """Put ``stock`` in the warehouse: items already there are left as they are."""
    with broker.engine.begin() as conn:
        known = set(conn.execute(select(po_stock.c.item)).scalars())
        rows = [
            {
                "item": s.item,
                "on_hand": s.on_hand,
                "reserved": 0,
                "list_price": s.list_price,
                "floor_price": s.floor_price,
                "lead_days": s.lead_days,
                "rush_days": s.rush_days,
            }
            for s in stock
            if s.item not in known
        ]
        if rows:
            conn.execute(insert(po_stock), rows)


def setup(broker: Broker, stock: Sequence[StockItem] = DEFAULT_STOCK) -> None:
    """Everything the example needs in a migrated broker database: the broker objects, the
    application tables and the warehouse. Safe to run again."""
    declare(broker)
    create_tables(broker)
    seed_stock(broker, stock)


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _now() -> datetime:
    return datetime.now(UTC)


def short(message_type: str) -> str:
    """``//airflow-broker/examples/po/Quote`` -> ``Quote``; system types by their last word."""
    return message_type.rstrip("/").rsplit("/", 1)[-1]


def money(cents: int) -> str:
    """``123456`` -> ``$1,234.56``."""
    sign = "-" if cents < 0 else ""
    whole, part = divmod(abs(cents), 100)
    return f"{sign}${whole:,}.{part:02d}"


def to_cents(price: float | int | str | Decimal) -> int:
    """A price in dollars (``4.4``, ``"4.40"``) as whole cents."""
    try:
        value = Decimal(str(price)).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    except (InvalidOperation, ValueError) as exc:
        raise InvalidDefinition(f"price must be a number of dollars, not {price!r}") from exc
    if value <= 0:
        raise InvalidDefinition(f"price must be positive, not {price!r}")
    return int(value * 100)


def describe(message_type: str, body: Any) -> str:
    """A message of the contract in words, for the trace."""
    b = body if isinstance(body, dict) else {}
    name = short(message_type)
    if message_type == ORDER:
        return (
            f"{b.get('qty')} {b.get('item')} at {money(b.get('unit_price', 0))}/unit, "
            f"ship within {b.get('ship_within_days')} days"
        )
    if message_type in (QUOTE, COUNTER, ACCEPT):
        days = b.get("ship_in_days", b.get("ship_within_days"))
        verb = "ships in" if message_type != COUNTER else "ship within"
        return f"{money(b.get('unit_price', 0))}/unit, {verb} {days} days"
    if message_type == BACKORDER:
        return f"{b.get('reserved')} reserved, {b.get('missing')} missing"
    if message_type in (REFUSE, CANCEL):
        return str(b.get("reason", ""))
    if message_type == SHIP_NOTICE:
        return f"{b.get('qty')} shipped, tracking {b.get('tracking')}"
    if message_type == RECEIPT:
        return f"{b.get('qty')} received"
    if message_type == INVOICE:
        return f"{b.get('invoice')} for {money(b.get('amount', 0))}"
    if message_type == PAYMENT:
        return f"{b.get('payment_ref')} of {money(b.get('amount', 0))}"
    return name


def _insert_once(conn: Connection, table: Table, values: dict[str, Any]) -> bool:
    """INSERT unless the row's unique key exists; True when this call inserted it.

    ``ON CONFLICT DO NOTHING RETURNING``: the returned row says whether it was inserted (the
    driver's rowcount is not reliable for this on every engine)."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    first = table.primary_key.columns.values()[0]
    stmt = dialect.insert(table).values(values).on_conflict_do_nothing().returning(first)
    return conn.execute(stmt).first() is not None


def record_event(
    conn: Connection,
    po_number: str,
    side: str,
    kind: str,
    text: str,
    group: uuid.UUID | None = None,
) -> None:
    """Append a line to the trace (``po_event``), in the caller's transaction."""
    conn.execute(
        insert(po_event).values(
            at=_now(),
            po_number=po_number,
            side=side,
            conversation_group_id=group,
            kind=kind,
            text=text[:1000],
        )
    )
    log.info("%s %s %s: %s", po_number, side, kind, text)


def _conversations(
    messages: Sequence[Message],
) -> list[tuple[uuid.UUID, uuid.UUID, list[Message]]]:
    """The messages by conversation, in the order received: (handle, group, messages)."""
    out: dict[uuid.UUID, tuple[uuid.UUID, uuid.UUID, list[Message]]] = {}
    for m in messages:
        entry = out.setdefault(
            m.conversation_handle, (m.conversation_handle, m.conversation_group_id, [])
        )
        entry[2].append(m)
    return list(out.values())


# ---------------------------------------------------------------------------------------------
# Compensating actions
# ---------------------------------------------------------------------------------------------


def _order_of(conn: Connection, group: uuid.UUID) -> tuple[str, dict[str, Any]]:
    """The side and state row of the order kept under conversation group ``group``."""
    for side, table in ((BUYER, po_buyer), (SUPPLIER, po_supplier)):
        row = (
            conn.execute(select(table).where(table.c.conversation_group_id == group))
            .mappings()
            .first()
        )
        if row is not None:
            return side, dict(row)
    raise LookupError(f"no purchase order is kept under conversation group {group}")


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


# ---------------------------------------------------------------------------------------------
# The two sides
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# What the applications do outside the readers
# ---------------------------------------------------------------------------------------------


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
) -> Submitted:
    """Buyer (the initiator): begin the order's dialog, record the order and send it, and arm
    the buyer's deadline (a conversation timer): all in ``tx``.

    :param price: the most the buyer pays per unit, in dollars; it opens 10% lower.
    :param deadline_seconds: when the order is not over by then, the buyer cancels it.
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
    handle = tx.begin_dialog(BUYER_SERVICE, SUPPLIER_SERVICE, CONTRACT)
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


# ---------------------------------------------------------------------------------------------
# Reading the state (the demo, the tests, a UI)
# ---------------------------------------------------------------------------------------------


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


__all__ = [
    "BUYER_QUEUE",
    "BUYER_SERVICE",
    "CONTRACT",
    "DECLARATIONS",
    "DEFAULT_STOCK",
    "FINAL_STATUSES",
    "MAX_ROUNDS",
    "SUPPLIER_QUEUE",
    "SUPPLIER_SERVICE",
    "StockItem",
    "Submitted",
    "buyer_handler",
    "buyer_order",
    "cancel_purchase_order",
    "cancel_shipment",
    "compensations",
    "create_tables",
    "declare",
    "ledger_balance",
    "metadata",
    "notify",
    "release_reservation",
    "restock",
    "seed_stock",
    "setup",
    "stock_levels",
    "submit_purchase_order",
    "supplier_handler",
    "supplier_order",
    "trace",
    "void_payment",
]
