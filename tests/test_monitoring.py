"""The engine side of the monitoring API (airflow_broker.operations.monitoring), on SQLite and
PostgreSQL.

No Airflow here: the functions take a Broker and return plain values; the HTTP layer over them
is tested in test_plugin_api.py.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import timedelta

import pytest
from helpers import (
    BUYER,
    BUYER_QUEUE,
    CONTRACT,
    NOTE,
    ORDER,
    SUPPLIER,
    SUPPLIER_QUEUE,
    begin,
    declare_pair,
    open_order,
    receive,
    send,
)
from sqlalchemy import Table, func, select, update

from airflow_broker import Broker, InvalidDefinition, UnknownObject
from airflow_broker.activation import finish_reader, register_reader
from airflow_broker.constants import DEFAULT, POISON_THRESHOLD
from airflow_broker.operations import echo
from airflow_broker.operations import monitoring as mon
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow

REMOTE = "//remote/Nowhere"


class ReaderFailed(Exception):
    """A reader's work failed: its transaction rolls back."""


@pytest.fixture(autouse=True)
def pair(broker: Broker) -> None:
    declare_pair(broker)


def poison(broker: Broker, queue: str = SUPPLIER_QUEUE) -> None:
    """Roll back receiving transactions until poison handling disables ``queue``."""
    for _ in range(POISON_THRESHOLD):
        with pytest.raises(ReaderFailed), broker.transaction() as tx:
            assert tx.receive(queue, top=1)
            raise ReaderFailed


def to_remote(broker: Broker, *bodies: str) -> uuid.UUID:
    """A dialog to a service no route reaches: its messages wait in the transmission queue."""
    with broker.transaction() as tx:
        h = tx.begin_dialog(BUYER, REMOTE, contract=DEFAULT)
        for body in bodies:
            tx.send(h, DEFAULT, body)
    return h


def backed_off(broker: Broker) -> None:
    """Every waiting message's next attempt is an hour away (as after many failures)."""
    with broker.engine.begin() as conn:
        conn.execute(
            update(s.transmission_queue).values(next_attempt_at=utcnow() + timedelta(hours=1))
        )


def count(broker: Broker, table: Table) -> int:
    with broker.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def by_name(items: list[mon.QueueInfo]) -> dict[str, mon.QueueInfo]:
    return {q.name: q for q in items}


# -- queues -----------------------------------------------------------------------------------


def test_queues_show_depth_oldest_message_groups_and_readers(broker: Broker) -> None:
    for i in range(3):
        send(broker, begin(broker), ORDER, {"po": i})
    time.sleep(0.02)
    reader_id, admitted = register_reader(broker, SUPPLIER_QUEUE, max_readers=5, label="run-1")
    assert admitted

    queues = by_name(mon.queues(broker))
    assert list(queues) == sorted(queues)
    supplier = queues[SUPPLIER_QUEUE]
    assert (supplier.depth, supplier.groups_ready) == (3, 3)
    assert supplier.oldest_age_seconds is not None and supplier.oldest_age_seconds > 0
    assert supplier.oldest_enqueued_at is not None
    assert (supplier.status, supplier.enabled) == ("enabled", True)
    assert (supplier.readers_running, supplier.readers_starting) == (1, 0)
    assert supplier.services == [SUPPLIER]
    assert (supplier.poison_events, supplier.last_poison_event) == (0, None)
    buyer = queues[BUYER_QUEUE]
    assert (buyer.depth, buyer.oldest_age_seconds, buyer.readers_running) == (0, None, 0)

    finish_reader(broker, reader_id)
    assert by_name(mon.queues(broker))[SUPPLIER_QUEUE].readers_running == 0
    detail = mon.queue(broker, SUPPLIER_QUEUE)
    assert detail.queue.depth == 3
    [reader] = detail.readers
    assert (reader.reader_id, reader.state, reader.outcome, reader.label) == (
        reader_id,
        "finished",
        "drained",
        "run-1",
    )


