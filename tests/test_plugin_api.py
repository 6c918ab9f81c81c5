"""The plugin's HTTP API through FastAPI's TestClient, behind Airflow's real authentication.

The app (airflow_broker.provider.plugin.api.create_app) is mounted at ``/broker`` beside Airflow's
own auth manager app, as the API server does: the simple auth manager of the installed Airflow,
with users admin, op, user and viewer whose passwords it generates, and real JWTs from its
``POST /auth/token``. Token validation reads Airflow's ``revoked_token`` table, so this module
points Airflow's ORM at a throw-away SQLite database holding Airflow's tables for its duration
(and restores it after). The end-to-end test against a real ``airflow api-server`` is
test_plugin_e2e.py.
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
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
    poison,
    receive,
    send,
)
from sqlalchemy import func, insert, select

from airflow_broker import Broker
from airflow_broker.constants import DEFAULT
from airflow_broker.operations import echo
from airflow_broker.operations import monitoring as mon
from airflow_broker.provider.plugin.api import create_app
from airflow_broker.storage import schema as s

SIMPLE_AUTH_MANAGER = (
    "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
)
USERS = {"admin": "admin", "op": "op", "user": "user", "viewer": "viewer"}
REMOTE = "//remote/Nowhere"
NO_SUCH = "00000000-0000-4000-8000-000000000000"
PROBE = "probe-0123456789ab"

GETS = [
    "/overview",
    "/queues",
    "/queue-names",
    f"/queues/{SUPPLIER_QUEUE}",
    f"/queues/{SUPPLIER_QUEUE}/depth-history",
    "/services",
    "/contracts",
    "/conversations/states",
    "/conversations",
    f"/conversations/{NO_SUCH}",
    "/transmission-queue",
    "/routes",
    "/certificates",
    "/routing-services",
    "/routing-mappings",
    "/events",
    f"/probes/{PROBE}",
]
POSTS = [
    f"/queues/{SUPPLIER_QUEUE}/enable",
    f"/transmission-queue/{NO_SUCH}/retry",
    f"/transmission-queue/{NO_SUCH}/drop",
    f"/conversations/{NO_SUCH}/end",
    "/probes",
]
PAGED = ["/queues", "/conversations", "/transmission-queue", "/routing-mappings", "/events"]


# -- Airflow's authentication, for the module ------------------------------------------------


@dataclass
class Airflow:
    """Airflow's auth manager, initialized, and a token per user."""

    tokens: dict[str, str]

    def headers(self, user: str = "admin") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[user]}"}


def _parent_app() -> FastAPI:
    """An app like the API server's: the auth manager's app at /auth (POST /auth/token)."""
    from airflow.api_fastapi.app import init_auth_manager

    parent = FastAPI()
    init_auth_manager(parent)
    return parent


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    from airflow import settings
    from airflow.api_fastapi.app import purge_cached_app
    from airflow.models import import_all_models
    from airflow.models.base import Base

    home = tmp_path_factory.mktemp("airflow_api")
    mp = pytest.MonkeyPatch()
    mp.setenv("AIRFLOW__CORE__AUTH_MANAGER", SIMPLE_AUTH_MANAGER)
    mp.setenv(
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS",
        ",".join(f"{name}:{role}" for name, role in USERS.items()),
    )
    mp.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "False")
    mp.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE", str(home / "passwords.json"))
    mp.setenv("AIRFLOW__API_AUTH__JWT_SECRET", secrets.token_hex(32))
    previous = settings.SQL_ALCHEMY_CONN
    settings.dispose_orm(do_log=False)
    settings.SQL_ALCHEMY_CONN = f"sqlite:///{home / 'airflow.db'}"
    settings.configure_orm()
    assert settings.engine is not None
    import_all_models()
    Base.metadata.create_all(settings.engine)  # Airflow's tables (get_user reads revoked_token)
    purge_cached_app()
    try:
        client = TestClient(_parent_app())
        passwords = json.loads((home / "passwords.json").read_text())
        tokens = {}
        for name in USERS:
            r = client.post("/auth/token", json={"username": name, "password": passwords[name]})
            assert r.status_code == 201, r.text
            tokens[name] = r.json()["access_token"]
        yield Airflow(tokens)
    finally:
        purge_cached_app()
        settings.dispose_orm(do_log=False)
        settings.SQL_ALCHEMY_CONN = previous
        settings.configure_orm()
        mp.undo()


