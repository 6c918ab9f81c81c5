"""Seed 001's route matching and choosing, and seed 003's load balancing: one case per rule.

Pure functions, no database: the same rules serve the delivery path and the Spark job.
"""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from airflow_broker.routing import (
    LOCAL,
    TRANSPORT,
    Route,
    choose_routes,
    dialog_bucket,
    match_routes,
    pick_broker_instance,
    route_conversation,
    transport_address,
)

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
SVC = "//sales/Target"
B1 = "11111111-1111-1111-1111-111111111111"
B2 = "22222222-2222-2222-2222-222222222222"
DIALOG = uuid.UUID("00000000-0000-0000-0000-000000000001")

exact = Route("exact", SVC, B1, "broker://east")
other_id = Route("other_id", SVC, B2, "broker://west")
no_id = Route("no_id", SVC, None, "broker://gw")
wildcard = Route("AutoCreatedLocal", None, None, LOCAL)
expired = Route("expired", SVC, None, "broker://old", expires_at=NOW - timedelta(seconds=1))


@pytest.mark.parametrize(
    ("case", "routes", "broker_instance", "local", "dynamic", "step", "names"),
    [
        (
            "1: exact name and broker id",
            [exact, other_id, no_id, wildcard],
            B1,
            (),
            False,
            1,
            {"exact"},
        ),
        (
            "2: name without broker id wins over ids when none was asked",
            [exact, no_id, wildcard],
            None,
            (),
            False,
            2,
            {"no_id"},
        ),
        (
            "2: also when an id was asked but no route has it",
            [other_id, no_id],
            B1,
            (),
            False,
            2,
            {"no_id"},
        ),
        (
            "3: no id asked, only routes with ids: one id picked",
            [exact, other_id, wildcard],
            None,
            (),
            False,
            3,
            None,
        ),
        ("4: dynamic routing service", [wildcard], None, (), True, 4, set()),
        (
            "5: wildcard route",
            [wildcard, Route("x", "//other", None, "broker://x")],
            None,
            (),
            False,
            5,
            {"AutoCreatedLocal"},
        ),
        (
            "6: id asked and a local service of that name",
            [],
            B1,
            (SVC,),
            False,
            6,
            {"(local service)"},
        ),
        (
            "7: nothing matches",
            [Route("x", "//other", None, "broker://x")],
            None,
            (),
            False,
            7,
            set(),
        ),
        ("expired routes never match", [expired], None, (), False, 7, set()),
    ],
)
def test_matching_steps(
    case: str,
    routes: list[Route],
    broker_instance: str | None,
    local: tuple[str, ...],
    dynamic: bool,
    step: int,
    names: set[str] | None,
) -> None:
    match = match_routes(
        routes,
        SVC,
        broker_instance,
        dialog_id=DIALOG,
        now=NOW,
        local_services=local,
        dynamic_routing=dynamic,
    )
    assert match.step == step, case
    if names is not None:
        assert {r.name for r in match.routes} == names, case
    else:
        assert len({r.broker_instance for r in match.routes}) == 1, case
        assert match.broker_instance in (B1, B2), case


def test_choosing_prefers_mirror_then_local_then_address_then_transport() -> None:
    # all on broker id B1 and asked for B1, so that every one matches at step 1
    mirror = Route("m", SVC, B1, "broker://principal", mirror_address="broker://mirror")
    local = Route("l", SVC, B1, LOCAL)
    explicit = Route("a", SVC, B1, "broker://east")
    transport = Route("t", SVC, B1, TRANSPORT)

    def choose(*routes: Route, local_service: bool = True) -> tuple[str, tuple[str, ...]]:
        match = match_routes(routes, SVC, B1, dialog_id=DIALOG, now=NOW)
        assert match.step == 1
        decision = choose_routes(match, SVC, service_is_local=local_service)
        return decision.kind, decision.addresses

    assert choose(mirror, local, explicit, transport) == (
        "remote",
        ("broker://principal", "broker://mirror"),
    )
    assert choose(local, explicit, transport) == ("local", (LOCAL,))
    # LOCAL but the service is not hosted here: the next kind is used
    assert choose(local, explicit, transport, local_service=False) == (
        "remote",
        ("broker://east",),
    )
    assert choose(local, transport, local_service=False) == ("delayed", ())
    transport_svc = "broker://west/orders/Target"
    match = match_routes(
        [Route("t", transport_svc, None, TRANSPORT)], transport_svc, None, dialog_id=DIALOG, now=NOW
    )
    decision = choose_routes(match, transport_svc, service_is_local=False)
    assert (decision.kind, decision.addresses) == ("remote", ("broker://west",))


def test_identical_routes_count_once_and_alternatives_are_all_offered() -> None:
    a = Route("gw_a", SVC, B1, "broker://gw_a")
    a_again = Route("gw_a_copy", SVC, B1, "broker://gw_a")
    b = Route("gw_b", SVC, B1, "broker://gw_b")
    decision = route_conversation([a, a_again, b], SVC, B1, dialog_id=DIALOG, now=NOW)
    assert decision.kind == "remote"
    assert decision.addresses == ("broker://gw_a", "broker://gw_b")
    assert decision.broker_instance == B1


def test_no_route_is_delayed_not_an_error() -> None:
    decision = route_conversation([], SVC, None, dialog_id=DIALOG, now=NOW)
    assert decision.kind == "delayed"
    assert decision.step == 7
    assert "no route" in decision.reason
    # the default wildcard LOCAL route, for a service not hosted here: delayed too
    decision = route_conversation([wildcard], SVC, None, dialog_id=DIALOG, now=NOW)
    assert (decision.kind, decision.step) == ("delayed", 5)


def _split(routes: list[Route], dialogs: int = 1000) -> Counter[str]:
    ids = [uuid.UUID(int=(i * 2654435761) % 2**128) for i in range(dialogs)]
    return Counter(
        route_conversation(routes, SVC, None, dialog_id=d, now=NOW).broker_instance or ""
        for d in ids
    )


def test_load_balancing_splits_dialogs_evenly_and_deterministically() -> None:
    routes = [exact, other_id]
    split = _split(routes)
    assert set(split) == {B1, B2}
    assert all(420 <= n <= 580 for n in split.values()), split
    # every message of a dialog goes to the same instance
    d = uuid.uuid4()
    assert len({pick_broker_instance(d, [B1, B2]) for _ in range(20)}) == 1


def test_more_routes_to_one_broker_id_do_not_weight_the_choice() -> None:
    third = Route("third", SVC, B2, "broker://west2")
    assert _split([exact, other_id, third]) == _split([exact, other_id])


def test_dialog_bucket_is_the_documented_hash() -> None:
    # sha256("00000000-0000-0000-0000-000000000001"), first 15 hex digits, as Spark computes it
    import hashlib

    digest = hashlib.sha256(str(DIALOG).encode()).hexdigest()
    assert dialog_bucket(DIALOG, 7) == int(digest[:15], 16) % 7
    assert dialog_bucket(str(DIALOG).upper(), 7) == dialog_bucket(DIALOG, 7)


def test_transport_address_from_service_name() -> None:
    assert transport_address("broker://west/orders/Target") == "broker://west"
    assert transport_address("//sales/Target") is None
