"""ALTER and DROP as Service Broker does them, on both engines.

- ALTER MESSAGE TYPE: the new validation applies to what is sent from then on.
- ALTER SERVICE: ON QUEUE moves the service's conversations and the messages waiting in them (an
  endpoint that shared its group with another service's gets a group of its own); contracts
  added or dropped decide what new dialogs may use, while dialogs already begun go on.
- ALTER ROUTE and ALTER BROKER PRIORITY: only what is given changes; a priority applies to the
  conversations begun afterwards.
- DROP SERVICE: each open conversation of the service ends WITH ERROR first, so that the far side
  gets an Error and goes to ER, in this database at once and in another broker database by
  ``deliver()``, whose Error rows outlive the dropped service's endpoints.

Every refusal is checked to leave nothing half-written, and each verb's races with writers and
readers on PostgreSQL (the lock order of ``airflow_broker.messaging``) at the end.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
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
    begin,
    declare_pair,
    drain,
    open_order,
    receive,
    send,
)
from races import race
from sqlalchemy import select
from transport_procs import (
    INIT_QUEUE,
    INITIATOR,
    TARGET,
    TARGET_QUEUE,
    Net,
    drain_all,
    endpoints,
    pump,
    two_way,
)

from airflow_broker import (
    DEFAULT,
    END_DIALOG,
    ERROR,
    Broker,
    ConversationEnded,
    InvalidDefinition,
    MessageValidationError,
    ObjectExists,
    Transaction,
    UnknownObject,
)
from airflow_broker.constants import ERR_CONTRACT_NOT_SUPPORTED, ERR_SERVICE_DROPPED
from airflow_broker.messaging.definitions import Definitions
from airflow_broker.messaging.objects import MessageTypeDef, PriorityDef, RouteDef, ServiceDef
from airflow_broker.storage import schema as s

QUEUE2 = "supplier_queue2"


@pytest.fixture
def pair(broker: Broker) -> Broker:
    declare_pair(broker)
    return broker


def named(name: str) -> str:
    """A ``pytest.raises(match=...)`` pattern: the error message names ``name``."""
    return re.escape(name)


def state(broker: Broker, handle: uuid.UUID) -> str:
    with broker.transaction() as tx:
        return tx.conversation(handle).state


def snapshot(broker: Broker) -> tuple[Any, ...]:
    """Every definition, endpoint and message: what a refused verb must leave as it was."""
    e, m = s.conversation_endpoint, s.message
    with broker.engine.connect() as conn:
        eps = conn.execute(
            select(
                e.c.conversation_handle, e.c.queue_id, e.c.conversation_group_id, e.c.state
            ).order_by(e.c.conversation_handle)
        ).all()
        msgs = conn.execute(
            select(m.c.queuing_order, m.c.queue_id, m.c.conversation_group_id).order_by(
                m.c.queuing_order
            )
        ).all()
        groups = conn.execute(select(s.conversation_group).order_by("conversation_group_id")).all()
    return broker.catalog(), eps, msgs, groups


def service_endpoints(broker: Broker, service: str) -> dict[uuid.UUID, str]:
    return {h: ep.state for h, ep in endpoints(broker).items() if ep.service_name == service}


# ---------------------------------------------------------------------------------------------
# ALTER MESSAGE TYPE
# ---------------------------------------------------------------------------------------------


def test_alter_message_type_validates_what_is_sent_from_now_on(pair: Broker) -> None:
    h, _ = open_order(pair)
    with pytest.raises(MessageValidationError):
        send(pair, h, ORDER, "not json")
    send(pair, h, ORDER, {"order": 2})

    pair.alter_message_type(ORDER, validation="none")  # off in production (seed 004)
    assert pair.catalog().message_types[ORDER] == MessageTypeDef(ORDER, "none", None)
    send(pair, h, ORDER, "not json")
    schema = {"type": "object", "required": ["order"]}
    pair.alter_message_type(ORDER, validation="json_schema", json_schema=schema)
    assert pair.catalog().message_types[ORDER] == MessageTypeDef(ORDER, "json_schema", schema)
    with pytest.raises(MessageValidationError, match="JSON schema"):
        send(pair, h, ORDER, {"qty": 1})
    send(pair, h, ORDER, {"order": 3})

    # What was sent before each change keeps the validation it was sent with.
    got = drain(pair, SUPPLIER_QUEUE)
    assert [(m.message_body, m.validation) for m in got] == [
        (b'{"order":2}', "J"),
        (b"not json", "N"),
        (b'{"order":3}', "S"),
    ]


def test_alter_message_type_refusals_leave_it_as_it_was(pair: Broker) -> None:
    before = snapshot(pair)
    with pytest.raises(UnknownObject, match=named("//po/Nope")):
        pair.alter_message_type("//po/Nope", validation="none")
    with pytest.raises(InvalidDefinition, match=named(DEFAULT)):
        pair.alter_message_type(DEFAULT, validation="json")
    with pytest.raises(InvalidDefinition, match=named(ORDER)):
        pair.alter_message_type(ORDER, validation="xml_schema_collection")
    with pytest.raises(InvalidDefinition, match=named(ORDER)):
        pair.alter_message_type(ORDER, validation="json_schema")  # no schema
    with pytest.raises(InvalidDefinition, match=named(ORDER)):
        pair.alter_message_type(ORDER, validation="json", json_schema={"type": "object"})
    with pytest.raises(RuntimeError), pair.definitions() as d:
        d.alter_message_type(ORDER, validation="none")
        raise RuntimeError("changed my mind")
    assert snapshot(pair) == before


# ---------------------------------------------------------------------------------------------
# ALTER SERVICE
# ---------------------------------------------------------------------------------------------


def test_alter_service_moves_conversations_and_waiting_messages_to_the_new_queue(
    pair: Broker,
) -> None:
    h, t = open_order(pair)
    send(pair, h, ORDER, {"order": 2}, {"order": 3})  # waiting in supplier_queue
    pair.create_queue(QUEUE2)

    pair.alter_service(SUPPLIER, queue=QUEUE2)

    assert pair.catalog().services[SUPPLIER] == ServiceDef(SUPPLIER, QUEUE2, (CONTRACT,))
    assert receive(pair, SUPPLIER_QUEUE) == []
    with pair.transaction() as tx:
        assert tx.conversation(t).queue_name == QUEUE2
        got = tx.receive(QUEUE2)
        assert [m.json() for m in got] == [{"order": 2}, {"order": 3}]
        assert {m.conversation_handle for m in got} == {t}
        tx.send(t, INVOICE, {"total": 5})  # the moved endpoint answers as before
    assert [m.json() for m in receive(pair, BUYER_QUEUE)] == [{"total": 5}]
    send(pair, h, NOTE, "after the move")
    assert [m.message_body for m in receive(pair, QUEUE2)] == [b"after the move"]
    # A dialog begun afterwards opens on the new queue.
    h2 = begin(pair)
    send(pair, h2, ORDER, {"order": 4})
    [first] = receive(pair, QUEUE2)
    assert first.json() == {"order": 4}
    assert pair.check() == []


def test_alter_service_gives_endpoints_in_a_shared_group_a_group_of_their_own(
    pair: Broker,
) -> None:
    """A conversation group belongs to one queue. The supplier's endpoint shares its group with
    another service's (BEGIN DIALOG ... RELATED_CONVERSATION): moving the supplier leaves that
    group, with the other service's conversation, where it was."""
    pair.create_service("//po/Warehouse", queue=SUPPLIER_QUEUE, contracts=[CONTRACT])
    _, t = open_order(pair)
    with pair.transaction() as tx:
        shared = tx.conversation(t).conversation_group_id
        w = tx.begin_dialog("//po/Warehouse", SUPPLIER, CONTRACT, related_conversation=t)
        tx.send(w, ORDER, {"order": "from the warehouse"})
        assert tx.conversation(w).conversation_group_id == shared
    # The supplier now has two endpoints: t (shared group) and the target of w (own group).
    pair.create_queue(QUEUE2)

    pair.alter_service(SUPPLIER, queue=QUEUE2)

    with pair.transaction() as tx:
        moved, stayed = tx.conversation(t), tx.conversation(w)
        assert (moved.queue_name, stayed.queue_name) == (QUEUE2, SUPPLIER_QUEUE)
        assert stayed.conversation_group_id == shared
        assert moved.conversation_group_id != shared
        [order] = tx.receive(QUEUE2)
        assert order.json() == {"order": "from the warehouse"}
        assert tx.conversation(order.conversation_handle).queue_name == QUEUE2
    assert pair.check() == []


