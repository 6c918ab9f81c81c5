"""BrokerHook: Airflow connection -> broker URL, the embedded fallback, one Broker per hook, the
connection form. Connections come from ``AIRFLOW_CONN_<ID>`` environment variables, which the
Task SDK reads like any secrets backend: no Airflow database is involved."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import make_url

from airflow_broker import Broker
from airflow_broker.hooks.broker import BrokerHook, fallback_url
from airflow_broker.provider import CONNECTION_FORM, get_provider_info


def set_connection(monkeypatch: pytest.MonkeyPatch, conn_id: str, **fields: Any) -> None:
    """Define Airflow connection ``conn_id`` for this test (JSON in AIRFLOW_CONN_<ID>)."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(fields))


# --------------------------------------------------------------------------------------------
# connection -> URL


@pytest.mark.parametrize("conn_type", ["broker", "postgres"])
def test_postgres_server_fields_make_a_psycopg_url(
    monkeypatch: pytest.MonkeyPatch, conn_type: str
) -> None:
    set_connection(
        monkeypatch,
        "pg_fields",
        conn_type=conn_type,
        host="db.example",
        port=6543,
        schema="queues",
        login="airflow",
        password="s3cret/:@",
    )
    url, fallback = BrokerHook("pg_fields").broker_url()
    assert not fallback
    parsed = make_url(url)
    assert parsed.drivername == "postgresql+psycopg"
    assert (parsed.host, parsed.port, parsed.database) == ("db.example", 6543, "queues")
    assert (parsed.username, parsed.password) == ("airflow", "s3cret/:@")


def test_sqlite_connection_uses_its_host_as_the_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    set_connection(monkeypatch, "embedded", conn_type="sqlite", host=str(tmp_path / "b.db"))
    assert BrokerHook("embedded").broker_url() == (f"sqlite:///{tmp_path / 'b.db'}", False)


@pytest.mark.parametrize("conn_type", ["broker", "postgres", "sqlite", "generic"])
def test_extra_url_wins_over_the_fields(monkeypatch: pytest.MonkeyPatch, conn_type: str) -> None:
    set_connection(
        monkeypatch,
        "by_url",
        conn_type=conn_type,
        host="ignored.example",
        extra={"url": "sqlite:////srv/broker.db"},
    )
    assert BrokerHook("by_url").broker_url() == ("sqlite:////srv/broker.db", False)


def test_airflow_makes_a_broker_hook_from_a_broker_connection(
    monkeypatch: pytest.MonkeyPatch, broker_url: str
) -> None:
    """``Connection.get_hook()`` (what generic Airflow code does) finds BrokerHook by type."""
    from airflow_broker.provider.compat import BaseHook

    set_connection(monkeypatch, "by_type", conn_type="broker", extra={"url": broker_url})
    hook = BaseHook.get_hook("by_type")
    assert isinstance(hook, BrokerHook)
    assert hook.broker_conn_id == "by_type"
    assert hook.get_broker().instance_id
    hook.close()


def test_a_connection_of_another_type_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    set_connection(monkeypatch, "smtp_box", conn_type="smtp", host="mail.example")
    with pytest.raises(ValueError, match=r"'smtp_box' has type 'smtp'"):
        BrokerHook("smtp_box").get_broker()


def test_broker_connection_reaches_a_real_postgres_database(
    monkeypatch: pytest.MonkeyPatch, pg_url: str
) -> None:
    url = make_url(pg_url)
    set_connection(
        monkeypatch,
        "pg_real",
        conn_type="broker",
        host=url.host,
        port=url.port,
        schema=url.database,
        login=url.username,
    )
    hook = BrokerHook(broker_conn_id="pg_real")
    expected = Broker.connect(pg_url)
    try:
        assert hook.get_broker().instance_id == expected.instance_id
        assert hook.get_broker().dialect == "postgresql"
    finally:
        hook.close()
        expected.dispose()


