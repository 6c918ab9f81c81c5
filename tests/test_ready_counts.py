"""Exact accounting: depth, the monitoring views, the metrics, ``queue_status()``, the CLI, the
broker page and activation count only messages a reader could take now, and show the others
apart: *held* (their conversation group waits out the backoff of a failed attempt) and *leased*
(a lease holds their group). On both engines, except the page (SQLite: what it shows does not
depend on the engine).

The queue of these tests: ``supplier_queue`` with ``retry_delay=30``, holding

- one conversation of 2 messages whose RECEIVE rolled back: held for 30 s;
- one conversation of 1 message, leased for 10 minutes;
- two conversations of 2 and 1 messages nobody holds: 3 ready, in 2 groups.

The hold ends by moving the broker's clock (:func:`airflow_broker.storage.clock.advance`), which
RECEIVE, the counts and the activation monitor all read.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import test_ui_browser as ui
from fastapi import FastAPI
from fastapi.testclient import TestClient
from helpers import NOTE, SUPPLIER_QUEUE, Recorder, begin, declare_pair, receive, send
from playwright.sync_api import Browser, expect

from airflow_broker import Activation, Broker
from airflow_broker.activation import Monitor, register_reader
from airflow_broker.activation.runner import ActivationRunner
from airflow_broker.cli import main
from airflow_broker.operations import monitoring as mon
from airflow_broker.operations import sampling
from airflow_broker.storage import clock
from airflow_broker.storage.clock import utcnow

RETRY_DELAY = 30
LEASE_SECONDS = 600

# test_ui_browser.py's chromium (Debian's, driven by Playwright)
browser = ui.browser


class HandlerFailed(Exception):
    """The handler failed: its receiving transaction rolls back."""


@dataclass
class Filled:
    """What :func:`fill` put in the queue."""

    held: uuid.UUID  # the conversation whose group is held (the supplier's handle)
    held_from: datetime  # the hold ends 30 s after a moment between these two
    held_to: datetime
    lease_token: uuid.UUID | None


@pytest.fixture(autouse=True)
def _wall_clock() -> Iterator[None]:
    yield
    clock.reset()


@pytest.fixture
def pair(broker: Broker) -> Broker:
    declare_pair(broker)
    broker.alter_queue(
        SUPPLIER_QUEUE, retry_delay=RETRY_DELAY, activation=Activation(max_readers=3)
    )
    return broker


def fail_once(broker: Broker) -> list[Any]:
    """A RECEIVE whose transaction rolls back: its group is held for ``retry_delay``."""
    got: list[Any] = []
    with pytest.raises(HandlerFailed), broker.transaction() as tx:
        got.extend(tx.receive(SUPPLIER_QUEUE))
        raise HandlerFailed
    return got


def hold_one(broker: Broker, messages: int = 2) -> tuple[uuid.UUID, datetime, datetime]:
    """A conversation of ``messages`` messages whose group is then held: (the target's handle,
    bounds of the moment the hold began)."""
    bodies = [f"held {i}".encode() for i in range(messages)]
    send(broker, begin(broker), NOTE, *bodies)
    before = utcnow()
    got = fail_once(broker)
    after = utcnow()
    assert [m.message_body for m in got] == bodies
    return got[0].conversation_handle, before, after


def fill(broker: Broker, *, ready: bool = True, lease: bool = True) -> Filled:
    """2 held, 1 leased, 3 ready (in 2 groups), as the module's docstring says."""
    held, before, after = hold_one(broker)
    token = None
    if lease:
        send(broker, begin(broker), NOTE, "leased")
        taken = broker.lease(SUPPLIER_QUEUE, lease_seconds=LEASE_SECONDS)
        assert taken is not None and [m.message_body for m in taken.messages] == [b"leased"]
        token = taken.token
    if ready:
        send(broker, begin(broker), NOTE, "ready 1", "ready 2")
        send(broker, begin(broker), NOTE, "ready 3")
    return Filled(held, before, after, token)


def supplier(broker: Broker) -> Any:
    return next(q for q in broker.queue_status() if q.name == SUPPLIER_QUEUE)


def assert_held_until(at: datetime | None, filled: Filled) -> None:
    assert at is not None
    delay = timedelta(seconds=RETRY_DELAY)
    assert filled.held_from + delay <= at <= filled.held_to + delay, (at, filled)


# -- queue_status(), the monitoring views, the CLI ----------------------------------------------


