"""The dialog operators under retries: ``BeginDialogOperator``, ``SendOperator`` and
``EndConversationOperator`` key their verb with the task instance's identity by default
(``dag_id/run_id/task_id/map_index``, never the try number), so a second try of one task instance
does nothing; executed for real against SQLite and PostgreSQL (``execute(context)``). The real
scheduler's retry is ``tests/test_e2e_dedupe.py``."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import (
    BUYER,
    BUYER_QUEUE,
    CONTRACT,
    NOTE,
    ORDER,
    SUPPLIER,
    SUPPLIER_QUEUE,
    drain,
    open_order,
    pair_behind_connection,
)
from sqlalchemy import select

from airflow_broker import END_DIALOG, Broker, ConversationEnded, InvalidDefinition
from airflow_broker.operators import BeginDialogOperator, EndConversationOperator, SendOperator
from airflow_broker.operators.dialog import dedupe_key_for
from airflow_broker.storage import schema as s

CONN_ID = "broker_ops"


@pytest.fixture
def broker(broker_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    """The buyer/supplier pair on a fresh broker that Airflow connection ``broker_ops`` names."""
    yield from pair_behind_connection(broker_url, monkeypatch, CONN_ID)


def context(try_number: int = 1, map_index: int = -1, task_id: str = "t") -> dict[str, Any]:
    """What the operators read of Airflow's context: the task instance's identity."""
    ti = SimpleNamespace(
        dag_id="orders",
        run_id="manual__2026-01-01T00:00:00+00:00",
        task_id=task_id,
        map_index=map_index,
        try_number=try_number,
    )
    return {"ti": ti}


def keys(broker: Broker) -> list[str]:
    with broker.engine.connect() as conn:
        return sorted(conn.execute(select(s.dedupe.c.dedupe_key)).scalars())


def test_the_default_key_is_the_task_instance_without_the_try() -> None:
    first = dedupe_key_for(True, None, context(try_number=1))
    assert first == "orders/manual__2026-01-01T00:00:00+00:00/t/-1"
    assert dedupe_key_for(True, None, context(try_number=2)) == first
    assert dedupe_key_for(True, "", context()) == first  # a template that rendered nothing
    assert dedupe_key_for(True, None, context(map_index=3)).endswith("/t/3")
    assert dedupe_key_for(True, "mine", context()) == "mine"
    assert dedupe_key_for(False, "mine", context()) is None
    assert dedupe_key_for(True, None, {}) is None  # outside a task run
    long = dedupe_key_for(True, None, context(task_id="x" * 600))
    assert long is not None and long.startswith("sha256:") and len(long) == 71
    with pytest.raises(InvalidDefinition, match="dedupe_key must be a string, not int 5"):
        dedupe_key_for(True, 5, context())


def test_a_retried_send_sends_once(broker: Broker) -> None:
    h, _ = open_order(broker)
    op = SendOperator(
        task_id="t", broker_conn_id=CONN_ID, conversation_handle=str(h), message_type=NOTE,
        body="hello",
    )  # fmt: skip
    assert op.execute(context(try_number=1)) == 1
    op.execute(context(try_number=2))
    assert [m.message_body for m in drain(broker, SUPPLIER_QUEUE)] == [b"hello"]
    assert keys(broker) == ["orders/manual__2026-01-01T00:00:00+00:00/t/-1"]


def test_mapped_sends_each_send(broker: Broker) -> None:
    """Mapped instances differ by map index: each sends, and a retry of one sends nothing."""
    handles = [str(open_order(broker)[0]) for _ in range(3)]
    for i, h in enumerate(handles):
        op = SendOperator(
            task_id="t", broker_conn_id=CONN_ID, conversation_handle=h, message_type=NOTE,
            body=f"n{i}",
        )  # fmt: skip
        op.execute(context(map_index=i))
        op.execute(context(map_index=i, try_number=2))
    got = sorted(m.message_body for m in drain(broker, SUPPLIER_QUEUE))
    assert got == [b"n0", b"n1", b"n2"]


def test_a_retried_send_of_several_bodies_sends_each_once(broker: Broker) -> None:
    h, _ = open_order(broker)
    op = SendOperator(
        task_id="t", broker_conn_id=CONN_ID, conversation_handle=[str(h)], message_type=NOTE,
        bodies=["a", "b", "a"],
    )  # fmt: skip
    op.execute(context())
    op.execute(context(try_number=2))
    assert [m.message_body for m in drain(broker, SUPPLIER_QUEUE)] == [b"a", b"b", b"a"]


def test_dedupe_off_and_explicit_keys(broker: Broker) -> None:
    h, _ = open_order(broker)

    def send(**kwargs: Any) -> None:
        SendOperator(
            task_id="t", broker_conn_id=CONN_ID, conversation_handle=str(h), message_type=NOTE,
            body="x", **kwargs,
        ).execute(context())  # fmt: skip

    send(dedupe=False)
    send(dedupe=False)
    send(dedupe_key="order-1001/note")
    send(dedupe_key="order-1001/note")
    assert len(drain(broker, SUPPLIER_QUEUE)) == 3
    assert keys(broker) == ["order-1001/note"]


def test_explicit_key_is_templated(broker: Broker) -> None:
    h, _ = open_order(broker)
    op = SendOperator(
        task_id="t", broker_conn_id=CONN_ID, conversation_handle=str(h), message_type=NOTE,
        body="x", dedupe_key="po-{{ params.po }}",
    )  # fmt: skip
    op.render_template_fields({"params": {"po": 7}})
    assert op.dedupe_key == "po-7"
    op.execute(context())
    assert keys(broker) == ["po-7"]


def test_a_retried_begin_returns_the_first_handle_and_sends_once(broker: Broker) -> None:
    op = BeginDialogOperator(
        task_id="begin", broker_conn_id=CONN_ID, from_service=BUYER, to_service=SUPPLIER,
        contract=CONTRACT, message_type=ORDER, body={"po": 1},
    )  # fmt: skip
    first = op.execute(context(task_id="begin"))
    assert op.execute(context(task_id="begin", try_number=2)) == first
    (got,) = drain(broker, SUPPLIER_QUEUE)
    assert got.json() == {"po": 1}
    with broker.engine.connect() as conn:
        assert len(conn.execute(select(s.conversation_endpoint.c.state)).all()) == 2


def test_a_retried_end_does_not_fail(broker: Broker) -> None:
    _h1, t1 = open_order(broker)
    _h2, t2 = open_order(broker)
    op = EndConversationOperator(
        task_id="end", broker_conn_id=CONN_ID, conversation_handle=[str(t1), str(t2)]
    )
    op.execute(context(task_id="end"))
    op.execute(context(task_id="end", try_number=2))  # no ConversationEnded
    got = drain(broker, BUYER_QUEUE)
    assert [m.message_type_name for m in got] == [END_DIALOG, END_DIALOG]
    off = EndConversationOperator(
        task_id="end", broker_conn_id=CONN_ID, conversation_handle=str(t1), dedupe=False
    )
    with pytest.raises(ConversationEnded):
        off.execute(context(task_id="end", try_number=3))
