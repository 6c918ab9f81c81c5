"""The ``airflow-broker`` command: migrate a broker database, apply declarations, show status.

::

    airflow-broker [--url URL] migrate
    airflow-broker [--url URL] apply FILE.yaml [--dry-run]
    airflow-broker [--url URL] status [--json]

The database is ``--url``, else ``$AIRFLOW_BROKER_URL``, else ``sqlite:///broker.db`` in the
current directory. Exit codes: 0 done, 1 the broker or the database refused (``error: ...`` on
stderr, no traceback), 2 a usage error or an invalid declarations file.

argparse is enough for three subcommands with a handful of options, and keeps the engine free of
a CLI dependency (click or typer would add one for no gain here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TextIO

from airflow_broker import declarations
from airflow_broker.errors import BrokerError

if TYPE_CHECKING:
    from airflow_broker.broker import Broker
    from airflow_broker.objects import QueueStatus

ENV_URL: Final = "AIRFLOW_BROKER_URL"
DEFAULT_URL: Final = "sqlite:///broker.db"

EXIT_OK: Final = 0
EXIT_ERROR: Final = 1
EXIT_USAGE: Final = 2


class UsageError(Exception):
    """The command line or the declarations file is wrong: exit status 2."""


# --------------------------------------------------------------------------------------------
# The database URL


def resolve_url(cli_url: str | None, environ: dict[str, str] | None = None) -> tuple[str, str]:
    """The database URL to use and where it came from (``--url``, the environment, the default)."""
    env = os.environ if environ is None else environ
    if cli_url:
        return cli_url, "--url"
    if env.get(ENV_URL):
        return env[ENV_URL], f"${ENV_URL}"
    return DEFAULT_URL, "default"


def shown_url(url: str) -> str:
    """The URL as it may be printed: without its password."""
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError as exc:
        raise UsageError(f"{url!r} is not a database URL ({exc})") from exc


def _connect(url: str) -> Broker:
    # Imported here so that `--help` and usage errors do not pay for loading the engine.
    from airflow_broker.broker import Broker

    return Broker.connect(url)


# --------------------------------------------------------------------------------------------
# Commands


def cmd_migrate(args: argparse.Namespace, out: TextIO) -> int:
    url, source = resolve_url(args.url)
    if source == "default":
        source = f"default: {Path.cwd() / 'broker.db'}; choose another with --url or ${ENV_URL}"
    print(f"database: {shown_url(url)} ({source})", file=out)
    broker = _connect(url)
    try:
        broker.migrate()
        print(f"migrated: broker tables up to date; broker instance {broker.instance_id}", file=out)
    finally:
        broker.dispose()
    return EXIT_OK


def cmd_apply(args: argparse.Namespace, out: TextIO) -> int:
    path = Path(args.file)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from exc
    filename = str(args.file)
    decls, problems = declarations.parse(text)

    url, source = resolve_url(args.url)
    shown = shown_url(url)
    broker = _connect(url)
    try:
        # References and conflicts are checked against the catalog even when the file already has
        # problems, so that one run lists everything there is to fix...
        try:
            catalog = broker.catalog()
        except Exception:
            if problems:  # ... but a database that does not answer must not hide them.
                raise declarations.DeclarationsInvalid(filename, problems) from None
            raise
        the_plan, plan_problems = declarations.plan(decls, catalog)
        problems = problems + plan_problems
        if problems:
            raise declarations.DeclarationsInvalid(filename, problems)
        if the_plan.has_changes and not args.dry_run:
            with broker.definitions() as d:
                declarations.apply_plan(the_plan, d)
    finally:
        broker.dispose()
    # Printed once the transaction has committed: a failure shows only its error, never a list
    # of objects that were not in fact created.
    print(f"apply {filename} to {shown} ({source})", file=out)
    for change in the_plan.changes:
        if change.action != "unchanged":
            print(f"  {change.describe()}", file=out)
    _print_summary(the_plan, out, dry_run=args.dry_run)
    return EXIT_OK


def _print_summary(the_plan: declarations.Plan, out: TextIO, *, dry_run: bool) -> None:
    counts = the_plan.counts()
    declared = [s for s in declarations.SECTIONS if sum(counts[s].values())]
    if not declared:
        print("the file declares nothing", file=out)
        return
    would = "would be " if dry_run else ""
    headers = ["", f"{would}created", f"{would}altered", "unchanged"]
    rows = [
        [
            s.replace("_", " "),
            str(counts[s]["created"]),
            str(counts[s]["altered"]),
            str(counts[s]["unchanged"]),
        ]
        for s in declared
    ]
    for line in _table([headers, *rows], right=(1, 2, 3)):
        print(line, file=out)
    if not the_plan.has_changes:
        print("nothing to change: the database already matches the file", file=out)
    elif dry_run:
        print("dry run: nothing was written", file=out)


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    url, source = resolve_url(args.url)
    shown = shown_url(url)
    broker = _connect(url)
    try:
        queues = sorted(broker.queue_status(), key=lambda q: q.name)
        waiting = broker.transmission_summary()
        transmission = sum(w.count for w in waiting)
    finally:
        broker.dispose()
    if args.json:
        doc = {
            "database": shown,
            "queues": [_queue_json(q) for q in queues],
            "transmission_queue": {
                "count": transmission,
                "waiting": [
                    {
                        "to_service_name": w.to_service_name,
                        "transmission_status": w.transmission_status,
                        "count": w.count,
                        "oldest_enqueued_at": w.oldest_enqueued_at.isoformat(),
                    }
                    for w in waiting
                ],
            },
        }
        print(json.dumps(doc, indent=2), file=out)
        return EXIT_OK
    print(f"broker database: {shown} ({source})", file=out)
    if queues:
        headers = ["QUEUE", "STATUS", "DEPTH", "OLDEST", "GROUPS", "ROLLBACKS"]
        rows = [
            [
                q.name,
                "enabled" if q.status else "DISABLED",
                str(q.depth),
                format_age(q.oldest_age_seconds),
                str(q.groups_ready),
                str(q.rollback_count),
            ]
            for q in queues
        ]
        for line in _table([headers, *rows], right=(2, 3, 4, 5)):
            print(line, file=out)
    else:
        print("no queues", file=out)
    plural = "" if transmission == 1 else "s"
    print(f"transmission queue: {transmission} message{plural} waiting", file=out)
    for w in waiting:
        print(f"  {w.count:>6}  to {w.to_service_name}: {w.transmission_status}", file=out)
    return EXIT_OK


def _queue_json(q: QueueStatus) -> dict[str, Any]:
    """A queue's status as JSON: the fields of :class:`~airflow_broker.objects.QueueStatus`."""
    doc = asdict(q)
    for key, value in doc.items():
        if isinstance(value, datetime):
            doc[key] = value.isoformat()
    return doc