def test_the_extras_listen_url_and_pooled_reach_the_broker(
    monkeypatch: pytest.MonkeyPatch, pg_url: str, postgres_server: Any
) -> None:
    """Behind PgBouncer: ``listen_url`` (a direct URL for LISTEN) and ``pooled`` from the
    connection's extra; a ``pooled`` that is no boolean is refused by name."""
    url = make_url(pg_url)
    direct = postgres_server.direct_url_for(url.database)
    fields = {"conn_type": "broker", "host": url.host, "port": url.port, "schema": url.database}
    fields["login"] = url.username
    set_connection(
        monkeypatch, "pg_pooled", **fields, extra={"pooled": "true", "listen_url": direct}
    )
    hook = BrokerHook(broker_conn_id="pg_pooled")
    try:
        adapter = hook.get_broker().adapter
        assert adapter.pooled is True
        assert adapter.listens  # type: ignore[union-attr]  # on listen_url, though pooled
    finally:
        hook.close()
    set_connection(monkeypatch, "pg_bad", **fields, extra={"pooled": "sometimes"})
    with pytest.raises(ValueError, match=r"'pg_bad'.*'pooled' must be true or false"):
        BrokerHook(broker_conn_id="pg_bad").get_broker()


# --------------------------------------------------------------------------------------------
# no connection: the embedded store


