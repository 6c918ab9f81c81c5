"""The monitoring API in a real ``airflow api-server``: mounted from the installed plugin, behind
the simple auth manager's real login (POST /auth/token with the password it generated)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from helpers import SUPPLIER_QUEUE, declare_pair
from support.airflow_stack import airflow_stack

from airflow_broker import Broker

pytestmark = pytest.mark.xdist_group("airflow_e2e")

PASSWORDS = "simple_auth_manager_passwords.json.generated"


def test_the_api_server_serves_the_broker_api_behind_airflow_auth(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    broker = Broker.connect(url)
    broker.migrate()
    declare_pair(broker)
    broker.alter_queue(SUPPLIER_QUEUE, status=False)
    broker.dispose()
    dags = tmp_path / "dags"
    dags.mkdir()
    env = {
        "AIRFLOW__CORE__AUTH_MANAGER": (
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
        ),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer",
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW_CONN_BROKER_DEFAULT": json.dumps({"conn_type": "broker", "extra": {"url": url}}),
    }
    with airflow_stack(tmp_path, dags, components=("api-server",), extra_env=env) as af:
        base = f"http://127.0.0.1:{af.port}"
        with httpx.Client(base_url=base, timeout=30) as http:
            af.wait_for(
                "the API server to answer",
                lambda: http.get("/api/v2/monitor/health").status_code == 200,
                timeout=180,
            )
            passwords = json.loads((af.home / PASSWORDS).read_text())

            def token(user: str) -> dict[str, str]:
                r = http.post("/auth/token", json={"username": user, "password": passwords[user]})
                assert r.status_code == 201, r.text
                return {"Authorization": f"Bearer {r.json()['access_token']}"}

            admin, viewer = token("admin"), token("viewer")

            anonymous = http.get("/broker/api/queues")
            assert anonymous.status_code == 401, anonymous.text
            r = http.get("/broker/api/queues", headers=admin)
            assert r.status_code == 200, r.text + af.log("api-server")[-3000:]
            queues = {q["name"]: q for q in r.json()["items"]}
            assert queues[SUPPLIER_QUEUE]["status"] == "disabled"

            refused = http.post(f"/broker/api/queues/{SUPPLIER_QUEUE}/enable", headers=viewer)
            assert refused.status_code == 403, refused.text
            done = http.post(f"/broker/api/queues/{SUPPLIER_QUEUE}/enable", headers=admin)
            assert done.status_code == 200 and done.json()["changed"] is True
            r = http.get(f"/broker/api/queues/{SUPPLIER_QUEUE}", headers=viewer)
            assert r.json()["queue"]["status"] == "enabled"
            # Listed among the deployment's plugins, without import errors.
            plugins = http.get("/api/v2/plugins", headers=admin).json()["plugins"]
            [plugin] = [p for p in plugins if p["name"] == "airflow_broker"]
            assert [a["url_prefix"] for a in plugin["fastapi_apps"]] == ["/broker"]
            errors = http.get("/api/v2/plugins/importErrors", headers=admin).json()
            assert errors["import_errors"] == [], errors
        assert "already registered" not in af.log("api-server")
