"""Dialog security's certificates and bindings from the outside: the ``certificates`` and
``remote_service_bindings`` sections of ``apply`` YAML, the ``certificate`` and ``binding``
commands, and ``status`` listing the certificates that end within 30 days."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from sqlalchemy import update

from airflow_broker import Broker
from airflow_broker.cli import ENV_URL, main
from airflow_broker.errors import DialogSecurityError
from airflow_broker.operations import declarations
from airflow_broker.security import crypto
from airflow_broker.security import master_key as mk
from airflow_broker.storage import schema as s

MASTER = "a master key for the tests"
LOCAL = "//po/Buyer"
FAR = "//po/Supplier"

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    def _run(*argv: str | Path) -> tuple[int, str, str]:
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return _run


@pytest.fixture(autouse=True)
def master(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(ENV_URL, raising=False)
    monkeypatch.setattr(mk, "registered_master_key_sources", lambda: ())
    monkeypatch.setenv(crypto.MASTER_KEY_ENV, MASTER)
    mk.forget_master_key()
    yield
    mk.forget_master_key()


@pytest.fixture
def far(tmp_path: Path) -> dict[str, Path]:
    """A far service's certificate, and its private key, as files beside the declarations."""
    now = datetime.now(UTC)
    pem, der = crypto.generate_certificate(
        "supplier", not_before=now - timedelta(hours=1), expires_at=now + timedelta(days=20)
    )
    key = crypto.load_private_key(der).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "supplier.pem").write_text(pem)
    (tmp_path / "certs" / "supplier.key").write_bytes(key)
    return {"pem": tmp_path / "certs" / "supplier.pem", "key": tmp_path / "certs" / "supplier.key"}


DECLARED = f"""
certificates:
  - name: buyer_cert
    owner: "{LOCAL}"
    subject: Buyer
    expires_at: 2031-01-31
  - name: supplier_cert
    owner: "{FAR}"
    pem_file: certs/supplier.pem
remote_service_bindings:
  - name: to_supplier
    service: "{FAR}"
    certificate: supplier_cert
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "security.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def connect(url: str) -> Broker:
    return Broker.connect(url)


# -- apply -----------------------------------------------------------------------------------


def test_apply_creates_imports_and_binds_then_changes_nothing(
    broker_url: str, run: Run, tmp_path: Path, far: dict[str, Path]
) -> None:
    path = write(tmp_path, DECLARED)
    code, out, err = run("--url", broker_url, "apply", path)
    assert (code, err) == (0, "")
    assert "+ certificate buyer_cert: created" in out
    assert "+ certificate supplier_cert: created" in out
    assert "+ remote service binding to_supplier: created" in out
    assert re.search(r"^certificates\s+2\s+0\s+0$", out, re.M)
    b = connect(broker_url)
    try:
        cat = b.catalog()
    finally:
        b.dispose()
    buyer, supplier = cat.certificates["buyer_cert"], cat.certificates["supplier_cert"]
    assert (buyer.subject, buyer.expires_at, buyer.has_private_key) == (
        "Buyer",
        datetime(2031, 1, 31, tzinfo=UTC),
        True,
    )
    assert (supplier.owner, supplier.has_private_key) == (FAR, False)
    assert supplier.fingerprint == crypto.load_certificate(far["pem"].read_text()).fingerprint
    assert cat.remote_service_bindings["to_supplier"].certificate == "supplier_cert"

    code, out, err = run("--url", broker_url, "apply", path)
    assert (code, err) == (0, "")
    assert "nothing to change" in out
    assert re.search(r"^remote service bindings\s+0\s+0\s+1$", out, re.M)


def test_apply_alters_a_binding_and_refuses_to_change_a_certificate(
    broker_url: str, run: Run, tmp_path: Path, far: dict[str, Path]
) -> None:
    assert run("--url", broker_url, "apply", write(tmp_path, DECLARED))[0] == 0
    code, out, _ = run(
        "--url", broker_url, "apply", write(tmp_path, DECLARED + "    anonymous: true\n")
    )
    assert code == 0
    assert "~ remote service binding to_supplier: altered (anonymous: false -> true)" in out
    changed = DECLARED.replace("subject: Buyer", "subject: Buyer Two")
    code, out, err = run("--url", broker_url, "apply", write(tmp_path, changed))
    assert code == 2
    assert (
        "certificate 'buyer_cert' already exists with a different definition "
        "(subject: Buyer -> Buyer Two, database -> file)"
    ) in err


def test_apply_of_a_private_key_never_shows_it(
    run: Run, tmp_path: Path, far: dict[str, Path]
) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}"
    text = f"""
certificates:
  - name: supplier_cert
    owner: "{FAR}"
    pem_file: certs/supplier.pem
    private_key_pem_file: certs/supplier.key
