"""Seed 000's example across PostgreSQL databases: sales partitioned by region.

Five broker databases, each its own broker instance:

- ``east``, ``west``, ``north``: each holds its region's sales (a table of its own) and hosts
  that region's sales service, which answers a request with the region's total for a quarter;
- ``router``: hosts the data-dependent routing service ``//sales/Router``, with routes to the
  three regional services and back to the client;
- ``client``: hosts ``//sales/Client``, which asks the router for sales by region.

Requests are classified by region (a module-level classifier reading the JSON body), forwarded
to the right database, answered from that database's data, and the answers travel back through
the router by its mapping to the conversation that asked. EndDialog from the client closes both
halves at the router and reaches the regional services; an Error from a region reaches the
client wrapped.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, select, text
from sqlalchemy.pool import NullPool

from airflow_broker import END_DIALOG, ERROR, Broker, Message
from airflow_broker.constants import REDIRECT
from airflow_broker.storage import schema as s

pytestmark = pytest.mark.xdist_group("transport")

CLIENT = "//sales/Client"
ROUTER = "//sales/Router"
CONTRACT = "//sales/QueryContract"
REQUEST = "//sales/Request"
REPLY = "//sales/Reply"
CLIENT_QUEUE = "client_queue"
ROUTER_QUEUE = "router_queue"
REGION_QUEUE = "sales_queue"

#: Each region's sales, by quarter: the partitioned data, one database per region.
SALES: dict[str, list[tuple[str, int]]] = {
    "east": [("Q1", 100), ("Q1", 20), ("Q2", 300), ("Q3", 5)],
    "west": [("Q1", 7), ("Q2", 70), ("Q2", 700), ("Q3", 7000)],
    "north": [("Q1", 1), ("Q2", 2), ("Q3", 3), ("Q3", 4)],
}
REGIONS = tuple(SALES)
QUARTERS = ("Q1", "Q2", "Q3")
#: The region that has no data for this quarter answers with an Error.
MISSING_QUARTER = "Q9"
NO_DATA = 50001

CALLS: Counter[str] = Counter()


def region_service(region: str) -> str:
    return f"//sales/{region.title()}"


def sales_region(body: bytes | None) -> str | None:
    """The classifier: ``{"region": "west", ...}`` -> ``//sales/West``."""
    CALLS["sales_region"] += 1
    if body is None:
        return None
    region = json.loads(body).get("region")
    return region_service(region) if region in SALES else None


# -- the network ----------------------------------------------------------------------------------


def declare_messages(b: Broker) -> None:
    """The message types and the contract: every database that takes part has them (seed 000:
    the routing broker contains all the message types of the contracts it routes)."""
    with b.definitions() as d:
        d.create_message_type(REQUEST, validation="json")
        d.create_message_type(REPLY, validation="json")
        d.create_contract(CONTRACT, {REQUEST: "initiator", REPLY: "target"})


@pytest.fixture
def network(make_pg_database: Callable[..., str]) -> Iterator[dict[str, Broker]]:
    urls = {name: make_pg_database() for name in ("client", "router", *REGIONS)}
    brokers = {name: Broker.connect(url, resolver=dict(urls)) for name, url in urls.items()}
    CALLS.clear()

    client = brokers["client"]
    declare_messages(client)
    client.create_queue(CLIENT_QUEUE)
    client.create_service(CLIENT, queue=CLIENT_QUEUE)
    client.create_route("to_router", service_name=ROUTER, address="broker://router")

    router = brokers["router"]
    declare_messages(router)
    router.create_queue(ROUTER_QUEUE)
    router.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=sales_region)
    for region in REGIONS:
        router.create_route(
            f"to_{region}", service_name=region_service(region), address=f"broker://{region}"
        )
    router.create_route("to_client", service_name=CLIENT, address="broker://client")

    for region in REGIONS:
        b = brokers[region]
        declare_messages(b)
        b.create_queue(REGION_QUEUE)
        b.create_service(region_service(region), queue=REGION_QUEUE, contracts=[CONTRACT])
        b.create_route("to_router", service_name=ROUTER, address="broker://router")
        engine = create_engine(urls[region], poolclass=NullPool)
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE test_sales (quarter text NOT NULL, amount int)"))
            conn.execute(
                text("INSERT INTO test_sales VALUES (:q, :a)"),
                [{"q": q, "a": a} for q, a in SALES[region]],
            )
        engine.dispose()
    yield brokers
    for b in brokers.values():
        b.dispose()


