"""Dialog security's certificate store on both engines (airflow_broker.security.certificates):
CREATE / import / DROP CERTIFICATE and remote service bindings through the Broker and its
definitions transaction, the master key they need, the look-ups SEND and delivery make, and the
certificates that end soon as ``Broker.certificates`` and the monitoring overview list them. The
YAML, the CLI and ``status`` are test_certificates_cli.py."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from cryptography.hazmat.primitives import serialization
from sqlalchemy import select, update

from airflow_broker import Broker
from airflow_broker.errors import (
    DialogSecurityError,
    InvalidDefinition,
    ObjectExists,
    UnknownObject,
)
from airflow_broker.operations import monitoring as mon
from airflow_broker.security import certificates as store
from airflow_broker.security import crypto
from airflow_broker.security import master_key as mk
from airflow_broker.storage import schema as s

MASTER = "a master key for the tests"
LOCAL = "//po/Buyer"
FAR = "//po/Supplier"


@pytest.fixture
def master(monkeypatch: pytest.MonkeyPatch) -> Iterator[bytes]:
    """The master key, from the environment; no registered source is asked."""
    monkeypatch.setattr(mk, "registered_master_key_sources", lambda: ())
    monkeypatch.setenv(crypto.MASTER_KEY_ENV, MASTER)
    mk.forget_master_key()
    yield crypto.derive_master_key(MASTER)
    mk.forget_master_key()


@pytest.fixture
def no_master(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(mk, "registered_master_key_sources", lambda: ())
    monkeypatch.delenv(crypto.MASTER_KEY_ENV, raising=False)
    mk.forget_master_key()
    yield
    mk.forget_master_key()


def far_certificate(subject: str = "supplier", days: int = 90) -> tuple[str, bytes]:
    """A certificate made elsewhere (the far broker's): PEM and its private key (DER)."""
    now = datetime.now(UTC)
    return crypto.generate_certificate(
        subject, not_before=now - timedelta(hours=1), expires_at=now + timedelta(days=days)
    )


def stored(broker: Broker, name: str) -> dict[str, object]:
    with broker.engine.connect() as conn:
        row = conn.execute(select(s.certificate).where(s.certificate.c.name == name)).first()
    return {} if row is None else dict(row._mapping)


def counts(broker: Broker) -> tuple[int, int]:
    with broker.engine.connect() as conn:
        return (
            len(conn.execute(select(s.certificate.c.name)).all()),
            len(conn.execute(select(s.remote_service_binding.c.name)).all()),
        )


def age(broker: Broker, name: str, expires_at: datetime) -> None:
    """Move a certificate's end (as the store sees it; its PEM keeps the real one)."""
    with broker.engine.begin() as conn:
        conn.execute(
            update(s.certificate).where(s.certificate.c.name == name).values(expires_at=expires_at)
        )


# -- create --------------------------------------------------------------------------------


def test_create_certificate_seals_its_private_key(broker: Broker, master: bytes) -> None:
    before = datetime.now(UTC)
    row = broker.create_certificate("buyer_cert", owner=LOCAL)
    assert (row.name, row.owner, row.subject) == ("buyer_cert", LOCAL, LOCAL)
    assert row.has_private_key and not row.expired
    year = before + store.DEFAULT_VALIDITY
    assert year - timedelta(seconds=5) <= row.expires_at <= year + timedelta(seconds=5)
    assert row.not_before <= before
    saved = stored(broker, "buyer_cert")
    info = crypto.load_certificate(str(saved["pem"]))
    assert (
        (info.fingerprint, info.subject)
        == (row.fingerprint, LOCAL)
        == (saved["fingerprint"], LOCAL)
    )
    sealed = bytes(saved["private_key"])  # type: ignore[arg-type]
    der = crypto.open_with_master(master, sealed)
    assert der not in sealed
    assert crypto.key_matches(info, crypto.load_private_key(der))
    assert broker.certificates() == [row]


def test_create_with_subject_and_end(broker: Broker, master: bytes) -> None:
    end = datetime(2031, 3, 1, 8, 30, 15, 999, tzinfo=UTC)
    row = broker.create_certificate("c", owner=LOCAL, subject="Buyer, Inc.", expires_at=end)
    assert (row.subject, row.expires_at) == ("Buyer, Inc.", end.replace(microsecond=0))
    naive = broker.create_certificate("n", owner=LOCAL, expires_at=datetime(2030, 1, 1))
    assert naive.expires_at == datetime(2030, 1, 1, tzinfo=UTC)
    long_owner = "//example.com/" + "x" * 100
    assert len(broker.create_certificate("long", owner=long_owner).subject) == 64


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"owner": ""}, InvalidDefinition, "owner"),
        ({"owner": LOCAL, "subject": "x" * 65}, InvalidDefinition, "1 to 64 characters"),
        (
            {"owner": LOCAL, "expires_at": datetime(2020, 1, 1, tzinfo=UTC)},
            InvalidDefinition,
            "is not in the future",
        ),
        ({"owner": LOCAL, "expires_at": "2030-01-01"}, InvalidDefinition, "must be a datetime"),
    ],
)
def test_create_refuses_bad_arguments(
    broker: Broker, master: bytes, kwargs: dict[str, object], error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        broker.create_certificate("c", **kwargs)  # type: ignore[arg-type]
    assert counts(broker) == (0, 0)


def test_create_needs_the_master_key_and_writes_nothing(broker: Broker, no_master: None) -> None:
    with pytest.raises(DialogSecurityError) as caught:
        broker.create_certificate("buyer_cert", owner=LOCAL)
    assert str(caught.value).startswith("no master key: set AIRFLOW_BROKER_MASTER_KEY")
    assert "create certificate 'buyer_cert'" in str(caught.value)
    assert counts(broker) == (0, 0)


def test_create_refuses_a_taken_name(broker: Broker, master: bytes) -> None:
    broker.create_certificate("c", owner=LOCAL)
    with pytest.raises(ObjectExists, match="certificate 'c' already exists"):
        broker.create_certificate("c", owner=LOCAL)
    pem, _ = far_certificate()
    with pytest.raises(ObjectExists, match="certificate 'c' already exists"):
        broker.import_certificate("c", pem, owner=FAR)


# -- import --------------------------------------------------------------------------------


def test_import_a_far_services_certificate_without_the_master_key(
    broker: Broker, no_master: None
) -> None:
    pem, _ = far_certificate()
    row = broker.import_certificate("supplier_cert", "some text before\n" + pem, owner=FAR)
    assert (row.owner, row.subject, row.has_private_key) == (FAR, "supplier", False)
    assert stored(broker, "supplier_cert")["pem"] == pem  # stored without the text around it
    assert stored(broker, "supplier_cert")["private_key"] is None
    with pytest.raises(ObjectExists, match="already exists as 'supplier_cert'"):
        broker.import_certificate("again", pem, owner=FAR)


def test_import_with_its_private_key(broker: Broker, master: bytes) -> None:
    pem, der = far_certificate("buyer")
    key_pem = (
        crypto.load_private_key(der)
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .decode()
    )
    row = broker.import_certificate("buyer_cert", pem, owner=LOCAL, private_key_pem=key_pem)
    assert row.has_private_key
    sealed = bytes(stored(broker, "buyer_cert")["private_key"])  # type: ignore[arg-type]
    assert crypto.open_with_master(master, sealed) == der


def test_import_refuses_and_writes_nothing(
    broker: Broker, monkeypatch: pytest.MonkeyPatch, no_master: None
) -> None:
    pem, der = far_certificate()
    _, other = far_certificate()
    with pytest.raises(DialogSecurityError, match="certificate 'x': not a PEM certificate"):
        broker.import_certificate("x", "garbage", owner=FAR)
    with pytest.raises(DialogSecurityError, match="does not belong to the certificate"):
        broker.import_certificate("x", pem, owner=FAR, private_key_pem=other)
    with pytest.raises(DialogSecurityError, match="certificate 'x': the private key does not"):
        broker.import_certificate("x", pem, owner=FAR, private_key_pem=b"garbage")
    with pytest.raises(DialogSecurityError, match=r"no master key.*private key of certificate 'x'"):
        broker.import_certificate("x", pem, owner=FAR, private_key_pem=der)
    now = datetime.now(UTC)
    old, _ = crypto.generate_certificate(
        "old", not_before=now - timedelta(days=30), expires_at=now - timedelta(days=1)
    )
    with pytest.raises(InvalidDefinition, match=r"certificate 'x' \(subject 'old'\) expired on"):
        broker.import_certificate("x", old, owner=FAR)
    assert counts(broker) == (0, 0)


# -- bindings and drops --------------------------------------------------------------------


def test_remote_service_bindings(broker: Broker, master: bytes) -> None:
    pem, _ = far_certificate()
    broker.import_certificate("supplier_cert", pem, owner=FAR)
    with pytest.raises(UnknownObject, match="certificate 'nope' does not exist"):
        broker.create_remote_service_binding("b", service=FAR, certificate="nope")
    broker.create_certificate("buyer_cert", owner=LOCAL)
    with pytest.raises(InvalidDefinition, match="speaks for service '//po/Buyer'"):
        broker.create_remote_service_binding("b", service=FAR, certificate="buyer_cert")
    broker.create_remote_service_binding("to_supplier", service=FAR, certificate="supplier_cert")
    with pytest.raises(ObjectExists, match="binding 'to_supplier' already exists"):
        broker.create_remote_service_binding("to_supplier", service=FAR, certificate="x")
    with pytest.raises(ObjectExists, match="already has remote service binding 'to_supplier'"):
        broker.create_remote_service_binding("other", service=FAR, certificate="supplier_cert")
    with pytest.raises(InvalidDefinition, match=r"used by remote service binding.*to_supplier"):
        broker.drop_certificate("supplier_cert")
    with broker.engine.connect() as conn:
        binding = store.binding_for(conn, FAR)
        assert store.binding_for(conn, LOCAL) is None
    assert binding is not None
    assert (binding.name, binding.certificate, binding.anonymous, binding.pem) == (
        "to_supplier",
        "supplier_cert",
        False,
        pem,
    )
    assert binding.expires_at == crypto.load_certificate(pem).expires_at

    renewed, _ = far_certificate()
    broker.import_certificate("supplier_cert_2", renewed, owner=FAR)
    broker.alter_remote_service_binding("to_supplier", certificate="supplier_cert_2")
    broker.alter_remote_service_binding("to_supplier", anonymous=True)
    with broker.engine.connect() as conn:
        [after] = store.bindings(conn)
    assert (after.certificate, after.anonymous, after.pem) == ("supplier_cert_2", True, renewed)
    broker.drop_certificate("supplier_cert")
    broker.drop_remote_service_binding("to_supplier")
    broker.drop_certificate("supplier_cert_2")
    for verb in ("drop_certificate", "drop_remote_service_binding", "alter_remote_service_binding"):
        with pytest.raises(UnknownObject, match="'gone' does not exist"):
            getattr(broker, verb)("gone")
    assert [c.name for c in broker.certificates()] == ["buyer_cert"]


def test_one_definitions_transaction_is_all_or_nothing(broker: Broker, master: bytes) -> None:
    pem, _ = far_certificate()
    with pytest.raises(UnknownObject), broker.definitions() as d:
        d.create_certificate("buyer_cert", owner=LOCAL)
        d.import_certificate("supplier_cert", pem, owner=FAR)
        d.create_remote_service_binding("b", service=FAR, certificate="supplier")
    assert counts(broker) == (0, 0)
    with broker.definitions() as d:
        d.import_certificate("supplier_cert", pem, owner=FAR)
        d.create_remote_service_binding(
            "b", service=FAR, certificate="supplier_cert", anonymous=True
        )
    assert counts(broker) == (1, 1)
    assert set(broker.catalog().remote_service_bindings) == {"b"}
    assert broker.catalog().certificates["supplier_cert"].owner == FAR


# -- look-ups ------------------------------------------------------------------------------


def test_local_identity_is_the_valid_certificate_that_ends_last(
    broker: Broker, master: bytes
) -> None:
    now = datetime.now(UTC)
    broker.create_certificate("soon", owner=LOCAL, expires_at=now + timedelta(days=10))
    broker.create_certificate("later", owner=LOCAL, expires_at=now + timedelta(days=200))
    pem, _ = far_certificate("public only", days=900)
    broker.import_certificate("public", pem, owner=LOCAL)
    with broker.engine.connect() as conn:
        identity = store.local_identity(conn, LOCAL, now)
        assert store.local_identity(conn, FAR, now) is None
    assert identity is not None and identity.name == "later"
    info = crypto.load_certificate(identity.pem)
    assert crypto.key_matches(info, identity.private_key)
    assert identity.expires_at == info.expires_at
    assert "private_key" not in repr(identity)

    age(broker, "later", now - timedelta(days=1))
    with broker.engine.connect() as conn:
        assert store.local_identity(conn, LOCAL, now).name == "soon"  # type: ignore[union-attr]
        assert store.local_identity(conn, LOCAL, now + timedelta(days=11)) is None
        last = store.last_identity(conn, LOCAL)
    assert last is not None and last.name == "soon"  # ends last of those with a key


def test_local_identity_needs_the_master_key(
    broker: Broker, master: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker.create_certificate("buyer_cert", owner=LOCAL)
    monkeypatch.delenv(crypto.MASTER_KEY_ENV)
    with broker.engine.connect() as conn, pytest.raises(DialogSecurityError, match="no master key"):
        store.local_identity(conn, LOCAL, datetime.now(UTC))
    monkeypatch.setenv(crypto.MASTER_KEY_ENV, "another one")
    with (
        broker.engine.connect() as conn,
        pytest.raises(
            DialogSecurityError,
            match="'buyer_cert' cannot be opened: sealed under another master key",
        ),
    ):
        store.local_identity(conn, LOCAL, datetime.now(UTC))


def test_far_certificates_by_owner_and_fingerprint(broker: Broker, no_master: None) -> None:
    first, _ = far_certificate(days=30)
    second, _ = far_certificate(days=60)
    broker.import_certificate("first", first, owner=FAR)
    broker.import_certificate("second", second, owner=FAR)
    fp = crypto.load_certificate(first).fingerprint
    with broker.engine.connect() as conn:
        assert store.certificate_owned_by(conn, FAR).name == "second"  # type: ignore[union-attr]
        found = store.certificate_owned_by(conn, FAR, fp)
        assert found is not None and (found.name, found.pem, found.fingerprint) == (
            "first",
            first,
            fp,
        )
        assert store.certificate_owned_by(conn, LOCAL) is None
        assert store.certificate_owned_by(conn, FAR, "0" * 64) is None
        assert store.certificate_by_fingerprint(conn, fp).owner == FAR  # type: ignore[union-attr]
        assert store.certificate_by_fingerprint(conn, "0" * 64) is None
        assert store.certificate_pem(conn, "second") == second
        with pytest.raises(UnknownObject, match="certificate 'x' does not exist"):
            store.certificate_pem(conn, "x")


# -- planning for expiry -------------------------------------------------------------------


def test_certificates_ending_within_30_days(broker: Broker, master: bytes) -> None:
    now = datetime.now(UTC)
    broker.create_certificate("year", owner=LOCAL)
    broker.create_certificate("ten_days", owner=LOCAL, expires_at=now + timedelta(days=10))
    broker.create_certificate("gone", owner=LOCAL, expires_at=now + timedelta(days=1))
    age(broker, "gone", now - timedelta(days=2))
    assert [c.name for c in broker.certificates()] == ["gone", "ten_days", "year"]
    soon = broker.certificates(expiring_within=store.EXPIRY_WARNING)
    assert [(c.name, c.expired) for c in soon] == [("gone", True), ("ten_days", False)]

    overview = mon.overview(broker)
    assert [c.name for c in overview.certificates_expiring] == ["gone", "ten_days"]
    doc = mon.to_json(overview)["certificates_expiring"]
    assert doc[0]["owner"] == LOCAL and doc[0]["expired"] is True
    assert doc[1]["expires_at"].endswith("+00:00")
    assert "private_key" not in doc[0] and "pem" not in doc[0]
    assert [c.name for c in mon.certificates(broker)] == ["gone", "ten_days", "year"]
    assert [c.name for c in mon.certificates(broker, expiring_within_days=0)] == ["gone"]
    with pytest.raises(InvalidDefinition, match="expiring_within_days"):
        mon.certificates(broker, expiring_within_days=-1)