"""
    assert run("--url", url, "migrate")[0] == 0
    code, out, err = run("--url", url, "apply", "--dry-run", write(tmp_path, text))
    assert code == 0 and "dry run: nothing was written" in out
    key_text = far["key"].read_text()
    body = key_text.splitlines()[1]
    decls, problems = declarations.parse(text, base_dir=tmp_path)
    assert problems == []
    assert body not in repr(decls)
    code, out, err = run("--url", url, "apply", write(tmp_path, text))
    assert code == 0 and body not in out + err
    b = connect(url)
    try:
        assert b.certificates()[0].has_private_key
    finally:
        b.dispose()


def test_apply_without_the_master_key_writes_nothing(
    run: Run, tmp_path: Path, far: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(crypto.MASTER_KEY_ENV)
    url = f"sqlite:///{tmp_path / 'b.db'}"
    assert run("--url", url, "migrate")[0] == 0
    code, _, err = run("--url", url, "apply", write(tmp_path, DECLARED))
    assert code == 1
    assert "error: no master key: set AIRFLOW_BROKER_MASTER_KEY" in err
    b = connect(url)
    try:
        assert b.certificates() == []
        assert b.catalog().remote_service_bindings == {}
    finally:
        b.dispose()


def test_declaration_problems_have_their_lines(tmp_path: Path, far: dict[str, Path]) -> None:
    text = f"""
certificates:
  - name: a
    owner: o
    pem: not a certificate
  - name: b
    owner: o
    pem_file: certs/missing.pem
  - name: c
    owner: o
    pem_file: certs/supplier.pem
    subject: nope
  - name: d
    owner: o
    expires_at: someday
  - name: e
    owner: o
    private_key_pem_file: certs/supplier.key
  - name: f
    subject: no owner
remote_service_bindings:
  - name: x
    service: "{FAR}"
    certificate: c
    anonymous: maybe
"""
    _, problems = declarations.parse(text, base_dir=tmp_path)
    found = {(p.line, p.message) for p in problems}
    assert any(line == 5 and "not a PEM certificate" in m for line, m in found)
    assert any(line == 8 and "cannot read" in m and "missing.pem" in m for line, m in found)
    assert any(line == 12 and "only for a created certificate" in m for line, m in found)
    assert any(line == 15 and "must be a date or time" in m for line, m in found)
    assert any(line == 18 and "goes with pem or pem_file" in m for line, m in found)
    assert any(line == 19 and "'owner' is required" in m for line, m in found)
    assert any(line == 25 and "anonymous must be true or false" in m for line, m in found)


def test_plan_problems(tmp_path: Path, far: dict[str, Path]) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}"
    b = connect(url)
    b.migrate()
    try:
        b.import_certificate("stored", far["pem"].read_text(), owner=FAR)
        b.create_certificate("mine", owner=LOCAL)
        b.create_remote_service_binding("existing", service=FAR, certificate="stored")
        text = f"""
certificates:
  - name: again
    owner: "{FAR}"
    pem_file: certs/supplier.pem
  - name: past
    owner: "{LOCAL}"
    expires_at: 2020-01-01
remote_service_bindings:
  - name: second
    service: "{FAR}"
    certificate: stored
  - name: wrong_owner
    service: //other/Service
    certificate: mine
  - name: unknown
    service: //third/Service
    certificate: nowhere