def test_a_poisoned_queue_shows_its_event_and_is_re_enabled(broker: Broker) -> None:
    send(broker, begin(broker), NOTE, "poison")
    poison(broker)

    supplier = by_name(mon.queues(broker))[SUPPLIER_QUEUE]
    assert (supplier.status, supplier.enabled, supplier.depth) == ("disabled", False, 1)
    assert supplier.poison_events == 1
    assert supplier.last_poison_event is not None
    assert "poison message handling" in supplier.last_poison_event.detail
    assert by_name(mon.queues(broker))[BUYER_QUEUE].poison_events == 0
    assert [e.id for e in mon.queue(broker, SUPPLIER_QUEUE).poison_events] == [
        supplier.last_poison_event.id
    ]
    assert mon.overview(broker).queues_disabled == 1
    # An operator disabling a queue is not a poison event.
    broker.alter_queue(BUYER_QUEUE, status=False)
    assert by_name(mon.queues(broker))[BUYER_QUEUE].poison_events == 0
    broker.alter_queue(BUYER_QUEUE, status=True)

    done = mon.enable_queue(broker, SUPPLIER_QUEUE, actor="alice")
    assert (done.changed, done.target) == (True, SUPPLIER_QUEUE)
    supplier = by_name(mon.queues(broker))[SUPPLIER_QUEUE]
    assert (supplier.enabled, supplier.rollback_count, supplier.depth) == (True, 0, 1)
    assert supplier.poison_events == 1  # history stays
    [action] = mon.events(broker, event=mon.OPERATOR_ACTION).items
    assert (action.object_name, action.detail) == (
        SUPPLIER_QUEUE,
        f"alice: re-enabled queue {SUPPLIER_QUEUE!r}",
    )
    assert [m.message_body for m in receive(broker, SUPPLIER_QUEUE)] == [b"poison"]

    again = mon.enable_queue(broker, SUPPLIER_QUEUE, actor="alice")
    assert again.changed is False
    assert mon.events(broker, event=mon.OPERATOR_ACTION).total == 1


def test_unknown_queue_is_named(broker: Broker) -> None:
    before = mon.events(broker).total
    with pytest.raises(UnknownObject, match="queue 'NoSuchQueue' does not exist"):
        mon.queue(broker, "NoSuchQueue")
    with pytest.raises(UnknownObject, match="NoSuchQueue"):
        mon.enable_queue(broker, "NoSuchQueue")
    with pytest.raises(UnknownObject, match="NoSuchQueue"):
        mon.conversations(broker, queue="NoSuchQueue")
    with pytest.raises(UnknownObject, match="NoSuchQueue"):
        mon.conversation_states(broker, queue="NoSuchQueue")
    assert mon.events(broker).total == before


# -- services, contracts, routes --------------------------------------------------------------


def test_services_and_contracts(broker: Broker) -> None:
    open_order(broker)
    services = {svc.name: svc for svc in mon.services(broker)}
    assert set(services) == {BUYER, SUPPLIER}
    assert (services[BUYER].queue, services[BUYER].contracts) == (BUYER_QUEUE, [CONTRACT])
    assert (services[BUYER].conversations, services[SUPPLIER].conversations) == (1, 1)
    assert services[BUYER].routing_service is False

    contracts = {c.name: c for c in mon.contracts(broker)}
    assert {CONTRACT, DEFAULT} <= set(contracts)
    po = contracts[CONTRACT]
    assert po.message_types == {ORDER: "initiator", "//po/Invoice": "target", NOTE: "any"}
    assert po.validation == {ORDER: "json", "//po/Invoice": "json", NOTE: "none"}
    assert po.services == [BUYER, SUPPLIER]


