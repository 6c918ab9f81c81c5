"""The plugin's peek endpoints through FastAPI's TestClient, behind Airflow's real authentication
(the set-up of test_plugin_api.py): a queue's waiting messages, paged, with body previews, and
its dead-lettering and disabling events."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import test_plugin_api as base
from fastapi.testclient import TestClient
from helpers import (
    BUYER_QUEUE,
    INVOICE,
    NOTE,
    SUPPLIER_QUEUE,
    begin,
    declare_pair,
    open_order,
    poison,
    receive,
    send,
)
from sqlalchemy import update
from test_plugin_api import Airflow, client_for, get, snapshot

from airflow_broker import Broker
from airflow_broker.messaging.events import record_event
from airflow_broker.messaging.objects import DeadLetter
from airflow_broker.operations import monitoring as mon
from airflow_broker.storage import schema as s

# The fixtures of test_plugin_api.py: Airflow's auth manager with its users, a SQLite broker
# holding the buyer/supplier pair, and the app on it.
airflow = base.airflow
sqlite_broker = base.sqlite_broker
api = base.api

MESSAGES = f"/queues/{SUPPLIER_QUEUE}/messages"
EVENTS = f"/queues/{SUPPLIER_QUEUE}/events"
PATHS = [MESSAGES, EVENTS]


class ReaderFailed(Exception):
    """A reader's processing failed: its receiving transaction rolls back."""


@pytest.mark.parametrize("path", PATHS)
def test_401_without_a_token(api: TestClient, path: str) -> None:
    r = api.get(f"/broker/api{path}")
    assert r.status_code == 401 and r.json() == {"detail": "Not authenticated"}
    assert api.get("/broker/api/queues/NoSuchQueue/messages?limit=0").status_code == 401


@pytest.mark.parametrize("user", ["viewer", "user", "op", "admin"])
def test_every_user_may_peek(api: TestClient, airflow: Airflow, user: str) -> None:
    for path in PATHS:
        get(api, airflow, path, user=user)


