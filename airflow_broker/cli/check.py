"""``check``: the consistency check of a live broker database (fsck for the broker).

Read-only unless ``--repair``; prints how many conversation endpoints it checked and how long it
took, each problem (kind, object, what is wrong) and a summary, or one JSON document with
``--json`` (``endpoints_checked``, ``seconds``). While it works through the conversations it
prints its progress to stderr every ``--progress-every`` seconds (2; ``--quiet``: never).
Exits 1 while any problem is left unrepaired, so it can
gate a deployment or page someone from cron.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import TextIO

from airflow_broker.cli.common import EXIT_ERROR, EXIT_OK, _connect, resolve_url, shown_url
from airflow_broker.operations.check import (
    KINDS,
    PROGRESS_EVERY,
    REPAIRS,
    Progress,
    run,
    summary,
)


def _progress_to(err: TextIO) -> Callable[[Progress], None]:
    def show(p: Progress) -> None:
        if not p.done:  # the last word is the report's, on stdout
            print(f"checking: {p}", file=err, flush=True)

    return show


def cmd_check(args: argparse.Namespace, out: TextIO) -> int:
    url, _ = resolve_url(args.url)
    broker = _connect(url)
    try:
        report = run(
            broker,
            repair=args.repair,
            progress=None if args.quiet else _progress_to(sys.stderr),
            every=args.progress_every,
        )
    finally:
        broker.dispose()
    problems = report.problems
    left = [p for p in problems if not p.repaired]
    if args.json:
        doc = {
            "database": shown_url(url),
            "summary": summary(problems),
            "endpoints_checked": report.endpoints,
            "seconds": round(report.seconds, 3),
            "problems": [dataclasses.asdict(p) for p in problems],
        }
        print(json.dumps(doc, indent=2), file=out)
        return EXIT_ERROR if left else EXIT_OK
    print(f"database: {shown_url(url)}", file=out)
    print(str(report), file=out)
    for p in problems:
        mark = "repaired" if p.repaired else ("repairable" if p.kind in REPAIRS else "problem")
        print(f"{mark:10}  {p.kind}  {p.object}: {p.detail}", file=out)
    print(summary(problems), file=out)
    if left and not args.repair and any(p.kind in REPAIRS for p in left):
        print("run with --repair to fix the repairable ones", file=out)
    return EXIT_ERROR if left else EXIT_OK


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    repairs = "; ".join(f"{kind}: {what}" for kind, what in REPAIRS.items())
    check = sub.add_parser(
        "check",
        help="check the broker database's invariants; --repair fixes what is safe to fix",
        description="A read-only consistency check of a live broker database: "
        + ", ".join(KINDS)
        + ". Exit status 1 while any problem is left. With --repair, these are fixed: "
        + repairs
        + ". Every other problem is reported for an operator to decide.",
    )
    check.add_argument(
        "--repair", action="store_true", help="fix what can be fixed without losing a message"
    )
    check.add_argument("--json", action="store_true", help="print JSON for machines")
    check.add_argument(
        "--progress-every",
        type=float,
        default=PROGRESS_EVERY,
        metavar="SECONDS",
        help="how often progress goes to stderr while it checks (default %(default)s s)",
    )
    check.add_argument("--quiet", action="store_true", help="no progress on stderr")
    check.set_defaults(func=cmd_check)