@pytest.fixture
def sqlite_broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker.connect(f"sqlite:///{tmp_path / 'broker.db'}")
    b.migrate()
    declare_pair(b)
    yield b
    b.dispose()


def client_for(broker: Broker) -> TestClient:
    parent = _parent_app()
    parent.mount("/broker", create_app(broker=broker))
    return TestClient(parent)


@pytest.fixture
def api(airflow: Airflow, sqlite_broker: Broker) -> TestClient:
    """The app on a SQLite broker holding the buyer/supplier pair."""
    return client_for(sqlite_broker)


def get(client: TestClient, airflow: Airflow, path: str, user: str = "viewer", **kw: Any) -> Any:
    r = client.get(f"/broker/api{path}", headers=airflow.headers(user), **kw)
    assert r.status_code == 200, (path, r.status_code, r.text)
    return r.json()


def post(
    client: TestClient, airflow: Airflow, path: str, body: Any = None, user: str = "op"
) -> Any:
    r = client.post(f"/broker/api{path}", headers=airflow.headers(user), json=body)
    assert r.status_code in (200, 202), (path, r.status_code, r.text)
    return r.json()


def snapshot(broker: Broker) -> dict[str, Any]:
    """What an action could change: queue status, endpoints, transmissions, events, probes."""
    with broker.engine.connect() as conn:

        def n(table: Any) -> int:
            return int(conn.execute(select(func.count()).select_from(table)).scalar_one())

        return {
            "queues": sorted(
                (r.name, r.status, r.rollback_count) for r in conn.execute(select(s.queue))
            ),
            "endpoints": sorted(
                (str(r.conversation_handle), r.state)
                for r in conn.execute(select(s.conversation_endpoint))
            ),
            "transmissions": n(s.transmission_queue),
            "messages": n(s.message),
            "events": n(s.event),
        }


def to_remote(broker: Broker, *bodies: str) -> uuid.UUID:
    with broker.transaction() as tx:
        h = tx.begin_dialog(BUYER, REMOTE, contract=DEFAULT)
        for body in bodies:
            tx.send(h, DEFAULT, body)
    return h


# -- authentication and authorization ---------------------------------------------------------


@pytest.mark.parametrize("path", GETS + POSTS)
def test_401_without_a_token(api: TestClient, sqlite_broker: Broker, path: str) -> None:
    before = snapshot(sqlite_broker)
    method = api.post if path in POSTS else api.get
    r = method(f"/broker/api{path}")
    assert r.status_code == 401, r.text
    assert r.json() == {"detail": "Not authenticated"}
    assert snapshot(sqlite_broker) == before


def test_401_comes_before_any_validation(api: TestClient) -> None:
    assert api.get("/broker/api/conversations/not-a-uuid").status_code == 401
    assert api.get("/broker/api/conversations?limit=100000").status_code == 401
    assert api.post("/broker/api/probes", json={"nonsense": 1}).status_code == 401
    assert api.get("/broker/api/queues/NoSuchQueue").status_code == 401


def test_a_forged_token_is_refused(api: TestClient) -> None:
    forged = "eyJhbGciOiJIUzUxMiJ9.eyJzdWIiOiJhZG1pbiIsInJvbGUiOiJhZG1pbiJ9.c2lnbmF0dXJl"
    r = api.get("/broker/api/queues", headers={"Authorization": f"Bearer {forged}"})
    assert r.status_code in (401, 403)


def test_the_ui_session_cookie_works(api: TestClient, airflow: Airflow) -> None:
    api.cookies.set("_token", airflow.tokens["viewer"])
    r = api.get("/broker/api/queues")
    assert r.status_code == 200, r.text
    assert {q["name"] for q in r.json()["items"]} == {BUYER_QUEUE, SUPPLIER_QUEUE}


