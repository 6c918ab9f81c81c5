"""``queue_status()`` and ``airflow-broker status`` with many queues and open conversations
(issue 46): what they say does not change when conversations are open (open dialogs hold no
message), and what they read is the queues' shown columns and the waiting messages, never the
conversations nor a thousand queues' activation settings."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from helpers import NOTE, ORDER, SUPPLIER_QUEUE, begin, declare_pair, send
from sqlalchemy import event
from test_cli import Run, run  # noqa: F401  (run: a fixture)

from airflow_broker import Activation, Broker

QUEUES = 30
OPEN = 25


def _recorded(broker: Broker, fn: Any) -> tuple[Any, list[str]]:
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(" ".join(statement.split()))

    event.listen(broker.engine, "before_cursor_execute", record)
    try:
        return fn(), statements
    finally:
        event.remove(broker.engine, "before_cursor_execute", record)


def _shape(broker: Broker) -> None:
    declare_pair(broker)
    with broker.definitions() as d:
        for i in range(QUEUES):
            d.create_queue(f"tenant_{i:02d}_q", activation=Activation(max_readers=2))
    send(broker, begin(broker), NOTE, "waiting")


def _open(broker: Broker, n: int = OPEN) -> None:
    """Open dialogs with a timer a month away: an initiator endpoint each, no message."""
    with broker.transaction() as tx:
        for _ in range(n):
            h = tx.begin_dialog("//po/Buyer", "//po/Supplier", contract="//po/OrderContract")
            tx.begin_conversation_timer(h, 30 * 86400)


def _without_ages(rows: list[Any]) -> list[Any]:
    return [dataclasses.replace(r, oldest_age_seconds=None) for r in rows]


def test_queue_status_reads_no_conversation_and_no_activation_settings(broker: Broker) -> None:
    _shape(broker)
    before = broker.queue_status()
    _open(broker)
    after, statements = _recorded(broker, broker.queue_status)
    assert _without_ages(after) == _without_ages(before)
    assert len(after) == QUEUES + 2
    [supplier] = [q for q in after if q.name == SUPPLIER_QUEUE]
    assert (supplier.depth, supplier.groups_ready, supplier.held, supplier.leased) == (1, 1, 0, 0)
    assert len(statements) <= 3, statements  # the queues, the waiting messages (and a BEGIN)
    assert not [s for s in statements if "broker_conversation_endpoint" in s], statements
    queue_reads = [s for s in statements if "FROM broker_queue" in s]
    assert queue_reads and not [s for s in queue_reads if "activation" in s], queue_reads


def test_status_says_the_same_with_conversations_open(broker_url: str, run: Run) -> None:  # noqa: F811
    b = Broker.connect(broker_url)
    try:
        _shape(b)
        code, out, _ = run("--url", broker_url, "status", "--json")
        before = json.loads(out)["queues"]
        _open(b)
        send(b, begin(b), ORDER, {"order": 1})  # one more waiting message: status sees it
    finally:
        b.dispose()
    code, out, _ = run("--url", broker_url, "status", "--json")
    assert code == 0
    after = json.loads(out)["queues"]
    strip = ("oldest_age_seconds", "oldest_enqueued_at")
    assert [q["name"] for q in after] == [q["name"] for q in before]
    changed = {
        q["name"]
        for q, p in zip(after, before, strict=True)
        if {k: v for k, v in q.items() if k not in strip}
        != {k: v for k, v in p.items() if k not in strip}
    }
    assert changed == {SUPPLIER_QUEUE}
    [supplier] = [q for q in after if q["name"] == SUPPLIER_QUEUE]
    assert supplier["depth"] == 2 and supplier["groups_ready"] == 2
