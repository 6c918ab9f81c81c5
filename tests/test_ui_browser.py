"""The broker page in a real browser: Debian's chromium, driven by Playwright, against a real
``airflow standalone`` with the simple auth manager.

An admin logs in through Airflow's own login page, opens "Service Broker" from the Airflow
navigation (the plugin's external view, shown in Airflow's frame), sees the queue this test
filled with its depth, watches it turn disabled when five rolled-back receives poison it (done
here through the engine, as a failing reader would), clicks Re-enable, and the engine says the
queue is enabled again. A viewer sees the same page but is refused (403) when acting, and opens
the queue's messages: a peek shows each waiting message's body preview, and the queue's
dead-lettering and disabling events are listed beside them.
Screenshots go to ``tmp_path/screenshots`` (kept by pytest, named in the assertion messages).

Playwright's own browser download is not used (it needs a host these machines do not reach):
``tests/support/ensure_browser.py`` installs /usr/bin/chromium, which ``make test`` runs first.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import NOTE, SUPPLIER_QUEUE, begin, declare_pair, send
from playwright.sync_api import Browser, ConsoleMessage, Page, expect, sync_playwright
from support.airflow_stack import AirflowStack, airflow_stack

from airflow_broker import Broker
from airflow_broker.constants import POISON_THRESHOLD
from airflow_broker.messaging.events import record_event

pytestmark = pytest.mark.xdist_group("airflow_e2e")

CHROMIUM = "/usr/bin/chromium"
PASSWORDS = "simple_auth_manager_passwords.json.generated"
DEPTH = 3
#: The page refreshes every 5 s; give it a few rounds on a busy 2-core machine.
SEEN = 30_000


class ReaderFailed(Exception):
    """A reader's processing failed: its receiving transaction rolls back."""


def poison(broker: Broker, queue: str) -> None:
    """Disable ``queue`` the way poison handling does: rolled-back receiving transactions."""
    for _ in range(POISON_THRESHOLD):
        with pytest.raises(ReaderFailed), broker.transaction() as tx:
            assert tx.receive(queue, top=1), f"{queue} has no message to roll back"
            raise ReaderFailed
    assert broker.catalog().queues[queue].status is False, "poison handling did not disable it"


def enabled(broker: Broker, queue: str) -> bool:
    return bool(broker.catalog().queues[queue].status)


