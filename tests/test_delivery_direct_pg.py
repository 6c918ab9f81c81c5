"""Delivery between PostgreSQL brokers without packets (:mod:`airflow_broker.transport.direct`):
which conversations go that way, and that everything else still goes as packets, in the same
pass, exactly once and in order; secure dialogs go sealed and arrive opened, and one that cannot
be opened falls back to packets, which give the sender its Error."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from helpers import CONTRACT, NOTE, ORDER
from sqlalchemy import select, text
from test_dialog_security import MARKER, SECRET, drain, flip_a_byte, secure, send, tq_bodies
from transport_procs import (
    INIT_QUEUE,
    INITIATOR,
    TARGET,
    TARGET_QUEUE,
    Net,
    assert_exactly_once_in_order,
    by_conversation,
    connect_all,
    conversation_ids,
    drain_all,
    host,
    send_dialogs,
    two_way,
)

from airflow_broker import ERROR, Broker
from airflow_broker.constants import ERR_DIALOG_SECURITY
from airflow_broker.security import dialogs
from airflow_broker.security.master_key import MASTER_KEY_ENV, forget_master_key
from airflow_broker.storage import schema as s
from airflow_broker.transport import Transport
from airflow_broker.transport.direct import Conversation
from airflow_broker.transport.packets import Outcome, Packet

pytestmark = [pytest.mark.postgres, pytest.mark.xdist_group("transport")]


@pytest.fixture(autouse=True)
def master_key(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(MASTER_KEY_ENV, "correct horse battery staple")
    forget_master_key()
    dialogs.forget()
    yield
    forget_master_key()
    dialogs.forget()


@pytest.fixture
def net(make_pg_database: Callable[..., str]) -> Iterator[Net]:
    n = connect_all({"a": make_pg_database(), "b": make_pg_database()})
    yield n
    n.close()


class Watched(Transport):
    """Which conversations went without packets, which as packets."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.direct: set[uuid.UUID] = set()
        self.packets: set[uuid.UUID] = set()

    def _send_direct(
        self, address: str, conversations: list[Conversation], plan: dict[str, Any]
    ) -> list[Conversation]:
        left = super()._send_direct(address, conversations, plan)
        self.direct |= {c.conversation_id for c in conversations} - {
            c.conversation_id for c in left
        }
        return left

    def push(self, address: str, packets: Sequence[Packet], depth: int = 0) -> Outcome:
        self.packets |= {p.conversation_id for p in packets}
        return super().push(address, packets, depth)


def test_plain_conversations_go_without_packets_and_validated_ones_as_packets(net: Net) -> None:
    a, b = net["a"], net["b"]
    two_way(net)
    for x in (a, b):
        with x.definitions() as d:
            d.create_message_type(ORDER, validation="json")
            d.create_message_type(NOTE, validation="none")
            d.create_contract(CONTRACT, {ORDER: "initiator", NOTE: "any"})
    host(a, "//svc/Buyer", "buyer_q", [CONTRACT])
    host(b, "//svc/Supplier", "supplier_q", [CONTRACT])
    a.create_route("ToSupplier", "//svc/Supplier", None, "broker://b")
    plain = send_dialogs(a, [5, 12, 3])
    with a.transaction() as tx:
        ordered = tx.begin_dialog("//svc/Buyer", "//svc/Supplier", CONTRACT, encryption=False)
        noted = tx.begin_dialog("//svc/Buyer", "//svc/Supplier", CONTRACT, encryption=False)
        tx.send(ordered, ORDER, body={"n": 0})  # validated here: as packets
        for k in range(4):
            tx.send(noted, NOTE, body={"n": k})  # not validated: without packets
    t = Watched(a)
    report = t.deliver()
    assert report.delivered == report.acknowledged == 5 + 12 + 3 + 1 + 4
    assert a.transmission_queue() == []
    ids = conversation_ids(a, [*plain, ordered, noted])
    assert t.direct == {ids[h] for h in [*plain, noted]}
    assert t.packets == {ids[ordered]}
    got = by_conversation(b, drain_all(b, TARGET_QUEUE))
    expected = {ids[h]: range(c) for h, c in zip(plain, [5, 12, 3], strict=True)}
    assert_exactly_once_in_order(got, expected, "b")
    supplier = by_conversation(b, drain_all(b, "supplier_q"))
    assert [m.json()["n"] for m in supplier[ids[noted]]] == [0, 1, 2, 3]
    assert [m.json()["n"] for m in supplier[ids[ordered]]] == [0]
    # Both sides bound to each other, as acknowledgments bind them.
    with a.engine.connect() as conn:
        bound = conn.execute(
            text("SELECT DISTINCT far_broker_instance FROM broker_conversation_endpoint")
        ).scalars()
        assert set(bound) == {b.instance_id}


def secure_pair(net: Net) -> tuple[Broker, Broker]:
    """``a`` (east) and ``b`` (west) as test_dialog_security's pair, on PostgreSQL."""
    east, west = net["a"], net["b"]
    host(east, INITIATOR, INIT_QUEUE)
    host(west, TARGET, TARGET_QUEUE)
    east.create_route("ToWest", TARGET, None, "broker://b")
    west.create_route("ToEast", INITIATOR, east.instance_id, "broker://a")
    secure(east, west)
    return east, west


def test_a_secure_dialog_goes_sealed_without_packets_and_arrives_opened(net: Net) -> None:
    east, west = secure_pair(net)
    h = send(east, 3)
    assert all(MARKER not in body for body in tq_bodies(east))
    t = Watched(east)
    assert t.deliver().delivered == 3
    assert t.packets == set() and len(t.direct) == 1
    with west.engine.connect() as conn:
        keys = conn.execute(select(s.dialog_key.c.conversation_handle)).scalars().all()
    assert len(keys) == 1  # the target agreed the session key from the key exchange
    with east.transaction() as tx:
        for k in range(3, 5):
            tx.send(h, body={**SECRET, "k": k})
    t = Watched(east)
    assert t.deliver().delivered == 2  # the endpoint there has the key now
    assert t.packets == set()
    got = drain(west, TARGET_QUEUE)
    assert [m.json() for m in got] == [{**SECRET, "k": k} for k in range(5)]
    # The reply goes back sealed the same way.
    with west.transaction() as tx:
        tx.send(got[0].conversation_handle, body={"reply": 1})
    back = Watched(west)
    assert back.deliver().delivered == 1
    assert back.packets == set()
    assert [m.json() for m in drain(east, INIT_QUEUE)] == [{"reply": 1}]


def test_a_secure_body_altered_on_the_way_goes_as_packets_and_the_sender_gets_an_error(
    net: Net,
) -> None:
    east, west = secure_pair(net)
    send(east, 2)
    flip_a_byte(east)
    watched = Watched(east)
    watched.deliver()
    assert watched.direct == set() and len(watched.packets) == 1
    assert all(m.message_type_name == ERROR for m in drain(west, TARGET_QUEUE))
    errors = [m for m in drain(east, INIT_QUEUE) if m.message_type_name == ERROR]
    assert len(errors) == 1
    code, description = errors[0].error
    assert code == ERR_DIALOG_SECURITY and "integrity check" in description