@pytest.mark.parametrize("user", ["viewer", "user", "op", "admin"])
def test_every_user_may_read(api: TestClient, airflow: Airflow, user: str) -> None:
    for path in GETS:
        r = api.get(f"/broker/api{path}", headers=airflow.headers(user))
        # An unknown conversation or probe is 404; everything else is there.
        assert r.status_code == (404 if NO_SUCH in path or PROBE in path else 200), (path, r.text)


@pytest.mark.parametrize("user", ["viewer", "user"])
def test_actions_need_edit_rights_on_the_broker_connection(
    api: TestClient, airflow: Airflow, sqlite_broker: Broker, user: str
) -> None:
    echo.setup(sqlite_broker)
    poison(sqlite_broker)
    h = to_remote(sqlite_broker, "stuck")
    before = snapshot(sqlite_broker)
    for path, body in (
        (f"/queues/{SUPPLIER_QUEUE}/enable", None),
        ("/queues/NoSuchQueue/enable", None),  # 403 before 404: nothing is revealed
        (f"/transmission-queue/{h}/retry", None),
        (f"/transmission-queue/{h}/drop", None),
        (f"/conversations/{h}/end", None),
        ("/probes", {"service": echo.ECHO_SERVICE}),
    ):
        r = api.post(f"/broker/api{path}", headers=airflow.headers(user), json=body)
        assert r.status_code == 403, (path, r.text)
        assert "edit access to connection 'broker_default'" in r.json()["detail"]
        assert user in r.json()["detail"]
    assert snapshot(sqlite_broker) == before


def test_an_op_may_act(api: TestClient, airflow: Airflow, sqlite_broker: Broker) -> None:
    poison(sqlite_broker)
    done = post(api, airflow, f"/queues/{SUPPLIER_QUEUE}/enable", user="op")
    assert done["changed"] is True
    [action] = mon.events(sqlite_broker, event=mon.OPERATOR_ACTION).items
    assert action.detail.startswith("op: re-enabled queue")


# -- reading ----------------------------------------------------------------------------------


def test_reading_every_list(airflow: Airflow, broker: Broker) -> None:
    """Every GET endpoint on both engines, with something in it."""
    declare_pair(broker)
    echo.setup(broker)
    _initiator, target = open_order(broker)
    send(broker, begin(broker), ORDER, {"po": 2})
    remote = to_remote(broker, "a", "b")
    broker.create_route("to_west", service_name=REMOTE, address="broker://west")
    broker.alter_queue(BUYER_QUEUE, status=False)
    broker.alter_queue(BUYER_QUEUE, status=True)
    api = client_for(broker)

    overview = get(api, airflow, "/overview")
    assert overview["instance_id"] == broker.instance_id
    assert overview["engine"] == broker.dialect
    assert overview["transmission_queue"] == 2

    queues = {q["name"]: q for q in get(api, airflow, "/queues")["items"]}
    assert set(queues) == {BUYER_QUEUE, SUPPLIER_QUEUE, echo.ECHO_QUEUE, echo.PROBER_QUEUE}
    assert queues[SUPPLIER_QUEUE]["depth"] == 1
    assert queues[SUPPLIER_QUEUE]["oldest_age_seconds"] >= 0
    assert queues[echo.ECHO_QUEUE]["activation"]["reader"] == echo.ECHO_READER_DAG
    one = get(api, airflow, f"/queues/{SUPPLIER_QUEUE}")
    assert one["queue"]["name"] == SUPPLIER_QUEUE
    assert (one["readers"], one["poison_events"]) == ([], [])

    services = {x["name"]: x for x in get(api, airflow, "/services")}
    assert services[SUPPLIER]["contracts"] == [CONTRACT]
    contracts = {x["name"]: x for x in get(api, airflow, "/contracts")}
    assert contracts[CONTRACT]["message_types"][ORDER] == "initiator"

    states = {x["state"]: x["count"] for x in get(api, airflow, "/conversations/states")}
    assert states["CO"] == 5
    by_queue = get(api, airflow, "/conversations/states", params={"queue": SUPPLIER_QUEUE})
    assert sum(x["count"] for x in by_queue) == 2
    page = get(api, airflow, "/conversations", params={"limit": 2})
    assert (page["total"], page["limit"], page["offset"], page["next_offset"]) == (5, 2, 0, 2)
    assert page["items"][0]["conversation_handle"] == str(remote)
    filtered = get(
        api,
        airflow,
        "/conversations",
        params={"state": "conversing", "queue": SUPPLIER_QUEUE, "initiator": "false"},
    )
    assert {c["conversation_handle"] for c in filtered["items"]} >= {str(target)}
    assert get(api, airflow, "/conversations", params={"far_service": REMOTE})["total"] == 1
    assert get(api, airflow, "/conversations", params={"service": SUPPLIER})["total"] == 2
    conv = get(api, airflow, f"/conversations/{target}")
    assert (conv["conversation_handle"], conv["queue"]) == (str(target), SUPPLIER_QUEUE)

    tq = get(api, airflow, "/transmission-queue")
    assert tq["total"] == 2 and len(tq["items"]) == 2
    assert {t["to_service_name"] for t in tq["items"]} == {REMOTE}
    assert REMOTE in tq["items"][0]["transmission_status"]  # why: no route reaches it
    assert sum(w["count"] for w in tq["summary"]) == 2
    assert (
        get(api, airflow, "/transmission-queue", params={"conversation_handle": str(remote)})[
            "total"
        ]
        == 2
    )
    assert get(api, airflow, "/transmission-queue", params={"to_service": SUPPLIER})["total"] == 0

    routes = {r["name"]: r for r in get(api, airflow, "/routes")}
    assert routes["to_west"]["kind"] == "broker"
    assert get(api, airflow, "/routing-services") == []
    assert get(api, airflow, "/routing-mappings")["items"] == []

    events = get(api, airflow, "/events", params={"limit": 1})
    assert (events["total"], events["next_offset"]) == (2, 1)
    assert events["items"][0]["event"] == "queue_enabled"
    assert get(api, airflow, "/events", params={"event": "queue_disabled"})["total"] == 1