@pytest.fixture
def browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def log_in(page: Page, base: str, user: str, password: str) -> None:
    """Through Airflow's login page, as a person would."""
    page.goto(f"{base}/")
    page.wait_for_url(re.compile(r"/auth/login"), timeout=60_000)
    page.locator("input[name=username]").fill(user)
    page.locator("input[name=password]").fill(password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(lambda url: "/auth/login" not in url, timeout=60_000)


def on_console(message: ConsoleMessage, problems: list[str]) -> None:
    """Errors the broker page logs (Airflow's own UI logs a 401 before the login, not ours)."""
    where = message.location.get("url", "")
    if message.type == "error" and "/broker/" in where:
        problems.append(f"console error at {where}: {message.text}")


@contextlib.contextmanager
def screenshot_on_failure(page: Page, path: Path) -> Iterator[None]:
    """A failure inside the block takes a screenshot and names it in the assertion message."""
    try:
        yield
    except Exception as exc:
        page.screenshot(path=path, full_page=True)
        raise AssertionError(f"{exc}\nscreenshot of the failure: {path}") from exc


def test_the_broker_page_in_the_airflow_ui(tmp_path: Path, browser: Browser) -> None:
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    broker = Broker.connect(url)
    broker.migrate()
    declare_pair(broker)
    for n in range(DEPTH):
        send(broker, begin(broker), NOTE, f"note {n}")
    shots = tmp_path / "screenshots"
    shots.mkdir()
    dags = tmp_path / "dags"
    dags.mkdir()
    env = {
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer",
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW_CONN_BROKER_DEFAULT": json.dumps({"conn_type": "broker", "extra": {"url": url}}),
    }
    try:
        with airflow_stack(tmp_path, dags, components=("standalone",), extra_env=env) as af:
            base = f"http://127.0.0.1:{af.port}"
            passwords = wait_until_serving(af, base)
            run_the_page(af, browser, broker, base, passwords, shots)
            see_the_queue_messages(browser, broker, base, passwords, shots)
    finally:
        broker.dispose()


def wait_until_serving(af: AirflowStack, base: str) -> dict[str, str]:
    with httpx.Client(base_url=base, timeout=10) as http:
        af.wait_for(
            "the API server to answer",
            lambda: http.get("/api/v2/monitor/health").status_code == 200,
            timeout=240,
        )
        af.wait_for("the broker page", lambda: http.get("/broker/ui/").status_code == 200)
    path = af.home / PASSWORDS
    passwords: dict[str, str] = af.wait_for(
        "the simple auth manager's passwords", lambda: json.loads(path.read_text())
    )
    return passwords


def run_the_page(
    af: AirflowStack,
    browser: Browser,
    broker: Broker,
    base: str,
    passwords: dict[str, str],
    shots: Path,
) -> None:
    admin = browser.new_context(viewport={"width": 1440, "height": 1000})
    page = admin.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("console", lambda m: on_console(m, problems))
    with screenshot_on_failure(page, shots / "failed-admin.png"):
        log_in(page, base, "admin", passwords["admin"])

        # The page is in Airflow's navigation, shown in Airflow's frame.
        page.get_by_role("link", name="Service Broker").first.click()
        page.wait_for_url(re.compile(r"/plugin/service-broker"))
        frame = page.frame_locator('iframe[src*="/broker/ui/"]')
        row = frame.locator(f'#queues-table tr[data-queue="{SUPPLIER_QUEUE}"]')
        expect(row.locator("td.depth")).to_have_text(str(DEPTH), timeout=SEEN)
        expect(row.locator("td.status")).to_contain_text("enabled")
        expect(row.get_by_role("button", name="Re-enable")).to_have_count(0)
        in_airflow = shots / "1-in-airflow-navigation.png"
        page.screenshot(path=in_airflow)

        # Poison disables the queue; the page shows it, highlighted, with Re-enable.
        poison(broker, SUPPLIER_QUEUE)
        expect(row.locator("td.status")).to_contain_text("DISABLED", timeout=SEEN)
        expect(row).to_have_class(re.compile(r"\bdisabled\b"))
        expect(frame.locator('[data-card="Queues"]')).to_contain_text("1 disabled", timeout=SEEN)
        expect(frame.locator("#events-table")).to_contain_text("queue_disabled", timeout=SEEN)
        page.screenshot(path=shots / "2-queue-disabled-in-airflow.png")

        # The overview shows the last consistency check (airflow-broker check).
        broker.check()
        card = frame.locator('[data-card="Consistency check"]')
        expect(card).to_contain_text("no problems", timeout=SEEN)

    # The page alone, full length: the screenshot of the disabled queue.
    alone = admin.new_page()
    alone.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    alone.on("console", lambda m: on_console(m, problems))
    disabled_shot = shots / "2-queue-disabled-by-poison.png"
    with screenshot_on_failure(alone, disabled_shot):
        alone.goto(f"{base}/broker/ui/")
        status = alone.locator(f'tr[data-queue="{SUPPLIER_QUEUE}"] td.status')
        expect(status).to_contain_text("DISABLED", timeout=SEEN)
        alone.wait_for_timeout(1000)  # the depth chart's first draw
        alone.screenshot(path=disabled_shot, full_page=True)
    alone.close()

    # Re-enable on the page: the engine agrees, the page shows it enabled.
    reenabled_shot = shots / "3-re-enabled.png"
    with screenshot_on_failure(page, reenabled_shot):
        row.get_by_role("button", name="Re-enable").click()
        expect(frame.locator("#flash")).to_contain_text(
            f"queue '{SUPPLIER_QUEUE}' re-enabled", timeout=SEEN
        )
        af.wait_for("the engine to see the queue enabled", lambda: enabled(broker, SUPPLIER_QUEUE))
        expect(row.locator("td.status")).to_contain_text("enabled", timeout=SEEN)
        expect(row.locator("td.status")).not_to_contain_text("DISABLED")
        expect(row.get_by_role("button", name="Re-enable")).to_have_count(0)
        page.screenshot(path=reenabled_shot)
    assert enabled(broker, SUPPLIER_QUEUE), f"queue still disabled; see {reenabled_shot}"
    assert problems == [], f"{problems}; screenshots: {in_airflow}, {disabled_shot}"
    admin.close()

    # A viewer reads the page but may not act: the 403 is shown, the queue stays disabled.
    poison(broker, SUPPLIER_QUEUE)
    viewer = browser.new_context(viewport={"width": 1440, "height": 1000})
    vpage = viewer.new_page()
    refused_shot = shots / "4-viewer-refused.png"
    with screenshot_on_failure(vpage, refused_shot):
        log_in(vpage, base, "viewer", passwords["viewer"])
        vpage.goto(f"{base}/broker/ui/")
        vrow = vpage.locator(f'#queues-table tr[data-queue="{SUPPLIER_QUEUE}"]')
        expect(vrow.locator("td.status")).to_contain_text("DISABLED", timeout=SEEN)
        # The refresh every 5 s redraws the row (its oldest message ages) but keeps the
        # button: a click or the keyboard's focus is not swapped out from under the person.
        button = vrow.get_by_role("button", name="Re-enable")
        kept = button.element_handle()
        shown = vpage.locator("#updated").text_content() or ""
        expect(vpage.locator("#updated")).not_to_have_text(shown, timeout=SEEN)
        assert kept.evaluate("el => el.isConnected"), "the refresh replaced the Re-enable button"
        button.click()
        flash = vpage.locator("#flash")
        expect(flash).to_contain_text("403 Forbidden", timeout=SEEN)
        expect(flash).to_contain_text("may not change the broker")
        vpage.screenshot(path=refused_shot)
    assert not enabled(broker, SUPPLIER_QUEUE), f"a viewer re-enabled it; see {refused_shot}"
    viewer.close()


def see_the_queue_messages(
    browser: Browser, broker: Broker, base: str, passwords: dict[str, str], shots: Path
) -> None:
    """A viewer opens a queue's messages: the notes still waiting (poisoning rolled back every
    receive), each with its body preview, and the queue's dead-lettering and disabling events;
    a click on a conversation shows that conversation's messages only."""
    with broker.engine.begin() as conn:
        record_event(conn, "dead_lettered", SUPPLIER_QUEUE, "1 message moved to dead_letters")
    waiting = broker.peek(SUPPLIER_QUEUE)
    assert len(waiting) == DEPTH
    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("console", lambda m: on_console(m, problems))
    shot = shots / "5-queue-messages.png"
    with screenshot_on_failure(page, shot):
        log_in(page, base, "viewer", passwords["viewer"])
        page.goto(f"{base}/broker/ui/")
        row = page.locator(f'#queues-table tr[data-queue="{SUPPLIER_QUEUE}"]')
        row.get_by_role("button", name="Messages").click()
        expect(page.locator("#messages-queue")).to_have_value(SUPPLIER_QUEUE)
        rows = page.locator("#messages-table tbody tr[data-message]")
        expect(rows).to_have_count(DEPTH, timeout=SEEN)
        for n, message in enumerate(waiting):
            cells = rows.nth(n)
            expect(cells.locator("td.body-preview")).to_have_text(message.text() or "")
            expect(cells.locator("td.receives")).to_have_text(str(message.receive_count))
        expect(page.locator("#messages-summary")).to_contain_text(f"{DEPTH} waiting")
        events = page.locator("#queue-events-table")
        expect(events).to_contain_text("dead_lettered", timeout=SEEN)
        expect(events).to_contain_text("1 message moved to dead_letters")
        expect(events).to_contain_text("queue_disabled")
        page.screenshot(path=shot, full_page=True)

        rows.nth(1).locator("button.handle").click()
        expect(rows).to_have_count(1, timeout=SEEN)
        expect(rows.first.locator("td.body-preview")).to_have_text(waiting[1].text() or "")
        page.locator("#messages-filter button").click()
        expect(rows).to_have_count(DEPTH, timeout=SEEN)
    assert problems == [], f"{problems}; screenshot: {shot}"
    assert broker.peek(SUPPLIER_QUEUE) == waiting, "looking at the messages changed them"
    context.close()
