"""The data-dependent routing service (seed 000), in one broker database, on both engines.

A client asks a router for sales figures; the router classifies the first message of each
conversation and forwards it to the regional service that holds that region's data (forward
mode), or tells the client where to go (redirect mode). Replies travel back by the mapping of
inbound to outbound conversations; EndDialog and Error cross the pair.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select

from airflow_broker import (
    END_DIALOG,
    ERROR,
    Broker,
    InvalidDefinition,
    Message,
    ObjectExists,
    UnknownObject,
)
from airflow_broker.constants import ERR_NOT_CLASSIFIED, REDIRECT
from airflow_broker.storage import schema as s
from airflow_broker.transport.routing_service import (
    NotClassified,
    compile_classifier,
    json_path_value,
    load_json,
    parse_json_path,
    parse_xpath,
)

CLIENT_QUEUE = "client_queue"
ROUTER_QUEUE = "router_queue"
CLIENT = "//sales/Client"
ROUTER = "//sales/Router"
REGIONS = ("East", "West", "North")
CONTRACT = "//sales/QueryContract"
REQUEST = "//sales/Request"
REPLY = "//sales/Reply"
NOTE = "//sales/Note"


def region_service(region: str) -> str:
    return f"//sales/{region}"


def region_queue(region: str) -> str:
    return f"{region.lower()}_queue"


# -- classifiers (module level: the router stores them by name) ------------------------------------

CALLS: Counter[str] = Counter()
_CALLS_LOCK = threading.Lock()


def classify_region(body: bytes | None) -> str | None:
    """``{"region": "east"}`` -> ``//sales/East``; anything else is not classified."""
    with _CALLS_LOCK:
        CALLS["classify_region"] += 1
    if body is None:
        return None
    region = json.loads(body).get("region")
    return None if region is None else region_service(str(region).title())


def classify_slowly(body: bytes | None) -> str | None:
    """classify_region, taking a little time: concurrent runners overlap."""
    time.sleep(0.005)
    return classify_region(body)


def classify_by_raising(body: bytes | None) -> str | None:
    raise ValueError("the region table is down")


def classify_to_nothing(body: bytes | None) -> str | None:
    return None


def classify_to_a_number(body: bytes | None) -> Any:
    return 42


class Classifiers:
    @staticmethod
    def by_region(body: bytes | None) -> str | None:
        return classify_region(body)


@pytest.fixture(autouse=True)
def _reset_calls() -> Iterator[None]:
    CALLS.clear()
    yield


# -- the sales system ------------------------------------------------------------------------------


def declare_sales(broker: Broker) -> None:
    """Client, three regional services, and a router queue (the router is made per test)."""
    with broker.definitions() as d:
        d.create_message_type(REQUEST, validation="none")
        d.create_message_type(REPLY, validation="json")
        d.create_message_type(NOTE, validation="none")
        d.create_contract(CONTRACT, {REQUEST: "initiator", REPLY: "target", NOTE: "any"})
        d.create_queue(CLIENT_QUEUE)
        d.create_queue(ROUTER_QUEUE)
        d.create_service(CLIENT, queue=CLIENT_QUEUE)
        for region in REGIONS:
            d.create_queue(region_queue(region))
            d.create_service(
                region_service(region), queue=region_queue(region), contracts=[CONTRACT]
            )


@pytest.fixture
def sales(broker: Broker) -> Broker:
    declare_sales(broker)
    return broker


def ask(broker: Broker, body: Any, message_type: str = REQUEST, **kwargs: Any) -> uuid.UUID:
    """Begin a dialog from the client to the router and send one message."""
    with broker.transaction() as tx:
        h = tx.begin_dialog(CLIENT, ROUTER, contract=CONTRACT, **kwargs)
        tx.send(h, message_type, body)
    return h


def receive_all(broker: Broker, queue: str) -> list[Message]:
    out: list[Message] = []
    for _ in range(1000):
        with broker.transaction() as tx:
            got = tx.receive(queue)
        if not got:
            return out
        out.extend(got)
    raise AssertionError(f"queue {queue} never ran dry")


def send(broker: Broker, handle: uuid.UUID, message_type: str, body: Any) -> None:
    with broker.transaction() as tx:
        tx.send(handle, message_type, body)


