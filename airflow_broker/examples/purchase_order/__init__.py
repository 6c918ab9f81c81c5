"""Seed 004's purchase order: a long-running dialog between a buyer and a supplier.

"Processing a purchase order typically involves a long-running exchange of messages between the
purchaser and supplier, as prices are negotiated, delivery dates agreed upon, status
communicated, delivery confirmed, and payment exchanged. This whole exchange can be a single
Service Broker dialog" (Architecting Service Broker Applications). This package is that
application, as plain engine code (modules :mod:`.contract`, :mod:`.state`, :mod:`.handlers`,
:mod:`.compensations`, :mod:`.orders`; :mod:`.saga` is the buyer's side as a saga of Airflow
tasks, ``dags/purchase_order_saga.py``):

- **Declarations** (:data:`DECLARATIONS`, the ``airflow-broker apply`` format): the message
  types, one contract, a queue and a service for each side, and the saga buyer's (its queue
  not activated: each saga run reads its own conversation).
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
    BUYER_MAX_READERS,
    BUYER_QUEUE,
    BUYER_READER_DAG,
    BUYER_SERVICE,
    CANCEL,
    CONTRACT,
    COUNTER,
    DECLARATIONS,
    DEFAULT_DEADLINE_SECONDS,
    FINAL_STATUSES,
    INVOICE,
    MALFORMED_MESSAGE,
    MAX_ROUNDS,
    ORDER,
    ORDER_SCHEMA,
    PAYMENT,
    PREFIX,
    QUOTE,
    RECEIPT,
    REFUSE,
    SAGA_BUYER_QUEUE,
    SAGA_BUYER_SERVICE,
    SENT_BY,
    SHIP_NOTICE,
    SUPPLIER,
    SUPPLIER_MAX_READERS,
    SUPPLIER_QUEUE,
    SUPPLIER_READER_DAG,
    SUPPLIER_SERVICE,
)
from airflow_broker.examples.purchase_order.handlers import buyer_handler, supplier_handler
from airflow_broker.examples.purchase_order.orders import (
    Submitted,
    buyer_order,
    cancel_purchase_order,
    compensations,
    ledger_balance,
    restock,
    stock_levels,
    submit_purchase_order,
    supplier_order,
    trace,
)
from airflow_broker.examples.purchase_order.state import (
    DEFAULT_STOCK,
    StockItem,
    Timestamp,
    create_tables,
    declare,
    describe,
    metadata,
    money,
    po_buyer,
    po_compensation,
    po_event,
    po_ledger,
    po_stock,
    po_supplier,
    record_event,
    seed_stock,
    setup,
    short,
    to_cents,
)

__all__ = [
    "ACCEPT",
    "BACKORDER",
    "BUYER",
    "BUYER_MAX_READERS",
    "BUYER_QUEUE",
    "BUYER_READER_DAG",
    "BUYER_SERVICE",
    "CANCEL",
    "CONTRACT",
    "COUNTER",
    "DECLARATIONS",
    "DEFAULT_DEADLINE_SECONDS",
    "DEFAULT_STOCK",
    "FINAL_STATUSES",
    "INVOICE",
    "MALFORMED_MESSAGE",
    "MAX_ROUNDS",
    "ORDER",
    "ORDER_SCHEMA",
    "PAYMENT",
    "PREFIX",
    "QUOTE",
    "RECEIPT",
    "REFUSE",
    "SAGA_BUYER_QUEUE",
    "SAGA_BUYER_SERVICE",
    "SENT_BY",
    "SHIP_NOTICE",
    "SUPPLIER",
    "SUPPLIER_MAX_READERS",
    "SUPPLIER_QUEUE",
    "SUPPLIER_READER_DAG",
    "SUPPLIER_SERVICE",
    "StockItem",
    "Submitted",
    "Timestamp",
    "buyer_handler",
    "buyer_order",
    "cancel_purchase_order",
    "cancel_shipment",
    "compensations",
    "create_tables",
    "declare",
    "describe",
    "ledger_balance",
    "metadata",
    "money",
    "notify",
    "po_buyer",
    "po_compensation",
    "po_event",
    "po_ledger",
    "po_stock",
    "po_supplier",
    "record_event",
    "release_reservation",
    "restock",
    "seed_stock",
    "setup",
    "short",
    "stock_levels",
    "submit_purchase_order",
    "supplier_handler",
    "supplier_order",
    "to_cents",
    "trace",
    "void_payment",
]
