"""The plugin's registration: the ``airflow.plugins`` entry point, the provider info, the app it
mounts at ``/broker``, and that loading it (which every Airflow process does, the task runner
included) imports nothing of the API server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

from fastapi import FastAPI

from airflow_broker.provider import get_provider_info
from airflow_broker.provider.plugin import PLUGIN_NAME, URL_PREFIX, BrokerPlugin

PLUGIN_CLASS = "airflow_broker.provider.plugin.BrokerPlugin"


def airflow_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW__", "AIRFLOW_CONN_"))}
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home / 'airflow.db'}",
    )
    return env


def run(code: str, home: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=airflow_env(home),
        cwd=home,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_entry_point_names_the_plugin() -> None:
    [ep] = [e for e in entry_points(group="airflow.plugins") if e.name == PLUGIN_NAME]
    assert ep.value == "airflow_broker.provider.plugin:BrokerPlugin"
    assert ep.load() is BrokerPlugin


def test_the_provider_info_names_the_same_plugin() -> None:
    from airflow.providers_manager import ProvidersManager, _create_provider_info_schema_validator

    info = get_provider_info()
    _create_provider_info_schema_validator().validate(info)
    assert info["plugins"] == [{"name": PLUGIN_NAME, "plugin-class": PLUGIN_CLASS}]
    pm = ProvidersManager()
    pm.initialize_providers_plugins()
    assert {(p.name, p.plugin_class, p.provider_name) for p in pm.plugins} >= {
        (PLUGIN_NAME, PLUGIN_CLASS, "airflow-broker")
    }


def test_the_plugin_mounts_one_app_at_broker() -> None:
    from airflow.plugins_manager import is_valid_plugin

    assert is_valid_plugin(BrokerPlugin)
    assert BrokerPlugin.name == PLUGIN_NAME
    # Provider plugins are classes, entry-point plugins instances: both see the same app.
    [entry] = BrokerPlugin.fastapi_apps
    assert BrokerPlugin().fastapi_apps == [entry]
    assert entry["url_prefix"] == URL_PREFIX == "/broker"
    assert isinstance(entry["app"], FastAPI)
    assert entry["app"] is BrokerPlugin.fastapi_apps[0]["app"]
    assert entry["app"].state.broker_source.broker_conn_id == "broker_default"
    paths = {getattr(r, "path", "") for r in entry["app"].routes}
    assert {"/api/queues", "/api/conversations", "/api/probes"} <= paths


def test_loading_the_plugin_imports_nothing_of_the_api_server(tmp_path: Path) -> None:
    heavy = [
        "fastapi",
        "airflow.api_fastapi.core_api.security",
        "airflow_broker.provider.plugin.api",
    ]
    out = run(
        "import sys, json; import airflow_broker.provider.plugin as p; "
        "assert p.BrokerPlugin.name; "
        f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))",
        tmp_path,
    )
    assert json.loads(out) == []


def test_the_api_server_mounts_it(tmp_path: Path) -> None:
    """Airflow's own init_plugins (what ``airflow api-server`` runs), from the entry point."""
    out = run(
        "import json; from fastapi import FastAPI; "
        "from airflow import plugins_manager; "
        "from airflow.api_fastapi.app import init_plugins; "
        "app = FastAPI(); init_plugins(app); "
        "mounts = [r.path for r in app.routes if hasattr(r, 'app')]; "
        "errors = plugins_manager.get_import_errors(); "
        "print(json.dumps({'mounts': mounts, 'errors': errors}))",
        tmp_path,
    )
    doc = json.loads(out)
    assert "/broker" in doc["mounts"]
    assert doc["errors"] == {}