def end(broker: Broker, handle: uuid.UUID, **kwargs: Any) -> None:
    with broker.transaction() as tx:
        tx.end_conversation(handle, **kwargs)


def state(broker: Broker, handle: uuid.UUID) -> str:
    with broker.transaction() as tx:
        return tx.conversation(handle).state


def mappings(broker: Broker) -> list[Any]:
    r = s.resolved_conversation
    with broker.engine.connect() as conn:
        return list(conn.execute(select(r).order_by(r.c.created_at)))


def router_outbound_count(broker: Broker) -> int:
    e = s.conversation_endpoint
    with broker.engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count()).where(e.c.service_name == ROUTER, e.c.is_initiator)
            ).scalar_one()
        )


def depths(broker: Broker) -> dict[str, int]:
    return {q.name: q.depth for q in broker.queue_status()}


# -- classification --------------------------------------------------------------------------------


def test_callable_classifier_routes_each_conversation_to_its_region(sales: Broker) -> None:
    broker = sales
    broker.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=classify_region)
    with broker.engine.connect() as conn:
        row = conn.execute(select(s.routing_service)).one()
    assert (row.name, row.mode, row.classifier) == (
        ROUTER,
        "forward",
        f"python:{__name__}:classify_region",
    )
    east = ask(broker, {"region": "east", "q": 1})
    west = ask(broker, {"region": "west", "q": 2})

    assert broker.run_routing_service(ROUTER) == 2
    assert CALLS["classify_region"] == 2

    [at_east] = receive_all(broker, region_queue("East"))
    [at_west] = receive_all(broker, region_queue("West"))
    assert receive_all(broker, region_queue("North")) == []
    # Same message type, same body; the target sees the router as the far service.
    assert (at_east.message_type_name, json.loads(at_east.message_body or b"")) == (
        REQUEST,
        {"region": "east", "q": 1},
    )
    assert json.loads(at_west.message_body or b"") == {"region": "west", "q": 2}
    with broker.transaction() as tx:
        target_side = tx.conversation(at_east.conversation_handle)
    assert (target_side.far_service, target_side.contract_name) == (ROUTER, CONTRACT)

    rows = {r.inbound_handle: r for r in mappings(broker)}
    assert set(rows) == {
        next(iter(_inbound_of(broker, east))),
        next(iter(_inbound_of(broker, west))),
    }
    for r in rows.values():
        assert r.routing_service == ROUTER
        with broker.transaction() as tx:
            inbound, outbound = (
                tx.conversation(r.inbound_handle),
                tx.conversation(r.outbound_handle),
            )
        # The outbound half: from the router, same contract, in the inbound half's group.
        assert (outbound.service_name, outbound.far_service, outbound.is_initiator) == (
            ROUTER,
            r.target_service,
            True,
        )
        assert outbound.contract_name == inbound.contract_name == CONTRACT
        assert outbound.conversation_group_id == inbound.conversation_group_id
    assert sorted(r.target_service for r in rows.values()) == [
        region_service("East"),
        region_service("West"),
    ]


def _inbound_of(broker: Broker, client_handle: uuid.UUID) -> set[uuid.UUID]:
    """The router's handle of the conversation the client began as ``client_handle``."""
    e = s.conversation_endpoint
    with broker.engine.connect() as conn:
        cid = conn.execute(
            select(e.c.conversation_id).where(e.c.conversation_handle == client_handle)
        ).scalar_one()
        return set(
            conn.execute(
                select(e.c.conversation_handle).where(
                    e.c.conversation_id == cid, e.c.service_name == ROUTER
                )
            ).scalars()
        )


def test_static_method_classifier_is_stored_by_qualified_name(sales: Broker) -> None:
    sales.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=Classifiers.by_region)
    with sales.engine.connect() as conn:
        stored = conn.execute(select(s.routing_service.c.classifier)).scalar_one()
    assert stored == f"python:{__name__}:Classifiers.by_region"
    ask(sales, {"region": "north"})
    assert sales.run_routing_service(ROUTER) == 1
    assert len(receive_all(sales, region_queue("North"))) == 1


