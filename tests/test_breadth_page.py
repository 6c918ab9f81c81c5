"""The broker page with many queues and many conversations (issue 46): the queue list is paged
like the conversation list, and no count reads every row: past ``COUNT_CAP`` matching rows a
count is PostgreSQL's estimate, marked so, and the page says "about N".

The cap is lowered here (``counts.COUNT_CAP``) so that a few dialogs are "many". The page
itself runs in chromium, served by the plugin's app alone (uvicorn in a thread, reading without
a login, as test_ready_counts.py does).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import test_ui_browser as ui
from fastapi.testclient import TestClient
from helpers import BUYER_QUEUE, ORDER, SUPPLIER_QUEUE, begin, declare_pair, send
from playwright.sync_api import Browser, expect
from sqlalchemy import event, text
from test_ready_counts import page_app

from airflow_broker import Broker
from airflow_broker.operations import counts
from airflow_broker.operations import monitoring as mon

browser = ui.browser  # the chromium fixture

DASH, NEXT = "\u2013", "Next \u203a"  # the pager: "1 DASH 20 of 59", its button
TENANTS = 57  # with the pair's two queues: 59, three pages of the page's 20
DIALOGS = 40  # 80 endpoints: past a cap of 60, which 59 queues are not


def _tenants(broker: Broker, n: int = TENANTS) -> list[str]:
    names = [f"tenant_{i:03d}_q" for i in range(n)]
    with broker.definitions() as d:
        for name in names:
            d.create_queue(name)
    return names


def _fill(broker: Broker) -> Broker:
    declare_pair(broker)
    _tenants(broker)
    for n in range(DIALOGS):
        send(broker, begin(broker), ORDER, {"order": n})
    if broker.dialect == "postgresql":
        with broker.engine.begin() as conn:
            conn.execute(text("ANALYZE broker_conversation_endpoint"))
    return broker


@pytest.fixture
def many(broker: Broker) -> Broker:
    return _fill(broker)


def _endpoints(broker: Broker) -> int:
    with broker.engine.connect() as conn:
        return int(
            conn.execute(text("SELECT count(*) FROM broker_conversation_endpoint")).scalar_one()
        )


# -- the queue list, paged --------------------------------------------------------------------


def test_the_queue_list_is_a_page_by_name(many: Broker) -> None:
    names = sorted([BUYER_QUEUE, SUPPLIER_QUEUE, *(f"tenant_{i:03d}_q" for i in range(TENANTS))])
    with TestClient(page_app(many)) as http:
        first = http.get("/broker/api/queues").json()
        assert (first["total"], first["limit"], first["offset"]) == (len(names), 50, 0)
        assert [q["name"] for q in first["items"]] == names[:50]
        assert first["next_offset"] == 50 and first["total_estimated"] is False
        second = http.get("/broker/api/queues", params={"offset": 50, "limit": 50}).json()
        assert [q["name"] for q in second["items"]] == names[50:]
        assert second["next_offset"] is None
        small = http.get("/broker/api/queues", params={"limit": 2, "offset": 1}).json()
        assert [q["name"] for q in small["items"]] == names[1:3] and small["next_offset"] == 3
        only = http.get("/broker/api/queues", params={"name_contains": "_01"}).json()
        assert [q["name"] for q in only["items"]] == [f"tenant_01{i}_q" for i in range(10)]
        assert only["total"] == 10
        # A literal match: % and _ are not wildcards.
        assert http.get("/broker/api/queues", params={"name_contains": "%"}).json()["total"] == 0
        assert http.get("/broker/api/queue-names").json() == names
        too_big = http.get("/broker/api/queues", params={"limit": mon.MAX_LIMIT + 1})
        assert too_big.status_code == 422
        past = http.get("/broker/api/queues", params={"offset": len(names)})
        assert past.status_code == 422 and "past the end" in past.json()["detail"]
    # A queue of the page is counted as the whole list counts it.
    [supplier] = [q for q in mon.queues(many) if q.name == SUPPLIER_QUEUE]
    page = mon.queue_page(many, limit=1, offset=names.index(SUPPLIER_QUEUE))
    aged = dataclasses.replace(page.items[0], oldest_age_seconds=supplier.oldest_age_seconds)
    assert [aged] == [supplier] and supplier.depth == DIALOGS


def test_a_page_of_queues_reads_only_its_queues_messages(many: Broker) -> None:
    statements = _recorded(many, lambda: mon.queue_page(many, limit=5))
    tally = [s for s in statements if "FROM broker_message" in s and "GROUP BY" in s]
    assert tally and all(" IN (" in s or "IN (__[POSTCOMPILE" in s for s in tally), tally


# -- counts that do not scan ------------------------------------------------------------------


def _recorded(broker: Broker, fn: Any) -> list[str]:
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(" ".join(statement.split()))

    event.listen(broker.engine, "before_cursor_execute", record)
    try:
        fn()
    finally:
        event.remove(broker.engine, "before_cursor_execute", record)
    return statements


def _counts_of_endpoints(statements: list[str]) -> list[str]:
    return [s for s in statements if "count(" in s.lower() and "broker_conversation_endpoint" in s]


def test_no_count_of_conversations_reads_past_the_cap(
    pg_broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL (SQLite, the embedded store, counts past the cap exactly)."""
    many = _fill(pg_broker)
    monkeypatch.setattr(counts, "COUNT_CAP", 4)
    statements = _recorded(
        many,
        lambda: (
            mon.overview(many),
            mon.conversations(many),
            mon.conversations(many, queue=SUPPLIER_QUEUE),
            mon.conversation_states(many),
            mon.services(many),
        ),
    )
    counted = _counts_of_endpoints(statements)
    assert counted and all("LIMIT" in s for s in counted), counted


