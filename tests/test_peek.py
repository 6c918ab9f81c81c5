"""``Broker.peek``: the messages waiting in a queue, seen without receiving or locking anything,
on both engines; and the body preview the monitoring API shows of them."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import (
    BUYER,
    NOTE,
    ORDER,
    SUPPLIER_QUEUE,
    begin,
    declare_pair,
    open_order,
    receive,
    send,
)
from sqlalchemy import select, update

from airflow_broker import Broker
from airflow_broker.constants import STATUS_READY, STATUS_RECEIVED, STATUS_RETAINED_SENT
from airflow_broker.errors import InvalidDefinition, UnknownObject
from airflow_broker.messaging.objects import DeadLetter
from airflow_broker.operations.monitoring import body_preview
from airflow_broker.storage import schema as s

RUSH = "//po/RushContract"
RUSH_SUPPLIER = "//po/RushSupplier"


class ReaderFailed(Exception):
    """A reader's processing failed: its receiving transaction rolls back."""


def stored_receive_counts(broker: Broker) -> dict[bytes | None, int]:
    with broker.engine.connect() as conn:
        return {
            r.message_body: r.receive_count
            for r in conn.execute(select(s.message.c.message_body, s.message.c.receive_count))
        }


def test_peek_shows_waiting_messages_in_queue_order_and_takes_nothing(broker: Broker) -> None:
    declare_pair(broker)
    a, b = begin(broker), begin(broker)
    send(broker, a, NOTE, b"a1")
    send(broker, b, NOTE, b"b1")
    send(broker, a, NOTE, b"a2")

    seen = broker.peek(SUPPLIER_QUEUE)
    assert [m.message_body for m in seen] == [b"a1", b"b1", b"a2"]  # arrival (queuing_order)
    assert [m.queuing_order for m in seen] == sorted(m.queuing_order for m in seen)
    first = seen[0]
    assert (first.status, first.message_type_name, first.service_name) == (
        STATUS_READY,
        NOTE,
        "//po/Supplier",
    )
    assert (first.receive_count, first.dead_letter) == (0, None)
    assert first.enqueued_at is not None and first.enqueued_at.tzinfo is not None
    assert seen[0].conversation_handle == seen[2].conversation_handle != seen[1].conversation_handle
    assert seen[0].conversation_group_id == seen[2].conversation_group_id

    # Nothing was taken, counted or locked: peeking again sees the same, RECEIVE gets them all.
    assert broker.peek(SUPPLIER_QUEUE) == seen
    assert set(stored_receive_counts(broker).values()) == {0}
    got = receive(broker, SUPPLIER_QUEUE) + receive(broker, SUPPLIER_QUEUE)
    assert sorted(m.message_body or b"" for m in got) == [b"a1", b"a2", b"b1"]
    assert broker.peek(SUPPLIER_QUEUE) == []


def test_higher_priority_first_as_receive_picks_groups(broker: Broker) -> None:
    declare_pair(broker)
    broker.create_contract(RUSH, {ORDER: "initiator", NOTE: "any"})
    broker.create_service(RUSH_SUPPLIER, queue=SUPPLIER_QUEUE, contracts=[RUSH])
    broker.create_priority("rush_orders", contract=RUSH, priority=9)
    send(broker, begin(broker), NOTE, b"normal 1", b"normal 2")
    with broker.transaction() as tx:
        urgent = tx.begin_dialog(BUYER, RUSH_SUPPLIER, contract=RUSH)
        tx.send(urgent, message_type=NOTE, body=b"rush")

    seen = broker.peek(SUPPLIER_QUEUE)
    assert [(m.message_body, m.priority) for m in seen] == [
        (b"rush", 9),
        (b"normal 1", 5),
        (b"normal 2", 5),
    ]
    [first] = receive(broker, SUPPLIER_QUEUE)  # RECEIVE takes the same group first
    assert first.message_body == b"rush"