def test_a_queue_name_with_slashes(
    api: TestClient, airflow: Airflow, sqlite_broker: Broker
) -> None:
    sqlite_broker.create_queue("team/orders", status=False)
    assert get(api, airflow, "/queues/team/orders")["queue"]["status"] == "disabled"
    assert post(api, airflow, "/queues/team/orders/enable")["changed"] is True
    assert get(api, airflow, "/queues/team%2Forders")["queue"]["status"] == "enabled"


def test_queue_depth_history(airflow: Airflow, broker: Broker) -> None:
    """Reading the queue list samples every queue (a fresh page has a point); the history is
    the queue's samples of the last minutes, oldest first, on both engines."""
    declare_pair(broker)
    send(broker, begin(broker), NOTE, "a", "b")
    now = datetime.now(UTC)
    with broker.engine.begin() as conn:
        qid = conn.execute(
            select(s.queue.c.queue_id).where(s.queue.c.name == SUPPLIER_QUEUE)
        ).scalar_one()
        conn.execute(
            insert(s.queue_sample),
            [
                {"queue_id": qid, "sampled_at": now - timedelta(minutes=m), "depth": m}
                for m in (90, 40, 20)
            ],
        )
    api = client_for(broker)
    assert get(api, airflow, "/queues")  # samples now
    history = get(api, airflow, f"/queues/{SUPPLIER_QUEUE}/depth-history")
    assert (history["queue"], history["minutes"]) == (SUPPLIER_QUEUE, 60)
    assert [p["depth"] for p in history["samples"]] == [40, 20, 2]
    ats = [datetime.fromisoformat(p["at"]) for p in history["samples"]]
    assert ats == sorted(ats) and all(a.tzinfo is not None for a in ats)
    assert ats[-1] >= now
    week = get(api, airflow, f"/queues/{SUPPLIER_QUEUE}/depth-history", params={"minutes": 10080})
    assert [p["depth"] for p in week["samples"]] == [90, 40, 20, 2]
    short = get(api, airflow, f"/queues/{SUPPLIER_QUEUE}/depth-history", params={"minutes": 1})
    assert [p["depth"] for p in short["samples"]] == [2]
    buyer = get(api, airflow, f"/queues/{BUYER_QUEUE}/depth-history")
    assert [p["depth"] for p in buyer["samples"]] == [0]