def test_without_the_connection_the_hook_uses_airflow_home_broker_db(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("AIRFLOW_CONN_BROKER_DEFAULT", raising=False)
    hook = BrokerHook()
    assert hook.broker_conn_id == "broker_default"
    assert hook.broker_url() == (f"sqlite:///{tmp_path / 'broker.db'}", True)
    with caplog.at_level(logging.INFO):
        broker = hook.get_broker()
    # Migrated: the broker has its identity without anyone calling migrate().
    assert broker.instance_id
    assert (tmp_path / "broker.db").exists()
    # Airflow's logging (structlog) writes the hook's log to stdout; plain logging to caplog.
    logged = capsys.readouterr().out + caplog.text
    assert (
        f"Airflow connection 'broker_default' does not exist: using the embedded broker "
        f"database sqlite:///{tmp_path / 'broker.db'} (create a connection of type 'broker' "
        "with that id to use another database)"
    ) in logged
    assert logged.count("does not exist: using the embedded broker database") == 1
    hook.close()


def test_fallback_is_migrated_once_per_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    calls: list[str] = []
    real_migrate = Broker.migrate

    def counting_migrate(self: Broker) -> None:
        calls.append(str(self.engine.url))
        real_migrate(self)

    monkeypatch.setattr(Broker, "migrate", counting_migrate)
    hooks = [BrokerHook("no_such_connection") for _ in range(3)]
    ids = {h.get_broker().instance_id for h in hooks}
    assert len(ids) == 1
    assert calls == [f"sqlite:///{tmp_path / 'broker.db'}"]
    for h in hooks:
        h.close()


def test_fallback_url_defaults_to_home_airflow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRFLOW_HOME", raising=False)
    assert fallback_url() == f"sqlite:///{Path('~/airflow').expanduser() / 'broker.db'}"


def test_a_connection_is_not_migrated_by_the_hook(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A connection names a database its owner migrates: the hook says what is missing.
    set_connection(monkeypatch, "bare", conn_type="sqlite", host=str(tmp_path / "bare.db"))
    hook = BrokerHook("bare")
    with pytest.raises(Exception, match=r"no broker tables: run Broker\.migrate"):
        _ = hook.get_broker().instance_id
    hook.close()


# --------------------------------------------------------------------------------------------
# one Broker per hook


def test_one_broker_per_hook_until_closed(monkeypatch: pytest.MonkeyPatch, broker_url: str) -> None:
    set_connection(monkeypatch, "mine", conn_type="broker", extra={"url": broker_url})
    hook = BrokerHook(broker_conn_id="mine")
    first = hook.get_broker()
    assert hook.get_broker() is first
    assert hook.get_conn() is first
    other = BrokerHook(broker_conn_id="mine").get_broker()
    assert other is not first  # each hook its own
    assert other.instance_id == first.instance_id
    hook.close()
    again = hook.get_broker()
    assert again is not first
    assert again.instance_id == first.instance_id
    hook.close()
    other.dispose()


def test_test_connection_reports_the_instance_or_the_reason(
    monkeypatch: pytest.MonkeyPatch, broker_url: str, tmp_path: Path
) -> None:
    set_connection(monkeypatch, "good", conn_type="broker", extra={"url": broker_url})
    ok, message = BrokerHook("good").test_connection()
    expected = Broker.connect(broker_url)
    assert ok
    assert expected.instance_id in message
    expected.dispose()
    set_connection(monkeypatch, "empty", conn_type="sqlite", host=str(tmp_path / "empty.db"))
    ok, message = BrokerHook("empty").test_connection()
    assert not ok
    assert "no broker tables" in message


# --------------------------------------------------------------------------------------------
# the connection form


def test_hook_form_matches_the_provider_info() -> None:
    behaviour = BrokerHook.get_ui_field_behaviour()
    declared = CONNECTION_FORM["ui-field-behaviour"]
    assert behaviour == {
        "hidden_fields": declared["hidden-fields"],
        "relabeling": declared["relabeling"],
        "placeholders": declared["placeholders"],
    }
    (entry,) = get_provider_info()["connection-types"]
    assert entry["ui-field-behaviour"] == declared
    assert entry["conn-fields"] == CONNECTION_FORM["conn-fields"]


def test_ui_shows_the_broker_connection_form() -> None:
    """What the Airflow UI's connection form gets for type ``broker`` (the API's hook metadata,
    built from the provider info through ProvidersManager)."""
    from airflow.api_fastapi.core_api.services.ui.connections import HookMetaService

    HookMetaService.hook_meta_data.cache_clear()
    metas = {m.connection_type: m for m in HookMetaService.hook_meta_data()}
    meta = metas["broker"]
    assert meta.hook_class_name == "airflow_broker.hooks.broker.BrokerHook"
    assert meta.hook_name == "Broker"
    fields = meta.standard_fields
    assert fields is not None
    assert fields.url_schema is not None and fields.url_schema.title == "Database"
    assert fields.host is not None and fields.host.placeholder.startswith("127.0.0.1")
    assert fields.port is not None and fields.port.placeholder == "5432"
    assert meta.extra_fields is not None
    url_field = meta.extra_fields["url"]
    assert url_field["schema"]["title"] == "Database URL"
    assert url_field["schema"]["type"] == ["string", "null"]
    assert "postgresql+psycopg" in url_field["description"]


# --------------------------------------------------------------------------------------------
# the provider, as Airflow reads it


def test_provider_info_is_valid_for_airflow() -> None:
    from airflow.providers_manager import _create_provider_info_schema_validator

    info = get_provider_info()
    _create_provider_info_schema_validator().validate(info)
    assert info["package-name"] == "airflow-broker"
    (conn_type,) = info["connection-types"]
    assert conn_type["connection-type"] == BrokerHook.conn_type == "broker"
    assert conn_type["hook-class-name"] == f"{BrokerHook.__module__}.{BrokerHook.__qualname__}"
    assert conn_type["hook-name"] == BrokerHook.hook_name
    assert info["queues"] == ["airflow_broker.provider.triggers.queues.BrokerMessageQueueProvider"]
    assert info["db-managers"] == ["airflow_broker.provider.dbmanager.BrokerDBManager"]
    (triggers,) = info["triggers"]
    assert triggers["python-modules"] == [
        "airflow_broker.provider.triggers.activation",
        "airflow_broker.provider.triggers.alerts",
        "airflow_broker.provider.triggers.conversation",
        "airflow_broker.provider.triggers.transmission",
    ]
    (hooks,) = info["hooks"]
    assert hooks["python-modules"] == ["airflow_broker.hooks.broker"]


def test_providers_manager_loads_the_provider() -> None:
    """Through the installed entry point, as every Airflow component does."""
    from airflow.providers_manager import ProvidersManager

    pm = ProvidersManager()
    provider = pm.providers["airflow-broker"]
    assert provider.data["name"] == "Service Broker"
    from airflow_broker import __version__

    assert provider.version == __version__
    from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime

    # What a task's Connection.get_hook() uses to find the hook of type "broker".
    hook = ProvidersManagerTaskRuntime().hooks["broker"]
    assert hook is not None
    assert hook.hook_class_name == "airflow_broker.hooks.broker.BrokerHook"
    assert hook.connection_id_attribute_name == "broker_conn_id"
    assert hook.hook_name == "Broker"
    assert pm.field_behaviours["broker"]["relabeling"]["schema"] == "Database"
    assert "extra__broker__url" in pm.connection_form_widgets
    assert "airflow_broker.provider.dbmanager.BrokerDBManager" in pm.db_managers
    # Listed only when the class imports: the "broker" scheme of MessageQueueTrigger.
    assert (
        "airflow_broker.provider.triggers.queues.BrokerMessageQueueProvider" in pm.queue_class_names
    )
    assert {t.trigger_class_name for t in pm.trigger} >= {
        "airflow_broker.provider.triggers.activation",
        "airflow_broker.provider.triggers.alerts",
        "airflow_broker.provider.triggers.conversation",
        "airflow_broker.provider.triggers.transmission",
    }
