"""The ``airflow-broker`` command line: migrate, apply a declarations file, status, deliver.

Most tests call :func:`airflow_broker.cli.main` in-process (fast, and capsys sees the output);
one runs the installed console script, to prove the entry point is wired, and one runs
``deliver --loop`` as a process, to stop it with SIGTERM. Tests that touch the database run on
SQLite and PostgreSQL through the ``broker_url`` fixture.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from helpers import declare_pair
from sqlalchemy import make_url, update
from sqlalchemy.exc import OperationalError

from airflow_broker import Broker, ObjectExists
from airflow_broker.cli import ENV_URL, broker_settings, format_age, main
from airflow_broker.messaging.objects import (
    Catalog,
    MessageTypeDef,
    PriorityDef,
    QueueStatus,
    ServiceDef,
)
from airflow_broker.operations import declarations
from airflow_broker.storage import schema as s
from airflow_broker.transport import DeliveryReport, env_name

FIXTURES = Path(__file__).parent / "fixtures"
PURCHASE_ORDERS = FIXTURES / "purchase_orders.yaml"
CHANGES = FIXTURES / "purchase_orders_changes.yaml"
INVALID = FIXTURES / "invalid.yaml"
UNKNOWN_REFERENCE = FIXTURES / "unknown_reference.yaml"

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    """``run("status", "--json") -> (exit code, stdout, stderr)``."""

    def _run(*argv: str | Path) -> tuple[int, str, str]:
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return _run


@pytest.fixture(autouse=True)
def _no_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_URL, raising=False)


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL of an empty, never migrated database on each engine."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fresh.db'}"
    server = request.getfixturevalue("postgres_server")
    url: str = server.create_database(migrated=False)
    return url


def catalog(url: str) -> Catalog:
    b = Broker.connect(url)
    try:
        return b.catalog()
    finally:
        b.dispose()


def settings(url: str) -> dict[str, bool]:
    b = Broker.connect(url)
    try:
        return broker_settings(b)
    finally:
        b.dispose()


def instance_id(url: str) -> str:
    b = Broker.connect(url)
    try:
        return b.instance_id
    finally:
        b.dispose()


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# migrate


def test_migrate_is_idempotent(fresh_url: str, run: Run) -> None:
    code, first, err = run("--url", fresh_url, "migrate")
    assert (code, err) == (0, "")
    assert "(--url)" in first
    code, second, err = run("--url", fresh_url, "migrate")
    assert (code, err) == (0, "")
    assert second == first  # same database, same broker instance id, nothing else to say
    assert re.search(r"broker instance [0-9a-f-]{36}", first)
    cat = catalog(fresh_url)
    assert "DEFAULT" in cat.message_types and "DEFAULT" in cat.contracts
    assert "AutoCreatedLocal" in cat.routes


def test_migrate_uses_the_environment_and_hides_the_password(
    make_pg_database: Callable[..., str], run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The test server trusts every connection, so any password works: it only has to be hidden.
    url = make_url(make_pg_database(migrated=False)).set(password="s3cret-pw")
    monkeypatch.setenv(ENV_URL, url.render_as_string(hide_password=False))
    code, out, err = run("migrate")
    assert (code, err) == (0, "")
    assert "s3cret-pw" not in out
    assert "***" in out and f"(${ENV_URL})" in out


def test_migrate_defaults_to_broker_db_in_the_current_directory(
    tmp_path: Path, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = run("migrate")
    assert code == 0
    assert (tmp_path / "broker.db").exists()
    assert out.startswith("database: sqlite:///broker.db (default: ")
    assert str(tmp_path / "broker.db") in out


def test_url_option_wins_over_the_environment(
    tmp_path: Path, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_URL, f"sqlite:///{tmp_path / 'from_env.db'}")
    code, _, _ = run("--url", f"sqlite:///{tmp_path / 'from_option.db'}", "migrate")
    assert code == 0
    assert (tmp_path / "from_option.db").exists()
    assert not (tmp_path / "from_env.db").exists()


# --------------------------------------------------------------------------------------------
# apply


def test_apply_creates_every_kind_then_reports_unchanged(broker_url: str, run: Run) -> None:
    code, out, err = run("--url", broker_url, "apply", PURCHASE_ORDERS)
    assert (code, err) == (0, "")
    assert "+ queue SupplierQueue: created" in out
    assert re.search(r"^message types\s+4\s+0\s+0$", out, re.M)
    assert re.search(r"^priorities\s+2\s+0\s+0$", out, re.M)

    cat = catalog(broker_url)
    order = cat.message_types["//po/Order"]
    assert order.validation == "json_schema"
    assert order.json_schema is not None and order.json_schema["required"] == ["order_id", "lines"]
    assert cat.message_types["//po/Note"].validation == "none"
    assert cat.message_types["//po/Cancel"].validation == "empty"
    assert cat.contracts["//po/OrderContract"].message_types == {
        "//po/Order": "initiator",
        "//po/Cancel": "initiator",
        "//po/Acknowledgement": "target",
        "//po/Note": "any",
    }
    buyer_q, supplier_q, audit_q = (
        cat.queues[n] for n in ("BuyerQueue", "SupplierQueue", "AuditQueue")
    )
    assert (buyer_q.status, buyer_q.retention, buyer_q.poison_message_handling) == (
        True,
        False,
        True,
    )
    assert buyer_q.activation is None
    assert supplier_q.retention is True
    assert supplier_q.activation == {"status": True, "max_readers": 4, "reader": "process_orders"}
    assert (audit_q.status, audit_q.poison_message_handling) == (False, False)
    assert cat.services["//po/Buyer"].queue == "BuyerQueue"
    assert cat.services["//po/Buyer"].contracts == ()
    assert set(cat.services["//po/Supplier"].contracts) == {"//po/OrderContract", "DEFAULT"}
    assert cat.routes["to_warehouse"].address == "TRANSPORT"
    pinned = cat.routes["warehouse_pinned"]
    assert pinned.broker_instance == "0b7c6a6e-3f1d-4c2b-9a57-2d4f0e8c1a90"
    assert pinned.service_name == "//po/Warehouse" and pinned.address == "LOCAL"
    assert pinned.expires_at is not None
    urgent = cat.priorities["urgent_orders"]
    assert (urgent.contract, urgent.local_service, urgent.remote_service, urgent.priority) == (
        "//po/OrderContract",
        "//po/Supplier",
        "//po/Buyer",
        8,
    )
    rest = cat.priorities["everything_else"]
    assert (rest.contract, rest.local_service, rest.remote_service, rest.priority) == (
        None,
        None,
        None,
        5,
    )

    code, out, err = run("--url", broker_url, "apply", PURCHASE_ORDERS)
    assert (code, err) == (0, "")
    assert "nothing to change" in out
    assert not re.search(r"^\s+[+~] ", out, re.M)  # no object line: nothing created or altered
    assert re.search(r"^queues\s+0\s+0\s+3$", out, re.M)
    assert catalog(broker_url) == cat


def test_apply_alters_queues_routes_and_priorities(broker_url: str, run: Run) -> None:
    assert run("--url", broker_url, "apply", PURCHASE_ORDERS)[0] == 0
    before = catalog(broker_url)

    code, out, err = run("--url", broker_url, "apply", CHANGES)
    assert (code, err) == (0, "")
    assert "~ queue SupplierQueue: altered (activation.max_readers: 4 -> 8)" in out
    assert "~ queue AuditQueue: altered (status: false -> true)" in out
    assert "~ route to_warehouse: altered (address: TRANSPORT -> LOCAL)" in out
    assert "~ priority urgent_orders: altered (priority: 8 -> 9)" in out
    assert re.search(r"^services\s+0\s+0\s+1$", out, re.M)

    after = catalog(broker_url)
    assert after.queues["SupplierQueue"].activation == {
        "status": True,
        "max_readers": 8,
        "reader": "process_orders",
    }
    assert after.queues["SupplierQueue"].retention is True  # not in the changes file: kept
    assert after.queues["AuditQueue"].status is True
    assert after.queues["AuditQueue"].poison_message_handling is False  # not given: kept
    assert after.routes["to_warehouse"].address == "LOCAL"
    assert after.priorities["urgent_orders"].priority == 9
    assert after.message_types == before.message_types
    assert after.contracts == before.contracts
    assert after.services == before.services
    assert after.routes["warehouse_pinned"] == before.routes["warehouse_pinned"]

    code, out, _ = run("--url", broker_url, "apply", CHANGES)
    assert code == 0 and "nothing to change" in out


def test_apply_removes_activation_when_the_file_says_null(
    broker_url: str, run: Run, tmp_path: Path
) -> None:
    assert run("--url", broker_url, "apply", PURCHASE_ORDERS)[0] == 0
    path = write(tmp_path, "off.yaml", "queues:\n  - name: SupplierQueue\n    activation: null\n")
    code, out, _ = run("--url", broker_url, "apply", path)
    assert code == 0
    assert "activation: " in out and "-> none" in out
    assert catalog(broker_url).queues["SupplierQueue"].activation is None


def test_dry_run_shows_the_plan_and_writes_nothing(broker_url: str, run: Run) -> None:
    before = catalog(broker_url)
    code, out, err = run("--url", broker_url, "apply", PURCHASE_ORDERS, "--dry-run")
    assert (code, err) == (0, "")
    assert "+ contract //po/OrderContract: created" in out
    assert "would be created" in out and "dry run: nothing was written" in out
    assert catalog(broker_url) == before


def test_invalid_file_lists_every_problem_with_its_line_and_writes_nothing(
    broker_url: str, run: Run
) -> None:
    expected = [
        (number, line.split("# expect:")[1].strip())
        for number, line in enumerate(INVALID.read_text().splitlines(), start=1)
        if "# expect:" in line
    ]
    assert len(expected) >= 10
    before = catalog(broker_url)

    code, out, err = run("--url", broker_url, "apply", INVALID)

    assert code == 2
    assert out == ""
    problems = [line for line in err.splitlines() if line.startswith(f"{INVALID}:")]
    for number, text in expected:
        on_line = [p for p in problems if p.startswith(f"{INVALID}:{number}: ")]
        assert any(text in p for p in on_line), f"line {number}: {text!r} not in {on_line}"
    assert len(problems) == len(expected)
    assert err.splitlines()[-1] == (
        f"error: {INVALID}: {len(expected)} problems; nothing was applied"
    )
    assert "Traceback" not in err
    assert catalog(broker_url) == before


def test_unknown_reference_is_refused_and_nothing_is_written(broker_url: str, run: Run) -> None:
    code, _, err = run("--url", broker_url, "apply", UNKNOWN_REFERENCE)
    assert code == 2
    assert (
        f"{UNKNOWN_REFERENCE}:6: service '//billing/Invoices': queue 'InvoiceQeue' is declared "
        "neither in this file nor in the database (did you mean 'InvoiceQueue'?)"
    ) in err
    # The queue itself was fine, but the file is applied whole or not at all.
    assert "InvoiceQueue" not in catalog(broker_url).queues


def test_references_resolve_against_the_database(broker_url: str, run: Run, tmp_path: Path) -> None:
    assert run("--url", broker_url, "apply", PURCHASE_ORDERS)[0] == 0
    path = write(
        tmp_path,
        "more.yaml",
        "services:\n"
        "  - name: //po/Supplier2\n"
        "    queue: SupplierQueue\n"
        "    contracts: [//po/OrderContract]\n",
    )
    code, out, err = run("--url", broker_url, "apply", path)
    assert (code, err) == (0, "")
    assert "+ service //po/Supplier2: created" in out
    assert catalog(broker_url).services["//po/Supplier2"].queue == "SupplierQueue"


def test_changed_definition_is_refused_naming_the_object(
    broker_url: str, run: Run, tmp_path: Path
) -> None:
    """A contract has no ALTER (conversations begun on it depend on its rules), nor does the
    system's DEFAULT message type: either refuses the whole file."""
    assert run("--url", broker_url, "apply", PURCHASE_ORDERS)[0] == 0
    before = catalog(broker_url)
    path = write(
        tmp_path,
        "changed.yaml",
        "message_types:\n"
        "  - name: //po/Note\n"
        "    validation: json\n"
        "  - name: DEFAULT\n"
        "    validation: json\n"
        "contracts:\n"
        "  - name: //po/OrderContract\n"
        "    message_types:\n"
        "      //po/Order: initiator\n"
        "services:\n"
        "  - name: //po/Audit\n"
        "    queue: BuyerQueue\n"
        "    contracts: [DEFAULT]\n"
        "queues:\n"
        "  - name: BuyerQueue\n"
        "    retention: true\n",
    )
    code, out, err = run("--url", broker_url, "apply", path)
    assert code == 2 and out == ""
    assert (
        f"{path}:7: contract '//po/OrderContract' already exists with a different definition "
        "(message_types: "
    ) in err
    assert "a contract cannot be changed in place" in err
    assert (
        f"{path}:4: message type 'DEFAULT' is a system object and cannot be altered "
        "(validation: none -> json, database -> file)"
    ) in err
    assert err.splitlines()[-1] == f"error: {path}: 2 problems; nothing was applied"
    # The message type, service and queue would have been altered: they are not, since the
    # file is refused.
    assert catalog(broker_url) == before


