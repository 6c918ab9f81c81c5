"""Seed 001's matching step 4: a conversation with no route of its own asks the dynamic
routing service (the service Service Broker calls BrokerConfiguration) and waits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_broker import Broker
from airflow_broker.routing.dynamic import (
    BROKER_CONFIGURATION,
    BROKER_CONFIGURATION_NOTICE,
    MISSING_ROUTE,
    REQUESTER,
)


@pytest.fixture(params=["sqlite", "postgres"])
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Broker, Broker]]:
    if request.param == "sqlite":
        urls = {n: f"sqlite:///{tmp_path / (n + '.db')}" for n in ("a", "b")}
        for url in urls.values():
            m = Broker.connect(url)
            m.migrate()
            m.dispose()
    else:
        make = request.getfixturevalue("make_pg_database")
        urls = {"a": make(), "b": make()}
    a = Broker.connect(urls["a"], resolver=urls)
    b = Broker.connect(urls["b"], resolver=urls)
    a.create_queue("qa")
    a.create_service("//svc/A", queue="qa")
    # The dynamic routing service, hosted here, and the route that says so.
    a.create_queue("dyn_q")
    a.create_service(BROKER_CONFIGURATION, queue="dyn_q", contracts=[BROKER_CONFIGURATION_NOTICE])
    a.create_route("dynamic", service_name=BROKER_CONFIGURATION, address="LOCAL")
    b.create_queue("qb")
    b.create_service("//svc/B", queue="qb", contracts=["DEFAULT"])
    yield a, b
    a.dispose()
    b.dispose()


def _requests(a: Broker) -> list[str]:
    with a.transaction() as tx:
        return [
            (m.message_body or b"").decode()
            for m in tx.receive("dyn_q", top=100)
            if m.message_type_name == MISSING_ROUTE
        ]


def test_no_route_asks_the_dynamic_routing_service_once_then_delivers_by_its_route(
    pair: tuple[Broker, Broker],
) -> None:
    a, b = pair
    with a.transaction() as tx:
        h = tx.begin_dialog("//svc/A", "//svc/B", encryption=False)
        tx.send(h, body="order")
    (row,) = a.transmission_queue()
    assert "dynamic routing service" in row.transmission_status

    report = a.deliver()
    assert (report.delivered, report.delayed) == (0, 1)
    (row,) = [r for r in a.transmission_queue() if r.to_service_name == "//svc/B"]
    assert "waiting for the dynamic routing service" in row.transmission_status
    assert any(e.event == "route_requested" and e.object_name == "//svc/B" for e in a.events())

    # A second pass while the request is pending does not ask again.
    a.deliver(retry_now=True)

    # The dynamic routing service: read the request, create the route, end the conversation.
    with a.transaction() as tx:
        msgs = [m for m in tx.receive("dyn_q", top=100) if m.message_type_name == MISSING_ROUTE]
        assert [(m.message_body or b"").decode() for m in msgs] == ["//svc/B"]
        tx.end_conversation(msgs[0].conversation_handle)
    a.create_route("found", service_name="//svc/B", address="broker://b")
    assert _requests(a) == []

    report = a.deliver(retry_now=True)
    assert report.delivered == 1
    with b.transaction() as tx:
        assert [m.text() for m in tx.receive("qb")] == ["order"]
    assert a.transmission_queue() == []
    # The requester's side of the answered request is closed.
    with a.engine.connect() as conn:
        from sqlalchemy import text

        states = (
            conn.execute(
                text("SELECT state FROM broker_conversation_endpoint WHERE service_name = :s"),
                {"s": REQUESTER},
            )
            .scalars()
            .all()
        )
    assert states == ["CD"]


def test_a_named_route_still_wins_over_the_dynamic_routing_service(
    pair: tuple[Broker, Broker],
) -> None:
    a, _ = pair
    a.create_route("to_b", service_name="//svc/B", address="broker://b")
    with a.transaction() as tx:
        h = tx.begin_dialog("//svc/A", "//svc/B", encryption=False)
        tx.send(h, body="order")
    assert a.deliver().delivered == 1
    assert _requests(a) == []