def test_depth_history_of_a_queue_name_with_slashes(
    api: TestClient, airflow: Airflow, sqlite_broker: Broker
) -> None:
    sqlite_broker.create_queue("team/orders")
    history = get(api, airflow, "/queues/team/orders/depth-history")
    assert history["queue"] == "team/orders"
    assert [p["depth"] for p in history["samples"]] == [0]


@pytest.mark.parametrize("minutes", ["0", "-5", "10081", "1.5", "an hour", ""])
def test_depth_history_refuses_bad_minutes(
    api: TestClient, airflow: Airflow, sqlite_broker: Broker, minutes: str
) -> None:
    r = api.get(
        f"/broker/api/queues/{SUPPLIER_QUEUE}/depth-history",
        headers=airflow.headers(),
        params={"minutes": minutes},
    )
    assert r.status_code == 422, r.text
    [problem] = r.json()["detail"]
    assert problem["loc"] == ["query", "minutes"]


def test_reading_needs_read_access_to_dags(
    api: TestClient, airflow: Airflow, sqlite_broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.api_fastapi.app import get_auth_manager

    monkeypatch.setattr(get_auth_manager(), "is_authorized_dag", lambda **kwargs: False)
    before = snapshot(sqlite_broker)
    for path in ("/queues", f"/queues/{SUPPLIER_QUEUE}/depth-history"):
        r = api.get(f"/broker/api{path}", headers=airflow.headers("admin"))
        assert r.status_code == 403, (path, r.text)
        assert "reading needs read access to DAGs" in r.json()["detail"]
    assert snapshot(sqlite_broker) == before
    with sqlite_broker.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(s.queue_sample)).scalar_one() == 0


# -- acting -----------------------------------------------------------------------------------


def test_re_enable_a_poisoned_queue(
    api: TestClient, airflow: Airflow, sqlite_broker: Broker
) -> None:
    poison(sqlite_broker)
    queue = get(api, airflow, f"/queues/{SUPPLIER_QUEUE}")
    assert queue["queue"]["status"] == "disabled" and queue["queue"]["poison_events"] == 1
    assert "poison message handling" in queue["poison_events"][0]["detail"]

    done = post(api, airflow, f"/queues/{SUPPLIER_QUEUE}/enable")
    assert (done["action"], done["target"], done["changed"]) == (
        "enable_queue",
        SUPPLIER_QUEUE,
        True,
    )
    assert get(api, airflow, f"/queues/{SUPPLIER_QUEUE}")["queue"]["enabled"] is True
    assert post(api, airflow, f"/queues/{SUPPLIER_QUEUE}/enable")["changed"] is False
    assert [m.message_body for m in receive(sqlite_broker, SUPPLIER_QUEUE)] == [b"poison"]


def test_retry_and_drop_stuck_transmissions(
    api: TestClient, airflow: Airflow, sqlite_broker: Broker
) -> None:
    sqlite_broker.alter_queue(SUPPLIER_QUEUE, status=False)
    local = begin(sqlite_broker)
    send(sqlite_broker, local, ORDER, {"po": 1})
    stuck = to_remote(sqlite_broker, "a", "b")

    waiting = post(api, airflow, f"/transmission-queue/{local}/retry")
    assert waiting["data"]["rescheduled"] == 1 and len(waiting["data"]["waiting"]) == 1
    assert "disabled" in waiting["data"]["waiting"][0]["transmission_status"]
    sqlite_broker.alter_queue(SUPPLIER_QUEUE, status=True)
    done = post(api, airflow, f"/transmission-queue/{local}/retry", {"deliver": True})
    assert done["data"]["waiting"] == [] and done["data"]["delivery"]["delivered"] >= 1
    assert [m.json() for m in receive(sqlite_broker, SUPPLIER_QUEUE)] == [{"po": 1}]

    later = post(api, airflow, f"/transmission-queue/{stuck}/retry", {"deliver": False})
    assert "delivery" not in later["data"] and len(later["data"]["waiting"]) == 2
    first = later["data"]["waiting"][0]["id"]
    one = post(api, airflow, f"/transmission-queue/{stuck}/drop", {"message_id": first})
    assert one["data"] == {"dropped": 1}
    rest = post(api, airflow, f"/transmission-queue/{stuck}/drop")
    assert rest["data"] == {"dropped": 1}
    assert get(api, airflow, "/transmission-queue")["total"] == 0


