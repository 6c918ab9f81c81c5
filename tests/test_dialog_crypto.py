"""Dialog security's cryptography without a database (airflow_broker.security.crypto): certificates
and keys, the master key, the once-per-dialog key exchange and message sealing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.x509.oid import NameOID

from airflow_broker.constants import ERR_CERTIFICATE_EXPIRED, ERR_DIALOG_SECURITY
from airflow_broker.errors import DialogSecurityError
from airflow_broker.security import crypto
from airflow_broker.security import master_key as mk
from airflow_broker.security.crypto import SecurityFailure

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
INITIATOR = "//po/Buyer"
TARGET = "//po/Supplier"


def certificate(
    subject: str = "test", *, days: int = 30, start: datetime = NOW - timedelta(days=1)
) -> tuple[str, crypto.PrivateKey]:
    pem, der = crypto.generate_certificate(
        subject, not_before=start, expires_at=start + timedelta(days=days)
    )
    return pem, crypto.load_private_key(der)


def self_signed(key: crypto.PrivateKey, subject: str, *, days: int = 30) -> str:
    """A certificate for ``key`` made here with cryptography directly (an "imported" one)."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - timedelta(days=1))
        .not_valid_after(NOW + timedelta(days=days))
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def pem_key(key: crypto.PrivateKey, password: bytes | None = None) -> str:
    enc: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password)
        if password
        else serialization.NoEncryption()
    )
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc
    ).decode()


@pytest.fixture(scope="module")
def rsa_key() -> crypto.PrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def pair() -> dict[str, tuple[str, crypto.PrivateKey]]:
    return {"initiator": certificate("buyer"), "target": certificate("supplier")}


# -- certificates and keys ---------------------------------------------------------------------


def test_generated_certificate_loads_with_its_fingerprint_and_times() -> None:
    end = NOW + timedelta(days=90, microseconds=500)
    pem, der = crypto.generate_certificate("//po/Buyer", not_before=NOW, expires_at=end)
    info = crypto.load_certificate(pem)
    cert = x509.load_pem_x509_certificate(pem.encode())
    assert info.subject == "//po/Buyer"
    assert info.fingerprint == cert.fingerprint(hashes.SHA256()).hex()
    assert len(info.fingerprint) == 64
    assert (info.not_before, info.expires_at) == (NOW, end.replace(microsecond=0))
    assert info.expires_at.tzinfo is not None
    assert isinstance(info.public_key, ec.EllipticCurvePublicKey)
    assert info.public_key.curve.name == "secp256r1"
    key = crypto.load_private_key(der)  # PKCS #8 DER, unencrypted
    assert crypto.key_matches(info, key)
    assert crypto.private_key_der(key) == der
    assert crypto.load_certificate(pem) is info  # parsed once per process


def test_subject_must_be_a_common_name() -> None:
    with pytest.raises(DialogSecurityError, match="1 to 64 characters"):
        crypto.generate_certificate("x" * 65, not_before=NOW, expires_at=NOW + timedelta(1))
    with pytest.raises(DialogSecurityError, match="must expire after it starts"):
        crypto.generate_certificate("x", not_before=NOW, expires_at=NOW)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not a certificate", "not a PEM certificate"),
        ("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", "does not parse"),
    ],
)
def test_garbage_certificates_say_what_failed(text: str, message: str) -> None:
    with pytest.raises(DialogSecurityError, match=message):
        crypto.load_certificate(text)


def test_rsa_certificates_import_and_small_keys_are_refused(rsa_key: crypto.PrivateKey) -> None:
    pem = self_signed(rsa_key, "far rsa")
    info = crypto.load_certificate(pem)
    assert isinstance(info.public_key, rsa.RSAPublicKey)
    assert info.subject == "far rsa"
    assert crypto.key_matches(info, crypto.load_private_key(pem_key(rsa_key)))
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    with pytest.raises(DialogSecurityError, match="1024 bits; at least 2048"):
        crypto.load_certificate(self_signed(small, "small"))
    with pytest.raises(DialogSecurityError, match="1024 bits"):
        crypto.load_private_key(pem_key(small))


def test_ec_imports_on_other_curves() -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    info = crypto.load_certificate(self_signed(key, "p384"))
    assert crypto.key_matches(info, crypto.load_private_key(pem_key(key).encode()))


