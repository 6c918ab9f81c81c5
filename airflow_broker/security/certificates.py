"""The certificate store of dialog security (seed 004): certificates and remote service bindings.

A certificate speaks for one service, its ``owner``: a local service's certificate has its private
key (sealed under the master key, :mod:`.master_key`), a far service's is public only. A remote
service binding names the certificate a far service is reached with (Service Broker's CREATE
REMOTE SERVICE BINDING); ``anonymous`` bindings do not authenticate the local side.

The verbs (:func:`create_certificate`, :func:`import_certificate`, :func:`drop_certificate`,
:func:`create_remote_service_binding`, :func:`alter_remote_service_binding`,
:func:`drop_remote_service_binding`) write inside the caller's transaction (a ``Definitions``
one) and check everything before they write a row; the look-ups SEND and delivery use
(:func:`binding_for`, :func:`local_identity`, :func:`certificate_owned_by`,
:func:`certificate_by_fingerprint`) read in the caller's transaction and cache nothing but parsed
certificates and keys. Plan for expiry: :func:`certificates` with ``expiring_within`` lists those
ending soon (``status`` and the UI show :data:`EXPIRY_WARNING`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from sqlalchemy import Row, delete, insert, select, update
from sqlalchemy.engine import Connection

from airflow_broker.errors import (
    DialogSecurityError,
    InvalidDefinition,
    ObjectExists,
    UnknownObject,
)
from airflow_broker.security import crypto
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow

#: Certificates ending within this are listed by ``status`` and the UI's overview.
EXPIRY_WARNING: Final = timedelta(days=30)

#: How long a created certificate is valid when no ``expires_at`` is given.
DEFAULT_VALIDITY: Final = timedelta(days=365)

#: A created certificate starts this long before it is created, so that a far broker whose
#: clock runs a little behind accepts it at once.
BACKDATE: Final = timedelta(minutes=10)

_c = s.certificate
_b = s.remote_service_binding


@dataclass(frozen=True, slots=True)
class CertificateRow:
    """A certificate as listed: never its private key, only whether there is one."""

    name: str
    owner: str
    subject: str
    fingerprint: str
    not_before: datetime
    expires_at: datetime
    has_private_key: bool
    #: past its end at the time it was listed
    expired: bool


@dataclass(frozen=True, slots=True)
class CertRow:
    """A stored certificate with its PEM (what the look-ups return)."""

    name: str
    owner: str
    subject: str
    fingerprint: str
    pem: str
    not_before: datetime
    expires_at: datetime
    has_private_key: bool

    def valid_at(self, now: datetime) -> bool:
        return self.not_before - crypto.CLOCK_SKEW <= now <= self.expires_at


@dataclass(frozen=True, slots=True)
class Binding:
    """A remote service binding, with its certificate's PEM and end."""

    name: str
    service: str
    certificate: str
    anonymous: bool
    pem: str
    expires_at: datetime


@dataclass(frozen=True)
class Identity:
    """A local service's certificate that is valid now, with its private key loaded."""

    name: str
    owner: str
    fingerprint: str
    pem: str
    expires_at: datetime
    private_key: crypto.PrivateKey = field(repr=False)


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidDefinition(f"{what} name must be a non-empty string, not {value!r}")
    if len(value) > 256:
        raise InvalidDefinition(f"{what} name {value[:40]!r}... is longer than 256 characters")
    return value


def _when(value: Any, what: str) -> datetime:
    if not isinstance(value, datetime):
        raise InvalidDefinition(f"{what} must be a datetime, not {value!r}")
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _refuse_existing(conn: Connection, name: str) -> None:
    if conn.execute(select(_c.c.name).where(_c.c.name == name)).first() is not None:
        raise ObjectExists(f"certificate {name!r} already exists")


def _refuse_same_certificate(conn: Connection, name: str, fingerprint: str) -> None:
    other = conn.execute(select(_c.c.name).where(_c.c.fingerprint == fingerprint)).scalar()
    if other is not None:
        raise ObjectExists(
            f"certificate {name!r}: the same certificate (fingerprint {fingerprint}) already "
            f"exists as {other!r}"
        )


def _insert(
    conn: Connection,
    name: str,
    owner: str,
    info: crypto.CertificateInfo,
    pem: str,
    sealed_key: bytes | None,
) -> CertificateRow:
    now = utcnow()
    conn.execute(
        insert(_c).values(
            name=name,
            owner=owner,
            subject=info.subject,
            fingerprint=info.fingerprint,
            pem=pem,
            private_key=sealed_key,
            not_before=info.not_before,
            expires_at=info.expires_at,
            created_at=now,
        )
    )
    return CertificateRow(
        name,
        owner,
        info.subject,
        info.fingerprint,
        info.not_before,
        info.expires_at,
        sealed_key is not None,
        info.expires_at < now,
    )