def test_json_path_classifier(sales: Broker) -> None:
    sales.create_routing_service(
        ROUTER, queue=ROUTER_QUEUE, classifier="json:$.route['to service'][1]"
    )
    ask(sales, {"route": {"to service": ["//sales/East", "//sales/West"]}})
    ask(sales, {"route": {"to service": ["//sales/West", "//sales/North"]}})
    assert sales.run_routing_service(ROUTER) == 2
    assert len(receive_all(sales, region_queue("West"))) == 1
    assert len(receive_all(sales, region_queue("North"))) == 1
    assert receive_all(sales, region_queue("East")) == []


def test_xpath_classifier_of_seed_000(sales: Broker) -> None:
    sales.create_routing_service(
        ROUTER, queue=ROUTER_QUEUE, classifier="xpath:/message/toServiceName"
    )
    ask(
        sales,
        "<message><toServiceName> //sales/West </toServiceName>"
        "<query region='west'>Q3</query></message>",
    )
    assert sales.run_routing_service(ROUTER) == 1
    [got] = receive_all(sales, region_queue("West"))
    assert got.text() is not None and "<query region='west'>Q3</query>" in (got.text() or "")


def test_xpath_attribute_and_descendant_paths(sales: Broker) -> None:
    sales.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier="xpath://query/@to")
    ask(sales, "<message><body><query to='//sales/North'/></body></message>")
    assert sales.run_routing_service(ROUTER) == 1
    assert len(receive_all(sales, region_queue("North"))) == 1


# -- replies, EndDialog, Error ---------------------------------------------------------------------


def _routed_pair(broker: Broker, region: str = "East") -> tuple[uuid.UUID, uuid.UUID]:
    """A client conversation routed to ``region``; returns (client handle, region handle)."""
    h = ask(broker, {"region": region.lower()})
    assert broker.run_routing_service(ROUTER) == 1
    [got] = receive_all(broker, region_queue(region))
    return h, got.conversation_handle


def test_replies_travel_back_by_the_mapping_without_classifying(sales: Broker) -> None:
    broker = sales
    broker.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=classify_region)
    client, east = _routed_pair(broker)
    assert CALLS["classify_region"] == 1

    send(broker, east, REPLY, {"total": 100})
    send(broker, east, NOTE, b"and one more thing")
    assert broker.run_routing_service(ROUTER) == 2
    replies = receive_all(broker, CLIENT_QUEUE)
    assert [(m.conversation_handle, m.message_type_name) for m in replies] == [
        (client, REPLY),
        (client, NOTE),
    ]
    assert replies[0].json() == {"total": 100}
    assert replies[1].message_body == b"and one more thing"

    # Further client messages, whatever their body, follow the mapping too.
    send(broker, client, NOTE, b"not JSON at all")
    send(broker, client, REQUEST, {"region": "west"})
    assert broker.run_routing_service(ROUTER) == 2
    assert [m.message_body for m in receive_all(broker, region_queue("East"))] == [
        b"not JSON at all",
        b'{"region":"west"}',
    ]
    assert receive_all(broker, region_queue("West")) == []
    assert CALLS["classify_region"] == 1
    assert len(mappings(broker)) == 1


def test_end_dialog_from_the_client_closes_both_halves(sales: Broker) -> None:
    broker = sales
    broker.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=classify_region)
    client, east = _routed_pair(broker)
    [row] = mappings(broker)

    end(broker, client)
    assert broker.run_routing_service(ROUTER) == 1
    [got] = receive_all(broker, region_queue("East"))
    assert (got.conversation_handle, got.message_type_name) == (east, END_DIALOG)
    assert state(broker, row.inbound_handle) == "CD"
    assert state(broker, row.outbound_handle) == "DO"
    assert mappings(broker) == []  # the router has ended both halves

    end(broker, east)
    assert {state(broker, h) for h in (client, east, row.inbound_handle, row.outbound_handle)} == {
        "CD"
    }
    assert broker.run_routing_service(ROUTER) == 0
    assert receive_all(broker, CLIENT_QUEUE) == []


def test_end_dialog_from_the_target_closes_both_halves(sales: Broker) -> None:
    broker = sales
    broker.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=classify_region)
    client, east = _routed_pair(broker)
    [row] = mappings(broker)

    send(broker, east, REPLY, {"total": 7})
    end(broker, east)
    assert broker.run_routing_service(ROUTER) == 2
    got = receive_all(broker, CLIENT_QUEUE)
    assert [(m.conversation_handle, m.message_type_name) for m in got] == [
        (client, REPLY),
        (client, END_DIALOG),
    ]
    assert state(broker, row.outbound_handle) == "CD"
    assert state(broker, row.inbound_handle) == "DO"
    assert mappings(broker) == []
    end(broker, client)
    assert {state(broker, h) for h in (client, east, row.inbound_handle, row.outbound_handle)} == {
        "CD"
    }