def test_a_key_that_is_not_the_certificates(rsa_key: crypto.PrivateKey) -> None:
    pem, _ = certificate("a")
    _, other = certificate("b")
    assert not crypto.key_matches(crypto.load_certificate(pem), other)
    assert not crypto.key_matches(crypto.load_certificate(pem), rsa_key)


def test_private_keys_that_do_not_load(rsa_key: crypto.PrivateKey) -> None:
    with pytest.raises(DialogSecurityError, match="encrypted with a password"):
        crypto.load_private_key(pem_key(rsa_key, b"secret"))
    with pytest.raises(DialogSecurityError, match="private key does not load"):
        crypto.load_private_key(b"\x30\x03\x02\x01\x00")
    with pytest.raises(DialogSecurityError, match="private key does not load"):
        crypto.load_private_key("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")


# -- the master key ----------------------------------------------------------------------------


@pytest.fixture
def no_sources(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """No master key source is installed but those a test appends."""
    sources: list[object] = []
    monkeypatch.setattr(mk, "registered_master_key_sources", lambda: tuple(sources))
    monkeypatch.delenv(crypto.MASTER_KEY_ENV, raising=False)
    mk.forget_master_key()
    yield sources
    mk.forget_master_key()


def test_master_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, no_sources: list[object]
) -> None:
    assert crypto.master_key() is None
    monkeypatch.setenv(crypto.MASTER_KEY_ENV, "first")
    first = crypto.master_key()
    assert first is not None and len(first) == 32
    assert first == crypto.derive_master_key("first") != b"first".ljust(32, b"\0")
    monkeypatch.setenv(crypto.MASTER_KEY_ENV, "second")  # re-read when it changes
    assert crypto.master_key() == crypto.derive_master_key("second") != first


def test_master_key_from_a_registered_source(
    monkeypatch: pytest.MonkeyPatch, no_sources: list[object], caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> str | None:
        raise RuntimeError("the secrets backend is down")

    no_sources.extend([broken, lambda: None, lambda: "from airflow"])
    assert crypto.master_key() == crypto.derive_master_key("from airflow")
    assert "failed; ignored" in caplog.text
    no_sources.clear()  # cached for a while, then asked again
    assert crypto.master_key() == crypto.derive_master_key("from airflow")
    crypto.forget_master_key()
    assert crypto.master_key() is None
    monkeypatch.setenv(crypto.MASTER_KEY_ENV, "env wins")
    no_sources.append(lambda: "source")
    assert crypto.master_key() == crypto.derive_master_key("env wins")


def test_require_master_key_says_how_to_give_one(no_sources: list[object]) -> None:
    with pytest.raises(DialogSecurityError) as caught:
        crypto.require_master_key("create certificate 'c'")
    message = str(caught.value)
    assert message.startswith("no master key: set AIRFLOW_BROKER_MASTER_KEY")
    assert "airflow_broker_master_key" in message and "create certificate 'c'" in message
    assert crypto.MASTER_KEY_MISSING_REASON.startswith("waiting for dialog security: no master key")


def test_the_provider_registers_the_airflow_variable() -> None:
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group=crypto.MASTER_KEY_SOURCES)}
    assert found["airflow"] == "airflow_broker.provider.master_key:airflow_master_key"


def test_sealing_under_the_master_key() -> None:
    master = crypto.derive_master_key("one")
    blob = crypto.seal_with_master(master, b"private key")
    assert b"private key" not in blob
    assert crypto.open_with_master(master, blob) == b"private key"
    assert crypto.seal_with_master(master, b"private key") != blob  # a fresh nonce each time
    with pytest.raises(DialogSecurityError, match="sealed under another master key"):
        crypto.open_with_master(crypto.derive_master_key("two"), blob)
    altered = blob[:-1] + bytes([blob[-1] ^ 1])
    with pytest.raises(DialogSecurityError, match="integrity check"):
        crypto.open_with_master(master, altered)
    with pytest.raises(DialogSecurityError, match="format"):
        crypto.open_with_master(master, b"\x02" + blob[1:])