def test_routes_show_kind_and_expiry(broker: Broker) -> None:
    broker.create_route("to_west", service_name=REMOTE, address="broker://west")
    broker.create_route("old", service_name=REMOTE, address="TRANSPORT", lifetime_seconds=3600)
    with broker.engine.begin() as conn:
        conn.execute(
            update(s.route)
            .where(s.route.c.name == "old")
            .values(expires_at=utcnow() - timedelta(seconds=5))
        )
    routes = {r.name: r for r in mon.routes(broker)}
    assert (routes["AutoCreatedLocal"].kind, routes["AutoCreatedLocal"].expired) == (
        "local",
        False,
    )
    assert (routes["to_west"].kind, routes["to_west"].address) == ("broker", "broker://west")
    assert (routes["old"].kind, routes["old"].expired) == ("transport", True)


# -- conversations ----------------------------------------------------------------------------


def test_conversations_by_state_with_filters_and_paging(broker: Broker) -> None:
    opened = [open_order(broker) for _ in range(3)]  # (initiator, target) pairs, conversing
    ended, _ = opened[0]
    with broker.transaction() as tx:
        tx.end_conversation(ended)  # this side waits for the far END (DO); the far side: DI
    remote = to_remote(broker, "hello")

    states = {c.state: c.count for c in mon.conversation_states(broker)}
    assert states == {"SO": 0, "SI": 0, "CO": 5, "DI": 1, "DO": 1, "ER": 0, "CD": 0}
    assert {c.state: c.count for c in mon.conversation_states(broker, queue=SUPPLIER_QUEUE)}[
        "DI"
    ] == 1

    page = mon.conversations(broker)
    assert (page.total, page.offset, page.next_offset) == (7, 0, None)
    created = [c.created_at for c in page.items]
    assert created == sorted(created, reverse=True)  # newest first
    assert page.items[0].conversation_handle == remote
    assert page.items[0].transmissions_waiting == 1

    conversing = mon.conversations(broker, state="CONVERSING")  # a description works too
    assert conversing.total == 5 and {c.state for c in conversing.items} == {"CO"}
    assert mon.conversations(broker, state="do").items[0].conversation_handle == ended
    suppliers = mon.conversations(broker, queue=SUPPLIER_QUEUE)
    assert suppliers.total == 3 and {c.service_name for c in suppliers.items} == {SUPPLIER}
    assert mon.conversations(broker, service=BUYER).total == 4
    assert mon.conversations(broker, far_service=REMOTE).total == 1
    assert mon.conversations(broker, is_initiator=False).total == 3
    assert mon.conversations(broker, state="CO", queue=BUYER_QUEUE, far_service=SUPPLIER).total == 2

    first = mon.conversations(broker, limit=3)
    second = mon.conversations(broker, limit=3, offset=3)
    last = mon.conversations(broker, limit=3, offset=6)
    assert (first.next_offset, second.next_offset, last.next_offset) == (3, 6, None)
    handles = [c.conversation_handle for p in (first, second, last) for c in p.items]
    assert len(handles) == len(set(handles)) == 7


def test_conversation_by_handle(broker: Broker) -> None:
    initiator, target = open_order(broker)
    send(broker, initiator, NOTE, "one", "two")
    one = mon.conversation(broker, str(target))
    assert (one.conversation_handle, one.is_initiator, one.queue) == (target, False, SUPPLIER_QUEUE)
    assert (one.state, one.state_desc, one.messages_ready) == ("CO", "CONVERSING", 2)
    assert (one.far_service, one.contract_name) == (BUYER, CONTRACT)
    with pytest.raises(UnknownObject, match="does not exist"):
        mon.conversation(broker, uuid.uuid4())
    with pytest.raises(InvalidDefinition, match="not a UUID"):
        mon.conversation(broker, "not-a-uuid")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"limit": 0}, "limit must be between 1 and 500"),
        ({"limit": mon.MAX_LIMIT + 1}, "limit must be between 1 and 500"),
        ({"offset": -1}, "offset must be between 0"),
        ({"offset": 1}, "offset 1 is past the end: no conversations match"),
        ({"limit": True}, "limit must be a whole number"),
        ({"state": "XX"}, "conversation state 'XX' is not one of SO"),
    ],
)
def test_bad_paging_and_filters_are_refused(
    broker: Broker, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidDefinition, match=message):
        mon.conversations(broker, **kwargs)  # type: ignore[arg-type]