ALTERATIONS = """\
message_types:
  - name: //po/Order            # validation off, as in production (seed 004)
queues:
  - name: SupplierQueue2
services:
  - name: //po/Supplier         # another queue, one contract fewer
    queue: SupplierQueue2
    contracts: [//po/OrderContract]
  - name: //po/Audit            # one contract more
    queue: AuditQueue
    contracts: [DEFAULT, //po/OrderContract]
routes:
  - name: warehouse_pinned      # another address; the lifetime as it was
    service_name: //po/Warehouse
    broker_instance: 0b7c6a6e-3f1d-4c2b-9a57-2d4f0e8c1a90
    address: broker://warehouse
    lifetime_seconds: 86400
  - name: to_warehouse          # a lifetime from now on
    service_name: //po/Warehouse
    address: TRANSPORT
    lifetime_seconds: 3600
priorities:
  - name: everything_else
    local_service: //po/Audit
    priority: 3
"""


def test_apply_alters_message_types_services_routes_and_priorities_in_place(
    broker_url: str, run: Run, tmp_path: Path
) -> None:
    """Each object that differs is altered by its ALTER verb, not dropped and created again: a
    service keeps its conversations, which move to its new queue with their messages."""
    assert run("--url", broker_url, "apply", PURCHASE_ORDERS)[0] == 0
    broker = Broker.connect(broker_url)
    try:
        with broker.transaction() as tx:
            h = tx.begin_dialog("//po/Buyer", "//po/Supplier", "//po/OrderContract")
            tx.send(h, "//po/Order", {"order_id": 1, "lines": [1]})
    finally:
        broker.dispose()
    before = catalog(broker_url)
    path = write(tmp_path, "alter.yaml", ALTERATIONS)

    code, out, err = run("--url", broker_url, "apply", path, "--dry-run")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert any(
        line.startswith(
            "  ~ message type //po/Order: altered (validation: json_schema -> none; json_schema: "
        )
        for line in lines
    ), out
    assert "  + queue SupplierQueue2: created" in lines
    assert (
        "  ~ service //po/Supplier: altered (queue: SupplierQueue -> SupplierQueue2; "
        "contracts: [//po/OrderContract, DEFAULT] -> [//po/OrderContract])"
    ) in lines
    assert (
        "  ~ service //po/Audit: altered (contracts: [DEFAULT] -> [//po/OrderContract, DEFAULT])"
    ) in lines
    assert "  ~ route warehouse_pinned: altered (address: LOCAL -> broker://warehouse)" in lines
    assert "  ~ route to_warehouse: altered (lifetime: none -> 3600 seconds)" in lines
    assert (
        "  ~ priority everything_else: altered (local_service: none -> //po/Audit; "
        "priority: 5 -> 3)"
    ) in lines
    assert re.search(r"^services\s+0\s+2\s+0$", out, re.M)
    assert "dry run: nothing was written" in out
    assert catalog(broker_url) == before

    code, again, err = run("--url", broker_url, "apply", path)
    assert (code, err) == (0, "")
    # The dry run showed what the apply did, line for line.
    assert [line for line in again.splitlines() if line.startswith(("  +", "  ~"))] == [
        line for line in lines if line.startswith(("  +", "  ~"))
    ]
    after = catalog(broker_url)
    assert after.message_types["//po/Order"] == MessageTypeDef("//po/Order", "none", None)
    assert after.services["//po/Supplier"] == ServiceDef(
        "//po/Supplier", "SupplierQueue2", ("//po/OrderContract",)
    )
    assert set(after.services["//po/Audit"].contracts) == {"DEFAULT", "//po/OrderContract"}
    pinned = after.routes["warehouse_pinned"]
    assert pinned.address == "broker://warehouse"
    assert pinned.expires_at == before.routes["warehouse_pinned"].expires_at  # not renewed
    assert after.routes["to_warehouse"].expires_at is not None
    assert after.priorities["everything_else"] == PriorityDef(
        "everything_else", None, "//po/Audit", None, 3
    )
    assert after.contracts == before.contracts

    broker = Broker.connect(broker_url)
    try:
        with broker.transaction() as tx:
            # The order waited in SupplierQueue: it moved with the service.
            assert tx.receive("SupplierQueue") == []
            [order] = tx.receive("SupplierQueue2")
            assert (order.message_type_name, order.json()) == (
                "//po/Order",
                {"order_id": 1, "lines": [1]},
            )
            # Validation is off: the schema that refused this body is gone.
            tx.send(h, "//po/Order", "not an order")
        assert broker.check() == []
    finally:
        broker.dispose()

    code, out, _ = run("--url", broker_url, "apply", path)
    assert code == 0 and "nothing to change" in out