def default_subject(owner: str) -> str:
    """The subject of a created certificate when none is given: its owner, cut to the 64
    characters X.509 allows a common name."""
    return owner if len(owner) <= crypto.MAX_SUBJECT else owner[: crypto.MAX_SUBJECT - 3] + "..."


def create_certificate(
    conn: Connection,
    name: str,
    *,
    owner: str,
    subject: str | None = None,
    expires_at: datetime | None = None,
) -> CertificateRow:
    """CREATE CERTIFICATE: a new key pair and a self-signed certificate for local service
    ``owner``; its private key is sealed under the master key (without one, nothing is written:
    :class:`DialogSecurityError`). ``subject`` defaults to the owner, ``expires_at`` to a year
    from now."""
    _name(name, "certificate")
    _name(owner, f"certificate {name!r}: owner (a service)")
    now = utcnow()
    if subject is None:
        subject = default_subject(owner)
    elif not isinstance(subject, str) or not 1 <= len(subject) <= crypto.MAX_SUBJECT:
        raise InvalidDefinition(
            f"certificate {name!r}: subject must be 1 to {crypto.MAX_SUBJECT} characters "
            f"(an X.509 common name), not {subject!r}"
        )
    end = now + DEFAULT_VALIDITY if expires_at is None else _when(expires_at, "expires_at")
    if end <= now:
        raise InvalidDefinition(
            f"certificate {name!r}: expires_at {crypto.format_time(end)} is not in the future"
        )
    master = crypto.require_master_key(f"create certificate {name!r} (its private key is sealed)")
    _refuse_existing(conn, name)
    try:
        pem, key_der = crypto.generate_certificate(
            subject, not_before=now - BACKDATE, expires_at=end
        )
    except DialogSecurityError as exc:
        raise InvalidDefinition(f"certificate {name!r}: {exc}") from None
    info = crypto.load_certificate(pem)
    return _insert(conn, name, owner, info, pem, crypto.seal_with_master(master, key_der))


def import_certificate(
    conn: Connection,
    name: str,
    pem: str,
    *,
    owner: str,
    private_key_pem: str | bytes | None = None,
) -> CertificateRow:
    """CREATE CERTIFICATE ... FROM FILE: a certificate given as PEM, speaking for service
    ``owner`` (a far service's, usually, to verify it and to wrap session keys for it). With
    ``private_key_pem`` (unencrypted PEM or DER, which must match the certificate) it can speak
    for a local service; the key is sealed under the master key, needed only then."""
    _name(name, "certificate")
    _name(owner, f"certificate {name!r}: owner (a service)")
    try:
        info = crypto.load_certificate(pem)
        stored = crypto.normalized_pem(pem)
    except DialogSecurityError as exc:
        raise DialogSecurityError(f"certificate {name!r}: {exc}") from None
    now = utcnow()
    if info.expires_at <= now:
        raise InvalidDefinition(
            f"certificate {name!r} (subject {info.subject!r}) expired on "
            f"{crypto.format_time(info.expires_at)}: import a current one"
        )
    sealed: bytes | None = None
    if private_key_pem is not None:
        try:
            key = crypto.load_private_key(private_key_pem)
        except DialogSecurityError as exc:
            raise DialogSecurityError(f"certificate {name!r}: {exc}") from None
        if not crypto.key_matches(info, key):
            raise DialogSecurityError(
                f"certificate {name!r}: the private key given does not belong to the "
                f"certificate (subject {info.subject!r})"
            )
        master = crypto.require_master_key(
            f"import the private key of certificate {name!r} (it is sealed)"
        )
        sealed = crypto.seal_with_master(master, crypto.private_key_der(key))
    _refuse_existing(conn, name)
    _refuse_same_certificate(conn, name, info.fingerprint)
    return _insert(conn, name, owner, info, stored, sealed)


def drop_certificate(conn: Connection, name: str) -> None:
    """DROP CERTIFICATE; refused while a remote service binding names it."""
    if conn.execute(select(_c.c.name).where(_c.c.name == name)).first() is None:
        raise UnknownObject(f"certificate {name!r} does not exist in this broker")
    users = sorted(conn.execute(select(_b.c.name).where(_b.c.certificate == name)).scalars())
    if users:
        raise InvalidDefinition(
            f"certificate {name!r} is used by remote service binding(s) {', '.join(users)}; "
            "drop or alter those first"
        )
    conn.execute(delete(_c).where(_c.c.name == name))


def _bindable(conn: Connection, binding: str, service: str, certificate: str) -> None:
    owner = conn.execute(select(_c.c.owner).where(_c.c.name == certificate)).first()
    if owner is None:
        raise UnknownObject(
            f"remote service binding {binding!r}: certificate {certificate!r} does not exist in "
            "this broker (import the far service's certificate first)"
        )
    if owner.owner != service:
        raise InvalidDefinition(
            f"remote service binding {binding!r}: certificate {certificate!r} speaks for service "
            f"{owner.owner!r} (its owner), not for {service!r}"
        )