def test_top_and_offset_page_through_the_queue(broker: Broker) -> None:
    declare_pair(broker)
    bodies = [f"note {n}".encode() for n in range(7)]
    send(broker, begin(broker), NOTE, *bodies)

    assert [m.message_body for m in broker.peek(SUPPLIER_QUEUE, top=3)] == bodies[:3]
    assert [m.message_body for m in broker.peek(SUPPLIER_QUEUE, top=3, offset=3)] == bodies[3:6]
    assert [m.message_body for m in broker.peek(SUPPLIER_QUEUE, top=3, offset=6)] == bodies[6:]
    assert broker.peek(SUPPLIER_QUEUE, offset=7) == []
    assert len(broker.peek(SUPPLIER_QUEUE)) == 7  # top defaults to 20
    assert len(broker.peek(SUPPLIER_QUEUE, top=1)) == 1


def test_peek_one_conversation_in_sequence_order(broker: Broker) -> None:
    declare_pair(broker)
    a, b = begin(broker), begin(broker)
    send(broker, b, NOTE, b"b0")
    send(broker, a, NOTE, b"a0", b"a1")
    send(broker, b, NOTE, b"b1", b"b2")
    target_b = next(
        m.conversation_handle for m in broker.peek(SUPPLIER_QUEUE) if m.message_body == b"b0"
    )

    mine = broker.peek(SUPPLIER_QUEUE, conversation_handle=target_b)
    assert [m.message_body for m in mine] == [b"b0", b"b1", b"b2"]
    assert [m.message_sequence_number for m in mine] == [0, 1, 2]
    assert {m.conversation_handle for m in mine} == {target_b}
    as_text = broker.peek(SUPPLIER_QUEUE, conversation_handle=str(target_b), top=1, offset=1)
    assert [m.message_body for m in as_text] == [b"b1"]
    # A handle with nothing waiting in this queue (the initiator's side, or none at all).
    assert broker.peek(SUPPLIER_QUEUE, conversation_handle=b) == []
    assert broker.peek(SUPPLIER_QUEUE, conversation_handle=uuid.uuid4()) == []


def test_receive_count_is_the_stored_count_of_hand_outs(broker: Broker) -> None:
    declare_pair(broker)
    send(broker, begin(broker), NOTE, b"fragile")
    assert broker.peek(SUPPLIER_QUEUE)[0].receive_count == 0  # never received

    with pytest.raises(ReaderFailed), broker.transaction() as tx:
        assert tx.receive(SUPPLIER_QUEUE)
        raise ReaderFailed
    [after_rollback] = broker.peek(SUPPLIER_QUEUE)
    assert after_rollback.receive_count == stored_receive_counts(broker)[b"fragile"]

    with broker.engine.begin() as conn:
        conn.execute(update(s.message).values(receive_count=3))
    [m] = broker.peek(SUPPLIER_QUEUE)
    assert m.receive_count == 3


def test_a_dead_lettered_message_says_where_it_came_from(broker: Broker) -> None:
    declare_pair(broker)
    send(broker, begin(broker), NOTE, b"gone wrong")
    origin = DeadLetter("orders", uuid.uuid4(), 5, "received 5 times without completing")
    with broker.engine.begin() as conn:
        conn.execute(update(s.message).values(dead_letter=origin.to_json(), receive_count=5))
    [m] = broker.peek(SUPPLIER_QUEUE)
    assert m.dead_letter == origin
    assert m.receive_count == 5


def test_retained_messages_are_not_waiting(broker: Broker) -> None:
    declare_pair(broker, supplier_retention=True)
    initiator, target = open_order(broker, {"po": 1})  # received: kept with status 0
    send(broker, target, NOTE, b"to the buyer")  # the supplier's copy: kept with status 3
    send(broker, initiator, NOTE, b"waiting")
    seen = broker.peek(SUPPLIER_QUEUE)
    assert [(m.message_body, m.status) for m in seen] == [(b"waiting", STATUS_READY)]
    with broker.engine.connect() as conn:
        kept = conn.execute(select(s.message.c.status).where(s.message.c.status != STATUS_READY))
        assert sorted(kept.scalars()) == [STATUS_RECEIVED, STATUS_RETAINED_SENT]