def test_error_from_the_target_reaches_the_client_wrapped(sales: Broker) -> None:
    broker = sales
    broker.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=classify_region)
    client, east = _routed_pair(broker)
    [row] = mappings(broker)

    end(broker, east, error_code=4711, error_description="no sales data for Q3")
    assert broker.run_routing_service(ROUTER) == 1
    [got] = receive_all(broker, CLIENT_QUEUE)
    assert (got.conversation_handle, got.message_type_name) == (client, ERROR)
    assert got.error is not None
    code, description = got.error
    assert code == 4711
    assert description == (
        f"[from service '//sales/East' via routing service '{ROUTER}'] no sales data for Q3"
    )
    assert state(broker, row.inbound_handle) == "CD"
    assert state(broker, row.outbound_handle) == "CD"
    assert state(broker, client) == "ER"
    assert mappings(broker) == []
    end(broker, client)
    assert state(broker, client) == "CD"


def test_error_from_the_client_reaches_the_target_wrapped(sales: Broker) -> None:
    broker = sales
    broker.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=classify_region)
    client, west = _routed_pair(broker, "West")

    end(broker, client, error_code=17, error_description="client gave up")
    assert broker.run_routing_service(ROUTER) == 1
    [got] = receive_all(broker, region_queue("West"))
    assert (got.conversation_handle, got.error) == (
        west,
        (17, f"[from service '{CLIENT}' via routing service '{ROUTER}'] client gave up"),
    )
    assert mappings(broker) == []
    assert receive_all(broker, CLIENT_QUEUE) == []


def test_dialog_timer_on_the_router_is_ignored(sales: Broker) -> None:
    broker = sales
    broker.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=classify_region)
    client, _east = _routed_pair(broker)
    [row] = mappings(broker)
    with broker.transaction() as tx:
        tx.begin_conversation_timer(row.inbound_handle, 0)
    broker.run_due()
    assert depths(broker)[ROUTER_QUEUE] == 1
    assert broker.run_routing_service(ROUTER) == 1
    assert depths(broker)[region_queue("East")] == 0
    assert state(broker, row.inbound_handle) == "CO"
    assert state(broker, client) == "CO"


# -- what cannot be classified ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("classifier", "body", "reason"),
    [
        (classify_region, {"country": "fr"}, "returned no service name"),
        (classify_to_nothing, {"region": "east"}, "returned no service name"),
        (classify_by_raising, {"region": "east"}, "raised ValueError: the region table is down"),
        (classify_to_a_number, {"region": "east"}, "gave int 42, not a service name"),
        ("json:$.region", {"country": "fr"}, "JSON path $.region finds nothing in the body"),
        ("json:$.region", {"region": None}, "finds nothing"),
        ("json:$.region", {"region": ["east"]}, "finds an array, not a string"),
        ("json:$.region", b"<region>east</region>", "the body is not JSON"),
        ("json:$.region", {"region": ROUTER}, "named the routing service"),
        ("xpath:/message/toServiceName", b"not xml <", "not well-formed, safe XML"),
        (
            "xpath:/message/toServiceName",
            b"<msg><toServiceName>x</toServiceName></msg>",
            "finds nothing",
        ),
        ("xpath:/message/toServiceName", b"<message><toServiceName/></message>", "empty value"),
        (
            "xpath:/message/toServiceName",
            b'<!DOCTYPE m [<!ENTITY e "//sales/East">]><message><toServiceName>&e;'
            b"</toServiceName></message>",
            "not well-formed, safe XML",
        ),
    ],
)
def test_unclassifiable_message_ends_the_inbound_conversation_with_an_error(
    sales: Broker, classifier: Any, body: Any, reason: str
) -> None:
    broker = sales
    broker.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=classifier)
    client = ask(broker, body)
    assert broker.run_routing_service(ROUTER) == 1

    [got] = receive_all(broker, CLIENT_QUEUE)
    assert (got.conversation_handle, got.message_type_name) == (client, ERROR)
    assert got.error is not None
    code, description = got.error
    assert code == ERR_NOT_CLASSIFIED
    assert f"routing service {ROUTER!r} could not classify" in description
    assert reason in description
    assert state(broker, client) == "ER"
    # Nothing else happened: no outbound dialog, no mapping, nothing at the regions.
    assert router_outbound_count(broker) == 0
    assert mappings(broker) == []
    assert all(depths(broker)[region_queue(r)] == 0 for r in REGIONS)
    assert broker.transmission_queue() == []
    [inbound] = _inbound_of(broker, client)
    assert state(broker, inbound) == "CD"