def test_alter_service_releases_messages_that_waited_for_its_disabled_queue(pair: Broker) -> None:
    h, _ = open_order(pair)
    pair.alter_queue(SUPPLIER_QUEUE, status=False)
    send(pair, h, ORDER, {"order": 2})
    [waiting] = pair.transmission_queue()
    assert "disabled" in waiting.transmission_status
    pair.create_queue(QUEUE2)

    pair.alter_service(SUPPLIER, queue=QUEUE2)
    assert pair.run_due().transmissions_delivered == 1

    assert pair.transmission_queue() == []
    assert [m.json() for m in receive(pair, QUEUE2)] == [{"order": 2}]
    assert pair.check() == []


def test_alter_service_contracts_apply_to_new_dialogs_only(pair: Broker) -> None:
    pair.create_contract("//po/NoteContract", {NOTE: "any"})
    h, t = open_order(pair)  # begun on CONTRACT

    pair.alter_service(SUPPLIER, add_contracts=["//po/NoteContract"], drop_contracts=[CONTRACT])

    assert pair.catalog().services[SUPPLIER].contracts == ("//po/NoteContract",)
    # The dialog begun on the dropped contract goes on, both ways.
    send(pair, h, ORDER, {"order": 2})
    with pair.transaction() as tx:
        [order] = tx.receive(SUPPLIER_QUEUE)
        tx.send(t, INVOICE, {"total": 1})
    assert order.json() == {"order": 2}
    assert [m.json() for m in receive(pair, BUYER_QUEUE)] == [{"total": 1}]
    # A new dialog on it is refused by the target, as Service Broker refuses it.
    refused = begin(pair)
    send(pair, refused, ORDER, {"order": 3})
    [error] = receive(pair, BUYER_QUEUE)
    assert (error.conversation_handle, error.message_type_name) == (refused, ERROR)
    assert error.error is not None and error.error[0] == ERR_CONTRACT_NOT_SUPPORTED
    # The added contract is accepted.
    with pair.transaction() as tx:
        n = tx.begin_dialog(BUYER, SUPPLIER, "//po/NoteContract")
        tx.send(n, NOTE, "hello")
    [note] = receive(pair, SUPPLIER_QUEUE)
    assert (note.message_body, note.service_contract_name) == (b"hello", "//po/NoteContract")


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"queue": "no_queue"}, UnknownObject, "no_queue"),
        ({"queue": QUEUE2, "add_contracts": ["//po/Missing"]}, UnknownObject, "//po/Missing"),
        ({"drop_contracts": ["//po/Missing"]}, UnknownObject, "//po/Missing"),
        ({"queue": QUEUE2, "drop_contracts": [DEFAULT]}, InvalidDefinition, DEFAULT),
        ({"queue": QUEUE2, "add_contracts": [CONTRACT]}, InvalidDefinition, CONTRACT),
        (
            {"add_contracts": [DEFAULT], "drop_contracts": [DEFAULT]},
            InvalidDefinition,
            DEFAULT,
        ),
        ({"queue": QUEUE2, "add_contracts": [DEFAULT, 7]}, InvalidDefinition, "7"),
    ],
    ids=[
        "unknown-queue",
        "unknown-contract-to-add",
        "unknown-contract-to-drop",
        "drop-one-it-lacks",
        "add-one-it-has",
        "add-and-drop",
        "not-a-name",
    ],
)
def test_alter_service_refusals_write_nothing(
    pair: Broker, kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    """Everything is checked before anything is written: even a caller that catches the error
    inside its definitions block and commits finds the service, its conversations and their
    messages as they were."""
    h, _ = open_order(pair)
    send(pair, h, ORDER, {"order": 2})
    pair.create_queue(QUEUE2)
    before = snapshot(pair)
    with pytest.raises(error, match=named(name)):
        pair.alter_service(SUPPLIER, **kwargs)
    with pair.definitions() as d:
        with pytest.raises(error, match=named(name)):
            d.alter_service(SUPPLIER, **kwargs)
        d.create_queue("committed_with_it")
    after = snapshot(pair)
    assert after[1:] == before[1:]
    assert after[0].services == before[0].services
    with pytest.raises(UnknownObject, match=named("//po/Nope")):
        pair.alter_service("//po/Nope", queue=QUEUE2)


# ---------------------------------------------------------------------------------------------
# ALTER ROUTE, ALTER BROKER PRIORITY
# ---------------------------------------------------------------------------------------------

WEST = "2f1e8a5c-4d7b-4e0e-9a44-9a0e5f7c1b11"


def test_alter_route_changes_only_what_is_given(broker: Broker) -> None:
    broker.create_route(
        "to_west", service_name="//po/Supplier", address="broker://west", lifetime_seconds=60
    )
    expires = broker.catalog().routes["to_west"].expires_at

    broker.alter_route("to_west", broker_instance=WEST.upper(), mirror_address="broker://west2")
    assert broker.catalog().routes["to_west"] == RouteDef(
        "to_west", "//po/Supplier", WEST, "broker://west", "broker://west2", expires
    )
    before = datetime.now(UTC)
    broker.alter_route("to_west", service_name=None, lifetime_seconds=3600)
    route = broker.catalog().routes["to_west"]
    assert (route.service_name, route.address, route.mirror_address) == (
        None,
        "broker://west",
        "broker://west2",
    )
    assert route.expires_at is not None
    assert before + timedelta(seconds=3599) <= route.expires_at
    broker.alter_route("to_west", mirror_address=None, address="TRANSPORT", lifetime_seconds=None)
    assert broker.catalog().routes["to_west"] == RouteDef(
        "to_west", None, WEST, "TRANSPORT", None, None
    )
    broker.alter_route("to_west")  # nothing given: nothing changes
    assert broker.catalog().routes["to_west"].address == "TRANSPORT"


def test_alter_route_refusals_leave_it_as_it_was(broker: Broker) -> None:
    broker.create_route(
        "to_west", service_name="//po/Supplier", broker_instance=WEST, address="broker://west"
    )
    broker.alter_route("to_west", mirror_address="broker://west2")
    before = broker.catalog()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"address": "LOCAL"}, "mirror_address"),  # the mirror needs a broker:// address
        ({"broker_instance": None}, "broker_instance"),  # ... and the mirrored pair's id
        ({"address": "postgresql://u:pw@db/x"}, "broker://NAME"),
        ({"mirror_address": "west3"}, "mirror_address"),
        ({"broker_instance": "not-a-uuid"}, "broker_instance"),
        ({"lifetime_seconds": 0}, "lifetime_seconds"),
        ({"service_name": ""}, "route service"),
    ]
    for kwargs, says in cases:
        with pytest.raises(InvalidDefinition, match=named(says)) as raised:
            broker.alter_route("to_west", **kwargs)
        if "route service" not in says:
            assert "to_west" in str(raised.value)
    with pytest.raises(UnknownObject, match=named("nope_route")):
        broker.alter_route("nope_route", address="LOCAL")
    assert broker.catalog() == before


