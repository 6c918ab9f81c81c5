"""Dialogs: BEGIN DIALOG, SEND, END CONVERSATION, lifetimes, timers and MOVE CONVERSATION.

Everything runs on the buyer/supplier pair of ``tests/helpers.py``, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

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
    begin,
    bodies,
    declare_pair,
    drain,
    open_order,
    receive,
    send,
    types,
)

from airflow_broker import (
    DEFAULT,
    DIALOG_TIMER,
    END_DIALOG,
    ERROR,
    Broker,
    BrokerError,
    ContractViolation,
    ConversationEnded,
    MessageValidationError,
    UnknownObject,
)
from airflow_broker.constants import ERR_CONTRACT_NOT_SUPPORTED, ERR_LIFETIME_EXPIRED
from airflow_broker.messaging.objects import ConversationEndpoint
from airflow_broker.storage import clock

NOWHERE = "//nowhere/Service"


@pytest.fixture(autouse=True)
def pair(broker: Broker) -> None:
    declare_pair(broker)


def endpoint(broker: Broker, handle: uuid.UUID) -> ConversationEndpoint:
    with broker.transaction() as tx:
        return tx.conversation(handle)


def depth(broker: Broker, queue: str) -> int:
    [status] = [s for s in broker.queue_status() if s.name == queue]
    return status.depth


def end(
    broker: Broker,
    handle: uuid.UUID,
    *,
    error_code: int | None = None,
    error_description: str | None = None,
    cleanup: bool = False,
) -> None:
    with broker.transaction() as tx:
        tx.end_conversation(
            handle, error_code=error_code, error_description=error_description, cleanup=cleanup
        )


# --------------------------------------------------------------------------- BEGIN DIALOG


def test_begin_dialog_creates_started_outbound_initiator(broker: Broker) -> None:
    h = begin(broker)
    assert isinstance(h, uuid.UUID)
    ep = endpoint(broker, h)
    assert ep.conversation_handle == h
    assert isinstance(ep.conversation_id, uuid.UUID)
    assert isinstance(ep.conversation_group_id, uuid.UUID)
    assert ep.is_initiator is True
    assert ep.service_name == BUYER
    assert ep.far_service == SUPPLIER
    assert ep.contract_name == CONTRACT
    assert ep.queue_name == BUYER_QUEUE
    assert (ep.state, ep.state_desc) == ("SO", "STARTED_OUTBOUND")
    assert ep.lifetime is None
    assert ep.priority == 5
    # Nothing travels before the first SEND.
    assert depth(broker, SUPPLIER_QUEUE) == 0
    assert broker.transmission_queue() == []


def test_begin_dialog_with_lifetime_sets_expiry(broker: Broker) -> None:
    before = datetime.now(UTC)
    h = begin(broker, lifetime_seconds=600)
    after = datetime.now(UTC)
    lifetime = endpoint(broker, h).lifetime
    assert lifetime is not None
    assert lifetime.tzinfo is not None
    assert before + timedelta(seconds=599) <= lifetime <= after + timedelta(seconds=601)


def test_begin_dialog_groups(broker: Broker) -> None:
    h1 = begin(broker)
    g1 = endpoint(broker, h1).conversation_group_id
    # Each dialog gets its own group by default.
    assert endpoint(broker, begin(broker)).conversation_group_id != g1
    # related_conversation joins that conversation's group.
    assert endpoint(broker, begin(broker, related_conversation=h1)).conversation_group_id == g1
    # related_conversation_group joins an existing group...
    h3 = begin(broker, related_conversation_group=g1)
    assert endpoint(broker, h3).conversation_group_id == g1
    # ... or creates a group with that id.
    group = uuid.uuid4()
    h4 = begin(broker, related_conversation_group=group)
    h5 = begin(broker, related_conversation_group=group)
    assert endpoint(broker, h4).conversation_group_id == group
    assert endpoint(broker, h5).conversation_group_id == group


def test_begin_dialog_refusals(broker: Broker) -> None:
    missing = uuid.uuid4()
    with pytest.raises(UnknownObject, match=str(missing)):
        begin(broker, related_conversation=missing)
    with pytest.raises(UnknownObject, match="//po/Ghost"), broker.transaction() as tx:
        tx.begin_dialog("//po/Ghost", SUPPLIER, contract=CONTRACT)
    with pytest.raises(UnknownObject, match="//po/NoContract"), broker.transaction() as tx:
        tx.begin_dialog(BUYER, SUPPLIER, contract="//po/NoContract")


def test_unroutable_service_waits_in_transmission_queue(broker: Broker) -> None:
    with broker.transaction() as tx:
        h = tx.begin_dialog(BUYER, NOWHERE, contract=CONTRACT)
        tx.send(h, message_type=NOTE, body=b"first")
        tx.send(h, message_type=NOTE, body=b"second")
    rows = broker.transmission_queue()
    assert [(r.conversation_handle, r.to_service_name, r.message_type_name) for r in rows] == [
        (h, NOWHERE, NOTE),
        (h, NOWHERE, NOTE),
    ]
    assert rows[1].message_sequence_number == rows[0].message_sequence_number + 1
    for row in rows:
        assert row.service_contract_name == CONTRACT
        assert isinstance(row.transmission_status, str)
        assert row.transmission_status.strip() != ""
    assert endpoint(broker, h).state == "CO"
    assert depth(broker, SUPPLIER_QUEUE) == 0


def test_target_without_the_contract_errors_the_initiator(broker: Broker) -> None:
    broker.create_contract("//po/OtherContract", {NOTE: "any"})
    h = begin(broker, contract="//po/OtherContract")
    send(broker, h, NOTE, b"hello")
    assert drain(broker, SUPPLIER_QUEUE) == []
    [error] = receive(broker, BUYER_QUEUE)
    assert error.message_type_name == ERROR
    assert error.conversation_handle == h
    assert error.error is not None
    assert error.error[0] == ERR_CONTRACT_NOT_SUPPORTED
    assert endpoint(broker, h).state == "ER"
    with pytest.raises(ConversationEnded):
        send(broker, h, NOTE, b"again")


def test_initiator_service_needs_no_contract(broker: Broker) -> None:
    broker.create_queue("anon_queue")
    broker.create_service("//po/Anon", queue="anon_queue")
    with broker.transaction() as tx:
        h = tx.begin_dialog("//po/Anon", SUPPLIER, contract=CONTRACT)
        tx.send(h, message_type=ORDER, body={"sku": "A-1"})
    [order] = receive(broker, SUPPLIER_QUEUE)
    assert order.json() == {"sku": "A-1"}
    send(broker, order.conversation_handle, INVOICE, {"total": 10})
    [invoice] = receive(broker, "anon_queue")
    assert invoice.conversation_handle == h
    assert invoice.json() == {"total": 10}


def test_default_contract_dialog(broker: Broker) -> None:
    broker.create_service("//po/Plain", queue=SUPPLIER_QUEUE, contracts=[DEFAULT])
    with broker.transaction() as tx:
        h = tx.begin_dialog(BUYER, "//po/Plain")
        tx.send(h, body="hi")
    [m] = receive(broker, SUPPLIER_QUEUE)
    assert DEFAULT == "DEFAULT"
    assert (m.message_type_name, m.service_contract_name, m.service_name) == (
        "DEFAULT",
        "DEFAULT",
        "//po/Plain",
    )
    assert m.message_body == b"hi"


def test_rolled_back_begin_and_send_leave_nothing(broker: Broker) -> None:
    handles: list[uuid.UUID] = []
    with pytest.raises(RuntimeError), broker.transaction() as tx:
        handles.append(tx.begin_dialog(BUYER, SUPPLIER, contract=CONTRACT))
        tx.send(handles[0], message_type=ORDER, body={"n": 1})
        raise RuntimeError("abort")
    assert depth(broker, SUPPLIER_QUEUE) == 0
    with pytest.raises(UnknownObject):
        endpoint(broker, handles[0])


# --------------------------------------------------------------------------- SEND


def test_send_body_encodings_and_message_accessors(broker: Broker) -> None:
    h = begin(broker)
    send(broker, h, NOTE, b"\x00\xffraw", "h\u00e9llo", {"a": [1, 2]}, None, 42)
    got = receive(broker, SUPPLIER_QUEUE)
    assert bodies(got)[:2] == [b"\x00\xffraw", b"h\xc3\xa9llo"]
    assert got[1].text() == "h\u00e9llo"
    assert got[2].json() == {"a": [1, 2]}
    assert got[3].message_body is None
    assert got[3].text() is None
    assert got[3].json() is None
    assert got[4].json() == 42
    assert [m.error for m in got] == [None] * 5


def test_received_message_columns(broker: Broker) -> None:
    h = begin(broker)
    send(broker, h, ORDER, {"sku": "A-1"})
    [m] = receive(broker, SUPPLIER_QUEUE)
    target = endpoint(broker, m.conversation_handle)
    assert m.conversation_handle != h
    assert m.conversation_group_id == target.conversation_group_id
    assert m.service_name == SUPPLIER
    assert m.service_contract_name == CONTRACT
    assert m.message_type_name == ORDER
    assert m.priority == 5
    assert isinstance(m.queuing_order, int)
    assert isinstance(m.message_sequence_number, int)


def test_send_to_several_handles(broker: Broker) -> None:
    h1, h2 = begin(broker), begin(broker)
    with broker.transaction() as tx:
        tx.send([h1, h2], message_type=NOTE, body=b"broadcast")
    got = drain(broker, SUPPLIER_QUEUE)
    assert bodies(got) == [b"broadcast", b"broadcast"]
    far = {endpoint(broker, m.conversation_handle).conversation_id for m in got}
    assert far == {endpoint(broker, h1).conversation_id, endpoint(broker, h2).conversation_id}


def test_send_to_several_handles_is_atomic_on_unknown_handle(broker: Broker) -> None:
    h1 = begin(broker)
    missing = uuid.uuid4()
    with broker.transaction() as tx, pytest.raises(UnknownObject, match=str(missing)):
        tx.send([h1, missing], message_type=NOTE, body=b"x")
    assert depth(broker, SUPPLIER_QUEUE) == 0
    assert endpoint(broker, h1).state == "SO"


def test_send_to_several_handles_is_atomic_on_contract_violation(broker: Broker) -> None:
    broker.create_contract("//po/NotesOnly", {NOTE: "any"})
    broker.create_service("//po/Notes", queue=SUPPLIER_QUEUE, contracts=["//po/NotesOnly"])
    h1 = begin(broker)
    with broker.transaction() as tx:
        h2 = tx.begin_dialog(BUYER, "//po/Notes", contract="//po/NotesOnly")
    before = endpoint(broker, h1).send_sequence
    with broker.transaction() as tx, pytest.raises(ContractViolation, match=ORDER):
        tx.send([h1, h2], message_type=ORDER, body={"n": 1})
    assert depth(broker, SUPPLIER_QUEUE) == 0
    assert endpoint(broker, h1).send_sequence == before
    assert endpoint(broker, h2).state == "SO"


def test_send_sequence_counts_sends(broker: Broker) -> None:
    h = begin(broker)
    before = endpoint(broker, h).send_sequence
    send(broker, h, ORDER, {"n": 1}, {"n": 2})
    send(broker, h, NOTE, b"3")
    assert endpoint(broker, h).send_sequence == before + 3


def test_initiator_may_not_send_target_type(broker: Broker) -> None:
    h = begin(broker)
    with broker.transaction() as tx, pytest.raises(ContractViolation, match=INVOICE):
        tx.send(h, message_type=INVOICE, body={"total": 1})
    assert depth(broker, SUPPLIER_QUEUE) == 0
    assert endpoint(broker, h).state == "SO"


def test_target_may_not_send_initiator_type(broker: Broker) -> None:
    h, target = open_order(broker)
    with broker.transaction() as tx, pytest.raises(ContractViolation, match=ORDER):
        tx.send(target, message_type=ORDER, body={"n": 2})
    assert depth(broker, BUYER_QUEUE) == 0
    # Either side may send an "any" type.
    send(broker, target, NOTE, b"from target")
    send(broker, h, NOTE, b"from initiator")
    assert bodies(receive(broker, BUYER_QUEUE)) == [b"from target"]
    assert bodies(receive(broker, SUPPLIER_QUEUE)) == [b"from initiator"]


def test_type_outside_the_contract_is_a_violation(broker: Broker) -> None:
    h = begin(broker)
    with pytest.raises(ContractViolation, match=DEFAULT):
        send(broker, h, DEFAULT, b"x")
    broker.create_service("//po/Plain", queue=SUPPLIER_QUEUE, contracts=[DEFAULT])
    with broker.transaction() as tx:
        plain = tx.begin_dialog(BUYER, "//po/Plain")
    with pytest.raises(ContractViolation, match=NOTE):
        send(broker, plain, NOTE, b"x")
    assert depth(broker, SUPPLIER_QUEUE) == 0


VALIDATION_CASES = [
    # kind, a valid body, an invalid body
    ("empty", None, b"not empty"),
    ("json", b'{"a": 1}', b"{not json"),
    ("json_schema", {"sku": "A-1", "qty": 2}, {"sku": "A-1", "qty": 0}),
    ("well_formed_xml", b"<order><sku>A-1</sku></order>", b"<order><sku>A-1</order>"),
]


@pytest.mark.parametrize(("kind", "good", "bad"), VALIDATION_CASES)
def test_invalid_body_raises_and_stores_nothing(
    broker: Broker, kind: str, good: object, bad: object
) -> None:
    mtype = f"//v/{kind}"
    schema = {
        "type": "object",
        "properties": {"qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"],
    }
    broker.create_message_type(
        mtype, validation=kind, json_schema=schema if kind == "json_schema" else None
    )
    broker.create_contract("//v/Contract", {mtype: "any"})
    broker.create_service("//v/Target", queue=SUPPLIER_QUEUE, contracts=["//v/Contract"])
    with broker.transaction() as tx:
        h = tx.begin_dialog(BUYER, "//v/Target", contract="//v/Contract")
    before = endpoint(broker, h).send_sequence
    with broker.transaction() as tx, pytest.raises(MessageValidationError, match=mtype):
        tx.send(h, message_type=mtype, body=bad)
    assert depth(broker, SUPPLIER_QUEUE) == 0
    assert broker.transmission_queue() == []
    ep = endpoint(broker, h)
    assert (ep.state, ep.send_sequence) == ("SO", before)
    # The valid body goes through.
    send(broker, h, mtype, good)
    [m] = receive(broker, SUPPLIER_QUEUE)
    assert m.message_type_name == mtype
    if good is None:
        assert m.message_body is None
    elif isinstance(good, bytes):
        assert m.message_body == good
    else:
        assert m.json() == good


def test_no_validation_accepts_any_bytes(broker: Broker) -> None:
    h = begin(broker)
    send(broker, h, NOTE, b"\xff\x00 <not xml { not json")
    assert bodies(receive(broker, SUPPLIER_QUEUE)) == [b"\xff\x00 <not xml { not json"]


def test_exactly_once_in_order_both_directions(broker: Broker) -> None:
    h = begin(broker)
    for n in range(1, 11):
        send(broker, h, ORDER, {"n": n})
    send(broker, h, ORDER, *({"n": n} for n in range(11, 21)))
    received = []
    for _ in range(20):
        got = receive(broker, SUPPLIER_QUEUE, top=3)
        if not got:
            break
        assert len(got) <= 3
        received.extend(got)
    assert [m.json()["n"] for m in received] == list(range(1, 21))
    seqs = [m.message_sequence_number for m in received]
    assert seqs == list(range(seqs[0], seqs[0] + 20))
    assert len({m.conversation_handle for m in received}) == 1
    assert receive(broker, SUPPLIER_QUEUE) == []

    target = received[0].conversation_handle
    for n in range(1, 6):
        send(broker, target, INVOICE, {"n": n})
    replies = drain(broker, BUYER_QUEUE)
    assert [m.json()["n"] for m in replies] == [1, 2, 3, 4, 5]
    assert {m.conversation_handle for m in replies} == {h}


# --------------------------------------------------------------------------- endpoints and END


def test_target_endpoint_fields(broker: Broker) -> None:
    h = begin(broker)
    send(broker, h, ORDER, {"n": 1})
    initiator = endpoint(broker, h)
    assert (initiator.state, initiator.state_desc) == ("CO", "CONVERSING")
    [m] = receive(broker, SUPPLIER_QUEUE)
    target = endpoint(broker, m.conversation_handle)
    assert target.conversation_handle == m.conversation_handle != h
    assert target.conversation_id == initiator.conversation_id
    assert target.conversation_group_id == m.conversation_group_id
    assert target.conversation_group_id != initiator.conversation_group_id
    assert target.is_initiator is False
    assert target.service_name == SUPPLIER
    assert target.far_service == BUYER
    assert target.contract_name == CONTRACT
    assert target.queue_name == SUPPLIER_QUEUE
    assert (target.state, target.state_desc) == ("CO", "CONVERSING")


def test_unknown_handle_everywhere(broker: Broker) -> None:
    g = endpoint(broker, begin(broker)).conversation_group_id
    missing = uuid.uuid4()
    with pytest.raises(UnknownObject, match=str(missing)):
        endpoint(broker, missing)
    with pytest.raises(UnknownObject, match=str(missing)):
        send(broker, missing, NOTE, b"x")
    with pytest.raises(UnknownObject, match=str(missing)):
        end(broker, missing)
    with pytest.raises(UnknownObject, match=str(missing)), broker.transaction() as tx:
        tx.begin_conversation_timer(missing, 1)
    with pytest.raises(UnknownObject, match=str(missing)), broker.transaction() as tx:
        tx.move_conversation(missing, g)


def test_plain_end_both_sides(broker: Broker) -> None:
    h, target = open_order(broker)
    end(broker, h)
    ep = endpoint(broker, h)
    assert (ep.state, ep.state_desc) == ("DO", "DISCONNECTED_OUTBOUND")
    [m] = receive(broker, SUPPLIER_QUEUE)
    assert END_DIALOG == "http://schemas.microsoft.com/SQL/ServiceBroker/EndDialog"
    assert (m.message_type_name, m.message_body, m.conversation_handle) == (
        "http://schemas.microsoft.com/SQL/ServiceBroker/EndDialog",
        None,
        target,
    )
    ep = endpoint(broker, target)
    assert (ep.state, ep.state_desc) == ("DI", "DISCONNECTED_INBOUND")
    with pytest.raises(ConversationEnded):
        send(broker, h, NOTE, b"after my end")
    with pytest.raises(ConversationEnded):
        send(broker, target, NOTE, b"after their end")
    with pytest.raises(ConversationEnded):
        end(broker, h)  # a DO endpoint has already ended

    end(broker, target)
    for handle in (h, target):
        ep = endpoint(broker, handle)
        assert (ep.state, ep.state_desc) == ("CD", "CLOSED")
    with pytest.raises(ConversationEnded):
        end(broker, target)
    with pytest.raises(ConversationEnded):
        send(broker, h, NOTE, b"closed")
    assert drain(broker, BUYER_QUEUE) == []
    assert drain(broker, SUPPLIER_QUEUE) == []


def test_plain_end_follows_pending_messages(broker: Broker) -> None:
    h = begin(broker)
    with broker.transaction() as tx:
        tx.send(h, message_type=ORDER, body={"n": 1})
        tx.send(h, message_type=NOTE, body=b"2")
        tx.end_conversation(h)
    got = receive(broker, SUPPLIER_QUEUE)
    assert types(got) == [ORDER, NOTE, END_DIALOG]
    assert bodies(got)[1:] == [b"2", None]


def test_plain_end_to_unroutable_service_queues_end_dialog_last(broker: Broker) -> None:
    with broker.transaction() as tx:
        h = tx.begin_dialog(BUYER, NOWHERE, contract=CONTRACT)
        tx.send(h, message_type=NOTE, body=b"1")
        tx.send(h, message_type=NOTE, body=b"2")
    end(broker, h)
    rows = [r for r in broker.transmission_queue() if r.conversation_handle == h]
    assert [r.message_type_name for r in rows] == [NOTE, NOTE, END_DIALOG]


def test_end_deletes_enders_queued_messages(broker: Broker) -> None:
    h, target = open_order(broker)
    send(broker, target, INVOICE, {"n": 1}, {"n": 2})
    assert depth(broker, BUYER_QUEUE) == 2
    end(broker, h)
    assert depth(broker, BUYER_QUEUE) == 0
    assert receive(broker, BUYER_QUEUE) == []


def test_end_with_error(broker: Broker) -> None:
    h, target = open_order(broker)
    end(broker, h, error_code=50001, error_description="out of stock: A-1")
    ep = endpoint(broker, h)
    assert (ep.state, ep.state_desc) == ("CD", "CLOSED")
    [m] = receive(broker, SUPPLIER_QUEUE)
    assert ERROR == "http://schemas.microsoft.com/SQL/ServiceBroker/Error"
    assert m.message_type_name == "http://schemas.microsoft.com/SQL/ServiceBroker/Error"
    assert m.conversation_handle == target
    assert m.error == (50001, "out of stock: A-1")
    ep = endpoint(broker, target)
    assert (ep.state, ep.state_desc) == ("ER", "ERROR")
    with pytest.raises(ConversationEnded):
        send(broker, target, NOTE, b"too late")
    with pytest.raises(ConversationEnded):
        send(broker, h, NOTE, b"too late")
    with pytest.raises(ConversationEnded):
        end(broker, h)
    end(broker, target)
    assert endpoint(broker, target).state == "CD"
    assert drain(broker, BUYER_QUEUE) == []


def test_end_with_error_drops_pending_outgoing_messages(broker: Broker) -> None:
    with broker.transaction() as tx:
        h = tx.begin_dialog(BUYER, NOWHERE, contract=CONTRACT)
        tx.send(h, message_type=NOTE, body=b"1")
        tx.send(h, message_type=NOTE, body=b"2")
    assert len(broker.transmission_queue()) == 2
    end(broker, h, error_code=50002, error_description="cancelled")
    rows = [r for r in broker.transmission_queue() if r.conversation_handle == h]
    assert NOTE not in [r.message_type_name for r in rows]
    assert endpoint(broker, h).state == "CD"


def test_an_error_from_the_far_side_drops_what_waited_to_go_to_it(broker: Broker) -> None:
    """The supplier's Invoice waits for the buyer's disabled queue; the buyer ends WITH ERROR.
    The supplier fails (ER) and can send nothing more: the Invoice leaves the transmission
    queue with the Error's arrival, as it does when the Error comes from another broker (the
    model-based test's final check found it left behind)."""
    h, target = open_order(broker)
    broker.alter_queue(BUYER_QUEUE, status=False)
    send(broker, target, INVOICE, {"n": 1})
    assert [r.message_type_name for r in broker.transmission_queue()] == [INVOICE]
    end(broker, h, error_code=50003, error_description="cancelled")
    assert endpoint(broker, target).state == "ER"
    assert broker.transmission_queue() == []
    assert broker.check() == []
    broker.alter_queue(BUYER_QUEUE, status=True)
    broker.run_due()
    assert drain(broker, BUYER_QUEUE) == []