def test_end_a_conversation(api: TestClient, airflow: Airflow, sqlite_broker: Broker) -> None:
    stuck = to_remote(sqlite_broker, "a")
    ended = post(api, airflow, f"/conversations/{stuck}/end")
    assert ended["data"] == {
        "previous_state": "CO",
        "messages_removed": 0,
        "transmissions_removed": 1,
    }
    r = api.get(f"/broker/api/conversations/{stuck}", headers=airflow.headers())
    assert r.status_code == 404

    initiator, target = open_order(sqlite_broker)
    body = {"cleanup": False, "error_code": 7, "error_description": "cancelled by an operator"}
    post(api, airflow, f"/conversations/{initiator}/end", body)
    [error] = receive(sqlite_broker, SUPPLIER_QUEUE, conversation_handle=target)
    assert error.error == (7, "cancelled by an operator")
    assert get(api, airflow, f"/conversations/{initiator}")["state"] == "CD"


def test_an_echo_probe_round_trip(api: TestClient, airflow: Airflow, sqlite_broker: Broker) -> None:
    echo.setup(sqlite_broker)
    r = api.post(
        "/broker/api/probes",
        headers=airflow.headers("op"),
        json={"service": echo.ECHO_SERVICE, "timeout_seconds": 30},
    )
    assert r.status_code == 202, r.text
    sent = r.json()
    assert (sent["status"], sent["service"]) == ("waiting", echo.ECHO_SERVICE)
    assert get(api, airflow, f"/probes/{sent['probe_id']}")["status"] == "waiting"

    with sqlite_broker.transaction() as tx:  # the echo service's reader
        echo.echo_handler(tx, tx.receive(echo.ECHO_QUEUE))
    done = get(api, airflow, f"/probes/{sent['probe_id']}")  # a viewer may poll
    assert done["status"] == "alive" and done["round_trip_ms"] >= 0
    assert done["answered_at"] is not None


# -- bad input --------------------------------------------------------------------------------


def test_unknown_queue_is_404_naming_it(api: TestClient, airflow: Airflow) -> None:
    for method, path in (
        ("get", "/queues/NoSuchQueue"),
        ("get", "/queues/NoSuchQueue/depth-history"),
        ("get", "/queues/NoSuchQueue/depth-history?minutes=5"),
        ("post", "/queues/NoSuchQueue/enable"),
        ("get", "/conversations?queue=NoSuchQueue"),
        ("get", "/conversations/states?queue=NoSuchQueue"),
    ):
        r = api.request(method, f"/broker/api{path}", headers=airflow.headers("admin"))
        assert r.status_code == 404, (path, r.text)
        assert r.json() == {"detail": "queue 'NoSuchQueue' does not exist in this broker"}


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/conversations/not-a-uuid"),
        ("get", "/conversations/1234"),
        ("post", "/conversations/not-a-uuid/end"),
        ("post", "/transmission-queue/zzz/retry"),
        ("post", "/transmission-queue/12345678-1234-1234-1234-12345678901/drop"),
        ("get", "/transmission-queue?conversation_handle=nope"),
        ("get", "/probes/probe-XYZ"),
        ("get", "/probes/not-a-probe"),
    ],
)
def test_malformed_ids_are_422(
    api: TestClient, airflow: Airflow, sqlite_broker: Broker, method: str, path: str
) -> None:
    before = snapshot(sqlite_broker)
    r = api.request(method, f"/broker/api{path}", headers=airflow.headers("admin"))
    assert r.status_code == 422, r.text
    [problem] = r.json()["detail"]
    assert problem["loc"][0] in ("path", "query")
    assert snapshot(sqlite_broker) == before