# -- the key exchange --------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_key_exchanges() -> Iterator[None]:
    """Each test starts with no key exchange header made or verified in this process."""
    crypto.forget_key_exchanges()
    yield
    crypto.forget_key_exchanges()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often the asymmetric operations run: signing and verifying a header, unwrapping its
    key exchange key with the target's private key."""
    calls = {"sign": 0, "verify": 0, "unwrap": 0}

    def counting(name: str) -> Any:
        real = getattr(crypto, f"_{name}")

        def wrapper(*args: Any) -> Any:
            calls[name] += 1
            return real(*args)

        return wrapper

    for name in list(calls):
        monkeypatch.setattr(crypto, f"_{name}", counting(name))
    return calls


def handshake(
    initiator: tuple[str, crypto.PrivateKey] | None,
    target_pem: str,
    *,
    now: datetime = NOW,
    conversation_id: uuid.UUID | None = None,
) -> tuple[uuid.UUID, bytes, bytes]:
    cid = conversation_id or uuid.uuid4()
    key, blob = crypto.make_handshake(
        conversation_id=cid,
        initiator_service=INITIATOR,
        target_service=TARGET,
        target_certificate_pem=target_pem,
        initiator_certificate_pem=initiator[0] if initiator else None,
        initiator_private_key=initiator[1] if initiator else None,
        now=now,
    )
    return cid, key, blob


def open_it(
    blob: bytes,
    cid: uuid.UUID,
    target: tuple[str, crypto.PrivateKey],
    initiator_pem: str | None,
    *,
    now: datetime = NOW,
    initiator_service: str = INITIATOR,
) -> crypto.HandshakeResult:
    return crypto.open_handshake(
        blob,
        conversation_id=cid,
        initiator_service=initiator_service,
        target_service=TARGET,
        target_certificate_pem=target[0],
        target_private_key=target[1],
        initiator_certificate_pem=initiator_pem,
        now=now,
    )


def test_authenticated_handshake_round_trip(pair: dict[str, tuple[str, crypto.PrivateKey]]) -> None:
    initiator, target = pair["initiator"], pair["target"]
    cid, key, blob = handshake(initiator, target[0])
    assert len(key) == 32 and key not in blob
    assert blob.startswith(b"ABDH")  # an explicit format, not pickle
    fields = crypto.handshake_fields(blob)
    assert fields["conversation_id"] == cid
    assert (fields["initiator_service"], fields["target_service"]) == (INITIATOR, TARGET)
    assert fields["target_fingerprint"] == crypto.load_certificate(target[0]).fingerprint
    assert fields["initiator_fingerprint"] == crypto.load_certificate(initiator[0]).fingerprint
    assert fields["anonymous"] is False
    result = open_it(blob, cid, target, initiator[0])
    assert result.session_key == key
    assert result.anonymous is False
    assert result.initiator_fingerprint == fields["initiator_fingerprint"]
    assert key.hex() not in repr(result) and repr(key) not in repr(result)


def test_rsa_handshake_round_trip(rsa_key: crypto.PrivateKey) -> None:
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    target = (self_signed(rsa_key, "rsa target"), rsa_key)
    initiator = (self_signed(other, "rsa initiator"), other)
    cid, key, blob = handshake(initiator, target[0])
    assert crypto.handshake_fields(blob)["algorithm"] == "rsa-oaep-sha256"
    assert open_it(blob, cid, target, initiator[0]).session_key == key


def test_anonymous_handshake_authenticates_only_the_target(
    pair: dict[str, tuple[str, crypto.PrivateKey]],
) -> None:
    target = pair["target"]
    cid, key, blob = handshake(None, target[0])
    assert crypto.handshake_fields(blob)["anonymous"] is True
    assert crypto.handshake_fields(blob)["initiator_fingerprint"] is None
    result = open_it(blob, cid, target, None)
    assert (result.session_key, result.anonymous, result.initiator_fingerprint) == (
        key,
        True,
        None,
    )
    # Whatever certificate the target knows for the initiator, nothing is checked against it.
    assert open_it(blob, cid, target, pair["initiator"][0]).session_key == key
    # Only the target can unwrap the key.
    with pytest.raises(SecurityFailure, match="cannot be unwrapped"):
        open_it(blob, cid, (target[0], pair["initiator"][1]), None)