def test_a_waiting_dialog_backs_off_as_a_whole(broker: Broker) -> None:
    """Two Invoices wait for the buyer's disabled queue. A due-work pass that finds the queue
    still disabled puts off every waiting row of the dialog, not only the first: a later row
    still due would bring the dialog back at every pass (every waiting RECEIVE's, once a
    second)."""
    _, target = open_order(broker)
    broker.alter_queue(BUYER_QUEUE, status=False)
    send(broker, target, INVOICE, {"n": 1}, {"n": 2})
    try:
        clock.advance(3600)  # past every row's first retry time
        broker.run_due()
        now = clock.utcnow()
        rows = broker.transmission_queue()
        assert [r.message_type_name for r in rows] == [INVOICE, INVOICE]
        assert all(r.next_attempt_at > now for r in rows), [r.next_attempt_at for r in rows]
    finally:
        clock.reset()


def test_end_with_cleanup(broker: Broker) -> None:
    h, target = open_order(broker)
    send(broker, target, INVOICE, {"n": 1})
    end(broker, h, cleanup=True)
    with pytest.raises(UnknownObject, match=str(h)):
        endpoint(broker, h)
    with pytest.raises(UnknownObject):
        send(broker, h, NOTE, b"gone")
    assert depth(broker, BUYER_QUEUE) == 0
    # Tells no one: the far side is still conversing and got nothing.
    assert endpoint(broker, target).state == "CO"
    assert drain(broker, SUPPLIER_QUEUE) == []