def test_alter_priority_applies_to_conversations_begun_afterwards(pair: Broker) -> None:
    pair.create_priority("rush", contract=CONTRACT, priority=8)
    h_before, t_before = open_order(pair)

    pair.alter_priority("rush", local_service=BUYER, priority=3)
    assert pair.catalog().priorities["rush"] == PriorityDef("rush", CONTRACT, BUYER, None, 3)
    h_after, t_after = open_order(pair)
    with pair.transaction() as tx:
        assert [tx.conversation(x).priority for x in (h_before, t_before)] == [8, 8]
        # The buyer's side matches (local service BUYER); the supplier's does not: default 5.
        assert [tx.conversation(x).priority for x in (h_after, t_after)] == [3, 5]

    pair.alter_priority("rush", contract=None, local_service=None, remote_service=BUYER)
    assert pair.catalog().priorities["rush"] == PriorityDef("rush", None, None, BUYER, 3)
    pair.alter_priority("rush")
    assert pair.catalog().priorities["rush"].priority == 3


def test_alter_priority_refusals_leave_it_as_it_was(pair: Broker) -> None:
    pair.create_priority("rush", contract=CONTRACT, priority=8)
    before = pair.catalog()
    for level in (0, 11, True, "9"):
        with pytest.raises(InvalidDefinition, match=named("rush")):
            pair.alter_priority("rush", priority=level)
    with pytest.raises(UnknownObject, match=named("//po/NoContract")):
        pair.alter_priority("rush", contract="//po/NoContract", priority=9)
    with pytest.raises(UnknownObject, match=named("//po/NoService")):
        pair.alter_priority("rush", local_service="//po/NoService")
    with pytest.raises(UnknownObject, match=named("nope_priority")):
        pair.alter_priority("nope_priority", priority=2)
    assert pair.catalog() == before
    with pytest.raises(ObjectExists), pair.definitions() as d:
        d.alter_priority("rush", priority=1)
        d.create_priority("rush")
    assert pair.catalog() == before