def test_every_paged_list_refuses_an_offset_past_its_end(broker: Broker) -> None:
    open_order(broker)
    assert mon.conversations(broker, offset=1).items  # 2 endpoints: offset 1 is the last
    for listing, what in (
        (mon.conversations, "2 conversations match"),
        (lambda b, **kw: mon.transmission_queue(b, **kw).page, "no messages match"),
        (mon.routing_mappings, "no mappings match"),
        (mon.events, "no events match"),
    ):
        with pytest.raises(InvalidDefinition, match=what):
            listing(broker, offset=2)  # type: ignore[operator]
        assert listing(broker, offset=0).offset == 0  # type: ignore[operator]


@pytest.mark.slow
def test_thousands_of_conversations_page_through(broker: Broker) -> None:
    dialogs = 1200
    with broker.transaction() as tx:
        handles = [tx.begin_dialog(BUYER, SUPPLIER, contract=CONTRACT) for _ in range(dialogs)]
        tx.send(handles, ORDER, {"po": 1})
    assert {c.state: c.count for c in mon.conversation_states(broker)}["CO"] == 2 * dialogs
    seen: set[uuid.UUID] = set()
    offset: int | None = 0
    pages = 0
    while offset is not None:
        page = mon.conversations(broker, queue=BUYER_QUEUE, limit=mon.MAX_LIMIT, offset=offset)
        assert page.total == dialogs and len(page.items) <= mon.MAX_LIMIT
        seen.update(c.conversation_handle for c in page.items)
        offset, pages = page.next_offset, pages + 1
    assert seen == set(handles) and pages == 3
    assert mon.overview(broker).messages_ready == dialogs


# -- the transmission queue -------------------------------------------------------------------


def test_transmission_queue_says_why_each_message_waits(broker: Broker) -> None:
    remote = to_remote(broker, "a", "b")
    broker.alter_queue(SUPPLIER_QUEUE, status=False)
    local = begin(broker)
    send(broker, local, ORDER, {"po": 7})

    listing = mon.transmission_queue(broker)
    assert listing.page.total == 3
    reasons = {(t.conversation_handle, t.message_sequence_number): t for t in listing.page.items}
    waiting_remote = reasons[(remote, 0)]
    assert REMOTE in waiting_remote.transmission_status
    assert "no route" in waiting_remote.transmission_status
    assert (waiting_remote.body_bytes, waiting_remote.attempts) == (1, 0)
    assert (
        "the target queue 'supplier_queue' is disabled" in reasons[(local, 0)].transmission_status
    )
    summary: dict[str, int] = {}
    for w in listing.summary:  # by service and reason
        summary[w.to_service_name] = summary.get(w.to_service_name, 0) + w.count
    assert summary == {REMOTE: 2, SUPPLIER: 1}

    only = mon.transmission_queue(broker, conversation_handle=remote, limit=1)
    assert (only.page.total, len(only.page.items), only.page.next_offset) == (2, 1, 1)
    assert [t.message_sequence_number for t in only.page.items] == [0]
    assert mon.transmission_queue(broker, to_service=SUPPLIER).page.total == 1

    overview = mon.overview(broker)
    assert overview.transmission_queue == 3
    assert overview.transmission_oldest_enqueued_at is not None