def create_remote_service_binding(
    conn: Connection,
    name: str,
    *,
    service: str,
    certificate: str,
    anonymous: bool = False,
) -> None:
    """CREATE REMOTE SERVICE BINDING: far service ``service`` is reached with ``certificate``
    (its public certificate: session keys are wrapped for it). ``anonymous``: the local side
    does not authenticate (no local certificate needed); only the far service is."""
    _name(name, "remote service binding")
    _name(service, f"remote service binding {name!r}: service")
    _name(certificate, f"remote service binding {name!r}: certificate")
    if not isinstance(anonymous, bool):
        raise InvalidDefinition(
            f"remote service binding {name!r}: anonymous must be True or False, not {anonymous!r}"
        )
    if conn.execute(select(_b.c.name).where(_b.c.name == name)).first() is not None:
        raise ObjectExists(f"remote service binding {name!r} already exists")
    other = conn.execute(select(_b.c.name).where(_b.c.service == service)).scalar()
    if other is not None:
        raise ObjectExists(
            f"remote service binding {name!r}: service {service!r} already has remote service "
            f"binding {other!r} (one per service: alter or drop that one)"
        )
    _bindable(conn, name, service, certificate)
    conn.execute(
        insert(_b).values(
            name=name,
            service=service,
            certificate=certificate,
            anonymous=anonymous,
            created_at=utcnow(),
        )
    )


def alter_remote_service_binding(
    conn: Connection,
    name: str,
    *,
    certificate: str | None = None,
    anonymous: bool | None = None,
) -> None:
    """ALTER REMOTE SERVICE BINDING: another certificate (the far service's renewed one) or
    anonymity; what is not given stays. Dialogs already secured keep their session keys."""
    row = conn.execute(select(_b).where(_b.c.name == name)).first()
    if row is None:
        raise UnknownObject(f"remote service binding {name!r} does not exist in this broker")
    values: dict[str, Any] = {}
    if certificate is not None:
        _name(certificate, f"remote service binding {name!r}: certificate")
        _bindable(conn, name, row.service, certificate)
        values["certificate"] = certificate
    if anonymous is not None:
        if not isinstance(anonymous, bool):
            raise InvalidDefinition(
                f"remote service binding {name!r}: anonymous must be True or False, "
                f"not {anonymous!r}"
            )
        values["anonymous"] = anonymous
    if values:
        conn.execute(update(_b).where(_b.c.name == name).values(**values))


def drop_remote_service_binding(conn: Connection, name: str) -> None:
    """DROP REMOTE SERVICE BINDING."""
    if conn.execute(select(_b.c.name).where(_b.c.name == name)).first() is None:
        raise UnknownObject(f"remote service binding {name!r} does not exist in this broker")
    conn.execute(delete(_b).where(_b.c.name == name))


# ---------------------------------------------------------------------------------------------
# Listing
# ---------------------------------------------------------------------------------------------


def _listed(r: Row[Any], now: datetime) -> CertificateRow:
    expires_at = aware(r.expires_at)
    assert expires_at is not None
    return CertificateRow(
        r.name,
        r.owner,
        r.subject,
        r.fingerprint,
        aware(r.not_before) or expires_at,
        expires_at,
        bool(r.has_private_key),
        expires_at < now,
    )


def certificates(
    conn: Connection,
    *,
    expiring_within: timedelta | None = None,
    now: datetime | None = None,
) -> list[CertificateRow]:
    """Every certificate, the one ending first first; with ``expiring_within``, only those
    ending within that time from now (expired ones included)."""
    now = now or utcnow()
    query = select(
        _c.c.name,
        _c.c.owner,
        _c.c.subject,
        _c.c.fingerprint,
        _c.c.not_before,
        _c.c.expires_at,
        _c.c.private_key.is_not(None).label("has_private_key"),
    ).order_by(_c.c.expires_at, _c.c.name)
    if expiring_within is not None:
        query = query.where(_c.c.expires_at <= now + expiring_within)
    return [_listed(r, now) for r in conn.execute(query)]


def _binding(r: Row[Any]) -> Binding:
    expires_at = aware(r.expires_at)
    assert expires_at is not None
    return Binding(r.name, r.service, r.certificate, bool(r.anonymous), r.pem, expires_at)


def _bindings_query() -> Any:
    return select(
        _b.c.name, _b.c.service, _b.c.certificate, _b.c.anonymous, _c.c.pem, _c.c.expires_at
    ).join(_c, _c.c.name == _b.c.certificate)


def bindings(conn: Connection) -> list[Binding]:
    """Every remote service binding, by name."""
    return [_binding(r) for r in conn.execute(_bindings_query().order_by(_b.c.name))]