def format_age(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``2h10m``, ``4d03h``; ``-`` for an empty queue."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _table(rows: list[list[str]], *, right: Sequence[int] = ()) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


# --------------------------------------------------------------------------------------------
# Entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="airflow-broker",
        description="Manage an airflow-broker database: migrate it, declare its objects, watch it.",
    )
    parser.add_argument(
        "--url",
        help=f"database URL (default: ${ENV_URL}, else {DEFAULT_URL} in the current directory)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    migrate = sub.add_parser("migrate", help="create or upgrade the broker tables (idempotent)")
    migrate.set_defaults(func=cmd_migrate)

    apply = sub.add_parser(
        "apply",
        help="declare message types, contracts, queues, services, routes, priorities from YAML",
        description="Check the whole file, then apply it in one transaction. Applying the same "
        "file again changes nothing. The format: docs/declarations.md.",
    )
    apply.add_argument("file", metavar="FILE.yaml", help="the declarations file")
    apply.add_argument(
        "--dry-run", action="store_true", help="check and show what would change; write nothing"
    )
    apply.set_defaults(func=cmd_apply)

    status = sub.add_parser("status", help="queues: depth, oldest message, readers' rollbacks")
    status.add_argument("--json", action="store_true", help="print JSON for machines")
    status.set_defaults(func=cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed by argparse
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        code: int = args.func(args, sys.stdout)
        return code
    except declarations.DeclarationsInvalid as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        from sqlalchemy.exc import SQLAlchemyError

        if not isinstance(exc, SQLAlchemyError):
            raise
        # The driver's own message, first line only: the SQL and parameters after it are noise
        # to an operator, and the URL is already printed without its password.
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        print(
            f"error: the database refused: {detail} "
            "(is it reachable, and has `airflow-broker migrate` been run on it?)",
            file=sys.stderr,
        )
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
