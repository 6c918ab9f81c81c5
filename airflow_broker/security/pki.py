"""Certificates and keys of dialog security (seed 004): X.509 certificates parsed once per process,
private keys (RSA of 2048 bits or more, or EC), self-signed EC P-256 certificates generated, and
:class:`SecurityFailure`, a check that failed. Pure; every primitive from ``cryptography``.
Re-exported by :mod:`airflow_broker.security.crypto`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from airflow_broker.constants import ERR_CERTIFICATE_EXPIRED, ERR_DIALOG_SECURITY
from airflow_broker.errors import DialogSecurityError

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
PublicKey = ec.EllipticCurvePublicKey | rsa.RSAPublicKey

#: The smallest RSA key accepted.
MIN_RSA_BITS: Final = 2048

#: How far a far broker's clock may run behind: a certificate is accepted this long before its
#: ``not_before``.
CLOCK_SKEW: Final = timedelta(minutes=5)

#: X.509's upper bound on a common name (ub-common-name).
MAX_SUBJECT: Final = 64


class SecurityFailure(Exception):
    """A check of dialog security failed: a far side's handshake or message that does not verify,
    an expired or wrong certificate. ``code`` is the Error code the dialog ends with
    (``ERR_DIALOG_SECURITY`` or ``ERR_CERTIFICATE_EXPIRED``); ``reason`` its description. For an
    expired certificate, ``subject`` and ``expires_at`` say which and when."""

    def __init__(
        self,
        reason: str,
        code: int = ERR_DIALOG_SECURITY,
        *,
        subject: str | None = None,
        expires_at: datetime | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code
        self.subject = subject
        self.expires_at = expires_at


# ---------------------------------------------------------------------------------------------
# Certificates and keys
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CertificateInfo:
    """What the broker needs of a certificate. ``subject``: its common name (else the whole
    distinguished name); ``fingerprint``: SHA-256 of its DER, hex; times aware UTC."""

    subject: str
    fingerprint: str
    not_before: datetime
    expires_at: datetime
    public_key: PublicKey

    def check_valid(self, now: datetime) -> None:
        """:class:`SecurityFailure` unless valid at ``now`` (``ERR_CERTIFICATE_EXPIRED`` past
        its end)."""
        if now > self.expires_at:
            raise SecurityFailure(
                f"certificate with subject {self.subject!r} expired on "
                f"{format_time(self.expires_at)}",
                ERR_CERTIFICATE_EXPIRED,
                subject=self.subject,
                expires_at=self.expires_at,
            )
        if now + CLOCK_SKEW < self.not_before:
            raise SecurityFailure(
                f"certificate with subject {self.subject!r} is not valid before "
                f"{format_time(self.not_before)}"
            )


def format_time(value: datetime) -> str:
    """A certificate time as messages show it: ``2026-01-31 12:00:00 UTC``."""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _check_public_key(key: object, what: str) -> PublicKey:
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size < MIN_RSA_BITS:
            raise DialogSecurityError(
                f"{what} has an RSA key of {key.key_size} bits; at least {MIN_RSA_BITS} are needed"
            )
        return key
    if isinstance(key, ec.EllipticCurvePublicKey):
        return key
    raise DialogSecurityError(
        f"{what} has a {type(key).__name__}; only RSA and EC keys are supported"
    )


def _subject_of(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if names:
        return str(names[0].value)
    return cert.subject.rfc4514_string()


@functools.lru_cache(maxsize=256)
def load_certificate(pem: str) -> CertificateInfo:
    """A PEM certificate's :class:`CertificateInfo` (parsed once per process);
    :class:`DialogSecurityError` naming what failed."""
    if not isinstance(pem, str) or "-----BEGIN CERTIFICATE-----" not in pem:
        raise DialogSecurityError(
            "not a PEM certificate: expected text with a -----BEGIN CERTIFICATE----- block"
        )
    try:
        cert = x509.load_pem_x509_certificate(pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise DialogSecurityError(f"the PEM certificate does not parse: {exc}") from None
    try:
        public_key = cert.public_key()
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise DialogSecurityError(f"the certificate's public key does not load: {exc}") from None
    subject = _subject_of(cert)
    return CertificateInfo(
        subject=subject,
        fingerprint=cert.fingerprint(hashes.SHA256()).hex(),
        not_before=cert.not_valid_before_utc,
        expires_at=cert.not_valid_after_utc,
        public_key=_check_public_key(public_key, f"certificate {subject!r}"),
    )


def normalized_pem(pem: str) -> str:
    """The first certificate of ``pem`` alone, re-encoded (what the broker stores)."""
    load_certificate(pem)
    cert = x509.load_pem_x509_certificate(pem.encode("ascii"))
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")


def load_private_key(pem_or_der: bytes | str) -> PrivateKey:
    """An unencrypted private key, PEM (text or bytes) or PKCS #8 DER; RSA (2048 bits or more)
    or EC. :class:`DialogSecurityError` when it does not load."""
    data = pem_or_der.encode("ascii", "replace") if isinstance(pem_or_der, str) else pem_or_der
    return _load_private_key(bytes(data))


@functools.lru_cache(maxsize=64)
def _load_private_key(data: bytes) -> PrivateKey:
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            key = serialization.load_pem_private_key(data, password=None)
        else:
            key = serialization.load_der_private_key(data, password=None)
    except TypeError:
        raise DialogSecurityError(
            "the private key is encrypted with a password: give it unencrypted (the broker "
            "seals it under its master key)"
        ) from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise DialogSecurityError(f"the private key does not load: {exc}") from None
    if isinstance(key, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey):
        _check_public_key(key.public_key(), "the private key")
        return key
    raise DialogSecurityError(
        f"the private key is a {type(key).__name__}; only RSA and EC keys are supported"
    )


def private_key_der(key: PrivateKey) -> bytes:
    """``key`` as unencrypted PKCS #8 DER (what is sealed under the master key)."""
    return key.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _spki(key: PublicKey) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def key_matches(cert_info: CertificateInfo, private_key: PrivateKey) -> bool:
    """Whether ``private_key`` is the private half of the certificate's public key."""
    return _spki(cert_info.public_key) == _spki(private_key.public_key())


def generate_certificate(
    subject: str, *, not_before: datetime, expires_at: datetime
) -> tuple[str, bytes]:
    """A new EC P-256 key pair and a self-signed X.509 certificate (CN=``subject``, at most
    :data:`MAX_SUBJECT` characters). Returns (certificate PEM, private key PKCS #8 DER)."""
    if not subject or len(subject) > MAX_SUBJECT:
        raise DialogSecurityError(
            f"a certificate subject must be 1 to {MAX_SUBJECT} characters, not {len(subject)}"
        )
    if expires_at <= not_before:
        raise DialogSecurityError(
            f"a certificate must expire after it starts ({format_time(expires_at)} is not after "
            f"{format_time(not_before)})"
        )
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(expires_at)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii"), private_key_der(key)
