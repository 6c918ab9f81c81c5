"""The purchase-order dialog's vocabulary: services, queues, message types, who sends what, the
order schema and the declarations (``airflow-broker apply`` format).
"""

from __future__ import annotations

from typing import Any

import yaml

PREFIX = "//airflow-broker/examples/po"


BUYER_SERVICE = f"{PREFIX}/Buyer"


SUPPLIER_SERVICE = f"{PREFIX}/Supplier"


CONTRACT = f"{PREFIX}/Contract"


BUYER_QUEUE = "po_buyer_queue"


SUPPLIER_QUEUE = "po_supplier_queue"


#: The buyer of the saga DAG (dags/purchase_order_saga.py): its own service and queue, with no
#: activation, so that no reader drains the replies its runs wait for (each run RECEIVEs from
#: its own conversation).
SAGA_BUYER_SERVICE = f"{PREFIX}/SagaBuyer"


SAGA_BUYER_QUEUE = "po_saga_buyer_queue"


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
            {"name": SAGA_BUYER_QUEUE},
        ],
        "services": [
            # The initiator's service needs no contract: replies come back on the dialog.
            {"name": BUYER_SERVICE, "queue": BUYER_QUEUE},
            {"name": SUPPLIER_SERVICE, "queue": SUPPLIER_QUEUE, "contracts": [CONTRACT]},
            {"name": SAGA_BUYER_SERVICE, "queue": SAGA_BUYER_QUEUE},
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