# ---------------------------------------------------------------------------------------------
# DROP SERVICE
# ---------------------------------------------------------------------------------------------


def test_drop_service_tells_the_far_side_in_this_database(pair: Broker) -> None:
    h, t = open_order(pair)
    send(pair, h, ORDER, {"order": 2})  # waits in the supplier's queue

    pair.drop_service(SUPPLIER)

    [error] = receive(pair, BUYER_QUEUE)
    assert (error.conversation_handle, error.message_type_name) == (h, ERROR)
    assert error.error == (ERR_SERVICE_DROPPED, f"service {SUPPLIER!r} has been dropped")
    assert state(pair, h) == "ER"
    with pytest.raises(ConversationEnded):
        send(pair, h, NOTE, "anyone there?")
    assert service_endpoints(pair, SUPPLIER) == {}  # nothing left to wait for: all removed
    assert t not in endpoints(pair)
    assert receive(pair, SUPPLIER_QUEUE) == []
    assert pair.transmission_queue() == []
    assert pair.check() == []
    with pair.transaction() as tx:
        tx.end_conversation(h)
    assert state(pair, h) == "CD"


def test_drop_service_of_the_initiator_tells_the_target(pair: Broker) -> None:
    h, t = open_order(pair)
    silent = begin(pair)  # begun, nothing sent: the supplier never heard of it

    pair.drop_service(BUYER)

    [error] = receive(pair, SUPPLIER_QUEUE)
    assert (error.conversation_handle, error.error) == (
        t,
        (ERR_SERVICE_DROPPED, f"service {BUYER!r} has been dropped"),
    )
    assert state(pair, t) == "ER"
    assert {h, silent} & set(endpoints(pair)) == set()
    assert pair.check() == []