def deliver(b: Broker) -> None:
    """deliver() until this broker's transmission queue is empty."""
    for _ in range(5):
        b.deliver(retry_now=True)
        if not b.transmission_queue():
            return
    rows = b.transmission_queue()
    raise AssertionError(
        f"{b!r}: {len(rows)} message(s) still waiting: {rows[0].transmission_status!r}"
    )


def receive_all(b: Broker, queue: str) -> list[Message]:
    out: list[Message] = []
    for _ in range(1000):
        with b.transaction() as tx:
            got = tx.receive(queue)
        if not got:
            return out
        out.extend(got)
    raise AssertionError(f"queue {queue} never ran dry")


def answer_requests(b: Broker, region: str) -> list[dict[str, Any]]:
    """The regional sales service: each request answered from this database's own data, in the
    transaction that received it; an unknown quarter ends the conversation with an Error."""
    answered: list[dict[str, Any]] = []
    for _ in range(1000):
        with b.transaction() as tx:
            got = tx.receive(REGION_QUEUE)
            if not got:
                return answered
            for m in got:
                assert m.message_type_name == REQUEST, m.message_type_name
                request = m.json()
                total = tx.connection.execute(
                    text("SELECT sum(amount) FROM test_sales WHERE quarter = :q"),
                    {"q": request["quarter"]},
                ).scalar()
                if total is None:
                    tx.end_conversation(
                        m.conversation_handle,
                        error_code=NO_DATA,
                        error_description=f"no {region} sales for {request['quarter']}",
                    )
                else:
                    tx.send(
                        m.conversation_handle,
                        REPLY,
                        {"request": request["request"], "region": region, "total": total},
                    )
                answered.append(request)
    raise AssertionError(f"{region}: requests never ran out")


def states(b: Broker, service: str) -> Counter[str]:
    e = s.conversation_endpoint
    with b.engine.connect() as conn:
        return Counter(conn.execute(select(e.c.state).where(e.c.service_name == service)).scalars())


def mapping_count(b: Broker) -> int:
    with b.engine.connect() as conn:
        return len(conn.execute(select(s.resolved_conversation)).all())


# -- the test -------------------------------------------------------------------------------------