def test_reading_needs_read_access_to_dags(
    api: TestClient, airflow: Airflow, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.api_fastapi.app import get_auth_manager

    monkeypatch.setattr(get_auth_manager(), "is_authorized_dag", lambda **kwargs: False)
    for path in PATHS:
        r = api.get(f"/broker/api{path}", headers=airflow.headers("admin"))
        assert r.status_code == 403 and "reading needs read access to DAGs" in r.json()["detail"]


def test_waiting_messages_paged_with_previews(airflow: Airflow, broker: Broker) -> None:
    """On both engines: order, paging, every field, and nothing received or locked."""
    declare_pair(broker)
    a, b = begin(broker), begin(broker)
    send(broker, a, NOTE, "first", b"\x00\x01binary\x02" * 40)
    send(broker, b, NOTE, "x" * 500)
    send(broker, a, NOTE, None)
    api = client_for(broker)
    before = snapshot(broker)

    page = get(api, airflow, MESSAGES, params={"limit": 2})
    assert (page["total"], page["limit"], page["offset"], page["next_offset"]) == (4, 2, 0, 2)
    assert (page["queue"], page["enabled"], page["retention"], page["retained"]) == (
        SUPPLIER_QUEUE,
        True,
        False,
        0,
    )
    assert page["conversation_handle"] is None
    first, binary = page["items"]
    assert first["body_preview"] == {
        "text": "first",
        "encoding": "utf-8",
        "size": 5,
        "truncated": False,
    }
    assert (first["message_type_name"], first["message_sequence_number"]) == (NOTE, 0)
    assert (first["receive_count"], first["dead_letter"], first["status"]) == (0, None, 1)
    assert first["age_seconds"] >= 0 and first["enqueued_at"].endswith("+00:00")
    uuid.UUID(first["conversation_handle"])
    uuid.UUID(first["conversation_group_id"])
    assert binary["body_preview"]["encoding"] == "base64"
    assert binary["body_preview"]["size"] == 360 and binary["body_preview"]["truncated"] is True
    assert binary["conversation_handle"] == first["conversation_handle"]

    rest = get(api, airflow, MESSAGES, params={"limit": 2, "offset": 2})
    assert (rest["total"], rest["offset"], rest["next_offset"]) == (4, 2, None)
    long, empty = rest["items"]
    assert long["body_preview"]["text"] == "x" * 200 and long["body_preview"]["truncated"]
    assert long["conversation_handle"] != first["conversation_handle"]
    assert empty["body_preview"] == {
        "text": None,
        "encoding": None,
        "size": None,
        "truncated": False,
    }
    short = get(api, airflow, MESSAGES, params={"preview": 3, "offset": 2, "limit": 1})
    assert short["items"][0]["body_preview"]["text"] == "xxx"

    mine = get(api, airflow, MESSAGES, params={"conversation_handle": first["conversation_handle"]})
    assert mine["conversation_handle"] == first["conversation_handle"]
    assert [m["message_sequence_number"] for m in mine["items"]] == [0, 1, 2]
    assert mine["total"] == 3

    assert snapshot(broker) == before  # nothing received, counted or recorded
    assert len(receive(broker, SUPPLIER_QUEUE)) == 3


def test_receive_count_retention_and_dead_letter(
    api: TestClient, airflow: Airflow, sqlite_broker: Broker
) -> None:
    send(sqlite_broker, begin(sqlite_broker), NOTE, "fragile")
    with pytest.raises(ReaderFailed), sqlite_broker.transaction() as tx:
        assert tx.receive(SUPPLIER_QUEUE)
        raise ReaderFailed
    [m] = get(api, airflow, MESSAGES)["items"]
    assert m["receive_count"] == sqlite_broker.peek(SUPPLIER_QUEUE)[0].receive_count

    origin = DeadLetter("orders", uuid.uuid4(), 5, "received 5 times without completing")
    with sqlite_broker.engine.begin() as conn:
        conn.execute(update(s.message).values(dead_letter=origin.to_json(), receive_count=5))
    [m] = get(api, airflow, MESSAGES)["items"]
    assert m["receive_count"] == 5
    assert m["dead_letter"] == {
        "queue": "orders",
        "conversation_handle": str(origin.conversation_handle),
        "receive_count": 5,
        "reason": "received 5 times without completing",
    }

    sqlite_broker.alter_queue(BUYER_QUEUE, retention=True)
    _initiator, target = open_order(sqlite_broker)
    send(sqlite_broker, target, INVOICE, {"total": 1})
    receive(sqlite_broker, BUYER_QUEUE)
    # The buyer keeps the order it sent (status 3) and the invoice it received (status 0).
    kept = get(api, airflow, f"/queues/{BUYER_QUEUE}/messages")
    assert (kept["retention"], kept["retained"], kept["total"], kept["items"]) == (True, 2, 0, [])


def test_queue_events_dead_lettered_disabled_and_enabled(
    api: TestClient, airflow: Airflow, sqlite_broker: Broker
) -> None:
    assert get(api, airflow, EVENTS)["items"] == []
    poison(sqlite_broker)
    with sqlite_broker.engine.begin() as conn:
        record_event(conn, mon.DEAD_LETTERED, SUPPLIER_QUEUE, "1 message moved to dead_letters")
        record_event(conn, mon.DEAD_LETTERED, BUYER_QUEUE, "another queue's")
        record_event(conn, "route_requested", SUPPLIER_QUEUE, "not a failure-handling event")
    sqlite_broker.alter_queue(SUPPLIER_QUEUE, status=True)

    events = get(api, airflow, EVENTS)
    assert [e["event"] for e in events["items"]] == [
        "queue_enabled",
        mon.DEAD_LETTERED,
        "queue_disabled",
    ]
    assert {e["object_name"] for e in events["items"]} == {SUPPLIER_QUEUE}
    assert events["items"][1]["detail"] == "1 message moved to dead_letters"
    assert "poison message handling" in events["items"][2]["detail"]
    one = get(api, airflow, EVENTS, params={"limit": 1, "offset": 1})
    assert (one["total"], one["next_offset"], one["items"][0]["event"]) == (3, 2, mon.DEAD_LETTERED)


def test_a_queue_name_with_slashes(
    api: TestClient, airflow: Airflow, sqlite_broker: Broker
) -> None:
    sqlite_broker.create_queue("team/orders")
    assert get(api, airflow, "/queues/team/orders/messages")["queue"] == "team/orders"
    assert get(api, airflow, "/queues/team/orders/events")["total"] == 0


@pytest.mark.parametrize("path", PATHS)
def test_unknown_queue_is_404_naming_it(api: TestClient, airflow: Airflow, path: str) -> None:
    r = api.get(
        f"/broker/api{path.replace(SUPPLIER_QUEUE, 'NoSuchQueue')}",
        headers=airflow.headers(),
    )
    assert r.status_code == 404, r.text
    assert r.json() == {"detail": "queue 'NoSuchQueue' does not exist in this broker"}


@pytest.mark.parametrize(
    ("path", "params", "where"),
    [
        (MESSAGES, {"limit": 0}, "limit"),
        (MESSAGES, {"limit": 501}, "limit"),
        (MESSAGES, {"offset": -1}, "offset"),
        (MESSAGES, {"preview": 0}, "preview"),
        (MESSAGES, {"preview": 4001}, "preview"),
        (MESSAGES, {"conversation_handle": "nope"}, "conversation_handle"),
        (EVENTS, {"limit": "many"}, "limit"),
        (EVENTS, {"offset": -1}, "offset"),
    ],
)
def test_bad_parameters_are_422(
    api: TestClient, airflow: Airflow, path: str, params: dict[str, Any], where: str
) -> None:
    r = api.get(f"/broker/api{path}", headers=airflow.headers(), params=params)
    assert r.status_code == 422, r.text
    [problem] = r.json()["detail"]
    assert problem["loc"] == ["query", where]


@pytest.mark.parametrize("path", PATHS)
def test_an_offset_past_the_end_is_422(api: TestClient, airflow: Airflow, path: str) -> None:
    r = api.get(f"/broker/api{path}", headers=airflow.headers(), params={"offset": 10})
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith("offset 10 is past the end")


def test_openapi_lists_the_endpoints(api: TestClient) -> None:
    paths = api.get("/broker/api/openapi.json").json()["paths"]
    assert {"/api/queues/{queue}/messages", "/api/queues/{queue}/events"} <= set(paths)