def test_retry_now_delivers_once_the_cause_is_fixed(broker: Broker) -> None:
    broker.alter_queue(SUPPLIER_QUEUE, status=False)
    h = begin(broker)
    send(broker, h, ORDER, {"po": 1}, {"po": 2})
    backed_off(broker)

    still = mon.retry_transmission(broker, h, actor="bob")
    assert still.data["rescheduled"] == 2 and len(still.data["waiting"]) == 2
    assert any("disabled" in t.transmission_status for t in still.data["waiting"])

    with broker.engine.begin() as conn:  # fixed behind the broker's back: no re-enable pass
        conn.execute(update(s.queue).where(s.queue.c.name == SUPPLIER_QUEUE).values(status=True))
    backed_off(broker)
    done = mon.retry_transmission(broker, h, actor="bob")
    assert done.changed and done.data["waiting"] == []
    assert done.data["delivery"]["delivered"] == 2
    assert [m.json() for m in receive(broker, SUPPLIER_QUEUE)] == [{"po": 1}, {"po": 2}]

    with pytest.raises(UnknownObject, match="has no messages in the transmission queue"):
        mon.retry_transmission(broker, h)
    with pytest.raises(UnknownObject, match="does not exist"):
        mon.retry_transmission(broker, uuid.uuid4())
    actions = mon.events(broker, event=mon.OPERATOR_ACTION, object_name=str(h)).items
    assert [a.detail for a in actions] == ["bob: retry now of 2 waiting message(s)"] * 2


def test_retry_without_a_delivery_pass_only_makes_them_due(broker: Broker) -> None:
    h = to_remote(broker, "x")
    backed_off(broker)
    result = mon.retry_transmission(broker, h, deliver=False)
    assert "delivery" not in result.data
    [row] = result.data["waiting"]
    assert row.next_attempt_at is not None and row.next_attempt_at <= utcnow()


def test_drop_a_stuck_transmission(broker: Broker) -> None:
    h = to_remote(broker, "a", "b", "c")
    other = to_remote(broker, "keep")
    ids = [t.id for t in mon.transmission_queue(broker, conversation_handle=h).page.items]

    with pytest.raises(UnknownObject, match=f"message {ids[0] + 1000} of conversation"):
        mon.drop_transmission(broker, h, message_id=ids[0] + 1000)
    with pytest.raises(InvalidDefinition, match="message_id"):
        mon.drop_transmission(broker, h, message_id=0)
    assert count(broker, s.transmission_queue) == 4  # nothing changed

    one = mon.drop_transmission(broker, h, message_id=ids[0], actor="carol")
    assert one.data == {"dropped": 1}
    rest = mon.drop_transmission(broker, h)
    assert rest.data == {"dropped": 2}
    assert [t.conversation_handle for t in mon.transmission_queue(broker).page.items] == [other]
    with pytest.raises(UnknownObject, match="no messages in the transmission queue"):
        mon.drop_transmission(broker, h)
    # The conversation itself stays: dropping messages does not end it.
    assert mon.conversation(broker, h).state == "CO"


# -- ending conversations ---------------------------------------------------------------------


def test_end_a_conversation_with_cleanup(broker: Broker) -> None:
    initiator, target = open_order(broker)
    send(broker, initiator, NOTE, "unread")
    remote = to_remote(broker, "a", "b")

    result = mon.end_conversation(broker, target, actor="dave")
    assert result.data == {
        "previous_state": "CO",
        "messages_removed": 1,
        "transmissions_removed": 0,
    }
    with pytest.raises(UnknownObject):
        mon.conversation(broker, target)
    assert mon.conversation(broker, initiator).state == "CO"  # nobody was told

    gone = mon.end_conversation(broker, remote)
    assert gone.data["transmissions_removed"] == 2
    assert mon.transmission_queue(broker).page.total == 0
    [latest, _] = mon.events(broker, event=mon.OPERATOR_ACTION).items
    assert latest.detail == "ended conversation WITH CLEANUP (it was CO)"


def test_end_normally_or_with_error(broker: Broker) -> None:
    failed, target = open_order(broker)
    mon.end_conversation(
        broker, failed, cleanup=False, error_code=42, error_description="operator gave up"
    )
    [error] = receive(broker, SUPPLIER_QUEUE, conversation_handle=target)
    assert error.error == (42, "operator gave up")
    assert mon.conversation(broker, failed).state == "CD"
    plain, _ = open_order(broker)
    assert mon.end_conversation(broker, plain, cleanup=False).detail.endswith("ended normally")
    assert mon.conversation(broker, plain).state == "DO"  # until the far side ENDs too