def test_unknown_queue_and_bad_arguments_are_refused(broker: Broker) -> None:
    declare_pair(broker)
    with pytest.raises(UnknownObject, match="queue 'NoSuchQueue' does not exist"):
        broker.peek("NoSuchQueue")
    for bad in (
        {"top": 0},
        {"top": -1},
        {"top": 2.5},
        {"top": True},
        {"offset": -1},
        {"offset": "1"},
        {"conversation_handle": "not-a-uuid"},
    ):
        with pytest.raises(InvalidDefinition):
            broker.peek(SUPPLIER_QUEUE, **bad)
    with pytest.raises(InvalidDefinition):
        broker.peek("")


def test_peek_neither_waits_for_nor_holds_up_a_receive_on_postgres(pg_broker: Broker) -> None:
    """A RECEIVE holds the group of conversation A open; a peek on another connection answers
    at once and still sees A's messages (taken, not committed); another reader still takes B."""
    declare_pair(pg_broker)
    send(pg_broker, begin(pg_broker), NOTE, b"a1", b"a2")
    send(pg_broker, begin(pg_broker), NOTE, b"b1")
    with ThreadPoolExecutor(max_workers=1) as pool, pg_broker.transaction() as tx:
        held = tx.receive(SUPPLIER_QUEUE)
        assert [m.message_body for m in held] == [b"a1", b"a2"]
        seen = pool.submit(pg_broker.peek, SUPPLIER_QUEUE).result(timeout=10)
        assert [m.message_body for m in seen] == [b"a1", b"a2", b"b1"]
        mine = pool.submit(
            pg_broker.peek, SUPPLIER_QUEUE, conversation_handle=held[0].conversation_handle
        ).result(timeout=10)
        assert [m.message_body for m in mine] == [b"a1", b"a2"]
        other = pool.submit(receive, pg_broker, SUPPLIER_QUEUE).result(timeout=10)
        assert [m.message_body for m in other] == [b"b1"]
    assert pg_broker.peek(SUPPLIER_QUEUE) == []  # the RECEIVE committed


@pytest.mark.parametrize(
    ("body", "chars", "text", "encoding", "truncated"),
    [
        (None, 200, None, None, False),
        (b"", 200, "", "utf-8", False),
        (b'{"po": 1}', 200, '{"po": 1}', "utf-8", False),
        ("héllo wörld".encode(), 5, "héllo", "utf-8", True),
        ("€€€€".encode(), 2, "€€", "utf-8", True),
        (b"caf\xe9 au lait", 200, "caf\ufffd au lait", "utf-8", False),  # latin-1 slip
        (b"\x00\x01\x02\x03", 200, "AAECAw==", "base64", False),
        (bytes(range(256)) * 4, 8, "AAECAwQF", "base64", True),
    ],
)
def test_body_preview(
    body: bytes | None, chars: int, text: str | None, encoding: str | None, truncated: bool
) -> None:
    preview = body_preview(body, chars)
    assert (preview.text, preview.encoding, preview.truncated) == (text, encoding, truncated)
    assert preview.size == (None if body is None else len(body))


def test_a_multibyte_character_cut_by_the_preview_is_left_out() -> None:
    body = ("a" * 10 + "€" * 100).encode()
    preview = body_preview(body, 3)
    assert (preview.text, preview.truncated) == ("aaa", True)
    cut = body_preview(b"abcdefghijkl\xe2\x82", 200)  # a body that ends mid-character
    assert cut.text == "abcdefghijkl\ufffd" and cut.encoding == "utf-8"