def certificate_pem(conn: Connection, name: str) -> str:
    """The PEM of certificate ``name`` (public: what the far broker imports)."""
    pem = conn.execute(select(_c.c.pem).where(_c.c.name == name)).scalar()
    if pem is None:
        raise UnknownObject(f"certificate {name!r} does not exist in this broker")
    return str(pem)


# ---------------------------------------------------------------------------------------------
# Look-ups of SEND and delivery
# ---------------------------------------------------------------------------------------------


def binding_for(conn: Connection, far_service: str) -> Binding | None:
    """The remote service binding of ``far_service``, or None (no dialog security to it)."""
    row = conn.execute(_bindings_query().where(_b.c.service == far_service)).first()
    return None if row is None else _binding(row)


def _cert(r: Row[Any]) -> CertRow:
    not_before, expires_at = aware(r.not_before), aware(r.expires_at)
    assert not_before is not None and expires_at is not None
    return CertRow(
        r.name,
        r.owner,
        r.subject,
        r.fingerprint,
        r.pem,
        not_before,
        expires_at,
        bool(r.has_private_key),
    )


def _cert_query() -> Any:
    return select(
        _c.c.name,
        _c.c.owner,
        _c.c.subject,
        _c.c.fingerprint,
        _c.c.pem,
        _c.c.not_before,
        _c.c.expires_at,
        _c.c.private_key.is_not(None).label("has_private_key"),
    )


def certificate_owned_by(
    conn: Connection, service: str, fingerprint: str | None = None
) -> CertRow | None:
    """A certificate speaking for ``service`` (a far service's, to verify its signature): the one
    with ``fingerprint`` when given, else the one that ends last."""
    query = _cert_query().where(_c.c.owner == service)
    if fingerprint is not None:
        query = query.where(_c.c.fingerprint == fingerprint)
    row = conn.execute(query.order_by(_c.c.expires_at.desc(), _c.c.name).limit(1)).first()
    return None if row is None else _cert(row)


def certificate_by_fingerprint(conn: Connection, fingerprint: str) -> CertRow | None:
    """The certificate with this SHA-256 fingerprint (hex), whoever it speaks for."""
    row = conn.execute(_cert_query().where(_c.c.fingerprint == fingerprint)).first()
    return None if row is None else _cert(row)


def local_identity(conn: Connection, service: str, now: datetime) -> Identity | None:
    """The certificate local ``service`` speaks with at ``now``: of those with a private key,
    valid now, the one that ends last, its private key opened with the master key
    (:class:`DialogSecurityError` without one). None when it has no such certificate (see
    :func:`last_identity` for one that has expired)."""
    row = conn.execute(
        select(_c.c.name, _c.c.owner, _c.c.fingerprint, _c.c.pem, _c.c.expires_at, _c.c.private_key)
        .where(
            _c.c.owner == service,
            _c.c.private_key.is_not(None),
            _c.c.not_before <= now + crypto.CLOCK_SKEW,
            _c.c.expires_at > now,
        )
        .order_by(_c.c.expires_at.desc(), _c.c.name)
        .limit(1)
    ).first()
    if row is None:
        return None
    master = crypto.require_master_key(
        f"use the private key of certificate {row.name!r} (service {service!r})"
    )
    try:
        key_der = crypto.open_with_master(master, bytes(row.private_key))
    except DialogSecurityError as exc:
        raise DialogSecurityError(
            f"the private key of certificate {row.name!r} cannot be opened: {exc}"
        ) from None
    expires_at = aware(row.expires_at)
    assert expires_at is not None
    return Identity(
        row.name,
        row.owner,
        row.fingerprint,
        row.pem,
        expires_at,
        crypto.load_private_key(key_der),
    )


def last_identity(conn: Connection, service: str) -> CertRow | None:
    """Of local ``service``'s certificates with a private key, the one that ends last, valid or
    not: to name it ("certificate 'x' expired on ...") when :func:`local_identity` finds none."""
    row = conn.execute(
        _cert_query()
        .where(_c.c.owner == service, _c.c.private_key.is_not(None))
        .order_by(_c.c.expires_at.desc(), _c.c.name)
        .limit(1)
    ).first()
    return None if row is None else _cert(row)


__all__ = [
    "BACKDATE",
    "DEFAULT_VALIDITY",
    "EXPIRY_WARNING",
    "Binding",
    "CertRow",
    "CertificateRow",
    "Identity",
    "alter_remote_service_binding",
    "binding_for",
    "bindings",
    "certificate_by_fingerprint",
    "certificate_owned_by",
    "certificate_pem",
    "certificates",
    "create_certificate",
    "create_remote_service_binding",
    "default_subject",
    "drop_certificate",
    "drop_remote_service_binding",
    "import_certificate",
    "last_identity",
    "local_identity",
]