def test_a_signed_handshake_needs_the_initiators_certificate(
    pair: dict[str, tuple[str, crypto.PrivateKey]],
) -> None:
    cid, _, blob = handshake(pair["initiator"], pair["target"][0])
    with pytest.raises(SecurityFailure) as caught:
        open_it(blob, cid, pair["target"], None)
    assert caught.value.code == ERR_DIALOG_SECURITY
    assert f"no certificate for initiator service {INITIATOR!r}" in caught.value.reason
    impostor, _ = certificate("buyer")
    with pytest.raises(SecurityFailure, match="not the one with subject 'buyer'"):
        open_it(blob, cid, pair["target"], impostor)


def field_offsets(blob: bytes) -> list[tuple[int, int]]:
    """(start, length) of each field of a handshake (after its 4-byte magic and version): the
    header's 9 (initiator service, target service, target fingerprint, initiator fingerprint,
    algorithm, ephemeral key, wrapped key exchange key, creation time, signature), then the
    dialog's conversation id and wrapped session key."""
    out, at = [], 5
    while at < len(blob):
        size = int.from_bytes(blob[at : at + 4], "big")
        out.append((at + 4, size))
        at += 4 + size
    return out


def header_of(blob: bytes) -> bytes:
    """The key exchange header a handshake starts with (shared by the dialogs of two services)."""
    start, size = field_offsets(blob)[8]
    return blob[: start + size]


def test_a_tampered_handshake_is_refused(pair: dict[str, tuple[str, crypto.PrivateKey]]) -> None:
    initiator, target = pair["initiator"], pair["target"]
    cid, _, blob = handshake(initiator, target[0])
    offsets = field_offsets(blob)
    assert len(offsets) == 11

    def flipped(field: int) -> bytes:
        altered = bytearray(blob)
        altered[offsets[field][0] + 3] ^= 0x01
        return bytes(altered)

    # The signature covers the key exchange key as wrapped (the algorithm, the ephemeral key
    # and the wrapping) and when the header was made; the signature must be the initiator's.
    for field in (4, 5, 6, 7, 8):
        with pytest.raises(SecurityFailure, match="not signed by initiator service") as caught:
            open_it(flipped(field), cid, target, initiator[0])
        assert caught.value.code == ERR_DIALOG_SECURITY
    # The fingerprints are compared with the certificates before that.
    with pytest.raises(SecurityFailure, match="remote service binding names another"):
        open_it(flipped(2), cid, target, initiator[0])
    with pytest.raises(SecurityFailure, match="is signed with a certificate of initiator"):
        open_it(flipped(3), cid, target, initiator[0])
    with pytest.raises(SecurityFailure, match="names initiator service"):
        open_it(flipped(0), cid, target, initiator[0])
    with pytest.raises(SecurityFailure, match="replayed or misdelivered"):
        open_it(flipped(9), cid, target, initiator[0])
    # The dialog's part: its session key wrapped under the header's key exchange key.
    with pytest.raises(SecurityFailure, match="does not unwrap under its key exchange header"):
        open_it(flipped(10), cid, target, initiator[0])
    for bad in (b"", blob[:40], blob + b"x", b"pickle" + blob, header_of(blob)):
        with pytest.raises(SecurityFailure):
            open_it(bad, cid, target, initiator[0])
    with pytest.raises(SecurityFailure, match="version 1; this broker knows version 2"):
        open_it(blob[:4] + b"\x01" + blob[5:], cid, target, initiator[0])


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "anonymous"])
def test_any_byte_altered_is_refused_even_with_the_header_cached(
    pair: dict[str, tuple[str, crypto.PrivateKey]], signed: bool
) -> None:
    initiator = pair["initiator"] if signed else None
    target, pem = pair["target"], pair["initiator"][0] if signed else None
    cid, key, blob = handshake(initiator, target[0])
    assert open_it(blob, cid, target, pem).session_key == key  # its header is verified now
    for at in range(len(blob)):
        for bit in (0x01, 0x80):
            altered = bytearray(blob)
            altered[at] ^= bit
            with pytest.raises(SecurityFailure):
                open_it(bytes(altered), cid, target, pem)
    assert open_it(blob, cid, target, pem).session_key == key