# --------------------------------------------------------------------------- lifetime


def test_lifetime_expiry_errors_both_sides(broker: Broker) -> None:
    h = begin(broker, lifetime_seconds=1)
    send(broker, h, ORDER, {"n": 1})
    time.sleep(1.2)
    # Expired: no new message is accepted, even before the due work has run.
    with pytest.raises(ConversationEnded):
        send(broker, h, NOTE, b"late")
    broker.run_due()
    [m] = receive(broker, BUYER_QUEUE)
    assert m.message_type_name == ERROR
    assert m.error is not None and m.error[0] == ERR_LIFETIME_EXPIRED
    got = receive(broker, SUPPLIER_QUEUE)
    assert types(got) == [ERROR, ORDER]
    assert got[0].error is not None and got[0].error[0] == ERR_LIFETIME_EXPIRED
    target = got[0].conversation_handle
    assert endpoint(broker, h).state == "ER"
    assert endpoint(broker, target).state == "ER"
    with pytest.raises(ConversationEnded):
        send(broker, target, NOTE, b"late")
    # Expiry is reported once.
    broker.run_due()
    assert receive(broker, BUYER_QUEUE) == []


# --------------------------------------------------------------------------- conversation timers


def test_conversation_timer(broker: Broker) -> None:
    h, target = open_order(broker)
    with broker.transaction() as tx:
        tx.begin_conversation_timer(h, 0.5)
    with broker.transaction() as tx:
        tx.begin_conversation_timer(h, 3600)  # re-arming replaces the 0.5 s timer
    time.sleep(0.6)
    broker.run_due()
    assert receive(broker, BUYER_QUEUE) == []

    with broker.transaction() as tx:
        tx.begin_conversation_timer(h, 0.5)
    send(broker, target, INVOICE, {"n": 1}, {"n": 2})
    time.sleep(0.6)
    broker.run_due()
    broker.run_due()
    # The timer fired once, on the local side only; the dialog is still open.
    assert endpoint(broker, h).state == "CO"
    assert depth(broker, SUPPLIER_QUEUE) == 0
    end(broker, target, error_code=50003, error_description="supplier closed")

    got = receive(broker, BUYER_QUEUE)
    # Queued as Invoice, Invoice, DialogTimer, Error; received Timer, Error, then the rest.
    assert DIALOG_TIMER == "http://schemas.microsoft.com/SQL/ServiceBroker/DialogTimer"
    assert types(got) == [
        "http://schemas.microsoft.com/SQL/ServiceBroker/DialogTimer",
        ERROR,
        INVOICE,
        INVOICE,
    ]
    assert (got[0].message_body, got[0].conversation_handle) == (None, h)
    assert got[1].error == (50003, "supplier closed")
    assert [m.json()["n"] for m in got[2:]] == [1, 2]
    assert receive(broker, BUYER_QUEUE) == []