def test_apply_renews_an_expired_route_and_removes_a_lifetime(
    broker_url: str, run: Run, tmp_path: Path
) -> None:
    assert run("--url", broker_url, "apply", PURCHASE_ORDERS)[0] == 0
    broker = Broker.connect(broker_url)
    try:
        with broker.engine.begin() as conn:
            conn.execute(
                update(s.route)
                .where(s.route.c.name == "warehouse_pinned")
                .values(expires_at=datetime(2020, 1, 1, tzinfo=UTC))
            )
    finally:
        broker.dispose()
    code, out, err = run("--url", broker_url, "apply", PURCHASE_ORDERS)
    assert (code, err) == (0, "")
    assert (
        "  ~ route warehouse_pinned: altered (lifetime: expired 2020-01-01T00:00:00+00:00 -> "
        "86400 seconds)"
    ) in out.splitlines()
    renewed = catalog(broker_url).routes["warehouse_pinned"].expires_at
    assert renewed is not None and renewed > datetime.now(UTC)

    forever = PURCHASE_ORDERS.read_text().replace("    lifetime_seconds: 86400\n", "")
    code, out, err = run("--url", broker_url, "apply", write(tmp_path, "forever.yaml", forever))
    assert (code, err) == (0, "")
    [line] = [line for line in out.splitlines() if "route warehouse_pinned" in line]
    assert line.startswith("  ~ route warehouse_pinned: altered (lifetime: expires ")
    assert line.endswith(" -> none)")
    assert catalog(broker_url).routes["warehouse_pinned"].expires_at is None


