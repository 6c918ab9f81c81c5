"""``certificate`` and ``binding``: dialog security's certificates and remote service bindings.

::

    airflow-broker certificate create NAME --owner SERVICE [--subject S] [--expires-at WHEN]
    airflow-broker certificate import NAME --owner SERVICE --pem FILE [--private-key FILE]
    airflow-broker certificate list [--expiring-within DAYS] [--json]
    airflow-broker certificate export NAME [--out FILE]
    airflow-broker certificate drop NAME
    airflow-broker binding create NAME --service SERVICE --certificate CERT [--anonymous]
    airflow-broker binding alter NAME [--certificate CERT] [--anonymous | --not-anonymous]
    airflow-broker binding list [--json]
    airflow-broker binding drop NAME

Creating a certificate, or importing one with its private key, needs the master key
(``AIRFLOW_BROKER_MASTER_KEY``); nothing else here does. A private key is never printed.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from airflow_broker.cli.common import EXIT_OK, UsageError, _connect, _table, resolve_url
from airflow_broker.security import certificates as store
from airflow_broker.security.crypto import format_time

if TYPE_CHECKING:
    from airflow_broker.broker import Broker
    from airflow_broker.security.certificates import CertificateRow


def _when(text: str) -> datetime:
    """``2027-01-31`` (midnight UTC) or ``2027-01-31T12:00:00+00:00``; naive times are UTC."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a date or time (2027-01-31, 2027-01-31T12:00:00Z)"
        ) from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days") from None
    if not 0 <= value < 100_000:
        raise argparse.ArgumentTypeError(f"must be a number of days >= 0, not {text}")
    return value


def _read(path: str, what: str) -> str:
    try:
        return Path(path).expanduser().read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {what} {path}: {exc}") from exc


def _broker(args: argparse.Namespace) -> Broker:
    url, _ = resolve_url(args.url)
    return _connect(url)


def _describe(row: CertificateRow) -> str:
    key = "with its private key (sealed)" if row.has_private_key else "public only"
    return (
        f"certificate {row.name} for service {row.owner}: subject {row.subject!r}, "
        f"valid until {format_time(row.expires_at)}, {key}; fingerprint {row.fingerprint}"
    )


def cmd_certificate_create(args: argparse.Namespace, out: TextIO) -> int:
    broker = _broker(args)
    try:
        row = broker.create_certificate(
            args.name, owner=args.owner, subject=args.subject, expires_at=args.expires_at
        )
    finally:
        broker.dispose()
    print(f"created {_describe(row)}", file=out)
    print(
        f"give the far broker its public part: airflow-broker certificate export {row.name}",
        file=out,
    )
    return EXIT_OK


def cmd_certificate_import(args: argparse.Namespace, out: TextIO) -> int:
    pem = _read(args.pem, "certificate")
    key = _read(args.private_key, "private key") if args.private_key else None
    broker = _broker(args)
    try:
        row = broker.import_certificate(args.name, pem, owner=args.owner, private_key_pem=key)
    finally:
        broker.dispose()
    print(f"imported {_describe(row)}", file=out)
    return EXIT_OK


def row_json(row: Any) -> dict[str, Any]:
    """A certificate or binding row as JSON (times in ISO 8601, no PEM)."""
    doc = asdict(row)
    doc.pop("pem", None)
    for key, value in doc.items():
        if isinstance(value, datetime):
            doc[key] = value.isoformat()
    return doc


def certificate_table(rows: list[CertificateRow], now: datetime) -> list[str]:
    """NAME, OWNER, ENDS (date and how soon), KEY: the lines ``certificate list`` and
    ``status`` print."""
    table = [["CERTIFICATE", "OWNER", "ENDS", "PRIVATE KEY"]]
    for r in rows:
        if r.expired:
            when = f"{format_time(r.expires_at)} (EXPIRED)"
        else:
            days = (r.expires_at - now).days
            when = f"{format_time(r.expires_at)} (in {days} day{'' if days == 1 else 's'})"
        table.append([r.name, r.owner, when, "yes" if r.has_private_key else "no"])
    return _table(table)


def cmd_certificate_list(args: argparse.Namespace, out: TextIO) -> int:
    within = None if args.expiring_within is None else timedelta(days=args.expiring_within)
    broker = _broker(args)
    try:
        rows = broker.certificates(expiring_within=within)
    finally:
        broker.dispose()
    if args.json:
        print(json.dumps([row_json(r) for r in rows], indent=2), file=out)
        return EXIT_OK
    if not rows:
        scope = "" if within is None else f" ending within {args.expiring_within:g} days"
        print(f"no certificates{scope}", file=out)
        return EXIT_OK
    for line in certificate_table(rows, datetime.now(UTC)):
        print(line, file=out)
    return EXIT_OK


def cmd_certificate_export(args: argparse.Namespace, out: TextIO) -> int:
    broker = _broker(args)
    try:
        with broker.engine.connect() as conn:
            pem = store.certificate_pem(conn, args.name)
    finally:
        broker.dispose()
    if args.out:
        try:
            Path(args.out).write_text(pem, encoding="ascii")
        except OSError as exc:
            raise UsageError(f"cannot write {args.out}: {exc}") from exc
        print(f"wrote the certificate {args.name} (public) to {args.out}", file=out)
    else:
        out.write(pem)
    return EXIT_OK


def cmd_certificate_drop(args: argparse.Namespace, out: TextIO) -> int:
    broker = _broker(args)
    try:
        broker.drop_certificate(args.name)
    finally:
        broker.dispose()
    print(f"dropped certificate {args.name}", file=out)
    return EXIT_OK