# --------------------------------------------------------------------------- MOVE CONVERSATION


def test_move_conversation_between_groups_of_one_queue(broker: Broker) -> None:
    h1, t1 = open_order(broker)
    h2, t2 = open_order(broker)
    g1 = endpoint(broker, h1).conversation_group_id
    assert endpoint(broker, h2).conversation_group_id != g1
    with broker.transaction() as tx:
        tx.move_conversation(h2, g1)
    assert endpoint(broker, h2).conversation_group_id == g1
    send(broker, t1, INVOICE, {"n": 1})
    send(broker, t2, INVOICE, {"n": 2})
    got = receive(broker, BUYER_QUEUE)
    assert sorted((m.conversation_handle, m.json()["n"]) for m in got) == sorted([(h1, 1), (h2, 2)])
    assert {m.conversation_group_id for m in got} == {g1}


def test_move_conversation_to_other_queue_is_refused(broker: Broker) -> None:
    h, target = open_order(broker)
    g = endpoint(broker, h).conversation_group_id
    supplier_group = endpoint(broker, target).conversation_group_id
    with broker.transaction() as tx, pytest.raises(BrokerError):
        tx.move_conversation(h, supplier_group)
    assert endpoint(broker, h).conversation_group_id == g


# --------------------------------------------------------------------------- disabled target queue