def test_end_refuses_bad_input_and_changes_nothing(broker: Broker) -> None:
    h, _ = open_order(broker)
    with pytest.raises(InvalidDefinition, match="WITH ERROR or WITH CLEANUP, not both"):
        mon.end_conversation(broker, h, error_code=1, error_description="x")
    with pytest.raises(UnknownObject, match="does not exist"):
        mon.end_conversation(broker, uuid.uuid4())
    with pytest.raises(InvalidDefinition, match="not a UUID"):
        mon.end_conversation(broker, "1234")
    assert mon.conversation(broker, h).state == "CO"
    assert mon.events(broker).total == 0


# -- data-dependent routing -------------------------------------------------------------------


def test_routing_services_and_their_mappings(broker: Broker) -> None:
    with broker.definitions() as d:
        d.create_queue("router_queue")
        d.create_queue("target_queue")
        d.create_service("//ddr/Target", queue="target_queue", contracts=[DEFAULT])
    broker.create_routing_service("//ddr/Router", queue="router_queue", classifier="json:$.to")
    inbound = []
    for _ in range(3):
        with broker.transaction() as tx:
            h = tx.begin_dialog(BUYER, "//ddr/Router", contract=DEFAULT)
            tx.send(h, DEFAULT, json.dumps({"to": "//ddr/Target"}))
        inbound.append(h)
    assert broker.run_routing_service("//ddr/Router") == 3

    [router] = mon.routing_services(broker)
    assert (router.name, router.queue, router.mode, router.mappings) == (
        "//ddr/Router",
        "router_queue",
        "forward",
        3,
    )
    assert router.classifier == "json:$.to"
    assert {svc.name: svc.routing_service for svc in mon.services(broker)}["//ddr/Router"]

    page = mon.routing_mappings(broker, routing_service="//ddr/Router", limit=2)
    assert (page.total, len(page.items), page.next_offset) == (3, 2, 2)
    mapping = page.items[0]
    assert mapping.target_service == "//ddr/Target"
    assert (mapping.inbound_state, mapping.outbound_state) == ("CO", "CO")
    assert mon.routing_mappings(broker, target_service="//ddr/Else").total == 0
    initiators = {
        c.conversation_handle
        for c in mon.conversations(broker, service=BUYER, far_service="//ddr/Router").items
    }
    assert initiators == set(inbound)


# -- events and the overview ------------------------------------------------------------------


def test_events_newest_first_with_filters_and_paging(broker: Broker) -> None:
    for name in (BUYER_QUEUE, SUPPLIER_QUEUE, BUYER_QUEUE):
        broker.alter_queue(name, status=False)
        broker.alter_queue(name, status=True)
    page = mon.events(broker, limit=4)
    assert (page.total, len(page.items), page.next_offset) == (6, 4, 4)
    ids = [e.id for e in page.items]
    assert ids == sorted(ids, reverse=True)
    assert mon.events(broker, event="queue_enabled").total == 3
    assert mon.events(broker, event="queue_enabled", object_name=BUYER_QUEUE).total == 2
    assert [e.event for e in mon.events(broker, limit=4, offset=4).items] == [
        "queue_enabled",
        "queue_disabled",
    ]


def test_overview(broker: Broker) -> None:
    open_order(broker)
    to_remote(broker, "x")
    o = mon.overview(broker)
    assert o.instance_id == broker.instance_id
    assert o.engine == broker.dialect
    assert (o.forwarding, o.principal) == (False, True)
    assert (o.queues, o.queues_disabled, o.messages_ready) == (2, 0, 0)
    assert {c.state: c.count for c in o.conversations}["CO"] == 3
    assert (o.transmission_queue, o.transmissions_failing, o.poison_events) == (1, 0, 0)
    assert o.in_transit == (0 if broker.dialect == "postgresql" else None)
    assert "password" not in o.database and "***" not in o.database.split("@")[-1]