def test_later_messages_of_an_unclassified_conversation_are_dropped(sales: Broker) -> None:
    broker = sales
    broker.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=classify_region)
    with broker.transaction() as tx:
        h = tx.begin_dialog(CLIENT, ROUTER, contract=CONTRACT, encryption=False)
        tx.send(h, REQUEST, {"nothing": "here"})
        tx.send(h, REQUEST, {"region": "east"})
    assert broker.run_routing_service(ROUTER) == 2
    assert CALLS["classify_region"] == 1
    assert [m.message_type_name for m in receive_all(broker, CLIENT_QUEUE)] == [ERROR]
    assert depths(broker)[region_queue("East")] == 0


# -- redirect mode ---------------------------------------------------------------------------------


def test_redirect_mode_tells_the_initiator_where_to_go(sales: Broker) -> None:
    broker = sales
    broker.create_routing_service(
        ROUTER, queue=ROUTER_QUEUE, classifier="json:$.region_service", mode="redirect"
    )
    client = ask(broker, {"region_service": "//sales/West"})
    assert broker.run_routing_service(ROUTER) == 1

    got = receive_all(broker, CLIENT_QUEUE)
    assert [(m.conversation_handle, m.message_type_name) for m in got] == [
        (client, REDIRECT),
        (client, END_DIALOG),
    ]
    assert got[0].json() == {"to_service": "//sales/West", "broker_instance": None}
    assert router_outbound_count(broker) == 0
    assert mappings(broker) == []
    assert depths(broker)[region_queue("West")] == 0
    end(broker, client)
    assert state(broker, client) == "CD"

    # The client follows the redirection.
    with broker.transaction() as tx:
        h = tx.begin_dialog(
            CLIENT, got[0].json()["to_service"], contract=CONTRACT, encryption=False
        )
        tx.send(h, REQUEST, {"region": "west"})
    assert len(receive_all(broker, region_queue("West"))) == 1


def test_redirect_mode_unclassifiable_gets_an_error(sales: Broker) -> None:
    sales.create_routing_service(
        ROUTER, queue=ROUTER_QUEUE, classifier="json:$.region_service", mode="redirect"
    )
    client = ask(sales, {"region": "west"})
    assert sales.run_routing_service(ROUTER) == 1
    [got] = receive_all(sales, CLIENT_QUEUE)
    assert got.error is not None and got.error[0] == ERR_NOT_CLASSIFIED
    assert state(sales, client) == "ER"


def test_a_forwarding_router_passes_on_the_redirect_of_a_redirecting_one(sales: Broker) -> None:
    broker = sales
    broker.create_queue("redirector_queue")
    broker.create_routing_service(
        "//sales/Redirector", "redirector_queue", "json:$.region_service", mode="redirect"
    )
    broker.create_routing_service(ROUTER, ROUTER_QUEUE, "json:$.via")
    client = ask(broker, {"via": "//sales/Redirector", "region_service": "//sales/North"})
    assert broker.run_routing_service(ROUTER) == 1
    assert broker.run_routing_service("//sales/Redirector") == 1
    assert broker.run_routing_service(ROUTER) == 2  # the Redirect, then EndDialog
    got = receive_all(broker, CLIENT_QUEUE)
    assert [(m.conversation_handle, m.message_type_name) for m in got] == [
        (client, REDIRECT),
        (client, END_DIALOG),
    ]
    assert got[0].json() == {"to_service": "//sales/North", "broker_instance": None}
    assert mappings(broker) == []


# -- definitions -----------------------------------------------------------------------------------


def _nested_classifier() -> Any:
    def inner(body: bytes | None) -> str | None:
        return None

    return inner