def test_unknown_ids_are_404(api: TestClient, airflow: Airflow, sqlite_broker: Broker) -> None:
    echo.setup(sqlite_broker)
    h, _ = open_order(sqlite_broker)  # exists, but nothing waits to leave
    before = snapshot(sqlite_broker)
    for method, path, says in (
        ("get", f"/conversations/{NO_SUCH}", f"conversation handle {NO_SUCH} does not exist"),
        ("post", f"/conversations/{NO_SUCH}/end", "does not exist"),
        ("post", f"/transmission-queue/{NO_SUCH}/retry", "does not exist"),
        ("post", f"/transmission-queue/{h}/drop", "has no messages in the transmission queue"),
        ("get", f"/probes/{PROBE}", f"probe {PROBE} does not exist"),
    ):
        r = api.request(method, f"/broker/api{path}", headers=airflow.headers("admin"))
        assert r.status_code == 404, (path, r.text)
        assert says in r.json()["detail"]
    stuck = to_remote(sqlite_broker, "a")
    before = snapshot(sqlite_broker)
    r = api.post(
        f"/broker/api/transmission-queue/{stuck}/drop",
        headers=airflow.headers("admin"),
        json={"message_id": 99999},
    )
    assert r.status_code == 404 and "message 99999" in r.json()["detail"]
    assert snapshot(sqlite_broker) == before


@pytest.mark.parametrize("path", PAGED)
@pytest.mark.parametrize(
    "params",
    [{"limit": 0}, {"limit": 501}, {"limit": -5}, {"offset": -1}, {"limit": "many"}],
)
def test_out_of_range_paging_is_422(
    api: TestClient, airflow: Airflow, path: str, params: dict[str, Any]
) -> None:
    r = api.get(f"/broker/api{path}", headers=airflow.headers(), params=params)
    assert r.status_code == 422, r.text
    [problem] = r.json()["detail"]
    assert problem["loc"] == ["query", next(iter(params))]


@pytest.mark.parametrize("path", PAGED)
def test_an_offset_past_the_end_is_422(api: TestClient, airflow: Airflow, path: str) -> None:
    r = api.get(f"/broker/api{path}", headers=airflow.headers(), params={"offset": 10})
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith("offset 10 is past the end")
    assert api.get(f"/broker/api{path}", headers=airflow.headers()).status_code == 200


def test_bad_filters_and_bodies_are_422_and_change_nothing(
    api: TestClient, airflow: Airflow, sqlite_broker: Broker
) -> None:
    echo.setup(sqlite_broker)
    h, _ = open_order(sqlite_broker)
    r = api.get("/broker/api/conversations?state=XX", headers=airflow.headers())
    assert r.status_code == 422 and "conversation state 'XX' is not one of" in r.json()["detail"]
    assert (
        api.get("/broker/api/conversations?initiator=perhaps", headers=airflow.headers())
    ).status_code == 422
    before = snapshot(sqlite_broker)
    for path, body, says in (
        (
            f"/conversations/{h}/end",
            {"cleanup": True, "error_code": 1, "error_description": "x"},
            "WITH ERROR or WITH CLEANUP, not both",
        ),
        (f"/conversations/{h}/end", {"clean": True}, "extra_forbidden"),
        (f"/transmission-queue/{h}/drop", {"message_id": 0}, "greater_than_equal"),
        ("/probes", {}, "missing"),
        ("/probes", {"service": echo.ECHO_SERVICE, "timeout_seconds": 0}, "greater_than"),
        ("/probes", {"service": echo.ECHO_SERVICE, "timeout_seconds": 1e6}, "less_than_equal"),
        ("/probes", {"service": SUPPLIER}, "does not accept the echo contract"),
        ("/probes", {"service": ""}, "string_too_short"),
    ):
        r = api.post(f"/broker/api{path}", headers=airflow.headers("admin"), json=body)
        assert r.status_code == 422, (path, body, r.text)
        assert says in r.text, (path, body, r.text)
    assert snapshot(sqlite_broker) == before