def test_to_json_is_plain_json(broker: Broker) -> None:
    open_order(broker)
    doc = mon.to_json(mon.conversations(broker, limit=1))
    assert json.loads(json.dumps(doc)) == doc
    assert set(doc) == {"items", "total", "limit", "offset", "next_offset", "total_estimated"}
    item = doc["items"][0]
    assert uuid.UUID(item["conversation_handle"])
    assert item["created_at"].endswith("+00:00")


# -- echo probes ------------------------------------------------------------------------------


def echo_once(broker: Broker) -> None:
    """The echo service's reader, one pass."""
    with broker.transaction() as tx:
        echo.echo_handler(tx, tx.receive(echo.ECHO_QUEUE))


def test_a_probe_reports_the_round_trip_of_the_echo(broker: Broker) -> None:
    echo.setup(broker)
    started = time.monotonic()
    sent = mon.start_probe(broker, echo.ECHO_SERVICE, timeout_seconds=30, actor="erin")
    assert (sent.status, sent.service, sent.round_trip_ms) == ("waiting", echo.ECHO_SERVICE, None)
    assert mon.PROBE_ID.match(sent.probe_id)
    assert mon.probe(broker, sent.probe_id).status == "waiting"  # no echo yet

    time.sleep(0.05)
    echo_once(broker)
    echoed = time.monotonic()
    time.sleep(0.3)  # the prober looks later: the round trip ends at the echo's arrival
    done = mon.probe(broker, sent.probe_id)
    assert (done.status, done.detail) == ("alive", "echoed")
    assert done.round_trip_ms is not None
    assert 50 <= done.round_trip_ms <= (echoed - started) * 1000
    assert done.answered_at is not None and done.answered_at >= sent.sent_at
    assert mon.probe(broker, sent.probe_id) == done  # answered: nothing more happens
    assert mon.transmission_queue(broker).page.total == 0
    [action] = mon.events(broker, event=mon.OPERATOR_ACTION).items
    assert action.detail == f"erin: echo probe {sent.probe_id} sent"


def test_a_probe_nobody_answers_times_out(broker: Broker) -> None:
    echo.setup(broker)
    sent = mon.start_probe(broker, echo.ECHO_SERVICE, timeout_seconds=0.2)
    time.sleep(0.5)
    late = mon.probe(broker, sent.probe_id)
    assert (late.status, late.round_trip_ms) == ("no_answer", None)
    assert late.detail == "no echo within 0.2 s"


def test_probe_refusals(broker: Broker) -> None:
    with pytest.raises(mon.NotReady, match="echo_setup DAG"):
        mon.start_probe(broker, SUPPLIER)
    with pytest.raises(UnknownObject, match="no probe was ever sent"):
        mon.probe(broker, "probe-0123456789ab")
    echo.setup(broker)
    with pytest.raises(InvalidDefinition, match="does not accept the echo contract"):
        mon.start_probe(broker, SUPPLIER)
    for bad in (0, -1, mon.MAX_PROBE_TIMEOUT + 1):
        with pytest.raises(InvalidDefinition, match="timeout_seconds"):
            mon.start_probe(broker, echo.ECHO_SERVICE, timeout_seconds=bad)
    with pytest.raises(InvalidDefinition, match="malformed"):
        mon.probe(broker, "probe-XYZ")
    with pytest.raises(UnknownObject, match="probe probe-0123456789ab does not exist"):
        mon.probe(broker, "probe-0123456789ab")
    assert count(broker, echo.echo_probe) == 0
    assert mon.events(broker).total == 0


def test_a_probe_of_a_service_no_route_reaches_waits_in_the_transmission_queue(
    broker: Broker,
) -> None:
    echo.setup(broker)
    sent = mon.start_probe(broker, REMOTE, timeout_seconds=30)
    [waiting] = mon.transmission_queue(broker).page.items
    assert (waiting.conversation_handle, waiting.to_service_name) == (
        sent.conversation_handle,
        REMOTE,
    )
    assert mon.probe(broker, sent.probe_id).status == "waiting"