def test_a_failure_while_applying_rolls_everything_back(
    broker_url: str, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_apply = declarations.apply_plan

    def apply_then_fail(plan: declarations.Plan, d: object) -> None:
        real_apply(plan, d)  # type: ignore[arg-type]
        raise ObjectExists("queue 'SupplierQueue' already exists")

    monkeypatch.setattr(declarations, "apply_plan", apply_then_fail)
    before = catalog(broker_url)
    code, out, err = run("--url", broker_url, "apply", PURCHASE_ORDERS)
    assert code == 1
    assert out == ""  # no "created" lines for objects that were rolled back
    assert err == "error: queue 'SupplierQueue' already exists\n"
    assert catalog(broker_url) == before


def test_empty_file_declares_nothing(run: Run, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}"
    assert run("--url", url, "migrate")[0] == 0
    path = write(tmp_path, "empty.yaml", "# nothing yet\n")
    code, out, _ = run("--url", url, "apply", path)
    assert code == 0 and "the file declares nothing" in out


ROUTES_AND_FORWARDING = """\
version: 1
broker:
  forwarding: true
routes:
  - name: to_west
    service_name: //po/Supplier
    broker_instance: 0b7c6a6e-3f1d-4c2b-9a57-2d4f0e8c1a90
    address: broker://west
    mirror_address: broker://west-mirror
  - name: everything_else
    address: broker://gw.central
  - name: via_transport
    service_name: //po/Elsewhere
    address: transport
  - name: here_for_a_day
    service_name: //po/Local
    broker_instance: 3d9e5c1a-0f2b-4e7d-8a6c-1b2c3d4e5f60
    lifetime_seconds: 86400
"""


def test_broker_settings_are_applied_then_unchanged(
    broker_url: str, run: Run, tmp_path: Path
) -> None:
    assert settings(broker_url) == {"forwarding": False, "principal": True}
    path = write(tmp_path, "routes.yaml", ROUTES_AND_FORWARDING)

    code, out, err = run("--url", broker_url, "apply", path, "--dry-run")
    assert (code, err) == (0, "")
    assert "  ~ broker setting forwarding: off -> on" in out.splitlines()
    assert re.search(r"^broker settings\s+-\s+1\s+0$", out, re.M)
    assert settings(broker_url)["forwarding"] is False  # a dry run writes nothing

    code, out, err = run("--url", broker_url, "apply", path)
    assert (code, err) == (0, "")
    assert "  ~ broker setting forwarding: off -> on" in out.splitlines()
    assert "+ route to_west: created" in out
    assert re.search(r"^routes\s+4\s+0\s+0$", out, re.M)
    assert settings(broker_url) == {"forwarding": True, "principal": True}

    code, out, err = run("--url", broker_url, "apply", path)
    assert (code, err) == (0, "")
    assert "  = broker setting forwarding: unchanged (on)" in out.splitlines()
    assert re.search(r"^broker settings\s+-\s+0\s+1$", out, re.M)
    assert "nothing to change" in out

    path = write(tmp_path, "off.yaml", "broker:\n  forwarding: false\n  principal: false\n")
    code, out, err = run("--url", broker_url, "apply", path)
    assert (code, err) == (0, "")
    assert "  ~ broker setting forwarding: on -> off" in out.splitlines()
    assert "  ~ broker setting principal: yes -> no" in out.splitlines()
    assert "the file declares nothing" not in out
    assert settings(broker_url) == {"forwarding": False, "principal": False}


def test_broker_settings_roll_back_with_the_rest_of_the_file(
    broker_url: str, run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_apply = declarations.apply_plan
    applied: list[declarations.Plan] = []

    def apply_then_fail(plan: declarations.Plan, d: object) -> None:
        real_apply(plan, d)  # type: ignore[arg-type]
        applied.append(plan)
        raise ObjectExists("route 'to_west' already exists")

    monkeypatch.setattr(declarations, "apply_plan", apply_then_fail)
    path = write(tmp_path, "routes.yaml", ROUTES_AND_FORWARDING)
    code, out, err = run("--url", broker_url, "apply", path)
    assert (code, out) == (1, "")
    assert err == "error: route 'to_west' already exists\n"
    assert applied and applied[0].settings  # configure ran, in the transaction that rolled back
    assert settings(broker_url)["forwarding"] is False
    assert "to_west" not in catalog(broker_url).routes


def test_broker_settings_are_checked_with_their_line(run: Run, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}"
    assert run("--url", url, "migrate")[0] == 0
    path = write(
        tmp_path,
        "bad.yaml",
        "broker:\n"
        '  forwarding: "yes"\n'
        "  principal: 1\n"
        "  principle: false\n"
        "queues:\n"
        "  - name: Fine\n",
    )
    code, out, err = run("--url", url, "apply", path)
    assert (code, out) == (2, "")
    problems = err.splitlines()
    assert f"{path}:2: broker.forwarding must be true or false, not the string 'yes'" in problems
    assert f"{path}:3: broker.principal must be true or false, not the number 1" in problems
    assert any(
        p.startswith(f"{path}:4: broker: unknown key 'principle' (did you mean 'principal'?)")
        for p in problems
    )
    assert problems[-1] == f"error: {path}: 3 problems; nothing was applied"
    assert "Fine" not in catalog(url).queues
    assert settings(url) == {"forwarding": False, "principal": True}

    _, problems_of_a_list = declarations.parse("broker: [forwarding]\n")
    assert [(p.line, p.message) for p in problems_of_a_list] == [
        (1, "broker must be a mapping (key: value lines), not a list")
    ]
    decls, none = declarations.parse("broker:\n")  # an empty section sets nothing
    assert (decls.settings, none) == ({}, [])


def test_routes_between_brokers_are_declared(broker_url: str, run: Run, tmp_path: Path) -> None:
    path = write(tmp_path, "routes.yaml", ROUTES_AND_FORWARDING)
    assert run("--url", broker_url, "apply", path)[0] == 0
    routes = catalog(broker_url).routes
    west = routes["to_west"]
    assert (west.service_name, west.broker_instance, west.address, west.mirror_address) == (
        "//po/Supplier",
        "0b7c6a6e-3f1d-4c2b-9a57-2d4f0e8c1a90",
        "broker://west",
        "broker://west-mirror",
    )
    gw = routes["everything_else"]
    assert (gw.service_name, gw.broker_instance, gw.address) == (None, None, "broker://gw.central")
    assert routes["via_transport"].address == "TRANSPORT"  # keywords in any case
    local = routes["here_for_a_day"]
    assert (local.address, local.mirror_address) == ("LOCAL", None)
    assert local.broker_instance == "3d9e5c1a-0f2b-4e7d-8a6c-1b2c3d4e5f60"
    assert local.expires_at is not None

    # A new mirror, another instance id: the route is altered, saying what differs.
    changed = ROUTES_AND_FORWARDING.replace("broker://west-mirror", "broker://west-standby")
    changed = changed.replace(
        "0b7c6a6e-3f1d-4c2b-9a57-2d4f0e8c1a90", "0b7c6a6e-3f1d-4c2b-9a57-2d4f0e8c1a91"
    )
    code, out, err = run("--url", broker_url, "apply", write(tmp_path, "changed.yaml", changed))
    assert (code, err) == (0, "")
    [line] = [line for line in out.splitlines() if "route to_west" in line]
    assert line.startswith("  ~ route to_west: altered (")
    assert "mirror_address: broker://west-mirror -> broker://west-standby" in line
    assert (
        "broker_instance: 0b7c6a6e-3f1d-4c2b-9a57-2d4f0e8c1a90 -> "
        "0b7c6a6e-3f1d-4c2b-9a57-2d4f0e8c1a91"
    ) in line
    assert re.search(r"^routes\s+0\s+1\s+3$", out, re.M)
    after = catalog(broker_url).routes["to_west"]
    assert after.mirror_address == "broker://west-standby"


DOCS = Path(__file__).parent.parent / "docs" / "declarations.md"


def docs_yaml_blocks(heading: str) -> list[str]:
    """The ```yaml blocks of one section of docs/declarations.md."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```yaml\n(.*?)```", section, re.S)


def test_the_documented_routes_example_applies(broker_url: str, run: Run, tmp_path: Path) -> None:
    gateway, standby = docs_yaml_blocks("Example: routes between brokers")
    code, out, err = run("--url", broker_url, "apply", write(tmp_path, "gateway.yaml", gateway))
    assert (code, err) == (0, "")
    assert "~ broker setting forwarding: off -> on" in out
    routes = catalog(broker_url).routes
    suppliers = routes["suppliers"]
    assert (suppliers.address, suppliers.mirror_address) == (
        "broker://west",
        "broker://west-standby",
    )
    assert routes["by_service_name"].address == "TRANSPORT"
    assert routes["audit_migration"].expires_at is not None
    assert settings(broker_url) == {"forwarding": True, "principal": True}
    code, out, _ = run("--url", broker_url, "apply", write(tmp_path, "gateway.yaml", gateway))
    assert code == 0 and "nothing to change" in out

    code, out, err = run("--url", broker_url, "apply", write(tmp_path, "standby.yaml", standby))
    assert (code, err) == (0, "")
    assert "~ broker setting principal: yes -> no" in out
    assert settings(broker_url) == {"forwarding": True, "principal": False}


@pytest.mark.parametrize(
    ("key", "address", "secret", "suggested"),
    [
        ("address", "broker://user:s3cret-pw@west", "s3cret-pw", "AIRFLOW_BROKER_ADDRESS_WEST"),
        ("address", "broker://apiuser@gw.central", "apiuser", "AIRFLOW_BROKER_ADDRESS_GW_CENTRAL"),
        ("address", "postgresql://broker:s3cret-pw@db.example/west", "s3cret-pw", None),
        ("address", "postgresql+psycopg://db.example/west?password=s3cret-pw", "s3cret-pw", None),
        ("address", "postgresql://db.example/west", None, None),
        ("address", "host=db.example password=s3cret-pw", "s3cret-pw", None),
        (
            "mirror_address",
            "broker://user:s3cret-pw@west2",
            "s3cret-pw",
            "AIRFLOW_BROKER_ADDRESS_WEST2",
        ),
        ("mirror_address", "sqlite:////var/lib/broker/west2.db", None, None),
    ],
)
def test_route_addresses_take_logical_names_not_urls_or_credentials(
    key: str, address: str, secret: str | None, suggested: str | None, run: Run, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}"
    assert run("--url", url, "migrate")[0] == 0
    entry = f"    address: {json.dumps(address)}\n"
    if key == "mirror_address":
        entry = (
            "    address: broker://west\n"
            "    broker_instance: 0b7c6a6e-3f1d-4c2b-9a57-2d4f0e8c1a90\n"
            f"    mirror_address: {json.dumps(address)}\n"
        )
    path = write(tmp_path, "route.yaml", f"routes:\n  - name: r\n{entry}")
    line = 3 if key == "address" else 5
    code, out, err = run("--url", url, "apply", path)
    assert (code, out) == (2, "")
    [problem] = [p for p in err.splitlines() if p.startswith(f"{path}:")]
    assert problem.startswith(f"{path}:{line}: route 'r': {key} must be ")
    assert "routes take logical names, never URLs or credentials" in problem
    assert "in Airflow the connection whose id is" in problem
    assert (suggested or "AIRFLOW_BROKER_ADDRESS_<NAME>") in problem
    if suggested:
        name = suggested.removeprefix("AIRFLOW_BROKER_ADDRESS_").lower().replace("_", ".")
        assert f"Write broker://{name} " in problem
        assert env_name(name) == suggested  # the resolver's own rule
    if secret is not None:
        assert secret not in err  # never echoed back
        assert "***" in problem
    assert "r" not in catalog(url).routes


def test_malformed_broker_names_are_refused() -> None:
    _, problems = declarations.parse(
        "routes:\n  - name: r\n    address: broker://west:5432\n  - name: s\n    address: broker://\n"
    )
    assert [p.line for p in problems] == [3, 5]
    assert all("must be LOCAL, TRANSPORT or broker://NAME" in p.message for p in problems)
    assert "logical broker name of letters, digits, _ . -" in problems[0].message


def test_file_problems_are_reported_even_when_the_database_is_not_migrated(
    run: Run, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'never_migrated.db'}"
    code, _, err = run("--url", url, "apply", INVALID)
    assert code == 2
    assert f"{INVALID}:4: " in err


# --------------------------------------------------------------------------------------------
# parsing details (no database)


def test_yaml_syntax_error_has_its_line() -> None:
    _, problems = declarations.parse("queues:\n  - name: a\n    status: [true\n  - name: b\n")
    assert len(problems) == 1
    assert problems[0].line is not None and problems[0].line >= 3
    assert problems[0].message.startswith("not valid YAML")


def test_routes_are_checked_as_the_engine_would() -> None:
    text = (
        "routes:\n"
        "  - name: mirrored\n"
        "    address: broker://west\n"
        "    mirror_address: broker://west2\n"
        "  - name: bad_instance\n"
        "    broker_instance: not-a-uuid\n"
        "  - name: mirror_of_local\n"
        "    broker_instance: 0b7c6a6e-3f1d-4c2b-9a57-2d4f0e8c1a90\n"
        "    mirror_address: broker://west2\n"
    )
    _, problems = declarations.parse(text)
    messages = {(p.line, p.message.split(": ", 1)[1]) for p in problems}
    assert (4, "mirror_address needs a broker_instance (the mirrored pair's id)") in messages
    assert any(line == 6 and "must be a broker instance id" in m for line, m in messages)
    assert any(
        line == 9 and "needs an address of the form broker://NAME" in m for line, m in messages
    )


def test_names_must_be_strings_and_keys_known() -> None:
    _, problems = declarations.parse("queues:\n  - name: 2024\n  - name: q\n    stauts: false\n")
    text = [p.format("f.yaml") for p in problems]
    assert "f.yaml:2: queue name must be a string, not the number 2024 (quote it)" in text
    assert any(
        t.startswith("f.yaml:4: queue 'q': unknown key 'stauts' (did you mean 'status'?)")
        for t in text
    )


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(None, "-"), (0.4, "0s"), (59, "59s"), (61, "1m01s"), (7260, "2h01m"), (90000, "1d01h")],
)
def test_format_age(seconds: float | None, shown: str) -> None:
    assert format_age(seconds) == shown


# --------------------------------------------------------------------------------------------
# status

STATUS_SETUP = """\
queues:
  - name: Inbox
  - name: Outbox
  - name: Parked
services:
  - name: //t/Sender
    queue: Outbox
  - name: //t/Receiver
    queue: Inbox
    contracts: [DEFAULT]
  - name: //t/Parked
    queue: Parked
    contracts: [DEFAULT]
"""


@pytest.fixture
def busy_url(broker_url: str, run: Run, tmp_path: Path) -> str:
    """A broker with 4 messages in 3 groups on Inbox, and Parked disabled with 1 message waiting
    for it in the transmission queue."""
    assert run("--url", broker_url, "apply", write(tmp_path, "setup.yaml", STATUS_SETUP))[0] == 0
    b = Broker.connect(broker_url)
    try:
        b.alter_queue("Parked", status=False)
        with b.transaction() as tx:
            handles = [
                tx.begin_dialog("//t/Sender", "//t/Receiver", encryption=False) for _ in range(3)
            ]
            for i, h in enumerate(handles):
                tx.send(h, body=f"order {i}")
            tx.send(handles[0], body="order 0, second line")
            parked = tx.begin_dialog("//t/Sender", "//t/Parked", encryption=False)
            tx.send(parked, body="for a disabled queue")
    finally:
        b.dispose()
    return broker_url


def test_status_table(busy_url: str, run: Run) -> None:
    code, out, err = run("--url", busy_url, "status")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[1] == f"broker instance: {instance_id(busy_url)}"
    assert lines[2] == "forwarding: off; principal: yes"
    header = next(i for i, line in enumerate(lines) if line.startswith("QUEUE"))
    assert lines[header].split() == [
        "QUEUE",
        "STATUS",
        "DEPTH",
        "HELD",
        "UNTIL",
        "LEASED",
        "OLDEST",
        "GROUPS",
        "ROLLBACKS",
    ]
    rows = {line.split()[0]: line.split() for line in lines[header + 1 :] if line.strip()}
    assert rows["Inbox"][1:6] == ["enabled", "4", "0", "-", "0"]
    assert re.fullmatch(r"\d+s", rows["Inbox"][6])  # sent a moment ago
    assert rows["Inbox"][7:] == ["3", "0"]
    assert rows["Outbox"][1:] == ["enabled", "0", "0", "-", "0", "-", "0", "0"]
    assert rows["Parked"][1:] == ["DISABLED", "0", "0", "-", "0", "-", "0", "0"]
    # Forwarding is off: no transit line, the transmission queue ends the output.
    assert lines[-3] == "transmission queue: 1 message waiting"
    assert lines[-2].split() == ["COUNT", "OLDEST", "TO", "SERVICE", "REASON"]
    count, age, service, reason = lines[-1].split(None, 3)
    assert (count, service) == ("1", "//t/Parked")
    assert re.fullmatch(r"\d+s", age)
    assert reason == "the target queue 'Parked' is disabled"
    assert "in transit" not in out


def test_status_json(busy_url: str, run: Run) -> None:
    code, out, err = run("--url", busy_url, "status", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert set(doc) == {
        "database",
        "broker",
        "identity",
        "queues",
        "transmission_queue",
        "in_transit",
        "certificates_expiring",
    }
    assert doc["certificates_expiring"] == []
    assert doc["identity"]["copy_detected"] is False and doc["identity"]["reason"] is None
    assert doc["broker"] == {
        "instance_id": instance_id(busy_url),
        "forwarding": False,
        "principal": True,
    }
    assert doc["transmission_queue"]["count"] == 1
    [waiting] = doc["transmission_queue"]["waiting"]
    assert waiting["count"] == 1
    assert waiting["transmission_status"] == "the target queue 'Parked' is disabled"
    assert datetime.fromisoformat(waiting["oldest_enqueued_at"]).tzinfo is not None
    assert 0 <= waiting["oldest_age_seconds"] < 600
    assert doc["in_transit"]["waiting"] == []
    # SQLite holds transit in the delivering process's memory: another process cannot count it.
    sqlite = busy_url.startswith("sqlite")
    assert doc["in_transit"]["count"] == (None if sqlite else 0)
    fields = {f.name for f in dataclasses.fields(QueueStatus)}
    assert all(set(q) == fields for q in doc["queues"])
    queues = {q["name"]: q for q in doc["queues"]}
    assert list(queues) == ["Inbox", "Outbox", "Parked"]
    inbox = queues["Inbox"]
    assert (inbox["status"], inbox["depth"], inbox["groups_ready"], inbox["rollback_count"]) == (
        True,
        4,
        3,
        0,
    )
    assert datetime.fromisoformat(inbox["oldest_enqueued_at"]).tzinfo is not None
    assert inbox["oldest_age_seconds"] >= 0
    assert queues["Parked"]["status"] is False
    assert queues["Outbox"]["oldest_enqueued_at"] is None


LONG_REASON = (
    "cannot deliver to broker://west: connection failed: connection to server at "
    '"10.20.30.40", port 5432 failed: FATAL:  password authentication failed for user "broker"'
    "\nHINT: check the connection named west (AIRFLOW_BROKER_ADDRESS_WEST outside Airflow); "
    "next attempt in 32 seconds, after 7 attempts"
)


def test_status_fits_long_reasons_to_the_width_and_shows_them_whole_with_verbose(
    busy_url: str, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = Broker.connect(busy_url)
    try:
        with b.engine.begin() as conn:
            conn.execute(update(s.transmission_queue).values(transmission_status=LONG_REASON))
        b.configure(forwarding=True, principal=False)
    finally:
        b.dispose()
    monkeypatch.setenv("COLUMNS", "80")

    code, out, err = run("--url", busy_url, "status")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[2] == "forwarding: on; principal: no (refuses deliveries: senders use the mirror)"
    wide = [line for line in lines[1:] if len(line) > 80]  # all but the database's URL
    assert wide == []
    start = lines.index("transmission queue: 1 message waiting")
    header, row = lines[start + 1 : start + 3]
    reason_at = header.index("REASON")
    assert row.split()[:3] == ["1", row.split()[1], "//t/Parked"]
    shown = row[reason_at:]
    assert shown.endswith("...") and len(row) == 80
    assert " ".join(LONG_REASON.split()).startswith(shown.removesuffix("..."))  # one line
    assert "HINT" not in out
    assert lines[-1] == "(reasons shortened to fit; --verbose shows them in full)"

    code, out, err = run("--url", busy_url, "status", "--verbose")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines[1:])
    start = lines.index("transmission queue: 1 message waiting")
    reason_at = lines[start + 1].index("REASON")
    block = []
    for line in lines[start + 2 :]:
        if block and line[:reason_at].strip():
            break  # the next table, or the next row
        block.append(line[reason_at:])
    assert "HINT: check the connection" in "\n".join(block)  # line breaks of the reason kept
    assert " ".join(" ".join(block).split()) == " ".join(LONG_REASON.split())
    assert "shortened" not in out

    code, out, _ = run("--url", busy_url, "status", "--json")
    doc = json.loads(out)
    assert doc["broker"]["forwarding"] is True and doc["broker"]["principal"] is False
    assert doc["transmission_queue"]["waiting"][0]["transmission_status"] == LONG_REASON


def test_status_of_a_forwarding_broker_counts_messages_in_transit(
    broker_url: str, run: Run
) -> None:
    b = Broker.connect(broker_url)
    try:
        b.configure(forwarding=True)
    finally:
        b.dispose()
    code, out, err = run("--url", broker_url, "status")
    assert (code, err) == (0, "")
    if broker_url.startswith("sqlite"):
        assert out.splitlines()[-1] == (
            "in transit: unknown here (SQLite: held in the delivering process's memory)"
        )
    else:
        assert out.splitlines()[-1] == "in transit: 0 messages held for their next hop"


@pytest.mark.xdist_group("transport")
def test_status_and_deliver_on_a_forwarder_holding_messages(
    make_pg_database: Callable[..., str], run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """east -> gw (forwarding) -> west: while west cannot be resolved, gw holds the messages in
    transit, and its status shows them; once it can, gw's deliver passes them on."""
    east, gw, west = make_pg_database(), make_pg_database(), make_pg_database()
    monkeypatch.setenv(env_name("gw"), gw)
    monkeypatch.delenv(env_name("west"), raising=False)
    east_file = EAST.replace("broker://west", "broker://gw")
    assert run("--url", east, "apply", write(tmp_path, "east.yaml", east_file))[0] == 0
    assert run("--url", west, "apply", write(tmp_path, "west.yaml", WEST))[0] == 0
    gw_file = "broker: {forwarding: true}\nroutes:\n  - {name: onward, address: broker://west}\n"
    code, out, _ = run("--url", gw, "apply", write(tmp_path, "gw.yaml", gw_file))
    assert code == 0 and "~ broker setting forwarding: off -> on" in out
    send(east, 3)

    code, out, err = run("--url", east, "deliver", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["delayed"] == 3

    code, out, err = run("--url", gw, "status")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[2] == "forwarding: on; principal: yes"
    start = lines.index("in transit: 3 messages held for their next hop")
    assert lines[start + 2].split()[0] == "3" and "//t/Receiver" in lines[start + 2]
    assert "next hop unreachable" in lines[start + 2]
    doc = json.loads(run("--url", gw, "status", "--json")[1])
    assert doc["in_transit"]["count"] == 3
    [held] = doc["in_transit"]["waiting"]
    assert held["to_service_name"] == "//t/Receiver"
    assert env_name("west") in held["transmission_status"]

    monkeypatch.setenv(env_name("west"), west)
    code, out, err = run("--url", gw, "deliver", "--retry-now")
    assert (code, err) == (0, "")
    report = dict(f.split(": ") for f in out.splitlines()[-1].split(", "))
    # The 3 messages, plus whatever of west's answers gw relayed back towards east.
    assert int(report["forwarded"]) >= 3 and report["failed"] == report["discarded"] == "0"
    assert json.loads(run("--url", gw, "status", "--json")[1])["in_transit"]["count"] == 0
    assert depth(west, "Inbox") == 3


def test_status_of_an_unmigrated_database_is_a_runtime_error(run: Run, tmp_path: Path) -> None:
    code, out, err = run("--url", f"sqlite:///{tmp_path / 'nothing.db'}", "status")
    assert code == 1 and out == ""
    assert err.startswith("error: ") and "migrate" in err
    assert "Traceback" not in err


# --------------------------------------------------------------------------------------------
# deliver

EAST = """\
queues: [{name: Outbox}]
services: [{name: //t/Sender, queue: Outbox}]
routes:
  - name: to_west
    service_name: //t/Receiver
    address: broker://west
"""

WEST = """\
queues: [{name: Inbox}]
services: [{name: //t/Receiver, queue: Inbox, contracts: [DEFAULT]}]
"""


def send(url: str, count: int) -> None:
    b = Broker.connect(url)
    try:
        with b.transaction() as tx:
            h = tx.begin_dialog("//t/Sender", "//t/Receiver", encryption=False)
            for i in range(count):
                tx.send(h, body=f"message {i}")
    finally:
        b.dispose()


def depth(url: str, queue: str) -> int:
    b = Broker.connect(url)
    try:
        return next(q.depth for q in b.queue_status() if q.name == queue)
    finally:
        b.dispose()


@pytest.fixture
def east_west(
    broker_url: str, run: Run, tmp_path: Path, request: pytest.FixtureRequest
) -> tuple[str, str]:
    """Two broker databases on one engine: east, whose route sends //t/Receiver to
    broker://west, and west, which hosts it. Three messages wait in east's transmission queue."""
    if broker_url.startswith("sqlite"):
        west = f"sqlite:///{tmp_path / 'west.db'}"
        assert run("--url", west, "migrate")[0] == 0
    else:
        west = request.getfixturevalue("make_pg_database")()
    assert run("--url", broker_url, "apply", write(tmp_path, "east.yaml", EAST))[0] == 0
    assert run("--url", west, "apply", write(tmp_path, "west.yaml", WEST))[0] == 0
    send(broker_url, 3)
    return broker_url, west


def test_deliver_once_resolves_names_from_the_environment(
    east_west: tuple[str, str], run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    east, west = east_west
    monkeypatch.delenv(env_name("west"), raising=False)
    code, out, err = run("--url", east, "deliver")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        out.splitlines()[0],
        "delivered: 0, acknowledged: 0, delayed: 3, failed: 0, discarded: 0, forwarded: 0",
    ]
    assert out.startswith(f"broker database: {make_url(east).render_as_string()} (--url)")
    doc = json.loads(run("--url", east, "status", "--json")[1])
    [waiting] = doc["transmission_queue"]["waiting"]
    assert waiting["count"] == 3 and "AIRFLOW_BROKER_ADDRESS_WEST" in waiting["transmission_status"]

    monkeypatch.setenv("AIRFLOW_BROKER_ADDRESS_WEST", west)
    code, out, err = run("--url", east, "deliver", "--retry-now", "--max-messages", "2", "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report == {**report, "delivered": 2, "acknowledged": 2, "failed": 0}
    assert set(report) == {f.name for f in dataclasses.fields(DeliveryReport)}
    assert depth(west, "Inbox") == 2

    code, out, err = run("--url", east, "deliver", "--retry-now")
    assert (code, err) == (0, "")
    assert out.splitlines()[-1].startswith("delivered: 1, acknowledged: 1, delayed: 0")
    assert depth(west, "Inbox") == 3
    assert json.loads(run("--url", east, "status", "--json")[1])["transmission_queue"] == {
        "count": 0,
        "waiting": [],
    }


def test_deliver_loop_runs_until_sigterm(tmp_path: Path) -> None:
    """The way cron or systemd runs it: a process, stopped by SIGTERM between two passes."""
    east, west = f"sqlite:///{tmp_path / 'east.db'}", f"sqlite:///{tmp_path / 'west.db'}"
    for url, text in ((east, EAST), (west, WEST)):
        assert main(["--url", url, "migrate"]) == 0
        assert main(["--url", url, "apply", str(write(tmp_path, "f.yaml", text))]) == 0
    send(east, 3)
    env = {**os.environ, "AIRFLOW_BROKER_ADDRESS_WEST": west, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "airflow_broker.cli", "--url", east, "deliver", "--loop", "0.2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        seen: list[str] = []
        deadline = time.monotonic() + 60
        while not any("delivered: 3" in line for line in seen):
            assert time.monotonic() < deadline, seen
            line = proc.stdout.readline()
            assert line, (seen, proc.stderr.read() if proc.stderr else "")
            seen.append(line.rstrip("\n"))
        time.sleep(0.5)  # a few empty passes: not printed
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert err == ""
    assert (
        seen[1] == "delivering every 0.2s; stop with Ctrl-C or SIGTERM "
        "(passes that move nothing are not shown)"
    )
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ delivered: 3, acknowledged: 3, .*", seen[-1]
    )
    [last] = rest.splitlines()
    assert re.fullmatch(r"stopped after \d+ passes; in all delivered: 3, acknowledged: 3, .*", last)
    assert depth(west, "Inbox") == 3


@pytest.fixture
def fake_deliver(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[object]], list[int]]:
    """Replace Broker.deliver by a script: each item is a DeliveryReport to return, an exception
    to raise, or a number of SIGTERMs to send this process before returning an empty report."""

    def install(script: list[object]) -> list[int]:
        calls: list[int] = []

        def deliver(
            self: Broker, max_messages: int | None = None, *, retry_now: bool = False
        ) -> DeliveryReport:
            calls.append(max_messages or 0)
            step = script[len(calls) - 1]
            if isinstance(step, BaseException):
                raise step
            if isinstance(step, int):
                for _ in range(step):
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.05)
                return DeliveryReport(forwarded=1)
            assert isinstance(step, DeliveryReport)
            return step

        monkeypatch.setattr(Broker, "deliver", deliver)
        return calls

    return install


def test_deliver_loop_reports_a_failing_pass_and_goes_on(
    fake_deliver: Callable[[list[object]], list[int]], run: Run, tmp_path: Path
) -> None:
    down = OperationalError(
        "SELECT 1", {}, Exception("server closed the connection unexpectedly\nDETAIL")
    )
    calls = fake_deliver([down, DeliveryReport(delivered=2, acknowledged=2), DeliveryReport(), 1])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    url = f"sqlite:///{tmp_path / 'b.db'}"

    code, out, err = run("--url", url, "deliver", "--loop", "0.01", "--max-messages", "50")

    assert code == 0
    assert calls == [50, 50, 50, 50]
    assert re.fullmatch(r"\S+Z error: server closed the connection unexpectedly\n", err)
    lines = out.splitlines()
    assert [line.split(" ", 1)[1] for line in lines[2:-1]] == [
        "delivered: 2, acknowledged: 2, delayed: 0, failed: 0, discarded: 0, forwarded: 0",
        "delivered: 0, acknowledged: 0, delayed: 0, failed: 0, discarded: 0, forwarded: 1",
    ]  # the empty third pass is not shown
    assert lines[-1] == (
        "stopped after 3 passes; in all delivered: 2, acknowledged: 2, delayed: 0, failed: 0, "
        "discarded: 0, forwarded: 1"
    )
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # put back


def test_deliver_loop_json_lines(
    fake_deliver: Callable[[list[object]], list[int]], run: Run, tmp_path: Path
) -> None:
    fake_deliver([DeliveryReport(delivered=1), 1])
    code, out, _ = run(
        "--url", f"sqlite:///{tmp_path / 'b.db'}", "deliver", "--loop", "1", "--json"
    )
    assert code == 0
    docs = [json.loads(line) for line in out.splitlines()]
    assert [d["delivered"] for d in docs] == [1, 0] and [d["forwarded"] for d in docs] == [0, 1]
    assert all(d["at"].endswith("Z") for d in docs)


def test_deliver_loop_second_signal_interrupts_the_pass(
    fake_deliver: Callable[[list[object]], list[int]], run: Run, tmp_path: Path
) -> None:
    fake_deliver([2])
    code, out, err = run("--url", f"sqlite:///{tmp_path / 'b.db'}", "deliver", "--loop", "5")
    assert code == 130
    assert err == "interrupted in the middle of a delivery pass\n"
    assert "stopped after" not in out


def test_deliver_on_an_unmigrated_database_is_a_runtime_error(run: Run, tmp_path: Path) -> None:
    code, out, err = run("--url", f"sqlite:///{tmp_path / 'nothing.db'}", "deliver")
    assert code == 1 and out == ""
    assert err.startswith("error: ") and "migrate" in err
    assert "Traceback" not in err


# --------------------------------------------------------------------------------------------
# usage


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required"),
        (["frobnicate"], "invalid choice"),
        (["apply"], "required"),
        (["apply", "/no/such/file.yaml"], "cannot read /no/such/file.yaml"),
        (["--url", "not a url", "status"], "is not a database URL"),
        (["deliver", "--max-messages", "0"], "must be at least 1, not 0"),
        (["deliver", "--max-messages", "many"], "'many' is not a whole number"),
        (["deliver", "--loop", "-1"], "must be a positive number of seconds, not -1"),
        (["deliver", "--loop", "soon"], "'soon' is not a number of seconds"),
    ],
)
def test_usage_errors_exit_2(argv: list[str], message: str, run: Run) -> None:
    code, _, err = run(*argv)
    assert code == 2
    assert message in err