def test_sales_by_region_through_a_routing_service_across_databases(
    network: dict[str, Broker],
) -> None:
    client, router = network["client"], network["router"]

    # The client asks each region for each quarter, and the west for a quarter it lacks.
    asked: dict[uuid.UUID, dict[str, Any]] = {}
    with client.transaction() as tx:
        for i, (region, quarter) in enumerate(
            [(r, q) for q in QUARTERS for r in REGIONS] + [("west", MISSING_QUARTER)]
        ):
            h = tx.begin_dialog(CLIENT, ROUTER, contract=CONTRACT, encryption=False)
            request = {"request": i, "region": region, "quarter": quarter}
            tx.send(h, REQUEST, request)
            asked[h] = request
    n = len(asked)
    deliver(client)

    # The router classifies each conversation once and forwards it to its region's database.
    assert router.run_routing_service(ROUTER) == n
    assert CALLS["sales_region"] == n
    assert mapping_count(router) == n
    deliver(router)

    for region in REGIONS:
        requests = answer_requests(network[region], region)
        assert {r["region"] for r in requests} == {region}
        assert sorted(r["quarter"] for r in requests) == sorted(
            list(QUARTERS) + ([MISSING_QUARTER] if region == "west" else [])
        )
        deliver(network[region])

    # Replies (and the west's Error) go back through the router by the mapping.
    assert router.run_routing_service(ROUTER) == n
    assert CALLS["sales_region"] == n  # nothing classified twice
    deliver(router)

    answers = receive_all(client, CLIENT_QUEUE)
    assert len(answers) == n
    assert {m.conversation_handle for m in answers} == set(asked)
    for m in answers:
        request = asked[m.conversation_handle]
        if request["quarter"] == MISSING_QUARTER:
            assert m.message_type_name == ERROR
            west_id = network["west"].instance_id
            assert m.error == (
                NO_DATA,
                f"[from service '//sales/West' at broker instance {west_id} via routing "
                f"service '{ROUTER}'] no west sales for {MISSING_QUARTER}",
            )
            continue
        assert m.message_type_name == REPLY
        expected = sum(a for q, a in SALES[request["region"]] if q == request["quarter"])
        assert m.json() == {
            "request": request["request"],
            "region": request["region"],
            "total": expected,
        }

    # The client ends every conversation: the router ends both halves of each pair, and the
    # regional services get EndDialog.
    with client.transaction() as tx:
        for h in asked:
            tx.end_conversation(h)
    deliver(client)
    # (The conversation the west failed is over at the router already: n - 1 EndDialogs.)
    assert router.run_routing_service(ROUTER) == n - 1
    deliver(router)
    assert mapping_count(router) == 0
    # Inbound halves closed; outbound halves ended by the router, waiting for the regions
    # (the pair the west failed is closed on both sides).
    assert states(router, ROUTER) == Counter({"CD": n + 1, "DO": n - 1})
    for region in REGIONS:
        b = network[region]
        ends = receive_all(b, REGION_QUEUE)
        assert {m.message_type_name for m in ends} == {END_DIALOG}
        with b.transaction() as tx:
            for m in ends:
                tx.end_conversation(m.conversation_handle)
        deliver(b)
        assert set(states(b, region_service(region))) == {"CD"}
    assert router.run_routing_service(ROUTER) == 0
    assert mapping_count(router) == 0
    # Every endpoint of every conversation is closed: client, router (both halves), regions.
    assert states(router, ROUTER) == Counter({"CD": 2 * n})
    assert states(client, CLIENT) == Counter({"CD": n})


def test_redirect_mode_across_databases(network: dict[str, Broker]) -> None:
    client, router = network["client"], network["router"]
    redirector = "//sales/Redirector"
    router.create_queue("redirector_queue")
    router.create_routing_service(
        redirector, queue="redirector_queue", classifier=sales_region, mode="redirect"
    )
    client.create_route("to_redirector", service_name=redirector, address="broker://router")
    for region in REGIONS:
        client.create_route(
            f"to_{region}", service_name=region_service(region), address=f"broker://{region}"
        )
        network[region].create_route("to_client", service_name=CLIENT, address="broker://client")

    request = {"request": 1, "region": "north", "quarter": "Q3"}
    with client.transaction() as tx:
        h = tx.begin_dialog(CLIENT, redirector, contract=CONTRACT, encryption=False)
        tx.send(h, REQUEST, request)
    deliver(client)
    assert router.run_routing_service(redirector) == 1
    deliver(router)
    assert mapping_count(router) == 0

    got = receive_all(client, CLIENT_QUEUE)
    assert [(m.conversation_handle, m.message_type_name) for m in got] == [
        (h, REDIRECT),
        (h, END_DIALOG),
    ]
    assert got[0].json() == {"to_service": "//sales/North", "broker_instance": None}
    with client.transaction() as tx:
        tx.end_conversation(h)
        # The client follows the redirection: straight to the north's database.
        direct = tx.begin_dialog(
            CLIENT, got[0].json()["to_service"], contract=CONTRACT, encryption=False
        )
        tx.send(direct, REQUEST, request)
    deliver(client)
    assert answer_requests(network["north"], "north") == [request]
    deliver(network["north"])
    [reply] = receive_all(client, CLIENT_QUEUE)
    assert (reply.conversation_handle, reply.json()) == (
        direct,
        {"request": 1, "region": "north", "total": 7},
    )
    assert CALLS["sales_region"] == 1
