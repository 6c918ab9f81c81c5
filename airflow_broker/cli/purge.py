"""``purge``: housekeeping outside Airflow (in Airflow the transmitter runs it).

Removes broker events, queue depth samples and closed conversation endpoints older than their
retention (:mod:`airflow_broker.operations.housekeeping`), and prints how many of each went.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from datetime import timedelta
from typing import TextIO

from airflow_broker.cli.common import EXIT_OK, UsageError, _connect, resolve_url, shown_url
from airflow_broker.errors import InvalidDefinition
from airflow_broker.operations.housekeeping import Retention

_DEFAULTS = Retention()


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {text}")
    return value


def cmd_purge(args: argparse.Namespace, out: TextIO) -> int:
    try:
        retention = Retention(
            events=timedelta(days=args.events_days),
            samples=timedelta(days=args.samples_days),
            closed_endpoints=timedelta(minutes=args.closed_endpoints_minutes),
        )
    except InvalidDefinition as exc:
        raise UsageError(str(exc)) from exc
    url, source = resolve_url(args.url)
    broker = _connect(url)
    try:
        report = broker.purge(retention)
    finally:
        broker.dispose()
    if args.json:
        print(json.dumps(dataclasses.asdict(report)), file=out)
        return EXIT_OK
    print(f"broker database: {shown_url(url)} ({source})", file=out)
    print(
        f"events: {report.events}, depth samples: {report.samples}, "
        f"closed endpoints: {report.endpoints}, dedupe keys: {report.dedupe_keys}",
        file=out,
    )
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    purge = sub.add_parser(
        "purge",
        help="remove old events, queue depth samples and closed conversation endpoints",
        description="Housekeeping for a broker database that no Airflow transmitter looks after "
        "(run it from cron): removes what is older than its retention, in short batches.",
    )
    purge.add_argument(
        "--events-days",
        type=_non_negative,
        default=_DEFAULTS.events / timedelta(days=1),
        metavar="DAYS",
        help="keep broker events this long (default: %(default)g)",
    )
    purge.add_argument(
        "--samples-days",
        type=_non_negative,
        default=_DEFAULTS.samples / timedelta(days=1),
        metavar="DAYS",
        help="keep queue depth samples this long (default: %(default)g)",
    )
    purge.add_argument(
        "--closed-endpoints-minutes",
        type=_non_negative,
        default=_DEFAULTS.closed_endpoints / timedelta(minutes=1),
        metavar="MINUTES",
        help="keep closed conversation endpoints this long, to recognise late duplicates "
        "(default: %(default)g)",
    )
    purge.add_argument("--json", action="store_true", help="print JSON for machines")
    purge.set_defaults(func=cmd_purge)