def test_handshake_for_another_dialog_or_service_is_refused(
    pair: dict[str, tuple[str, crypto.PrivateKey]],
) -> None:
    initiator, target = pair["initiator"], pair["target"]
    cid, _, blob = handshake(initiator, target[0])
    with pytest.raises(SecurityFailure, match="replayed or misdelivered"):
        open_it(blob, uuid.uuid4(), target, initiator[0])
    with pytest.raises(SecurityFailure, match="names initiator service"):
        open_it(blob, cid, target, initiator[0], initiator_service="//po/Other")


def test_wrong_target_key_or_certificate(pair: dict[str, tuple[str, crypto.PrivateKey]]) -> None:
    initiator, target = pair["initiator"], pair["target"]
    cid, _, blob = handshake(initiator, target[0])
    with pytest.raises(SecurityFailure, match="cannot be unwrapped"):
        open_it(blob, cid, (target[0], initiator[1]), initiator[0])
    open_it(blob, cid, target, initiator[0])  # also once the header is verified and cached
    with pytest.raises(SecurityFailure, match="cannot be unwrapped"):
        open_it(blob, cid, (target[0], initiator[1]), initiator[0])
    other = certificate("supplier")
    with pytest.raises(SecurityFailure, match="remote service binding names another"):
        open_it(blob, cid, other, initiator[0])


def test_expired_certificates_at_either_end(pair: dict[str, tuple[str, crypto.PrivateKey]]) -> None:
    initiator, target = pair["initiator"], pair["target"]
    later = NOW + timedelta(days=40)  # both were made for 30 days from yesterday
    end = crypto.load_certificate(target[0]).expires_at
    with pytest.raises(SecurityFailure) as caught:
        handshake(initiator, target[0], now=later)
    assert caught.value.code == ERR_CERTIFICATE_EXPIRED
    assert caught.value.reason == (
        f"certificate with subject 'supplier' expired on {end:%Y-%m-%d %H:%M:%S} UTC"
    )
    assert (caught.value.subject, caught.value.expires_at) == ("supplier", end)
    fresh_target = certificate("supplier", days=400)
    with pytest.raises(SecurityFailure, match="subject 'buyer' expired on") as caught:
        handshake(initiator, fresh_target[0], now=later)
    assert caught.value.code == ERR_CERTIFICATE_EXPIRED
    # At the target: the handshake was made in time, arrives late.
    cid, _, blob = handshake(initiator, target[0])
    with pytest.raises(SecurityFailure, match="subject 'supplier' expired on") as caught:
        open_it(blob, cid, target, initiator[0], now=later)
    assert caught.value.code == ERR_CERTIFICATE_EXPIRED
    cid, _, blob = handshake(initiator, fresh_target[0])
    with pytest.raises(SecurityFailure, match="subject 'buyer' expired on") as caught:
        open_it(blob, cid, fresh_target, initiator[0], now=later)
    assert caught.value.code == ERR_CERTIFICATE_EXPIRED


def test_a_certificate_not_yet_valid(pair: dict[str, tuple[str, crypto.PrivateKey]]) -> None:
    future = certificate("supplier", start=NOW + timedelta(days=1))
    with pytest.raises(SecurityFailure, match="not valid before") as caught:
        handshake(pair["initiator"], future[0])
    assert caught.value.code == ERR_DIALOG_SECURITY
    soon = certificate("supplier", start=NOW + crypto.CLOCK_SKEW / 2)  # a clock a bit behind
    handshake(pair["initiator"], soon[0])


def test_handshake_arguments_go_together(pair: dict[str, tuple[str, crypto.PrivateKey]]) -> None:
    with pytest.raises(DialogSecurityError, match="needs both"):
        crypto.make_handshake(
            conversation_id=uuid.uuid4(),
            initiator_service=INITIATOR,
            target_service=TARGET,
            target_certificate_pem=pair["target"][0],
            initiator_certificate_pem=pair["initiator"][0],
            initiator_private_key=None,
            now=NOW,
        )
    with pytest.raises(SecurityFailure, match="does not belong to its certificate"):
        handshake((pair["initiator"][0], pair["target"][1]), pair["target"][0])


# -- the key exchange header, cached per pair of services ---------------------------------------


def short_lived(subject: str, ends: datetime) -> tuple[str, crypto.PrivateKey]:
    pem, der = crypto.generate_certificate(
        subject, not_before=NOW - timedelta(days=1), expires_at=ends
    )
    return pem, crypto.load_private_key(der)


