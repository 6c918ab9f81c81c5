"""The ``certificates`` and ``remote_service_bindings`` sections of a declarations file (dialog
security): how they are read (:func:`certificate`, :func:`binding`), what the plan checks
(:func:`plan_problems`) and how a declared one compares with the database's (:func:`compare`).

A certificate without ``pem`` / ``pem_file`` is created (a new key pair; ``subject`` and
``expires_at`` may be given), one with them is imported (``private_key_pem_file`` for a local
service's). Files are read relative to the declarations file. A private key is never shown: not
in problems, not in plans.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, date, datetime, time
from pathlib import Path
from typing import Any, Final, Literal

import yaml

from airflow_broker.errors import DialogSecurityError
from airflow_broker.messaging.objects import Catalog
from airflow_broker.operations.declarations.model import (
    _NULL,
    _STR,
    Action,
    BindingDecl,
    CertificateDecl,
    Declarations,
    Problem,
    Ref,
)
from airflow_broker.operations.declarations.reader import _describe, _line, _Reader
from airflow_broker.security import crypto

#: The keys of each entry, and those it must have (besides ``name``).
KEYS: Final[Mapping[str, tuple[str, ...]]] = {
    "certificates": (
        "name",
        "owner",
        "subject",
        "expires_at",
        "pem",
        "pem_file",
        "private_key_pem_file",
    ),
    "remote_service_bindings": ("name", "service", "certificate", "anonymous"),
}
REQUIRED: Final[Mapping[str, tuple[str, ...]]] = {
    "certificates": ("owner",),
    "remote_service_bindings": ("service", "certificate"),
}

#: Longest PEM text read from a file or the declarations themselves.
MAX_PEM: Final = 64 * 1024

_TIMESTAMP: Final = "tag:yaml.org,2002:timestamp"


def _null(node: yaml.Node | None) -> bool:
    return node is None or (isinstance(node, yaml.ScalarNode) and node.tag == _NULL)


def _expires_at(r: _Reader, node: yaml.Node, what: str) -> datetime | None:
    """``2027-01-31`` (midnight UTC), ``2027-01-31T12:00:00Z`` or such a string; naive is UTC."""
    value: Any = None
    if isinstance(node, yaml.ScalarNode) and node.tag in (_TIMESTAMP, _STR):
        value = r.loader.construct_object(node)
        if isinstance(value, str):
            try:
                value = datetime.fromisoformat(value.strip())
            except ValueError:
                value = None
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    if isinstance(value, date):
        return datetime.combine(value, time(), tzinfo=UTC)
    r.problem(
        node,
        f"{what} must be a date or time (2027-01-31, 2027-01-31T12:00:00Z), not {_describe(node)}",
    )
    return None


def _read_file(r: _Reader, node: yaml.Node, what: str) -> str | None:
    name = r.string(node, what, max_length=4096)
    if not name:
        return None
    path = Path(name).expanduser()
    if not path.is_absolute() and r.base_dir is not None:
        path = r.base_dir / path
    try:
        if path.stat().st_size > MAX_PEM:
            r.problem(node, f"{what}: {path} is larger than {MAX_PEM} bytes: not a PEM file")
            return None
        return path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        r.problem(node, f"{what}: cannot read {path}: {type(exc).__name__}: {exc}")
        return None


def certificate(
    r: _Reader, what: str, name: str, line: int, e: dict[str, yaml.Node]
) -> CertificateDecl:
    owner = r.string(e["owner"], f"{what}: owner") if "owner" in e else ""
    subject = r.optional_string(e.get("subject"), f"{what}: subject", max_length=crypto.MAX_SUBJECT)
    expires_at = None if _null(e.get("expires_at")) else _expires_at(r, e["expires_at"], what)
    pem: str | None = None
    if not _null(e.get("pem")) and not _null(e.get("pem_file")):
        r.problem(e["pem_file"], f"{what}: give pem or pem_file, not both")
    elif not _null(e.get("pem")):
        pem = r.string(e["pem"], f"{what}: pem", max_length=MAX_PEM) or None
    elif not _null(e.get("pem_file")):
        pem = _read_file(r, e["pem_file"], f"{what}: pem_file")
    given = "pem" if "pem" in e else "pem_file" if "pem_file" in e else None
    key_node = e.get("private_key_pem_file")
    if given is None:
        if not _null(key_node):
            r.problem(key_node, f"{what}: private_key_pem_file goes with pem or pem_file")
        return CertificateDecl(name, line, owner, subject, expires_at)
    for key in ("subject", "expires_at"):
        if key in e:
            r.problem(
                e[key],
                f"{what}: {key} is only for a created certificate; an imported one's is in its PEM",
            )
    if pem is None:
        return CertificateDecl(name, line, owner)
    try:
        info = crypto.load_certificate(pem)
    except DialogSecurityError as exc:
        r.problem(e[given], f"{what}: {exc}")
        return CertificateDecl(name, line, owner)
    private_key: str | None = None
    if not _null(key_node):
        assert key_node is not None
        private_key = _read_file(r, key_node, f"{what}: private_key_pem_file")
        if private_key is not None:
            try:
                matches = crypto.key_matches(info, crypto.load_private_key(private_key))
            except DialogSecurityError as exc:
                r.problem(key_node, f"{what}: {exc}")
            else:
                if not matches:
                    r.problem(
                        key_node,
                        f"{what}: the private key does not belong to the certificate (subject "
                        f"{info.subject!r})",
                    )
    return CertificateDecl(name, line, owner, None, None, pem, info.fingerprint, private_key)


def binding(r: _Reader, what: str, name: str, line: int, e: dict[str, yaml.Node]) -> BindingDecl:
    service = r.string(e["service"], f"{what}: service") if "service" in e else ""
    cert = r.string(e["certificate"], f"{what}: certificate") if "certificate" in e else ""
    refs = (Ref("certificates", cert, _line(e["certificate"]), "certificate"),) if cert else ()
    anonymous = r.boolean(e["anonymous"], f"{what}: anonymous") if "anonymous" in e else False
    return BindingDecl(name, line, service, cert, anonymous, refs)


def plan_problems(decls: Declarations, catalog: Catalog, now: datetime) -> list[Problem]:
    """What the file asks of dialog security that cannot be: one certificate under two names, a
    created certificate that ends before now, an imported one that has ended, two bindings for
    one service (in the file, or one in the file and another in the database), a binding to a
    certificate that speaks for another service."""
    problems: list[Problem] = []
    same: dict[str, str] = {row.fingerprint: name for name, row in catalog.certificates.items()}
    for c in decls.certificates:
        if c.fingerprint is not None:
            other = same.setdefault(c.fingerprint, c.name)
            if other != c.name:
                problems.append(
                    Problem(
                        c.line,
                        f"certificate {c.name!r}: the same certificate (fingerprint "
                        f"{c.fingerprint}) is already declared or stored as {other!r}",
                    )
                )
        if c.name in catalog.certificates:
            continue
        end = c.expires_at
        if c.pem is not None:
            end = crypto.load_certificate(c.pem).expires_at
        if end is not None and end <= now:
            problems.append(
                Problem(
                    c.line,
                    f"certificate {c.name!r}: it would end on {crypto.format_time(end)}, "
                    "which has passed",
                )
            )
    owners = {name: row.owner for name, row in catalog.certificates.items()}
    owners.update({c.name: c.owner for c in decls.certificates})
    by_service: dict[str, str] = {
        b.service: name for name, b in catalog.remote_service_bindings.items()
    }
    declared: dict[str, BindingDecl] = {}
    for b in decls.remote_service_bindings:
        first = declared.get(b.service)
        if first is not None:
            problems.append(
                Problem(
                    b.line,
                    f"remote service binding {b.name!r}: service {b.service!r} is bound twice "
                    f"in this file (first by {first.name!r} on line {first.line})",
                )
            )
        declared.setdefault(b.service, b)
        bound = by_service.get(b.service)
        if bound is not None and bound != b.name:
            problems.append(
                Problem(
                    b.line,
                    f"remote service binding {b.name!r}: service {b.service!r} already has "
                    f"remote service binding {bound!r} in the database (one per service)",
                )
            )
        owner = owners.get(b.certificate)
        if owner is not None and owner != b.service:
            problems.append(
                Problem(
                    b.line,
                    f"remote service binding {b.name!r}: certificate {b.certificate!r} speaks "
                    f"for service {owner!r} (its owner), not for {b.service!r}",
                )
            )
    return problems


Compared = tuple[Action | Literal["refuse"], tuple[str, ...], dict[str, Any]]


def compare(decl: CertificateDecl | BindingDecl, current: Any) -> Compared:
    """A declared certificate or binding against the database's. Certificates cannot change in
    place (refused when they differ); a binding's certificate and anonymity are altered (ALTER
    REMOTE SERVICE BINDING), its service cannot change."""
    differences: list[str] = []
    if isinstance(decl, BindingDecl):
        if current.service != decl.service:
            return "refuse", (f"service: {current.service} -> {decl.service}",), {}
        arguments: dict[str, Any] = {}
        if current.certificate != decl.certificate:
            differences.append(f"certificate: {current.certificate} -> {decl.certificate}")
            arguments["certificate"] = decl.certificate
        if current.anonymous != decl.anonymous:
            differences.append(
                f"anonymous: {str(current.anonymous).lower()} -> {str(decl.anonymous).lower()}"
            )
            arguments["anonymous"] = decl.anonymous
        return ("alter" if differences else "unchanged"), tuple(differences), arguments
    if current.owner != decl.owner:
        differences.append(f"owner: {current.owner} -> {decl.owner}")
    if decl.pem is not None:
        if current.fingerprint != decl.fingerprint:
            differences.append(f"fingerprint: {current.fingerprint} -> {decl.fingerprint}")
        if decl.private_key_pem is not None and not current.has_private_key:
            differences.append("private key: none -> given")
    else:
        if not current.has_private_key:
            differences.append("private key: none (imported) -> generated")
        if decl.subject is not None and decl.subject != current.subject:
            differences.append(f"subject: {current.subject} -> {decl.subject}")
        end = decl.expires_at
        if end is not None and end.replace(microsecond=0) != current.expires_at:
            differences.append(
                f"expires_at: {crypto.format_time(current.expires_at)} -> {crypto.format_time(end)}"
            )
    return ("refuse" if differences else "unchanged"), tuple(differences), {}