def test_past_the_cap_postgresql_counts_are_estimates(
    pg_broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    many = _fill(pg_broker)
    exact = mon.conversation_states(many)
    real = {s.state: s.count for s in exact}
    assert not any(s.estimated for s in exact) and not mon.overview(many).conversations_estimated

    monkeypatch.setattr(counts, "COUNT_CAP", 4)
    page = mon.conversations(many, limit=5)
    assert page.total_estimated and page.total == _endpoints(many) == sum(real.values())
    assert len(page.items) == 5 and page.next_offset == 5  # a full page has a next one
    states = mon.conversation_states(many)
    assert all(s.estimated for s in states)
    # ANALYZE read every row of so small a table: the estimates are the counts.
    assert {s.state: s.count for s in states} == real
    view = mon.overview(many)
    assert view.conversations_estimated and {s.state: s.count for s in view.conversations} == real
    assert all(s.conversations is None for s in mon.services(many))
    doc = mon.to_json(page)
    assert doc["total_estimated"] is True
    with TestClient(page_app(many)) as http:
        listed = http.get("/broker/api/conversations", params={"limit": 5}).json()
        assert listed["total_estimated"] is True and listed["next_offset"] == 5
        past = http.get("/broker/api/conversations", params={"offset": 400})
        assert past.status_code == 422 and "past the end" in past.json()["detail"]
        assert http.get("/broker/api/overview").json()["conversations_estimated"] is True


# -- the page, in chromium --------------------------------------------------------------------


@pytest.fixture
def served_many(pg_broker: Broker, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Broker, str]]:
    import uvicorn

    _fill(pg_broker)
    monkeypatch.setattr(counts, "COUNT_CAP", 60)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(page_app(pg_broker), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield pg_broker, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_the_page_pages_the_queues_and_says_about(
    served_many: tuple[Broker, str], browser: Browser
) -> None:
    broker, base = served_many
    total = TENANTS + 2
    endpoints = _endpoints(broker)
    problems: list[str] = []
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("console", lambda m: ui.on_console(m, problems))
    page.goto(f"{base}/broker/ui/")
    rows = page.locator("#queues-table tbody tr[data-queue]")
    pager = page.locator('[data-pager="queues"]')
    expect(pager).to_contain_text(f"1{DASH}20 of {total}", timeout=20_000)
    expect(rows).to_have_count(20)
    expect(rows.first).to_have_attribute("data-queue", BUYER_QUEUE)
    pager.get_by_role("button", name=NEXT).click()
    expect(pager).to_contain_text(f"21{DASH}40 of {total}", timeout=20_000)
    expect(rows.first).to_have_attribute("data-queue", "tenant_018_q")
    pager.get_by_role("button", name=NEXT).click()
    expect(pager).to_contain_text(f"41{DASH}{total} of {total}", timeout=20_000)
    expect(pager.get_by_role("button", name=NEXT)).to_be_disabled()
    expect(rows.last).to_have_attribute("data-queue", f"tenant_{TENANTS - 1:03d}_q")
    expect(page.locator(f'#queues-table tr[data-queue="{SUPPLIER_QUEUE}"]')).to_have_count(0)

    # The pickers hold every queue, not only the page's.
    expect(page.locator("#conversation-queue option")).to_have_count(total + 1)

    page.locator("#queue-filter").fill("tenant_05")
    expect(pager).to_contain_text(f"1{DASH}7 of 7", timeout=20_000)
    expect(rows).to_have_count(7)
    expect(rows.first).to_have_attribute("data-queue", "tenant_050_q")

    # Past the cap the counts are estimates, and say so.
    expect(page.locator('[data-card="Conversations"] .card-value')).to_have_text(
        f"about {endpoints}"
    )
    expect(page.locator('[data-pager="conversations"]')).to_contain_text(
        f"1{DASH}20 of about {endpoints}"
    )
    expect(page.locator('#state-chips [data-state=""] .count')).to_have_text(f"about {endpoints}")
    expect(page.locator('#services-table tr[data-service="//po/Buyer"] td.num')).to_have_text(
        "many"
    )
    page.close()
    assert problems == []