def test_dialogs_between_the_same_services_share_a_header(
    pair: dict[str, tuple[str, crypto.PrivateKey]], counted: dict[str, int]
) -> None:
    initiator, target = pair["initiator"], pair["target"]
    first, second = handshake(initiator, target[0]), handshake(initiator, target[0])
    header = header_of(first[2])
    assert second[2].startswith(header)  # the same header: signed once
    assert first[2][len(header) :] != second[2][len(header) :]
    assert first[1] != second[1]  # a session key per dialog
    assert counted["sign"] == 1
    for cid, key, blob in (first, second):
        result = open_it(blob, cid, target, initiator[0])
        assert (result.session_key, result.anonymous) == (key, False)
    # The target verified the header once and unwrapped its key exchange key once.
    assert (counted["verify"], counted["unwrap"]) == (1, 1)
    assert crypto.handshake_fields(second[2])["conversation_id"] == second[0]
    # Another pair of services, or the same with other certificates, has a header of its own.
    _, other = crypto.make_handshake(
        conversation_id=uuid.uuid4(),
        initiator_service="//po/Other",
        target_service=TARGET,
        target_certificate_pem=target[0],
        initiator_certificate_pem=initiator[0],
        initiator_private_key=initiator[1],
        now=NOW,
    )
    assert not other.startswith(header)
    renewed = certificate("supplier")
    assert not handshake(initiator, renewed[0])[2].startswith(header)
    assert counted["sign"] == 3
    # Forgotten (a certificate rotated): a new header at the next dialog, verified in full.
    crypto.forget_key_exchanges()
    cid, key, blob = handshake(initiator, target[0])
    assert not blob.startswith(header)
    assert open_it(blob, cid, target, initiator[0]).session_key == key
    assert (counted["sign"], counted["verify"], counted["unwrap"]) == (4, 2, 2)


def test_rsa_headers_are_cached_too(rsa_key: crypto.PrivateKey, counted: dict[str, int]) -> None:
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    target = (self_signed(rsa_key, "rsa target"), rsa_key)
    initiator = (self_signed(other, "rsa initiator"), other)
    exchanges = [handshake(initiator, target[0]) for _ in range(3)]
    assert len({header_of(blob) for _, _, blob in exchanges}) == 1
    for cid, key, blob in exchanges:
        assert open_it(blob, cid, target, initiator[0]).session_key == key
    assert counted == {"sign": 1, "verify": 1, "unwrap": 1}


def test_anonymous_headers_are_cached_too(
    pair: dict[str, tuple[str, crypto.PrivateKey]], counted: dict[str, int]
) -> None:
    target = pair["target"]
    exchanges = [handshake(None, target[0]) for _ in range(3)]
    assert len({header_of(blob) for _, _, blob in exchanges}) == 1
    assert len({key for _, key, _ in exchanges}) == 3
    for cid, key, blob in exchanges:
        result = open_it(blob, cid, target, None)
        assert (result.session_key, result.anonymous, result.initiator_fingerprint) == (
            key,
            True,
            None,
        )
    assert counted == {"sign": 0, "verify": 0, "unwrap": 1}
    # Signed and anonymous dialogs between the same services do not share a header.
    _, _, signed = handshake(pair["initiator"], target[0])
    assert header_of(signed) != header_of(exchanges[0][2])
    # Only the target can unwrap the key, also with the header cached.
    cid, _, blob = exchanges[0]
    with pytest.raises(SecurityFailure, match="cannot be unwrapped"):
        open_it(blob, cid, (target[0], pair["initiator"][1]), None)


def test_a_header_replayed_for_another_conversation_is_refused(
    pair: dict[str, tuple[str, crypto.PrivateKey]],
) -> None:
    initiator, target = pair["initiator"], pair["target"]
    cid, _, blob = handshake(initiator, target[0])
    another = uuid.uuid4()
    start, size = field_offsets(blob)[9]
    replayed = blob[:start] + another.bytes + blob[start + size :]
    for cached in (False, True):
        if cached:
            open_it(blob, cid, target, initiator[0])
        with pytest.raises(SecurityFailure, match="replayed or misdelivered"):
            open_it(blob, another, target, initiator[0])
        # The conversation rewritten: the session key is bound to the one it was made for.
        with pytest.raises(SecurityFailure, match="does not unwrap under its key exchange"):
            open_it(replayed, another, target, initiator[0])