@pytest.mark.parametrize(
    ("classifier", "message"),
    [
        (lambda body: "//sales/East", "is a lambda"),
        (_nested_classifier(), "is defined inside a function"),
        (42, "must be a callable or a string"),
        ("//sales/East", "must start with 'python:', 'json:' or 'xpath:'"),
        ("sql:dbo.sample_classifier", "must start with 'python:', 'json:' or 'xpath:'"),
        ("python:classify", "must be 'python:module:qualname'"),
        ("python:no_such_module_ddr:f", "cannot be imported"),
        (f"python:{__name__}:no_such_function", "has no 'no_such_function'"),
        (f"python:{__name__}:CLIENT", "not a callable"),
        ("json:region", "must start with '$'"),
        ("json:$.", "a name must follow the '.'"),
        ("json:$.items[*]", "wildcards ([*])"),
        ("json:$.*", "wildcards (.*)"),
        ("json:$['*']", "wildcards (['*'])"),
        ("json:$['a?']", "without ' or ?"),
        ("json:$['a'", "without ' or ?"),
        ("json:$. region", "whitespace"),
        ("json:$.region ", "whitespace"),
        ("json:$[a]", "expected [n]"),
        ("json:$-region", "unexpected '-'"),
        ("xpath:message/toServiceName", "must be absolute"),
        ("xpath:/", "must name an element"),
        ("xpath:/message/", "must name an element"),
        ("xpath:/message[", "not in ElementTree's XPath subset"),
        ("xpath:/message/@to/x", "an attribute can only be the last step"),
        ("xpath:/message/text()/x", "not in ElementTree's XPath subset"),
    ],
)
def test_bad_classifier_definitions_are_refused(
    sales: Broker, classifier: Any, message: str
) -> None:
    with pytest.raises(InvalidDefinition, match=None) as info:
        sales.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=classifier)
    assert message in str(info.value)
    assert ROUTER not in sales.catalog().services


def test_bad_routing_service_definitions_are_refused(sales: Broker) -> None:
    with pytest.raises(InvalidDefinition, match="mode 'sideways' must be 'forward' or 'redirect'"):
        sales.create_routing_service(ROUTER, ROUTER_QUEUE, classify_region, mode="sideways")
    with pytest.raises(UnknownObject, match="queue 'no_queue' does not exist"):
        sales.create_routing_service(ROUTER, "no_queue", classify_region)
    with pytest.raises(ObjectExists, match=f"service '{CLIENT}' already exists"):
        sales.create_routing_service(CLIENT, ROUTER_QUEUE, classify_region)
    with pytest.raises(InvalidDefinition, match="already serves //sales/Client"):
        sales.create_routing_service(ROUTER, CLIENT_QUEUE, classify_region)
    # Nothing half-written by any of them.
    assert ROUTER not in sales.catalog().services
    with sales.engine.connect() as conn:
        assert conn.execute(select(s.routing_service)).all() == []
    with pytest.raises(UnknownObject, match=f"routing service '{CLIENT}' does not exist"):
        sales.run_routing_service(CLIENT)

    sales.create_routing_service(ROUTER, ROUTER_QUEUE, classify_region)
    assert sales.catalog().services[ROUTER].queue == ROUTER_QUEUE
    with pytest.raises(ObjectExists):
        sales.create_routing_service(ROUTER, ROUTER_QUEUE, classify_region)
    # Dropping the service drops the routing service with it.
    sales.drop_service(ROUTER)
    with sales.engine.connect() as conn:
        assert conn.execute(select(s.routing_service)).all() == []
    with pytest.raises(UnknownObject, match=f"routing service '{ROUTER}' does not exist"):
        sales.run_routing_service(ROUTER)


def test_max_messages_limits_one_pass(sales: Broker) -> None:
    sales.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=classify_region)
    for region in ("east", "west", "north"):
        ask(sales, {"region": region})
    assert sales.run_routing_service(ROUTER, max_messages=2) == 2
    assert sales.run_routing_service(ROUTER, max_messages=2) == 1
    assert sales.run_routing_service(ROUTER) == 0
    assert sum(depths(sales)[region_queue(r)] for r in REGIONS) == 3


# -- many conversations, two runners ---------------------------------------------------------------