"""
        decls, problems = declarations.parse(text, base_dir=tmp_path)
        assert problems == []
        _, problems = declarations.plan(decls, b.catalog())
    finally:
        b.dispose()
    messages = "\n".join(p.message for p in problems)
    assert "the same certificate (fingerprint" in messages and "as 'stored'" in messages
    assert "certificate 'past': it would end on 2020-01-01 00:00:00 UTC" in messages
    assert "already has remote service binding 'existing' in the database" in messages
    assert "certificate 'mine' speaks for service '//po/Buyer'" in messages
    assert "certificate 'nowhere' is declared neither in this file nor in the database" in messages


# -- the commands ------------------------------------------------------------------------------


def test_certificate_and_binding_commands(
    broker_url: str, run: Run, tmp_path: Path, far: dict[str, Path]
) -> None:
    u = ("--url", broker_url)
    code, out, err = run(*u, "certificate", "create", "buyer_cert", "--owner", LOCAL)
    assert (code, err) == (0, "")
    assert out.startswith(f"created certificate buyer_cert for service {LOCAL}")
    assert "with its private key (sealed)" in out and "PRIVATE KEY-----" not in out
    code, out, _ = run(
        *u, "certificate", "create", "short", "--owner", LOCAL, "--expires-at", "2030-06-01",
        "--subject", "Short",
    )  # fmt: skip
    assert code == 0 and "subject 'Short', valid until 2030-06-01 00:00:00 UTC" in out
    code, out, _ = run(
        *u, "certificate", "import", "supplier_cert", "--owner", FAR, "--pem", far["pem"]
    )
    assert code == 0 and "public only" in out
    code, out, _ = run(*u, "certificate", "export", "buyer_cert")
    assert code == 0 and out.startswith("-----BEGIN CERTIFICATE-----")
    assert "PRIVATE" not in out
    exported = tmp_path / "buyer.pem"
    assert run(*u, "certificate", "export", "buyer_cert", "--out", exported)[0] == 0
    assert exported.read_text() == out

    code, out, _ = run(*u, "certificate", "list")
    lines = out.splitlines()
    assert lines[0].split() == ["CERTIFICATE", "OWNER", "ENDS", "PRIVATE", "KEY"]
    assert [line.split()[0] for line in lines[1:]] == ["supplier_cert", "buyer_cert", "short"]
    assert "(in 19 days)" in lines[1] or "(in 20 days)" in lines[1]
    code, out, _ = run(*u, "certificate", "list", "--expiring-within", "30", "--json")
    [doc] = json.loads(out)
    assert (doc["name"], doc["owner"], doc["has_private_key"]) == ("supplier_cert", FAR, False)
    code, out, _ = run(*u, "certificate", "list", "--expiring-within", "1")
    assert out == "no certificates ending within 1 days\n"

    code, out, _ = run(
        *u, "binding", "create", "to_supplier", "--service", FAR, "--certificate", "supplier_cert"
    )
    assert code == 0 and "(authenticated)" in out
    code, out, err = run(*u, "certificate", "drop", "supplier_cert")
    assert code == 1 and "used by remote service binding(s) to_supplier" in err
    assert run(*u, "binding", "alter", "to_supplier", "--anonymous")[0] == 0
    code, out, _ = run(*u, "binding", "list", "--json")
    assert json.loads(out)[0]["anonymous"] is True
    assert "pem" not in json.loads(out)[0]
    code, out, _ = run(*u, "binding", "list")
    assert out.splitlines()[1].split()[:4] == ["to_supplier", FAR, "supplier_cert", "yes"]
    assert run(*u, "binding", "alter", "to_supplier")[0] == 2
    assert run(*u, "binding", "drop", "to_supplier")[0] == 0
    assert run(*u, "certificate", "drop", "supplier_cert") == (
        0,
        "dropped certificate supplier_cert\n",
        "",
    )
    assert run(*u, "binding", "list")[1] == "no remote service bindings\n"
    code, _, err = run(*u, "certificate", "drop", "supplier_cert")
    assert code == 1 and "certificate 'supplier_cert' does not exist" in err


def test_create_without_the_master_key_is_an_error(
    run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}"
    assert run("--url", url, "migrate")[0] == 0
    monkeypatch.delenv(crypto.MASTER_KEY_ENV)
    code, out, err = run("--url", url, "certificate", "create", "c", "--owner", LOCAL)
    assert (code, out) == (1, "")
    assert err.startswith("error: no master key: set AIRFLOW_BROKER_MASTER_KEY")
    code, _, err = run("--url", url, "certificate", "create", "c", "--owner", LOCAL,
                       "--expires-at", "soon")  # fmt: skip
    assert code == 2 and "not a date or time" in err
    with pytest.raises(DialogSecurityError):
        crypto.require_master_key("x")


def test_status_lists_certificates_ending_within_30_days(
    broker_url: str, run: Run, far: dict[str, Path]
) -> None:
    u = ("--url", broker_url)
    code, out, _ = run(*u, "status")
    assert code == 0 and "\ncertificates" not in out  # dialog security not in use
    b = connect(broker_url)
    try:
        b.create_certificate("year", owner=LOCAL)
    finally:
        b.dispose()
    code, out, _ = run(*u, "status")
    assert "certificates: 1, none ending within 30 days (the first ends " in out
    b = connect(broker_url)
    try:
        b.import_certificate("supplier_cert", far["pem"].read_text(), owner=FAR)
        b.create_certificate("gone", owner=LOCAL, expires_at=datetime.now(UTC) + timedelta(1))
        with b.engine.begin() as conn:
            conn.execute(
                update(s.certificate)
                .where(s.certificate.c.name == "gone")
                .values(expires_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
            )
    finally:
        b.dispose()
    code, out, _ = run(*u, "status")
    assert code == 0
    assert "certificates ending within 30 days or expired: 2" in out
    rows = out[out.index("certificates ending") :].splitlines()[2:]
    assert rows[0].split()[:2] == ["gone", LOCAL]
    assert "2026-01-02 03:04:05 UTC (EXPIRED)" in rows[0]
    assert rows[1].split()[:2] == ["supplier_cert", FAR]
    assert "year" not in out
    code, out, _ = run(*u, "status", "--json")
    doc = json.loads(out)["certificates_expiring"]
    assert [(c["name"], c["owner"], c["expired"]) for c in doc] == [
        ("gone", LOCAL, True),
        ("supplier_cert", FAR, False),
    ]
    assert doc[0]["expires_at"] == "2026-01-02T03:04:05+00:00"


def test_the_documented_example_applies(run: Run, tmp_path: Path, far: dict[str, Path]) -> None:
    docs = Path(__file__).parent.parent / "docs" / "declarations.md"
    section = docs.read_text().split("\n## remote_service_bindings\n", 1)[1].split("\n## ", 1)[0]
    [block] = re.findall(r"```yaml\n(.*?)```", section, re.S)
    url = f"sqlite:///{tmp_path / 'b.db'}"
    assert run("--url", url, "migrate")[0] == 0
    code, out, err = run("--url", url, "apply", write(tmp_path, block))
    assert (code, err) == (0, "")
    assert "+ remote service binding to_supplier: created" in out