def test_drop_service_ends_each_conversation_as_its_state_requires(pair: Broker) -> None:
    """CO: WITH ERROR. DI (the far side ended first): a plain END, which closes the far side.
    ER: a plain END, nothing to tell. DO (this side ended first): already ended; the endpoint
    stays until the far side ends too."""
    co, _ = open_order(pair)
    di, _ = open_order(pair)
    er, _ = open_order(pair)
    do, do_t = open_order(pair)
    with pair.transaction() as tx:
        tx.end_conversation(di)
        tx.end_conversation(er, error_code=50001, error_description="cancelled")
        tx.end_conversation(do_t)
    drain(pair, BUYER_QUEUE)  # the EndDialog of `do`
    assert [state(pair, x) for x in (co, di, er, do)] == ["CO", "DO", "CD", "DI"]

    pair.drop_service(SUPPLIER)

    assert [state(pair, x) for x in (co, di, er, do)] == ["ER", "CD", "CD", "DI"]
    got = drain(pair, BUYER_QUEUE)
    assert [(m.conversation_handle, m.message_type_name) for m in got] == [(co, ERROR)]
    assert service_endpoints(pair, SUPPLIER) == {do_t: "DO"}
    assert receive(pair, SUPPLIER_QUEUE) == []
    assert pair.check() == []  # the kept endpoint has ended: it needs no service

    with pair.transaction() as tx:
        tx.end_conversation(do)  # the far side ends too: the kept endpoint closes
    assert service_endpoints(pair, SUPPLIER) == {do_t: "CD"}
    assert pair.check() == []


