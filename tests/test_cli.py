"""The ``airflow-broker`` command line: migrate, apply a declarations file, status.

Most tests call :func:`airflow_broker.cli.main` in-process (fast, and capsys sees the output);
one runs the installed console script, to prove the entry point is wired. Tests that touch the
database run on SQLite and PostgreSQL through the ``broker_url`` fixture.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import make_url

from airflow_broker import Broker, ObjectExists, declarations
from airflow_broker.cli import ENV_URL, format_age, main
from airflow_broker.objects import Catalog, QueueStatus

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


def test_apply_alters_queues_and_replaces_routes_and_priorities(broker_url: str, run: Run) -> None:
    assert run("--url", broker_url, "apply", PURCHASE_ORDERS)[0] == 0
    before = catalog(broker_url)

    code, out, err = run("--url", broker_url, "apply", CHANGES)
    assert (code, err) == (0, "")
    assert "~ queue SupplierQueue: altered (activation.max_readers: 4 -> 8)" in out
    assert "~ queue AuditQueue: altered (status: false -> true)" in out
    assert "~ route to_warehouse: replaced (address: TRANSPORT -> LOCAL)" in out
    assert "~ priority urgent_orders: replaced (priority: 8 -> 9)" in out
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
    assert run("--url", broker_url, "apply", PURCHASE_ORDERS)[0] == 0
    before = catalog(broker_url)
    path = write(
        tmp_path,
        "changed.yaml",
        "message_types:\n"
        "  - name: //po/Note\n"
        "    validation: json\n"
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
        f"{path}:2: message type '//po/Note' already exists with a different definition "
        "(validation: none -> json, database -> file)"
    ) in err
    assert f"{path}:5: service '//po/Audit' already exists with a different definition" in err
    assert "queue: AuditQueue -> BuyerQueue" in err
    # The queue change alone would have been applied: it is not, since the file is refused.
    assert catalog(broker_url) == before


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


def test_forwarding_is_reserved(run: Run, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}"
    assert run("--url", url, "migrate")[0] == 0
    path = write(tmp_path, "fwd.yaml", "version: 1\nbroker:\n  forwarding: true\n")
    code, _, err = run("--url", url, "apply", path)
    assert code == 2
    assert f"{path}:3: broker.forwarding is reserved" in err


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
            handles = [tx.begin_dialog("//t/Sender", "//t/Receiver") for _ in range(3)]
            for i, h in enumerate(handles):
                tx.send(h, body=f"order {i}")
            tx.send(handles[0], body="order 0, second line")
            parked = tx.begin_dialog("//t/Sender", "//t/Parked")
            tx.send(parked, body="for a disabled queue")
    finally:
        b.dispose()
    return broker_url


def test_status_table(busy_url: str, run: Run) -> None:
    code, out, err = run("--url", busy_url, "status")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("QUEUE"))
    assert lines[header].split() == ["QUEUE", "STATUS", "DEPTH", "OLDEST", "GROUPS", "ROLLBACKS"]
    rows = {line.split()[0]: line.split() for line in lines[header + 1 :] if line.strip()}
    assert rows["Inbox"][1:3] == ["enabled", "4"]
    assert re.fullmatch(r"\d+s", rows["Inbox"][3])  # sent a moment ago
    assert rows["Inbox"][4:] == ["3", "0"]
    assert rows["Outbox"][1:] == ["enabled", "0", "-", "0", "0"]
    assert rows["Parked"][1:] == ["DISABLED", "0", "-", "0", "0"]
    assert lines[-2] == "transmission queue: 1 message waiting"
    assert lines[-1].split(None, 3)[:3] == ["1", "to", "//t/Parked:"]
    assert "the target queue 'Parked' is disabled" in lines[-1]


def test_status_json(busy_url: str, run: Run) -> None:
    code, out, err = run("--url", busy_url, "status", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert set(doc) == {"database", "queues", "transmission_queue"}
    assert doc["transmission_queue"]["count"] == 1
    [waiting] = doc["transmission_queue"]["waiting"]
    assert waiting["count"] == 1
    assert waiting["transmission_status"] == "the target queue 'Parked' is disabled"
    assert datetime.fromisoformat(waiting["oldest_enqueued_at"]).tzinfo is not None
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


def test_status_of_an_unmigrated_database_is_a_runtime_error(run: Run, tmp_path: Path) -> None:
    code, out, err = run("--url", f"sqlite:///{tmp_path / 'nothing.db'}", "status")
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
    ],
)
def test_usage_errors_exit_2(argv: list[str], message: str, run: Run) -> None:
    code, _, err = run(*argv)
    assert code == 2
    assert message in err


def test_help_exits_0(run: Run) -> None:
    code, out, _ = run("--help")
    assert code == 0 and "migrate" in out and "apply" in out and "status" in out


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