def test_queue_status_counts_ready_held_and_leased_apart(pair: Broker) -> None:
    filled = fill(pair)
    q = supplier(pair)
    assert (q.depth, q.groups_ready, q.held, q.leased) == (3, 2, 2, 1)
    assert_held_until(q.held_until, filled)
    assert q.oldest_enqueued_at is not None and q.oldest_enqueued_at > filled.held_to
    buyer = next(b for b in pair.queue_status() if b.name != SUPPLIER_QUEUE)
    assert (buyer.depth, buyer.held, buyer.leased, buyer.held_until) == (0, 0, 0, None)

    # The hold ends: its messages are ready again, and RECEIVE agrees.
    clock.advance(RETRY_DELAY + 1)
    q = supplier(pair)
    assert (q.depth, q.groups_ready, q.held, q.leased, q.held_until) == (5, 3, 0, 1, None)
    assert [m.conversation_handle for m in receive(pair, SUPPLIER_QUEUE)] == [filled.held] * 2

    # The lease ends: its message is ready again.
    assert filled.lease_token is not None
    pair.release(filled.lease_token)
    q = supplier(pair)
    assert (q.depth, q.groups_ready, q.held, q.leased) == (4, 3, 0, 0)


def test_only_held_messages_make_depth_0(pair: Broker) -> None:
    filled = fill(pair, ready=False, lease=False)
    q = supplier(pair)
    assert (q.depth, q.groups_ready, q.held, q.leased) == (0, 0, 2, 0)
    assert (q.oldest_enqueued_at, q.oldest_age_seconds) == (None, None)
    assert_held_until(q.held_until, filled)
    assert receive(pair, SUPPLIER_QUEUE) == []
    clock.advance(RETRY_DELAY + 1)
    assert (supplier(pair).depth, supplier(pair).held) == (2, 0)


def test_the_monitoring_views_show_held_and_leased_apart(pair: Broker) -> None:
    filled = fill(pair)
    [info] = [q for q in mon.queues(pair) if q.name == SUPPLIER_QUEUE]
    assert (info.depth, info.groups_ready, info.held, info.leased) == (3, 2, 2, 1)
    assert_held_until(info.held_until, filled)
    detail = mon.queue(pair, SUPPLIER_QUEUE).queue
    assert (detail.depth, detail.held, detail.leased) == (3, 2, 1)
    o = mon.overview(pair)
    assert (o.messages_ready, o.messages_held, o.messages_leased) == (3, 2, 1)


def test_depth_samples_and_gauges_count_ready_messages(pair: Broker, recorder: Recorder) -> None:
    fill(pair)
    recorder.calls.clear()
    assert sampling.sample_queue_depths(pair, min_interval=0) is not None
    gauges = {name: value for _, name, value, _ in recorder.calls}
    assert gauges["broker.queue_depth.supplier_queue"] == 3
    assert gauges["broker.queue_held.supplier_queue"] == 2
    assert gauges["broker.queue_leased.supplier_queue"] == 1
    history = mon.queue_depth_history(pair, SUPPLIER_QUEUE, 5)
    assert [p.depth for p in history.samples] == [3]