def test_a_session_key_moved_onto_another_header_is_refused(
    pair: dict[str, tuple[str, crypto.PrivateKey]],
) -> None:
    initiator, target = pair["initiator"], pair["target"]
    cid, _, blob = handshake(initiator, target[0])
    dialog_part = blob[len(header_of(blob)) :]
    crypto.forget_key_exchanges()
    other_cid, other_key, other = handshake(initiator, target[0])  # same services, another KEK
    anonymous_cid, anonymous_key, anonymous = handshake(None, target[0])
    assert header_of(other) != header_of(blob)
    assert open_it(other, other_cid, target, initiator[0]).session_key == other_key
    assert open_it(anonymous, anonymous_cid, target, None).session_key == anonymous_key
    with pytest.raises(SecurityFailure, match="does not unwrap under its key exchange header"):
        open_it(header_of(other) + dialog_part, cid, target, initiator[0])
    with pytest.raises(SecurityFailure, match="does not unwrap under its key exchange header"):
        open_it(header_of(anonymous) + dialog_part, cid, target, None)


@pytest.mark.parametrize("ending", ["target", "initiator"])
def test_a_cached_header_is_refused_once_a_certificate_expires(
    pair: dict[str, tuple[str, crypto.PrivateKey]], counted: dict[str, int], ending: str
) -> None:
    subject = {"target": "supplier", "initiator": "buyer"}[ending]
    short = short_lived(subject, NOW + timedelta(minutes=30))  # well within KEK_LIFETIME
    end = crypto.load_certificate(short[0]).expires_at
    initiator, target = pair["initiator"], pair["target"]
    if ending == "target":
        target = short
    else:
        initiator = short
    cid, key, blob = handshake(initiator, target[0])
    assert open_it(blob, cid, target, initiator[0]).session_key == key
    later = NOW + timedelta(minutes=20)
    cid, key, blob = handshake(initiator, target[0], now=later)
    assert open_it(blob, cid, target, initiator[0], now=later).session_key == key
    assert (counted["sign"], counted["verify"]) == (1, 1)  # one header, verified once
    past_end = end + timedelta(seconds=1)
    with pytest.raises(SecurityFailure) as caught:  # a cache hit, refused all the same
        open_it(blob, cid, target, initiator[0], now=past_end)
    assert caught.value.code == ERR_CERTIFICATE_EXPIRED
    assert caught.value.reason == (
        f"certificate with subject {subject!r} expired on {end:%Y-%m-%d %H:%M:%S} UTC"
    )
    assert (caught.value.subject, caught.value.expires_at) == (subject, end)
    with pytest.raises(SecurityFailure) as caught:  # nor does the initiator use it any more
        handshake(initiator, target[0], now=past_end)
    assert (caught.value.code, caught.value.subject) == (ERR_CERTIFICATE_EXPIRED, subject)
    assert counted["verify"] == 1


