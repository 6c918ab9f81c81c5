"""The broker page without a browser: its entry in Airflow's navigation (``external_views``), the
files the app serves at ``/broker/ui/`` and their headers, and rules its script keeps (data only
ever as text). The page in a real browser against a real Airflow is test_ui_browser.py."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_plugin import run

from airflow_broker import Broker
from airflow_broker.provider.plugin import EXTERNAL_VIEWS, UI_HREF, URL_PREFIX, BrokerPlugin
from airflow_broker.provider.plugin.api import create_app
from airflow_broker.provider.plugin.ui import STATIC_DIR

FILES = {
    "index.html": "text/html",
    "broker.js": "javascript",
    "broker.css": "text/css",
    "icon.svg": "image/svg+xml",
}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    broker = Broker.connect(f"sqlite:///{tmp_path / 'broker.db'}")
    broker.migrate()
    root = FastAPI()
    root.mount(URL_PREFIX, create_app(broker=broker))
    with TestClient(root, follow_redirects=False) as http:
        yield http
    broker.dispose()


def test_the_page_is_an_external_view_in_the_navigation() -> None:
    from airflow.api_fastapi.core_api.datamodels.plugins import ExternalViewResponse

    [view] = BrokerPlugin.external_views
    assert BrokerPlugin().external_views == [view] == EXTERNAL_VIEWS
    checked = ExternalViewResponse.model_validate(view)
    assert (checked.name, checked.href, checked.destination) == (
        "Service Broker",
        "/broker/ui/",
        "nav",
    )
    assert checked.href == UI_HREF
    assert checked.url_route == "service-broker"
    assert checked.icon is not None and checked.icon.startswith(UI_HREF)
    assert (STATIC_DIR / checked.icon.removeprefix(UI_HREF)).is_file()


def test_airflow_lists_the_view_from_the_installed_plugin(tmp_path: Path) -> None:
    """What the plugins endpoint and the UI's navigation read (Airflow's own plugin manager)."""
    out = run(
        "import json; from airflow import plugins_manager as pm; "
        "info = [p for p in pm.get_plugin_info() if p['name'] == 'airflow_broker']; "
        "views, _apps = pm._get_ui_plugins(); "
        "print(json.dumps({'info': info[0]['external_views'], 'views': views}))",
        tmp_path,
    )
    doc = json.loads(out)
    assert doc["info"] == EXTERNAL_VIEWS
    assert [v for v in doc["views"] if v["url_route"] == "service-broker"] == EXTERNAL_VIEWS


@pytest.mark.parametrize(("name", "kind"), FILES.items())
def test_the_app_serves_the_page_without_a_login(client: TestClient, name: str, kind: str) -> None:
    r = client.get(f"/broker/ui/{name}")
    assert r.status_code == 200, r.text
    assert kind in r.headers["content-type"]
    assert r.headers["cache-control"] == "no-cache"
    assert r.headers["x-frame-options"] == "SAMEORIGIN"
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'self'" in csp
    # The data behind it does need one.
    assert client.get("/broker/api/queues").status_code == 401


def test_the_page_is_index_html_and_its_path_without_slash_redirects(client: TestClient) -> None:
    page = client.get("/broker/ui/")
    assert page.status_code == 200
    assert "<title>Service Broker</title>" in page.text
    assert page.text == (STATIC_DIR / "index.html").read_text()
    bare = client.get("/broker/ui")
    assert bare.status_code == 307 and bare.headers["location"] == "ui/"
    assert client.get("/broker/ui/nothing.js").status_code == 404
    assert client.get("/broker/ui/../api/queues").status_code in (401, 404)


def test_the_page_is_not_in_the_api_schema(client: TestClient) -> None:
    paths = client.get("/broker/api/openapi.json").json()["paths"]
    assert not [p for p in paths if p.startswith("/ui")]


def test_the_script_puts_data_in_the_page_only_as_text() -> None:
    script = (STATIC_DIR / "broker.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, f"broker.js uses {sink}"
    # Relative to the page, so the API is found under any base URL of the API server.
    assert 'new URL("../api/", document.baseURI)' in script
    html = (STATIC_DIR / "index.html").read_text()
    # No inline script or style: the Content-Security-Policy allows only the page's own files.
    assert re.findall(r"<script(?![^>]*\bsrc=)", html) == []
    assert " style=" not in html and "<style" not in html
    assert re.search(r"<[^>]*\son[a-z]+\s*=", html) is None, "an inline event handler"