def test_many_conversations_through_one_router_with_two_runners(
    sales: Broker, broker_url: str
) -> None:
    broker = sales
    broker.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=classify_slowly)
    n = 90
    clients: dict[uuid.UUID, tuple[int, str]] = {}
    with broker.transaction() as tx:
        for i in range(n):
            region = REGIONS[i % 3]
            h = tx.begin_dialog(CLIENT, ROUTER, contract=CONTRACT, encryption=False)
            tx.send(h, REQUEST, {"region": region.lower(), "request": i})
            clients[h] = (i, region)

    start = threading.Barrier(2)
    handled: list[int] = []
    errors: list[BaseException] = []

    def runner() -> None:
        b = Broker.connect(broker_url)
        try:
            start.wait()
            handled.append(b.run_routing_service(ROUTER))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            b.dispose()

    threads = [threading.Thread(target=runner) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    # A runner stops when it finds nothing it may take; whatever is left, one more pass takes.
    rest = broker.run_routing_service(ROUTER)
    assert sum(handled) + rest == n
    if broker.dialect == "postgresql":
        assert all(h > 0 for h in handled), handled  # both runners routed conversations
    assert CALLS["classify_region"] == n  # each conversation classified exactly once
    rows = mappings(broker)
    assert len(rows) == len({r.inbound_handle for r in rows}) == n
    assert router_outbound_count(broker) == n

    # Every region got its requests, each once; each answers; each answer reaches its client.
    seen: list[int] = []
    for region in REGIONS:
        got = receive_all(broker, region_queue(region))
        requests = [m.json() for m in got]
        assert {r["region"] for r in requests} == {region.lower()}
        seen += [r["request"] for r in requests]
        with broker.transaction() as tx:
            for m, r in zip(got, requests, strict=True):
                tx.send(m.conversation_handle, REPLY, {"request": r["request"], "region": region})
    assert sorted(seen) == list(range(n))

    assert broker.run_routing_service(ROUTER) == n
    replies = receive_all(broker, CLIENT_QUEUE)
    assert len(replies) == n
    for m in replies:
        i, region = clients[m.conversation_handle]
        assert m.json() == {"request": i, "region": region}
    assert CALLS["classify_region"] == n


# -- the classifier grammars, without a database ---------------------------------------------------


@pytest.mark.parametrize(
    ("path", "steps"),
    [
        ("$", ()),
        ("$.a.b", ("a", "b")),
        ("$['a']", ("a",)),
        ("$.a[0]", ("a", 0)),
        ("$['a.b'][12].c d", ("a.b", 12, "c d")),
        ("$.a]'x", ("a]'x",)),
    ],
)
def test_json_path_grammar(path: str, steps: tuple[Any, ...]) -> None:
    assert parse_json_path(path) == steps


@pytest.mark.parametrize(
    ("document", "path", "value"),
    [
        (b'{"a": {"b": "x"}}', "$.a.b", "x"),
        (b'{"a": [{"b": "x"}, {"b": "y"}]}', "$.a[1].b", "y"),
        (b'{"a": ["x"]}', "$.a[1]", None),
        (b'{"a": {"b": "x"}}', "$.a[0]", None),
        (b'[{"a": "x"}]', "$.a", None),
        (b'[{"a": "x"}]', "$[0].a", "x"),
        (b'"x"', "$", "x"),
        # As get_json_object: a null member does not match; of duplicate names, the first one
        # the rest of the path matches in wins.
        (b'{"a": null, "a": {"b": "x"}}', "$.a.b", "x"),
        (b'{"a": {"c": 1}, "a": {"b": "x"}, "a": {"b": "y"}}', "$.a.b", "x"),
    ],
)
def test_json_path_values(document: bytes, path: str, value: Any) -> None:
    assert json_path_value(load_json(document), parse_json_path(path)) == value


def test_compiled_classifiers_say_why_they_do_not_classify() -> None:
    classify = compile_classifier("xpath:/message/to/text()")
    assert classify(b"<message><to>\n  //sales/East\n</to></message>") == "//sales/East"
    with pytest.raises(NotClassified, match="the message has no body"):
        classify(None)
    assert parse_xpath("/m/@to").attribute == "to"
    classify = compile_classifier("json:$.to")
    with pytest.raises(NotClassified, match="finds the int 5, not a string"):
        classify(b'{"to": 5}')