def test_the_status_command_shows_held_and_leased_apart(
    pair: Broker, broker_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    filled = fill(pair)
    assert main(["--url", broker_url, "status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("QUEUE"))
    assert lines[header].split()[:6] == ["QUEUE", "STATUS", "DEPTH", "HELD", "UNTIL", "LEASED"]
    row = next(line.split() for line in lines if line.startswith(SUPPLIER_QUEUE))
    until = supplier(pair).held_until
    assert until is not None
    assert row[1:6] == ["enabled", "3", "2", until.astimezone(UTC).strftime("%H:%M:%SZ"), "1"]

    assert main(["--url", broker_url, "status", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    q = next(q for q in doc["queues"] if q["name"] == SUPPLIER_QUEUE)
    assert (q["depth"], q["held"], q["leased"], q["groups_ready"]) == (3, 2, 1, 2)
    assert_held_until(datetime.fromisoformat(q["held_until"]), filled)


# -- activation ---------------------------------------------------------------------------------


def test_activation_with_only_held_groups_starts_no_reader(pair: Broker) -> None:
    """Two groups, each held after a failed attempt: the monitor fires for nothing and a reader
    is refused (it would find nothing to RECEIVE). When the holds end, it fires."""
    hold_one(pair, messages=1)
    hold_one(pair, messages=1)
    monitor = Monitor(pair, SUPPLIER_QUEUE, sample_seconds=0)
    assert [monitor.check() for _ in range(3)] == [None] * 3
    assert register_reader(pair, SUPPLIER_QUEUE)[1] is False
    for mode in ("depth", "growth"):
        other = Monitor(pair, SUPPLIER_QUEUE, key=mode, mode=mode, sample_seconds=0)
        assert [other.check(), other.check()] == [None, None]

    clock.advance(RETRY_DELAY + 1)
    fire = monitor.check()
    assert fire is not None and (fire.depth, fire.groups_ready, fire.readers) == (2, 2, 1)


def test_activation_with_a_leased_group_only_starts_no_reader(pair: Broker) -> None:
    fill(pair, ready=False)  # 2 held, 1 leased
    monitor = Monitor(pair, SUPPLIER_QUEUE, sample_seconds=0)
    assert monitor.check() is None
    clock.advance(RETRY_DELAY + 1)  # the hold ends; the lease (10 minutes) holds on
    fire = monitor.check()
    assert fire is not None and (fire.depth, fire.groups_ready) == (2, 1)


def test_the_runner_starts_no_reader_until_the_hold_ends(pair: Broker) -> None:
    hold_one(pair, messages=2)
    handled: list[bytes | None] = []

    def handle(tx: Any, messages: list[Any]) -> None:
        handled.extend(m.message_body for m in messages)

    runner = ActivationRunner(pair, SUPPLIER_QUEUE, handle, poll_interval=0.05)
    with runner:
        time.sleep(1.0)  # twenty looks at the queue
        assert (runner.report.fires, runner.report.readers_started) == (0, 0)
        clock.advance(RETRY_DELAY + 1)
        report = runner.run_until_idle(timeout=60)
    assert handled == [b"held 0", b"held 1"]
    assert report.readers_started >= 1 and report.readers_refused == 0


# -- the broker page ----------------------------------------------------------------------------


@pytest.fixture
def page_broker(tmp_path: Any) -> Iterator[Broker]:
    b = Broker.connect(f"sqlite:///{tmp_path / 'broker.db'}")
    b.migrate()
    declare_pair(b)
    b.alter_queue(SUPPLIER_QUEUE, retry_delay=RETRY_DELAY)
    yield b
    b.dispose()


def page_app(broker: Broker) -> FastAPI:
    """The plugin's app at /broker, as the API server mounts it, reading without a login (who
    may read is test_plugin_api.py's subject, not this one's)."""
    from airflow_broker.provider.plugin.api import create_app
    from airflow_broker.provider.plugin.security import require_read

    app = create_app(broker=broker)
    app.dependency_overrides[require_read] = lambda: None
    root = FastAPI()
    root.mount("/broker", app)
    return root


def test_the_api_shows_held_and_leased_apart(page_broker: Broker) -> None:
    filled = fill(page_broker)
    with TestClient(page_app(page_broker)) as http:
        queues = http.get("/broker/api/queues")
        one = http.get(f"/broker/api/queues/{SUPPLIER_QUEUE}")
        overview = http.get("/broker/api/overview")
    assert queues.status_code == one.status_code == overview.status_code == 200
    [q] = [q for q in queues.json()["items"] if q["name"] == SUPPLIER_QUEUE]
    assert (q["depth"], q["groups_ready"], q["held"], q["leased"]) == (3, 2, 2, 1)
    assert_held_until(datetime.fromisoformat(q["held_until"]), filled)
    assert one.json()["queue"]["held"] == 2
    o = overview.json()
    assert (o["messages_ready"], o["messages_held"], o["messages_leased"]) == (3, 2, 1)


@pytest.fixture
def served(page_broker: Broker) -> Iterator[str]:
    """The app served over HTTP (uvicorn in a thread): the base URL."""
    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(page_app(page_broker), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_the_page_shows_held_and_leased_apart(
    page_broker: Broker, served: str, browser: Browser
) -> None:
    """The page in chromium, served by the plugin's app alone (no Airflow around it)."""
    fill(page_broker)
    problems: list[str] = []
    page = browser.new_page()
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("console", lambda m: ui.on_console(m, problems))
    page.goto(f"{served}/broker/ui/")
    row = page.locator(f'#queues-table tr[data-queue="{SUPPLIER_QUEUE}"]')
    expect(row.locator("td.depth")).to_have_text("3", timeout=20_000)
    expect(row.locator("td.not-ready .held")).to_have_text(
        re.compile(r"^2 held until \d{1,2}:\d\d")
    )
    expect(row.locator("td.not-ready .leased")).to_have_text("1 leased")
    buyer = page.locator('#queues-table tr[data-queue="buyer_queue"]')
    expect(buyer.locator("td.not-ready")).to_have_text("—")
    expect(page.locator('[data-card="Messages ready"]')).to_contain_text("2 held · 1 leased")
    page.close()
    assert problems == []