def test_drop_service_of_a_service_talking_to_itself(broker: Broker) -> None:
    broker.create_queue("q")
    broker.create_service("//t/Self", queue="q", contracts=[DEFAULT])
    with broker.transaction() as tx:
        h = tx.begin_dialog("//t/Self", "//t/Self")
        tx.send(h, body=b"to myself")
    broker.drop_service("//t/Self")
    assert endpoints(broker) == {}
    assert receive(broker, "q") == []
    assert broker.check() == []
    broker.drop_queue("q")


def test_a_drop_service_that_rolls_back_tells_no_one(pair: Broker) -> None:
    h, _ = open_order(pair)
    before = snapshot(pair)
    with pytest.raises(RuntimeError), pair.definitions() as d:
        d.drop_service(SUPPLIER)
        raise RuntimeError("changed my mind")
    assert snapshot(pair) == before
    assert receive(pair, BUYER_QUEUE) == []
    assert state(pair, h) == "CO"
    with pytest.raises(UnknownObject, match=named("//po/Nope")):
        pair.drop_service("//po/Nope")


# -- in another broker database -----------------------------------------------------------------

Network = Callable[..., Net]


def _dialog_between(net: Net) -> tuple[Broker, Broker, uuid.UUID, uuid.UUID]:
    """An initiator in A and a target in B, one message delivered: (a, b, initiator handle,
    target handle)."""
    two_way(net)
    a, b = net["a"], net["b"]
    with a.transaction() as tx:
        h = tx.begin_dialog(INITIATOR, TARGET, encryption=False)
        tx.send(h, body=b"hello")
    pump([a, b])
    [hello] = drain_all(b, TARGET_QUEUE)
    return a, b, h, hello.conversation_handle


@pytest.mark.timeout(120)
def test_drop_service_tells_the_far_side_in_another_broker_database(network: Network) -> None:
    a, b, h, t = _dialog_between(network("a", "b"))

    b.drop_service(TARGET)

    # The Error waits in B's transmission queue; its endpoint stays, closed, for delivery.
    assert [(r.conversation_handle, r.message_type_name) for r in b.transmission_queue()] == [
        (t, ERROR)
    ]
    assert endpoints(b)[t].state == "CD"
    assert b.check() == []
    b.deliver()
    assert b.transmission_queue() == []
    [error] = drain_all(a, INIT_QUEUE)
    assert (error.conversation_handle, error.message_type_name) == (h, ERROR)
    assert error.error == (ERR_SERVICE_DROPPED, f"service {TARGET!r} has been dropped")
    assert state(a, h) == "ER"
    with a.transaction() as tx:
        tx.end_conversation(h)
    pump([a, b])
    assert state(a, h) == "CD"
    assert drain_all(b, TARGET_QUEUE) == []
    assert a.check() == [] and b.check() == []