def cmd_binding_create(args: argparse.Namespace, out: TextIO) -> int:
    broker = _broker(args)
    try:
        broker.create_remote_service_binding(
            args.name, service=args.service, certificate=args.certificate, anonymous=args.anonymous
        )
    finally:
        broker.dispose()
    how = "anonymous: this side is not authenticated" if args.anonymous else "authenticated"
    print(
        f"created remote service binding {args.name}: service {args.service} with certificate "
        f"{args.certificate} ({how})",
        file=out,
    )
    return EXIT_OK


def cmd_binding_alter(args: argparse.Namespace, out: TextIO) -> int:
    if args.certificate is None and args.anonymous is None:
        raise UsageError("binding alter: give --certificate, --anonymous or --not-anonymous")
    broker = _broker(args)
    try:
        broker.alter_remote_service_binding(
            args.name, certificate=args.certificate, anonymous=args.anonymous
        )
    finally:
        broker.dispose()
    print(f"altered remote service binding {args.name}", file=out)
    return EXIT_OK


def cmd_binding_list(args: argparse.Namespace, out: TextIO) -> int:
    broker = _broker(args)
    try:
        with broker.engine.connect() as conn:
            rows = store.bindings(conn)
    finally:
        broker.dispose()
    if args.json:
        print(json.dumps([row_json(r) for r in rows], indent=2), file=out)
        return EXIT_OK
    if not rows:
        print("no remote service bindings", file=out)
        return EXIT_OK
    table = [["BINDING", "SERVICE", "CERTIFICATE", "ANONYMOUS", "CERTIFICATE ENDS"]]
    table += [
        [
            b.name,
            b.service,
            b.certificate,
            "yes" if b.anonymous else "no",
            format_time(b.expires_at),
        ]
        for b in rows
    ]
    for line in _table(table):
        print(line, file=out)
    return EXIT_OK


def cmd_binding_drop(args: argparse.Namespace, out: TextIO) -> int:
    broker = _broker(args)
    try:
        broker.drop_remote_service_binding(args.name)
    finally:
        broker.dispose()
    print(f"dropped remote service binding {args.name}", file=out)
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cert = sub.add_parser(
        "certificate",
        help="dialog security's certificates: create, import, list, export, drop",
        description="Certificates of dialog security. A local service's certificate has its "
        "private key, sealed under the master key ($AIRFLOW_BROKER_MASTER_KEY, never stored in "
        "the database); a far service's is imported public only.",
    )
    verbs = cert.add_subparsers(dest="verb", required=True, metavar="VERB")
    create = verbs.add_parser("create", help="a new key pair and self-signed certificate")
    create.add_argument("name")
    create.add_argument("--owner", required=True, help="the local service it speaks for")
    create.add_argument("--subject", help="its common name (default: the owner)")
    create.add_argument(
        "--expires-at", type=_when, metavar="WHEN", help="its end (default: a year from now)"
    )
    create.set_defaults(func=cmd_certificate_create)
    imp = verbs.add_parser("import", help="a certificate from a PEM file (a far service's)")
    imp.add_argument("name")
    imp.add_argument("--owner", required=True, help="the service it speaks for")
    imp.add_argument("--pem", required=True, metavar="FILE", help="the certificate, PEM")
    imp.add_argument(
        "--private-key", metavar="FILE", help="its unencrypted private key (a local service's)"
    )
    imp.set_defaults(func=cmd_certificate_import)
    listing = verbs.add_parser("list", help="every certificate, the one ending first first")
    listing.add_argument(
        "--expiring-within",
        type=_days,
        metavar="DAYS",
        help="only those ending within DAYS days (expired ones included)",
    )
    listing.add_argument("--json", action="store_true", help="print JSON for machines")
    listing.set_defaults(func=cmd_certificate_list)
    export = verbs.add_parser("export", help="print a certificate's PEM (never its private key)")
    export.add_argument("name")
    export.add_argument("--out", metavar="FILE", help="write it to FILE instead")
    export.set_defaults(func=cmd_certificate_export)
    drop = verbs.add_parser("drop", help="drop a certificate no binding uses")
    drop.add_argument("name")
    drop.set_defaults(func=cmd_certificate_drop)

    binding = sub.add_parser(
        "binding",
        help="remote service bindings: which certificate a far service is reached with",
        description="Remote service bindings (dialog security): dialogs to SERVICE are secured "
        "with CERTIFICATE, the far service's public certificate; --anonymous: this side does "
        "not authenticate (only the far service is).",
    )
    verbs = binding.add_subparsers(dest="verb", required=True, metavar="VERB")
    create = verbs.add_parser("create", help="bind a far service to its certificate")
    create.add_argument("name")
    create.add_argument("--service", required=True, help="the far service")
    create.add_argument("--certificate", required=True, help="its certificate (imported)")
    create.add_argument("--anonymous", action="store_true", help="do not authenticate this side")
    create.set_defaults(func=cmd_binding_create)
    alter = verbs.add_parser("alter", help="another certificate (a renewed one), or anonymity")
    alter.add_argument("name")
    alter.add_argument("--certificate", help="the far service's new certificate")
    alter.add_argument("--anonymous", action="store_true", default=None)
    alter.add_argument("--not-anonymous", action="store_false", dest="anonymous")
    alter.set_defaults(func=cmd_binding_alter)
    listing = verbs.add_parser("list", help="every remote service binding")
    listing.add_argument("--json", action="store_true", help="print JSON for machines")
    listing.set_defaults(func=cmd_binding_list)
    drop = verbs.add_parser("drop", help="drop a remote service binding")
    drop.add_argument("name")
    drop.set_defaults(func=cmd_binding_drop)