def test_send_to_disabled_queue_waits_then_delivers_in_order(broker: Broker) -> None:
    broker.alter_queue(SUPPLIER_QUEUE, status=False)
    h = begin(broker)
    send(broker, h, ORDER, {"n": 1})
    send(broker, h, ORDER, {"n": 2})
    rows = broker.transmission_queue()
    assert [(r.conversation_handle, r.to_service_name) for r in rows] == [(h, SUPPLIER)] * 2
    assert all(r.transmission_status.strip() for r in rows)
    assert depth(broker, SUPPLIER_QUEUE) == 0
    broker.alter_queue(SUPPLIER_QUEUE, status=True)
    # A later message of the dialog never overtakes the waiting ones.
    send(broker, h, ORDER, {"n": 3})
    early = receive(broker, SUPPLIER_QUEUE)
    assert [m.json()["n"] for m in early] in ([], [1, 2, 3])
    broker.run_due()
    assert broker.transmission_queue() == []
    got = early + receive(broker, SUPPLIER_QUEUE)
    assert [m.json()["n"] for m in got] == [1, 2, 3]


def test_waiting_receive_fires_a_due_timer_without_run_due(broker: Broker) -> None:
    """Nobody calls run_due(): RECEIVE's own due-work step fires the timer it is waiting for."""
    h, _target = open_order(broker)
    with broker.transaction() as tx:
        tx.begin_conversation_timer(h, 0.3)
    started = time.monotonic()
    with broker.transaction() as tx:
        got = tx.receive(BUYER_QUEUE, wait_seconds=5)
    waited = time.monotonic() - started
    assert [m.message_type_name for m in got] == [DIALOG_TIMER]
    assert got[0].conversation_handle == h
    assert 0.25 <= waited < 1.5, waited
