"""Small helpers shared by the API tests: a buyer/supplier pair and one-transaction shortcuts.

The pair models the purchase-order dialog of the seeds: ``//po/Buyer`` (queue ``buyer_queue``)
begins dialogs on ``//po/OrderContract`` with ``//po/Supplier`` (queue ``supplier_queue``). The
buyer sends ``//po/Order`` (JSON), the supplier answers ``//po/Invoice`` (JSON), either side may
send ``//po/Note`` (no validation).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, select

from airflow_broker import Broker, Message
from airflow_broker.storage.schema import message as message_table
from airflow_broker.storage.schema import queue as queue_table

BUYER_QUEUE = "buyer_queue"
SUPPLIER_QUEUE = "supplier_queue"
BUYER = "//po/Buyer"
SUPPLIER = "//po/Supplier"
CONTRACT = "//po/OrderContract"
ORDER = "//po/Order"
INVOICE = "//po/Invoice"
NOTE = "//po/Note"


def declare_pair(
    broker: Broker,
    *,
    buyer_retention: bool = False,
    supplier_retention: bool = False,
    poison_message_handling: bool = True,
) -> None:
    """Declare the buyer/supplier message types, contract, queues and services in one block."""
    with broker.definitions() as d:
        d.create_message_type(ORDER, validation="json")
        d.create_message_type(INVOICE, validation="json")
        d.create_message_type(NOTE, validation="none")
        d.create_contract(CONTRACT, {ORDER: "initiator", INVOICE: "target", NOTE: "any"})
        d.create_queue(
            BUYER_QUEUE,
            retention=buyer_retention,
            poison_message_handling=poison_message_handling,
        )
        d.create_queue(
            SUPPLIER_QUEUE,
            retention=supplier_retention,
            poison_message_handling=poison_message_handling,
        )
        d.create_service(BUYER, queue=BUYER_QUEUE, contracts=[CONTRACT])
        d.create_service(SUPPLIER, queue=SUPPLIER_QUEUE, contracts=[CONTRACT])


def begin(broker: Broker, *, contract: str = CONTRACT, **kwargs: Any) -> uuid.UUID:
    """BEGIN DIALOG from the buyer to the supplier in its own transaction."""
    with broker.transaction() as tx:
        return tx.begin_dialog(BUYER, SUPPLIER, contract=contract, **kwargs)


def send(broker: Broker, handle: uuid.UUID, message_type: str, *bodies: Any) -> None:
    """SEND each body, in order, on ``handle`` in one transaction."""
    with broker.transaction() as tx:
        for body in bodies:
            tx.send(handle, message_type=message_type, body=body)


def receive(broker: Broker, queue: str, **kwargs: Any) -> list[Message]:
    """One RECEIVE in its own, committed transaction."""
    with broker.transaction() as tx:
        return tx.receive(queue, **kwargs)


def drain(broker: Broker, queue: str) -> list[Message]:
    """RECEIVE until the queue returns nothing (one committed transaction per RECEIVE)."""
    out: list[Message] = []
    for _ in range(100):
        got = receive(broker, queue)
        if not got:
            return out
        out.extend(got)
    raise AssertionError(f"queue {queue} never ran dry")


def open_order(broker: Broker, *orders: Any) -> tuple[uuid.UUID, uuid.UUID]:
    """Begin a dialog, send ``orders`` (default one) and return (initiator, target) handles.

    The supplier RECEIVEs the orders, so the target endpoint exists and the supplier queue is
    empty again when this returns.
    """
    h = begin(broker)
    orders = orders or ({"order": 1},)
    send(broker, h, ORDER, *orders)
    got = receive(broker, SUPPLIER_QUEUE)
    assert len(got) == len(orders)
    return h, got[0].conversation_handle


def bodies(messages: Iterable[Message]) -> list[bytes | None]:
    return [m.message_body for m in messages]


def types(messages: Iterable[Message]) -> list[str]:
    return [m.message_type_name for m in messages]


def queue_rows(url: str, queue_name: str) -> list[tuple[int, str, bytes | None]]:
    """Every row of a queue, ready or not, as ``(status, message_type_name, body)``.

    RECEIVE only returns ready messages; retention (status 0 and 3) is only visible by looking
    at the queue itself, as one would ``SELECT * FROM queue`` in Service Broker.
    """
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            query = (
                select(
                    message_table.c.status,
                    message_table.c.message_type_name,
                    message_table.c.message_body,
                )
                .join(queue_table, queue_table.c.queue_id == message_table.c.queue_id)
                .where(queue_table.c.name == queue_name)
                .order_by(message_table.c.queuing_order)
            )
            return [(int(r[0]), str(r[1]), r[2]) for r in conn.execute(query)]
    finally:
        engine.dispose()


class Recorder:
    """A metrics sink (:func:`airflow_broker.metrics.install`) that keeps what it is given; the
    ``recorder`` fixture installs one for a test."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float, dict[str, str] | None]] = []

    def gauge(self, name: str, value: float, tags: dict[str, str] | None) -> None:
        self.calls.append(("gauge", name, value, tags))

    def incr(self, name: str, count: int, tags: dict[str, str] | None) -> None:
        self.calls.append(("incr", name, count, tags))

    def total(self, name: str) -> float:
        return sum(c[2] for c in self.calls if c[0] == "incr" and c[1] == name)


def poison(broker: Broker, queue: str = SUPPLIER_QUEUE) -> None:
    """Disable ``queue`` by poison message handling: a message on it, and as many rolled-back
    receives in a row as it takes (the buyer/supplier pair must be declared)."""
    from airflow_broker.constants import POISON_THRESHOLD

    send(broker, begin(broker), NOTE, "poison")

    class _Refused(Exception):
        pass

    for _ in range(POISON_THRESHOLD):
        try:
            with broker.transaction() as tx:
                assert tx.receive(queue, top=1), f"{queue} has no message to roll back"
                raise _Refused
        except _Refused:
            pass
    assert broker.catalog().queues[queue].status is False, "poison handling did not disable it"


def pair_behind_connection(
    broker_url: str, monkeypatch: pytest.MonkeyPatch, conn_id: str
) -> Iterator[Broker]:
    """The buyer/supplier pair on a fresh broker that the Airflow connection ``conn_id``
    names (for operator tests: ``yield from`` it in a fixture)."""
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{conn_id.upper()}",
        json.dumps({"conn_type": "broker", "extra": {"url": broker_url}}),
    )
    b = Broker.connect(broker_url)
    declare_pair(b)
    yield b
    b.dispose()


def rollbacks_after_reaping(broker: Broker, queue: str, want: int, timeout: float = 30) -> int:
    """Run the due work (which reaps the leases of dead readers, counting their attempts)
    until ``queue``'s run of rollbacks reaches ``want`` or ``timeout`` seconds pass; returns
    the count."""
    deadline = time.monotonic() + timeout
    while True:
        broker.run_due()
        status = next(q for q in broker.queue_status() if q.name == queue)
        if status.rollback_count >= want or time.monotonic() > deadline:
            return status.rollback_count
        time.sleep(0.1)