def test_help_exits_0(run: Run) -> None:
    code, out, _ = run("--help")
    assert code == 0 and all(c in out for c in ("migrate", "apply", "status", "deliver"))
    code, out, _ = run("deliver", "--help")
    assert code == 0 and "AIRFLOW_BROKER_ADDRESS_<NAME>" in out and "--loop SECONDS" in out


# --------------------------------------------------------------------------------------------
# the installed console script


def test_console_script(tmp_path: Path) -> None:
    script = shutil.which("airflow-broker", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.fail(
            "the airflow-broker console script is not installed in this virtualenv: "
            "uv pip install --python .venv/bin/python -e ."
        )
    url = f"sqlite:///{tmp_path / 'script.db'}"
    b = Broker.connect(url)
    b.migrate()
    b.create_queue("ScriptQueue", status=False)
    b.dispose()
    env = {**os.environ, ENV_URL: url}
    proc = subprocess.run(
        [script, "status", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [(q["name"], q["status"]) for q in doc["queues"]] == [("ScriptQueue", False)]


# --------------------------------------------------------------------------------------------
# check


def test_check_exits_0_on_a_consistent_broker_1_on_a_problem_and_repair_fixes_it(
    broker_url: str, run: Run
) -> None:
    from test_check import _message_without_endpoint

    b = Broker.connect(broker_url)
    try:
        declare_pair(b)
        code, out, _ = run("--url", broker_url, "check")
        assert code == 0 and out.splitlines()[-1] == "no problems"
        _message_without_endpoint(b)
    finally:
        b.dispose()

    code, out, _ = run("--url", broker_url, "check")
    assert code == 1
    assert "repairable  message_without_endpoint" in out
    assert "1 problem: 1 message_without_endpoint" in out and "--repair" in out

    code, out, _ = run("--url", broker_url, "check", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["problems"][0]["kind"] == "message_without_endpoint"
    assert doc["problems"][0]["repaired"] is False

    code, out, _ = run("--url", broker_url, "check", "--repair")
    assert code == 0 and "repaired    message_without_endpoint" in out
    code, out, _ = run("--url", broker_url, "check")
    assert code == 0 and out.splitlines()[-1] == "no problems"


def test_check_reports_what_repair_cannot_fix_and_exits_1(broker_url: str, run: Run) -> None:
    from test_check import _impossible_state

    b = Broker.connect(broker_url)
    try:
        declare_pair(b)
        _impossible_state(b)
    finally:
        b.dispose()
    code, out, _ = run("--url", broker_url, "check", "--repair")
    assert code == 1 and "problem     impossible_state" in out