@pytest.mark.timeout(120)
def test_drop_service_of_the_initiator_tells_a_target_in_another_broker_database(
    network: Network,
) -> None:
    a, b, h, t = _dialog_between(network("a", "b"))
    with a.transaction() as tx:
        tx.send(h, body=b"one more")  # not delivered yet: WITH ERROR drops it, as END does

    a.drop_service(INITIATOR)

    assert [r.message_type_name for r in a.transmission_queue()] == [ERROR]
    assert endpoints(a)[h].state == "CD"
    pump([a, b])
    got = drain_all(b, TARGET_QUEUE)
    assert [(m.conversation_handle, m.message_type_name) for m in got] == [(t, ERROR)]
    assert got[0].error == (ERR_SERVICE_DROPPED, f"service {INITIATOR!r} has been dropped")
    assert state(b, t) == "ER"
    assert a.check() == [] and b.check() == []


# ---------------------------------------------------------------------------------------------
# Races (PostgreSQL): the lock order holds for ALTER and DROP SERVICE
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def pg_pair(pg_broker: Broker) -> Broker:
    declare_pair(pg_broker)
    return pg_broker


@pytest.mark.postgres
def test_drop_service_waits_for_the_reader_that_holds_a_conversation_group(
    pg_pair: Broker,
) -> None:
    """Rule 0: DROP SERVICE takes the groups before the endpoints, as END does, so a reader
    that received on one of the service's conversations and answers on it finishes first."""
    h, t = open_order(pg_pair)
    send(pg_pair, h, ORDER, {"order": 2})

    def reader(tx: Transaction) -> object:
        return tx.receive(SUPPLIER_QUEUE)

    def answers(tx: Transaction) -> None:
        tx.send(t, NOTE, "on it")

    def drop(tx: Transaction) -> None:
        Definitions(pg_pair, tx.connection).drop_service(SUPPLIER)

    got, dropped = race(pg_pair, reader, drop, then=answers)
    assert not isinstance(got, Exception), got
    assert dropped is None, dropped
    at_buyer = drain(pg_pair, BUYER_QUEUE)
    assert sorted(m.message_type_name for m in at_buyer) == sorted([NOTE, ERROR])
    assert state(pg_pair, h) == "ER"
    assert pg_pair.check() == []


@pytest.mark.postgres
@pytest.mark.parametrize("writer_first", [True, False], ids=["writer-first", "alter-first"])
@pytest.mark.parametrize("writer", ["send", "end"])
def test_a_writer_racing_alter_service_files_its_message_in_the_new_queue(
    pg_pair: Broker, writer: str, writer_first: bool
) -> None:
    h, t = open_order(pg_pair)
    pg_pair.create_queue(QUEUE2)

    def write(tx: Transaction) -> None:
        if writer == "send":
            tx.send(h, NOTE, "racing the move")
        else:
            tx.end_conversation(h)

    def alter(tx: Transaction) -> None:
        Definitions(pg_pair, tx.connection).alter_service(SUPPLIER, queue=QUEUE2)

    first, second = race(pg_pair, write, alter) if writer_first else race(pg_pair, alter, write)
    assert first is None and second is None, (first, second)
    pg_pair.run_due()  # an EndDialog that waited for the far endpoint goes now
    assert receive(pg_pair, SUPPLIER_QUEUE) == []
    [got] = receive(pg_pair, QUEUE2)
    assert got.conversation_handle == t
    assert got.message_type_name == (NOTE if writer == "send" else END_DIALOG)
    assert pg_pair.check() == []
