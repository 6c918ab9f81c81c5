"""The dialog and declarations operators, executed for real against SQLite and PostgreSQL
brokers (``execute(context)``), their templated fields rendered through Airflow, and their
XCom values JSON-serializable. The same operators run in a DAG (``airflow dags test``) in
``test_operators_run_in_a_dag``."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    BUYER,
    BUYER_QUEUE,
    CONTRACT,
    INVOICE,
    NOTE,
    ORDER,
    SUPPLIER,
    SUPPLIER_QUEUE,
    open_order,
    pair_behind_connection,
    receive,
)
from sqlalchemy import create_engine, text

from airflow_broker import (
    END_DIALOG,
    ERROR,
    Broker,
    ConversationEnded,
    InvalidDefinition,
    MessageValidationError,
    UnknownObject,
)
from airflow_broker.operations.declarations import DeclarationsInvalid
from airflow_broker.operators import (
    ApplyDeclarationsOperator,
    BeginDialogOperator,
    EndConversationOperator,
    ReceiveOperator,
    SendOperator,
)
from airflow_broker.provider.xcom import body_bytes, message_to_dict

FIXTURES = Path(__file__).parent / "fixtures"
CONN_ID = "broker_ops"
CONTEXT: dict[str, Any] = {}  # the operators use nothing from the task context


@pytest.fixture
def broker(broker_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    """The buyer/supplier pair on a fresh broker that Airflow connection ``broker_ops`` names."""
    yield from pair_behind_connection(broker_url, monkeypatch, CONN_ID)


def xcom_safe(value: Any) -> Any:
    """The value as XCom stores it (JSON), asserting nothing is lost on the way."""
    encoded = json.dumps(value, allow_nan=False)
    assert json.loads(encoded) == value
    return value


# --------------------------------------------------------------------------------------------
# BEGIN DIALOG


def test_begin_dialog_returns_the_handle_and_sends_the_first_message(broker: Broker) -> None:
    op = BeginDialogOperator(
        task_id="begin",
        broker_conn_id=CONN_ID,
        from_service=BUYER,
        to_service=SUPPLIER,
        contract=CONTRACT,
        message_type=ORDER,
        body={"po": 1001, "qty": 5},
    )
    handle = xcom_safe(op.execute(CONTEXT))
    assert isinstance(handle, str)
    with broker.transaction() as tx:
        ep = tx.conversation(handle)
        assert (ep.is_initiator, ep.service_name, ep.far_service) == (True, BUYER, SUPPLIER)
    (got,) = receive(broker, SUPPLIER_QUEUE)
    assert got.message_type_name == ORDER
    assert got.json() == {"po": 1001, "qty": 5}


def test_begin_dialog_without_message_type_sends_nothing(broker: Broker) -> None:
    handle = BeginDialogOperator(
        task_id="begin",
        broker_conn_id=CONN_ID,
        from_service=BUYER,
        to_service=SUPPLIER,
        contract=CONTRACT,
        lifetime_seconds=3600,
    ).execute(CONTEXT)
    with broker.transaction() as tx:
        assert tx.conversation(handle).lifetime is not None
    assert receive(broker, SUPPLIER_QUEUE) == []


def test_begin_dialog_joins_a_related_conversation_group(broker: Broker) -> None:
    first = BeginDialogOperator(
        task_id="first",
        broker_conn_id=CONN_ID,
        from_service=BUYER,
        to_service=SUPPLIER,
        contract=CONTRACT,
    ).execute(CONTEXT)
    with broker.transaction() as tx:
        group = str(tx.conversation(first).conversation_group_id)
    second = BeginDialogOperator(
        task_id="second",
        broker_conn_id=CONN_ID,
        from_service=BUYER,
        to_service=SUPPLIER,
        contract=CONTRACT,
        related_conversation_group=group,
    ).execute(CONTEXT)
    third = BeginDialogOperator(
        task_id="third",
        broker_conn_id=CONN_ID,
        from_service=BUYER,
        to_service=SUPPLIER,
        contract=CONTRACT,
        related_conversation=first,
    ).execute(CONTEXT)
    with broker.transaction() as tx:
        assert str(tx.conversation(second).conversation_group_id) == group
        assert str(tx.conversation(third).conversation_group_id) == group


def test_a_failed_first_send_leaves_no_dialog(broker: Broker) -> None:
    op = BeginDialogOperator(
        task_id="begin_bad",
        broker_conn_id=CONN_ID,
        from_service=BUYER,
        to_service=SUPPLIER,
        contract=CONTRACT,
        message_type=ORDER,  # validation json
        body="not json",
    )
    with pytest.raises(MessageValidationError) as raised:
        op.execute(CONTEXT)
    assert ORDER in str(raised.value)
    engine = create_engine(str(broker.engine.url.render_as_string(hide_password=False)))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM broker_conversation_endpoint")).scalar() == 0
    engine.dispose()


# --------------------------------------------------------------------------------------------
# SEND


def test_send_one_message_on_several_conversations(broker: Broker) -> None:
    handles = [
        BeginDialogOperator(
            task_id=f"begin{i}",
            broker_conn_id=CONN_ID,
            from_service=BUYER,
            to_service=SUPPLIER,
            contract=CONTRACT,
        ).execute(CONTEXT)
        for i in range(3)
    ]
    count = SendOperator(
        task_id="send",
        broker_conn_id=CONN_ID,
        conversation_handle=handles,
        message_type=ORDER,
        body={"po": 7},
    ).execute(CONTEXT)
    assert xcom_safe(count) == 3
    seen = set()
    for _ in range(3):
        (m,) = receive(broker, SUPPLIER_QUEUE)
        assert m.json() == {"po": 7}
        with broker.transaction() as tx:
            seen.add(str(tx.conversation(m.conversation_handle).conversation_id))
    with broker.transaction() as tx:
        assert seen == {str(tx.conversation(h).conversation_id) for h in handles}


def test_send_several_bodies_in_order(broker: Broker) -> None:
    h, _ = open_order(broker)
    count = SendOperator(
        task_id="send",
        broker_conn_id=CONN_ID,
        conversation_handle=str(h),
        message_type=NOTE,
        bodies=["one", b"\x00\xff", {"three": 3}],
    ).execute(CONTEXT)
    assert count == 3
    got = receive(broker, SUPPLIER_QUEUE)
    assert [m.message_body for m in got] == [b"one", b"\x00\xff", b'{"three":3}']


def test_send_is_all_or_nothing(broker: Broker) -> None:
    good, _ = open_order(broker)
    ended = BeginDialogOperator(
        task_id="b",
        broker_conn_id=CONN_ID,
        from_service=BUYER,
        to_service=SUPPLIER,
        contract=CONTRACT,
    ).execute(CONTEXT)
    EndConversationOperator(
        task_id="end", broker_conn_id=CONN_ID, conversation_handle=ended, cleanup=True
    ).execute(CONTEXT)
    op = SendOperator(
        task_id="send_both",
        broker_conn_id=CONN_ID,
        conversation_handle=[str(good), ended],
        message_type=NOTE,
        body="x",
    )
    with pytest.raises(UnknownObject) as raised:
        op.execute(CONTEXT)
    assert ended in str(raised.value)
    assert receive(broker, SUPPLIER_QUEUE) == []


# --------------------------------------------------------------------------------------------
# RECEIVE


def test_receive_returns_xcom_safe_messages_of_one_group(broker: Broker) -> None:
    h, target = open_order(broker)
    with broker.transaction() as tx:
        tx.send(target, INVOICE, {"total": 12.5, "lines": ["a"]})
        tx.send(target, NOTE, b"\xff\xfe binary")
        tx.send(target, NOTE, "plain text")
        tx.send(target, NOTE, None)
    messages = ReceiveOperator(
        task_id="receive", broker_conn_id=CONN_ID, queue=BUYER_QUEUE
    ).execute(CONTEXT)
    xcom_safe(messages)
    assert [m["message_type_name"] for m in messages] == [INVOICE, NOTE, NOTE, NOTE]
    assert {m["conversation_handle"] for m in messages} == {str(h)}
    invoice, binary, plain, empty = messages
    assert invoice["body_json"] == {"total": 12.5, "lines": ["a"]}
    assert invoice["body_text"] == '{"total":12.5,"lines":["a"]}'
    assert binary["body_text"] is None and "body_json" not in binary
    assert body_bytes(binary) == b"\xff\xfe binary"
    assert plain["body_text"] == "plain text" and "body_json" not in plain
    assert empty["body_text"] is None and empty["body_base64"] is None
    assert "body_json" not in empty
    assert all(m["error"] is None for m in messages)
    assert [m["message_sequence_number"] for m in messages] == [0, 1, 2, 3]
    assert set(invoice) >= {
        "status", "priority", "queuing_order", "conversation_group_id", "conversation_handle",
        "message_sequence_number", "service_name", "service_contract_name", "message_type_name",
        "validation", "body_text", "body_base64", "error",
    }  # fmt: skip
    assert uuid.UUID(invoice["conversation_group_id"])


def test_receive_top_handle_and_empty_queue(broker: Broker) -> None:
    h1, t1 = open_order(broker)
    h2, t2 = open_order(broker)
    with broker.transaction() as tx:
        tx.send(t1, NOTE, "1a")
        tx.send(t1, NOTE, "1b")
        tx.send(t2, NOTE, "2a")
    only_two = ReceiveOperator(
        task_id="r", broker_conn_id=CONN_ID, queue=BUYER_QUEUE, conversation_handle=str(h2)
    ).execute(CONTEXT)
    assert [m["body_text"] for m in only_two] == ["2a"]
    one = ReceiveOperator(task_id="r", broker_conn_id=CONN_ID, queue=BUYER_QUEUE, top=1).execute(
        CONTEXT
    )
    assert [m["body_text"] for m in one] == ["1a"]
    with broker.transaction() as tx:
        group = str(tx.conversation(h1).conversation_group_id)
    rest = ReceiveOperator(
        task_id="r", broker_conn_id=CONN_ID, queue=BUYER_QUEUE, conversation_group=group
    ).execute(CONTEXT)
    assert [m["body_text"] for m in rest] == ["1b"]
    assert (
        ReceiveOperator(
            task_id="r", broker_conn_id=CONN_ID, queue=BUYER_QUEUE, wait_seconds=0.2
        ).execute(CONTEXT)
        == []
    )


def test_receive_error_message_carries_code_and_description(broker: Broker) -> None:
    _, target = open_order(broker)
    EndConversationOperator(
        task_id="refuse",
        broker_conn_id=CONN_ID,
        conversation_handle=str(target),
        error_code=4001,
        error_description="out of stock",
    ).execute(CONTEXT)
    (msg,) = ReceiveOperator(task_id="r", broker_conn_id=CONN_ID, queue=BUYER_QUEUE).execute(
        CONTEXT
    )
    assert msg["message_type_name"] == ERROR
    assert msg["error"] == [4001, "out of stock"]
    xcom_safe(msg)


def test_message_to_dict_refuses_non_json_constants() -> None:
    from airflow_broker.messaging.objects import Message

    m = Message(1, 5, 1, uuid.uuid4(), uuid.uuid4(), 0, "s", "c", "t", "N", b"NaN")
    d = message_to_dict(m)
    assert d["body_text"] == "NaN" and "body_json" not in d
    assert base64.b64decode(d["body_base64"]) == b"NaN"
    xcom_safe(d)


# --------------------------------------------------------------------------------------------
# END CONVERSATION


def test_end_conversation_plain_then_both_sides(broker: Broker) -> None:
    h, target = open_order(broker)
    EndConversationOperator(
        task_id="end_target", broker_conn_id=CONN_ID, conversation_handle=str(target)
    ).execute(CONTEXT)
    (end_dialog,) = receive(broker, BUYER_QUEUE)
    assert end_dialog.message_type_name == END_DIALOG
    with pytest.raises(ConversationEnded):
        SendOperator(
            task_id="late",
            broker_conn_id=CONN_ID,
            conversation_handle=str(target),
            message_type=NOTE,
            body="too late",
        ).execute(CONTEXT)
    assert (
        EndConversationOperator(
            task_id="end_initiator", broker_conn_id=CONN_ID, conversation_handle=str(h)
        ).execute(CONTEXT)
        is None
    )
    with broker.transaction() as tx:
        assert tx.conversation(h).state == "CD"


def test_end_conversation_with_cleanup_of_several(broker: Broker) -> None:
    h1, _ = open_order(broker)
    h2, _ = open_order(broker)
    EndConversationOperator(
        task_id="cleanup",
        broker_conn_id=CONN_ID,
        conversation_handle=[str(h1), str(h2)],
        cleanup=True,
    ).execute(CONTEXT)
    for h in (h1, h2):
        with broker.transaction() as tx, pytest.raises(UnknownObject):
            tx.conversation(h)


# --------------------------------------------------------------------------------------------
# errors name the object, the task and the connection


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


def test_unknown_queue_error_names_queue_task_and_connection(broker: Broker) -> None:
    op = ReceiveOperator(task_id="read_orders", broker_conn_id=CONN_ID, queue="NoSuchQueue")
    with pytest.raises(UnknownObject, match="queue 'NoSuchQueue' does not exist") as raised:
        op.execute(CONTEXT)
    assert (
        "in ReceiveOperator 'read_orders' on broker connection 'broker_ops': "
        "RECEIVE from queue 'NoSuchQueue'"
    ) in notes(raised.value)


def test_unknown_service_error_names_the_service(broker: Broker) -> None:
    op = BeginDialogOperator(
        task_id="begin",
        broker_conn_id=CONN_ID,
        from_service="//po/Nobody",
        to_service=SUPPLIER,
        contract=CONTRACT,
    )
    with pytest.raises(UnknownObject, match="service '//po/Nobody'") as raised:
        op.execute(CONTEXT)
    assert "BeginDialogOperator 'begin'" in notes(raised.value)
    assert "from service '//po/Nobody' to service '//po/Supplier'" in notes(raised.value)


@pytest.mark.parametrize(
    ("handle", "message"),
    [
        ("not-a-uuid", "conversation_handle: 'not-a-uuid' is not a conversation handle"),
        ("[1, 2", r"conversation_handle '\[1, 2' is neither a conversation handle nor a list"),
        (42, "conversation_handle must be a conversation handle .* not int 42"),
        ([], "conversation_handle is an empty list"),
    ],
)
def test_bad_handles_are_refused_by_field(broker: Broker, handle: Any, message: str) -> None:
    op = SendOperator(task_id="send", broker_conn_id=CONN_ID, conversation_handle=handle)
    with pytest.raises(InvalidDefinition, match=message) as raised:
        op.execute(CONTEXT)
    assert "SendOperator 'send'" in notes(raised.value)


def test_unknown_conversation_names_the_handle(broker: Broker) -> None:
    missing = str(uuid.uuid4())
    op = EndConversationOperator(task_id="end", broker_conn_id=CONN_ID, conversation_handle=missing)
    with pytest.raises(UnknownObject, match=f"conversation handle {missing} does not exist"):
        op.execute(CONTEXT)


def test_body_without_message_type_is_refused() -> None:
    op = BeginDialogOperator(
        task_id="b", broker_conn_id="unused", from_service=BUYER, to_service=SUPPLIER, body="x"
    )
    with pytest.raises(InvalidDefinition, match="body given without message_type"):
        op.execute(CONTEXT)


def test_send_takes_body_or_bodies() -> None:
    with pytest.raises(ValueError, match="SendOperator 's': give body or bodies, not both"):
        SendOperator(task_id="s", conversation_handle="x", body="a", bodies=["b"])


# --------------------------------------------------------------------------------------------
# templated fields


class FakeTI:
    """Enough of a task instance for templates that pull XComs."""

    def __init__(self, xcoms: dict[str, Any]) -> None:
        self.xcoms = xcoms

    def xcom_pull(self, task_ids: str, key: str = "return_value") -> Any:
        return self.xcoms[task_ids]


def render(op: Any, **context: Any) -> None:
    op.render_template_fields(context)


def test_template_fields_are_declared() -> None:
    assert BeginDialogOperator.template_fields == (
        "from_service", "to_service", "contract", "broker_instance",
        "related_conversation_group", "related_conversation", "message_type", "body", "dedupe_key",
    )  # fmt: skip
    assert SendOperator.template_fields == (
        "conversation_handle", "message_type", "body", "bodies", "dedupe_key",
    )  # fmt: skip
    assert ReceiveOperator.template_fields == (
        "queue_name",
        "conversation_handle",
        "conversation_group",
    )
    assert EndConversationOperator.template_fields == (
        "conversation_handle", "error_description", "dedupe_key",
    )  # fmt: skip
    assert ApplyDeclarationsOperator.template_fields == ("path", "text")


def test_no_argument_shadows_a_base_operator_attribute() -> None:
    """``queue`` is BaseOperator's executor queue and ``dry_run`` its method: the broker queue
    and the plan-only flag are kept under other names, so neither is clobbered."""
    from airflow_broker.provider.compat import BaseOperator

    receive_op = ReceiveOperator(task_id="r", queue="SupplierQueue")
    assert receive_op.queue_name == "SupplierQueue"
    assert receive_op.queue == BaseOperator(task_id="plain").queue  # the executor default
    routed = ReceiveOperator(task_id="r2", queue="SupplierQueue", executor_queue="celery_q")
    assert (routed.queue_name, routed.queue) == ("SupplierQueue", "celery_q")
    apply_op = ApplyDeclarationsOperator(task_id="a", text="queues: []", dry_run=True)
    assert apply_op.plan_only is True
    assert callable(apply_op.dry_run)
    for op in (receive_op, apply_op):
        for field in op.template_fields:
            assert not hasattr(BaseOperator, field), field


def test_begin_dialog_renders_names_and_a_nested_body(broker: Broker) -> None:
    op = BeginDialogOperator(
        task_id="begin",
        broker_conn_id=CONN_ID,
        from_service="{{ params.side }}",
        to_service="//po/{{ params.other }}",
        contract=CONTRACT,
        message_type="{{ params.order_type }}",
        body={"po": "{{ params.po }}", "lines": ["{{ ti.xcom_pull(task_ids='quote') }}", 2]},
    )
    render(
        op,
        params={"side": BUYER, "other": "Supplier", "order_type": ORDER, "po": 17},
        ti=FakeTI({"quote": "widget"}),
    )
    assert (op.from_service, op.to_service, op.message_type) == (BUYER, SUPPLIER, ORDER)
    assert op.body == {"po": "17", "lines": ["widget", 2]}  # a dict stays a dict
    op.execute(CONTEXT)
    (got,) = receive(broker, SUPPLIER_QUEUE)
    assert got.json() == {"po": "17", "lines": ["widget", 2]}


def test_send_renders_handle_and_body_from_xcom(broker: Broker) -> None:
    h1, _ = open_order(broker)
    h2, _ = open_order(broker)
    op = SendOperator(
        task_id="send",
        broker_conn_id=CONN_ID,
        conversation_handle="{{ ti.xcom_pull(task_ids='begin') }}",
        message_type=NOTE,
        body="{{ ti.xcom_pull(task_ids='quote') | tojson }}",
    )
    # A list pulled by a template renders as its Python literal: the operator reads it back.
    render(op, ti=FakeTI({"begin": [str(h1), str(h2)], "quote": {"price": 3}}))
    assert op.conversation_handle == repr([str(h1), str(h2)])
    assert op.body == '{"price": 3}'
    assert op.execute(CONTEXT) == 2
    for _ in range(2):
        (m,) = receive(broker, SUPPLIER_QUEUE)
        assert m.json() == {"price": 3}


def test_send_bodies_rendered_as_text_are_read_back(broker: Broker) -> None:
    h, _ = open_order(broker)
    op = SendOperator(
        task_id="send",
        broker_conn_id=CONN_ID,
        conversation_handle=str(h),
        message_type=NOTE,
        bodies="{{ ti.xcom_pull(task_ids='lines') | tojson }}",
    )
    render(op, ti=FakeTI({"lines": ["a", {"b": 1}]}))
    assert op.execute(CONTEXT) == 2
    assert [m.message_body for m in receive(broker, SUPPLIER_QUEUE)] == [b"a", b'{"b":1}']


def test_receive_and_end_render_their_fields(broker: Broker) -> None:
    h, target = open_order(broker)
    with broker.transaction() as tx:
        tx.send(target, NOTE, "hello")
    receive_op = ReceiveOperator(
        task_id="r",
        broker_conn_id=CONN_ID,
        queue="{{ params.queue }}",
        conversation_handle="{{ ti.xcom_pull(task_ids='begin') }}",
    )
    render(receive_op, params={"queue": BUYER_QUEUE}, ti=FakeTI({"begin": str(h)}))
    assert receive_op.queue_name == BUYER_QUEUE
    (m,) = receive_op.execute(CONTEXT)
    assert m["body_text"] == "hello"
    end_op = EndConversationOperator(
        task_id="e",
        broker_conn_id=CONN_ID,
        conversation_handle="{{ ti.xcom_pull(task_ids='r')[0]['conversation_handle'] }}",
        error_code=500,
        error_description="cancelled by {{ params.who }}",
    )
    render(end_op, params={"who": "buyer"}, ti=FakeTI({"r": [m]}))
    assert end_op.conversation_handle == str(h)
    assert end_op.error_description == "cancelled by buyer"
    end_op.execute(CONTEXT)
    (err,) = receive(broker, SUPPLIER_QUEUE)
    assert err.error == (500, "cancelled by buyer")


# --------------------------------------------------------------------------------------------
# ApplyDeclarationsOperator


@pytest.fixture
def empty_broker(broker_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{CONN_ID.upper()}",
        json.dumps({"conn_type": "broker", "extra": {"url": broker_url}}),
    )
    b = Broker.connect(broker_url)
    yield b
    b.dispose()


def test_apply_declarations_from_a_file_then_again(empty_broker: Broker) -> None:
    path = str(FIXTURES / "purchase_orders.yaml")
    dry = ApplyDeclarationsOperator(
        task_id="plan", broker_conn_id=CONN_ID, path=path, dry_run=True
    ).execute(CONTEXT)
    xcom_safe(dry)
    assert "+ queue SupplierQueue: created" in dry
    assert "SupplierQueue" not in empty_broker.catalog().queues  # dry run wrote nothing
    lines = ApplyDeclarationsOperator(task_id="apply", broker_conn_id=CONN_ID, path=path).execute(
        CONTEXT
    )
    assert lines == dry
    catalog = empty_broker.catalog()
    assert {"BuyerQueue", "SupplierQueue", "AuditQueue"} <= set(catalog.queues)
    assert "//po/Supplier" in catalog.services
    again = ApplyDeclarationsOperator(task_id="apply", broker_conn_id=CONN_ID, path=path).execute(
        CONTEXT
    )
    assert not [line for line in again if line.startswith(("+", "~"))]


def test_apply_declarations_text_rendered(empty_broker: Broker) -> None:
    op = ApplyDeclarationsOperator(
        task_id="apply",
        broker_conn_id=CONN_ID,
        text="queues:\n  - name: {{ params.queue }}\n    retention: true\n",
    )
    render(op, params={"queue": "RenderedQueue"})
    assert op.execute(CONTEXT) == ["+ queue RenderedQueue: created"]
    assert empty_broker.catalog().queues["RenderedQueue"].retention is True


def test_apply_declarations_all_or_nothing_with_every_problem(empty_broker: Broker) -> None:
    path = FIXTURES / "invalid.yaml"
    op = ApplyDeclarationsOperator(task_id="apply", broker_conn_id=CONN_ID, path=str(path))
    before = empty_broker.catalog()
    with pytest.raises(DeclarationsInvalid, match="nothing was applied") as raised:
        op.execute(CONTEXT)
    listed = notes(raised.value)
    assert f"{path}:4: " in listed  # validation: jsn, on its line
    assert "'//bad/Missing' is declared neither" in listed
    assert "ApplyDeclarationsOperator 'apply'" in listed
    assert empty_broker.catalog() == before


def test_apply_declarations_needs_path_or_text() -> None:
    with pytest.raises(ValueError, match="exactly one of them"):
        ApplyDeclarationsOperator(task_id="a")
    with pytest.raises(ValueError, match="exactly one of them"):
        ApplyDeclarationsOperator(task_id="a", path="x.yaml", text="queues: []")


def test_apply_declarations_unreadable_file_names_it(empty_broker: Broker, tmp_path: Path) -> None:
    op = ApplyDeclarationsOperator(
        task_id="apply", broker_conn_id=CONN_ID, path=str(tmp_path / "missing.yaml")
    )
    with pytest.raises(InvalidDefinition, match=r"cannot read declarations file .*missing\.yaml"):
        op.execute(CONTEXT)


def test_plan_lines_match_the_cli(empty_broker: Broker, broker_url: str) -> None:
    """The operator returns what `airflow-broker apply` prints, line for line."""
    path = str(FIXTURES / "purchase_orders.yaml")
    lines = ApplyDeclarationsOperator(
        task_id="plan", broker_conn_id=CONN_ID, path=path, dry_run=True
    ).execute(CONTEXT)
    out = subprocess.run(
        [sys.executable, "-m", "airflow_broker.cli", "--url", broker_url, "apply", path,
         "--dry-run"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    printed = [line.strip() for line in out.splitlines() if line.startswith(("  +", "  ~", "  ="))]
    assert lines == printed
    assert len(lines) > 10


# --------------------------------------------------------------------------------------------
# in a DAG, through Airflow's own task runner


DAGS = Path(__file__).parent / "dags" / "operators"


@pytest.mark.slow
def test_operators_run_in_a_dag(tmp_path: Path) -> None:
    """The operators in a DAG file, parsed, serialized and run by ``airflow dags test``: XComs
    flow between them through templates and natively (``task.output``)."""
    home = tmp_path / "airflow"
    home.mkdir()
    broker_db = tmp_path / "broker.db"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_BROKER_ADDRESS_"))
    }
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(DAGS),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW_CONN_BROKER_DEFAULT=json.dumps({"conn_type": "sqlite", "host": str(broker_db)}),
    )
    b = Broker.connect(f"sqlite:///{broker_db}")
    b.migrate()
    airflow = str(Path(sys.executable).parent / "airflow")
    for args in (["db", "migrate"], ["dags", "test", "broker_operators"]):
        done = subprocess.run(
            [airflow, *args], env=env, cwd=home, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, (
            f"airflow {' '.join(args)}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )
    engine = create_engine(f"sqlite:///{home / 'airflow.db'}")
    with engine.connect() as conn:
        states = dict(
            conn.execute(
                text("SELECT task_id, state FROM task_instance WHERE dag_id = 'broker_operators'")
            ).all()
        )
        xcoms = {
            task_id: json.loads(value) if isinstance(value, str) else value
            for task_id, value in conn.execute(
                text(
                    "SELECT task_id, value FROM xcom WHERE dag_id = 'broker_operators' "
                    "AND key = 'return_value'"
                )
            ).all()
        }
    engine.dispose()
    assert states and set(states.values()) == {"success"}, states
    assert [m["body_json"] for m in xcoms["supplier_receives"]] == [{"po": 1001, "qty": 5}]
    assert xcoms["supplier_answers"] == 1
    assert uuid.UUID(xcoms["begin"])
    (answer,) = xcoms["buyer_receives"]
    assert answer["body_json"] == {"po": 1001, "price": 50}
    # Both sides ended the dialog: nothing of it is left but closed endpoints.
    with b.engine.connect() as conn:
        endpoints = conn.execute(text("SELECT state FROM broker_conversation_endpoint")).all()
    assert {row.state for row in endpoints} <= {"CD"}
    assert receive(b, "DagBuyerQueue") == [] and receive(b, "DagSupplierQueue") == []
    b.dispose()