def test_ending_an_ended_conversation_again_is_409(
    api: TestClient, airflow: Airflow, sqlite_broker: Broker
) -> None:
    h, _ = open_order(sqlite_broker)
    post(api, airflow, f"/conversations/{h}/end", {"cleanup": False})
    before = snapshot(sqlite_broker)
    r = api.post(
        f"/broker/api/conversations/{h}/end",
        headers=airflow.headers("admin"),
        json={"cleanup": False},
    )
    assert r.status_code == 409
    assert (
        r.json()["detail"]
        == f"conversation {h} has already ended on this side (DO: DISCONNECTED_OUTBOUND)"
    )
    assert snapshot(sqlite_broker) == before


def test_a_probe_needs_the_echo_example(
    api: TestClient, airflow: Airflow, sqlite_broker: Broker
) -> None:
    before = snapshot(sqlite_broker)
    r = api.post(
        "/broker/api/probes", headers=airflow.headers(), json={"service": echo.ECHO_SERVICE}
    )
    assert r.status_code == 409
    assert "echo_setup DAG" in r.json()["detail"]
    assert snapshot(sqlite_broker) == before


def test_a_broker_database_without_tables_is_503(airflow: Airflow, tmp_path: Path) -> None:
    empty = Broker.connect(f"sqlite:///{tmp_path / 'empty.db'}")
    try:
        api = client_for(empty)
        r = api.get("/broker/api/queues", headers=airflow.headers())
        assert r.status_code == 503
        assert r.json()["detail"].startswith("the broker database failed: no such table")
    finally:
        empty.dispose()


def test_the_broker_of_the_airflow_connection(
    airflow: Airflow, sqlite_broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a broker given, the app opens the one of connection broker_default."""
    url = sqlite_broker.engine.url.render_as_string(hide_password=False)
    monkeypatch.setenv(
        "AIRFLOW_CONN_BROKER_DEFAULT",
        json.dumps({"conn_type": "broker", "extra": {"url": url}}),
    )
    app = create_app()
    parent = _parent_app()
    parent.mount("/broker", app)
    overview = get(TestClient(parent), airflow, "/overview")
    assert overview["instance_id"] == sqlite_broker.instance_id
    app.state.broker_source.get().dispose()


def test_openapi_lists_every_endpoint(api: TestClient) -> None:
    doc = api.get("/broker/api/openapi.json").json()
    paths = {p.removeprefix("/api") for p in doc["paths"]}
    assert {p.split("?")[0] for p in GETS if NO_SUCH not in p and PROBE not in p} - {
        f"/queues/{SUPPLIER_QUEUE}",
        f"/queues/{SUPPLIER_QUEUE}/depth-history",
    } <= paths
    assert "/probes" in paths and "/queues/{queue}/enable" in paths
    assert "/queues/{queue}/depth-history" in paths


def test_certificates_ending_soon_on_the_overview_and_their_list(
    airflow: Airflow, sqlite_broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dialog security's certificates: those ending within 30 days (or ended) on the overview,
    every one at /certificates; never a private key."""
    from airflow_broker.security import crypto
    from airflow_broker.security import master_key as mk

    monkeypatch.setattr(mk, "registered_master_key_sources", lambda: ())
    monkeypatch.setenv(crypto.MASTER_KEY_ENV, "test")
    now = datetime.now(UTC)
    sqlite_broker.create_certificate("year", owner=BUYER)
    sqlite_broker.create_certificate("soon", owner=BUYER, expires_at=now + timedelta(days=9))
    api = client_for(sqlite_broker)
    [soon] = get(api, airflow, "/overview")["certificates_expiring"]
    assert (soon["name"], soon["owner"], soon["expired"], soon["has_private_key"]) == (
        "soon",
        BUYER,
        False,
        True,
    )
    assert datetime.fromisoformat(soon["expires_at"]) > now
    assert "private_key" not in soon and "pem" not in soon
    assert [c["name"] for c in get(api, airflow, "/certificates")] == ["soon", "year"]
    listed = get(api, airflow, "/certificates", params={"expiring_within_days": 30})
    assert [c["name"] for c in listed] == ["soon"]
    r = api.get(
        "/broker/api/certificates",
        params={"expiring_within_days": -1},
        headers=airflow.headers("viewer"),
    )
    assert r.status_code == 422
