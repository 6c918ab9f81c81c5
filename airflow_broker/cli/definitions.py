"""``migrate`` and ``apply``: the broker's tables, and its objects from a declarations file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from airflow_broker.cli.common import (
    ENV_URL,
    EXIT_OK,
    UsageError,
    _connect,
    _table,
    broker_settings,
    resolve_url,
    shown_url,
)
from airflow_broker.operations import declarations


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
    decls, problems = declarations.parse(text, base_dir=path.parent)

    url, source = resolve_url(args.url)
    shown = shown_url(url)
    broker = _connect(url)
    try:
        # References and conflicts are checked against the catalog even when the file already has
        # problems, so that one run lists everything there is to fix...
        try:
            catalog = broker.catalog()
            settings = broker_settings(broker)
            granted = declarations.granted_now(broker) if decls.permissions else ()
        except Exception:
            if problems:  # ... but a database that does not answer must not hide them.
                raise declarations.DeclarationsInvalid(filename, problems) from None
            raise
        the_plan, plan_problems = declarations.plan(
            decls, catalog, settings=settings, granted=granted
        )
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
    # Settings are few: each is shown, changed or not, so that the file's intent is visible.
    for setting in the_plan.settings:
        print(f"  {setting.describe()}", file=out)
    for grant in the_plan.permissions:  # each is shown, as a setting is
        print(f"  {grant.describe()}", file=out)
    _print_summary(the_plan, out, dry_run=args.dry_run)
    return EXIT_OK


def _print_summary(the_plan: declarations.Plan, out: TextIO, *, dry_run: bool) -> None:
    counts = the_plan.counts()
    declared = [s for s in declarations.SECTIONS if sum(counts[s].values())]
    if not declared and not the_plan.settings and not the_plan.permissions:
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
    if the_plan.settings:
        changed = sum(1 for s in the_plan.settings if s.changed)
        rows.append(["broker settings", "-", str(changed), str(len(the_plan.settings) - changed)])
    if the_plan.permissions:
        changed = sum(1 for g in the_plan.permissions if g.changed)
        total = len(the_plan.permissions)
        rows.append(["permissions", "-", str(changed), str(total - changed)])
    for line in _table([headers, *rows], right=(1, 2, 3)):
        print(line, file=out)
    if not the_plan.has_changes:
        print("nothing to change: the database already matches the file", file=out)
    elif dry_run:
        print("dry run: nothing was written", file=out)
