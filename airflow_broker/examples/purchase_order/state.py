"""The application's state in the broker database (``po_*`` tables keyed by conversation group
id), set-up, and the small helpers the handlers share.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

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
    insert,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from airflow_broker.errors import InvalidDefinition
from airflow_broker.examples import apply_declarations
from airflow_broker.examples.purchase_order.contract import (
    ACCEPT,
    BACKORDER,
    BUYER,
    CANCEL,
    COUNTER,
    DECLARATIONS,
    INVOICE,
    ORDER,
    PAYMENT,
    QUOTE,
    RECEIPT,
    REFUSE,
    SHIP_NOTICE,
    SUPPLIER,
)
from airflow_broker.messaging.objects import Message
from airflow_broker.storage.schema import NAMING_CONVENTION

if TYPE_CHECKING:
    from airflow_broker.broker import Broker

log = logging.getLogger("airflow_broker.examples.purchase_order")


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