def test_a_header_older_than_its_lifetime(
    pair: dict[str, tuple[str, crypto.PrivateKey]],
    counted: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    initiator, target = pair["initiator"], pair["target"]
    lifetime, skew = crypto.KEK_LIFETIME, crypto.CLOCK_SKEW
    assert lifetime == timedelta(hours=1)
    cid, key, blob = handshake(initiator, target[0])
    assert open_it(blob, cid, target, initiator[0]).session_key == key
    # The initiator reuses its header for KEK_LIFETIME, then makes a new one.
    _, _, same = handshake(initiator, target[0], now=NOW + lifetime - timedelta(seconds=1))
    assert header_of(same) == header_of(blob)
    _, _, renewed = handshake(initiator, target[0], now=NOW + lifetime)
    assert header_of(renewed) != header_of(blob)
    assert counted["sign"] == 2
    # The target takes a header long after KEK_LIFETIME: a dialog's first messages carry the
    # exchange made at its first SEND, however long they waited for the far broker...
    later = NOW + lifetime + skew + timedelta(days=2)
    assert open_it(blob, cid, target, initiator[0], now=later).session_key == key
    # ... up to HEADER_MAX_AGE, on a cache hit and when it verifies the header afresh.
    monkeypatch.setattr(crypto, "HEADER_MAX_AGE", timedelta(days=1))
    message = "made on 2026-06-01 12:00:00 UTC, more than 1 days ago"
    with pytest.raises(SecurityFailure, match=message) as caught:
        open_it(blob, cid, target, initiator[0], now=later)
    assert caught.value.code == ERR_DIALOG_SECURITY
    crypto.forget_key_exchanges()
    with pytest.raises(SecurityFailure, match=message):
        open_it(blob, cid, target, initiator[0], now=later)
    # A header from the future: the initiator's clock runs ahead by more than CLOCK_SKEW.
    crypto.forget_key_exchanges()
    ahead = NOW + skew + timedelta(seconds=1)
    cid, key, blob = handshake(initiator, target[0], now=ahead)
    with pytest.raises(SecurityFailure, match="in the future: the initiator's clock runs ahead"):
        open_it(blob, cid, target, initiator[0])
    assert open_it(blob, cid, target, initiator[0], now=ahead - skew).session_key == key
    # An initiator whose clock went back does not reuse a header made "later".
    _, _, back = handshake(initiator, target[0])
    assert header_of(back) != header_of(blob)


# -- messages ----------------------------------------------------------------------------------


def test_seal_and_open() -> None:
    key = AESGCM.generate_key(bit_length=256)
    cid = uuid.uuid4()
    aad = crypto.message_aad(cid, True, 7, "//po/Order")
    sealed = crypto.seal(key, b'{"order": 1}', aad)
    assert b"order" not in sealed
    assert crypto.open_sealed(key, sealed, aad) == b'{"order": 1}'
    assert crypto.seal(key, b'{"order": 1}', aad) != sealed  # a fresh nonce each time
    none, empty = crypto.seal(key, None, aad), crypto.seal(key, b"", aad)
    assert crypto.open_sealed(key, none, aad) is None
    assert crypto.open_sealed(key, empty, aad) == b""


def test_one_flipped_byte_anywhere_is_refused() -> None:
    key = AESGCM.generate_key(bit_length=256)
    aad = crypto.message_aad(uuid.uuid4(), False, 1, "t")
    sealed = crypto.seal(key, b"hello, supplier", aad)
    for at in range(len(sealed)):
        altered = bytearray(sealed)
        altered[at] ^= 0x80
        with pytest.raises(SecurityFailure) as caught:
            crypto.open_sealed(key, bytes(altered), aad)
        assert caught.value.code == ERR_DIALOG_SECURITY
    for bad in (sealed[:-1], sealed + b"\0", b""):
        with pytest.raises(SecurityFailure):
            crypto.open_sealed(key, bad, aad)


def test_a_body_moved_elsewhere_or_under_another_key_is_refused() -> None:
    key = AESGCM.generate_key(bit_length=256)
    cid = uuid.uuid4()
    sealed = crypto.seal(key, b"body", crypto.message_aad(cid, True, 3, "t"))
    for aad in (
        crypto.message_aad(cid, True, 4, "t"),  # another sequence number
        crypto.message_aad(cid, False, 3, "t"),  # the other direction
        crypto.message_aad(cid, True, 3, "u"),  # another message type
        crypto.message_aad(uuid.uuid4(), True, 3, "t"),  # another dialog
    ):
        with pytest.raises(SecurityFailure, match="failed its integrity check: altered in transit"):
            crypto.open_sealed(key, sealed, aad)
    with pytest.raises(SecurityFailure, match="sealed with another key"):
        crypto.open_sealed(
            AESGCM.generate_key(bit_length=256),
            sealed,
            crypto.message_aad(cid, True, 3, "t"),
        )


def test_the_agreed_key_seals_both_ways(pair: dict[str, tuple[str, crypto.PrivateKey]]) -> None:
    cid, key, blob = handshake(pair["initiator"], pair["target"][0])
    theirs = open_it(blob, cid, pair["target"], pair["initiator"][0]).session_key
    out = crypto.seal(key, b"order", crypto.message_aad(cid, True, 0, "o"))
    back = crypto.seal(theirs, b"invoice", crypto.message_aad(cid, False, 0, "i"))
    assert crypto.open_sealed(theirs, out, crypto.message_aad(cid, True, 0, "o")) == b"order"
    assert crypto.open_sealed(key, back, crypto.message_aad(cid, False, 0, "i")) == b"invoice"
