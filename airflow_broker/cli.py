"""The ``airflow-broker`` command: migrate a broker database, apply declarations, show status.

::

    airflow-broker [--url URL] migrate
    airflow-broker [--url URL] apply FILE.yaml [--dry-run]
    airflow-broker [--url URL] status [--json] [--verbose]
    airflow-broker [--url URL] deliver [--max-messages N] [--retry-now] [--loop SECONDS] [--json]

The database is ``--url``, else ``$AIRFLOW_BROKER_URL``, else ``sqlite:///broker.db`` in the
current directory. Other broker databases that routes name (``broker://NAME``) are resolved by
``Broker.connect``: outside Airflow, from ``$AIRFLOW_BROKER_ADDRESS_<NAME>``. Exit codes: 0 done,
1 the broker or the database refused (``error: ...`` on stderr, no traceback), 2 a usage error or
an invalid declarations file.

argparse is enough for four subcommands with a handful of options, and keeps the engine free of
a CLI dependency (click or typer would add one for no gain here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import textwrap
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Final, TextIO

from airflow_broker import declarations
from airflow_broker.errors import BrokerError

if TYPE_CHECKING:
    from airflow_broker.broker import Broker
    from airflow_broker.objects import QueueStatus, TransitRow, TransmissionSummary
    from airflow_broker.transport import DeliveryReport

ENV_URL: Final = "AIRFLOW_BROKER_URL"
DEFAULT_URL: Final = "sqlite:///broker.db"

EXIT_OK: Final = 0
EXIT_ERROR: Final = 1
EXIT_USAGE: Final = 2
#: Ctrl-C (or, for ``deliver --loop``, a second Ctrl-C / SIGTERM in the middle of a pass).
EXIT_INTERRUPTED: Final = 130
#: stdout was closed by its reader (``airflow-broker status | head``), as a shell reports SIGPIPE.
EXIT_BROKEN_PIPE: Final = 141

#: The fields of a :class:`~airflow_broker.transport.DeliveryReport`, in the order printed.
REPORT_FIELDS: Final = ("delivered", "acknowledged", "delayed", "failed", "discarded", "forwarded")


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


def broker_settings(broker: Broker) -> dict[str, bool]:
    """The broker's own settings, as ``broker:`` in a declarations file names them (the
    ``forwarding`` and ``principal`` columns of ``broker_instance``)."""
    from sqlalchemy import select

    from airflow_broker import schema

    t = schema.broker_instance
    with broker.engine.connect() as conn:
        row = conn.execute(select(t.c.forwarding, t.c.principal)).first()
    if row is None:
        raise BrokerError(f"{broker!r} has no broker instance: run `airflow-broker migrate`")
    return {"forwarding": bool(row.forwarding), "principal": bool(row.principal)}


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
            settings = broker_settings(broker)
        except Exception:
            if problems:  # ... but a database that does not answer must not hide them.
                raise declarations.DeclarationsInvalid(filename, problems) from None
            raise
        the_plan, plan_problems = declarations.plan(decls, catalog, settings=settings)
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
    _print_summary(the_plan, out, dry_run=args.dry_run)
    return EXIT_OK


def _print_summary(the_plan: declarations.Plan, out: TextIO, *, dry_run: bool) -> None:
    counts = the_plan.counts()
    declared = [s for s in declarations.SECTIONS if sum(counts[s].values())]
    if not declared and not the_plan.settings:
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
        instance_id = broker.instance_id
        settings = broker_settings(broker)
        # On SQLite a forwarding broker holds messages in transit in the memory of the process
        # that delivers (see transport.hold): another process, this one, cannot see them.
        transit_visible = broker.dialect != "sqlite"
        queues = sorted(broker.queue_status(), key=lambda q: q.name)
        waiting = _from_summary(broker.transmission_summary())
        transit = _from_transit(broker.in_transit())
    finally:
        broker.dispose()
    now = datetime.now(UTC)
    transmission = sum(w.count for w in waiting)
    in_transit = sum(w.count for w in transit)
    if args.json:
        doc = {
            "database": shown,
            "broker": {"instance_id": instance_id, **settings},
            "queues": [_queue_json(q) for q in queues],
            "transmission_queue": {
                "count": transmission,
                "waiting": [w.to_json(now) for w in waiting],
            },
            "in_transit": {
                "count": in_transit if transit_visible else None,
                "waiting": [w.to_json(now) for w in transit],
            },
        }
        print(json.dumps(doc, indent=2), file=out)
        return EXIT_OK
    print(f"broker database: {shown} ({source})", file=out)
    print(f"broker instance: {instance_id}", file=out)
    principal = (
        "yes" if settings["principal"] else "no (refuses deliveries: senders use the mirror)"
    )
    print(
        f"forwarding: {'on' if settings['forwarding'] else 'off'}; principal: {principal}",
        file=out,
    )
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
    width = _terminal_width()
    shortened = False
    print(f"transmission queue: {_messages(transmission)} waiting", file=out)
    lines, cut = _waiting_table(waiting, now, width=width, verbose=args.verbose)
    shortened |= cut
    for line in lines:
        print(line, file=out)
    # Transit only exists on a forwarding broker; rows left after forwarding was switched off are
    # still worth seeing (its deliver() keeps passing them on).
    if settings["forwarding"] and not transit_visible:
        print(
            "in transit: unknown here (SQLite: held in the delivering process's memory)", file=out
        )
    elif settings["forwarding"] or transit:
        print(f"in transit: {_messages(in_transit)} held for their next hop", file=out)
        lines, cut = _waiting_table(transit, now, width=width, verbose=args.verbose)
        shortened |= cut
        for line in lines:
            print(line, file=out)
    if shortened:
        print("(reasons shortened to fit; --verbose shows them in full)", file=out)
    return EXIT_OK


def _messages(count: int) -> str:
    return f"{count} message{'' if count == 1 else 's'}"


@dataclass(frozen=True, slots=True)
class Waiting:
    """Messages waiting for one target service for one reason (transmission queue or transit)."""

    to_service_name: str
    transmission_status: str
    count: int
    oldest_enqueued_at: datetime

    def age_seconds(self, now: datetime) -> float:
        return max(0.0, (now - self.oldest_enqueued_at).total_seconds())

    def to_json(self, now: datetime) -> dict[str, Any]:
        return {
            "to_service_name": self.to_service_name,
            "transmission_status": self.transmission_status,
            "count": self.count,
            "oldest_enqueued_at": self.oldest_enqueued_at.isoformat(),
            "oldest_age_seconds": round(self.age_seconds(now), 3),
        }


def _from_summary(rows: Iterable[TransmissionSummary]) -> list[Waiting]:
    return [
        Waiting(r.to_service_name, r.transmission_status, r.count, _aware(r.oldest_enqueued_at))
        for r in rows
    ]


def _from_transit(rows: Iterable[TransitRow]) -> list[Waiting]:
    groups: dict[tuple[str, str], list[datetime]] = {}
    for r in rows:
        key = (r.to_service_name, r.transmission_status)
        groups.setdefault(key, []).append(_aware(r.enqueued_at))
    waiting = [
        Waiting(service, reason, len(times), min(times))
        for (service, reason), times in groups.items()
    ]
    return sorted(waiting, key=lambda w: (-w.count, w.to_service_name, w.transmission_status))


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


#: A reason column narrower than this is not worth shortening to: the line overflows instead.
MIN_REASON_WIDTH: Final = 24
NO_REASON: Final = "(no reason recorded)"


def _terminal_width() -> int:
    """The width to fit lines into: the terminal's, ``$COLUMNS``, else 100 (pipes, cron)."""
    return shutil.get_terminal_size((100, 24)).columns


def _waiting_table(
    waiting: Sequence[Waiting], now: datetime, *, width: int, verbose: bool
) -> tuple[list[str], bool]:
    """One line per (target service, reason): count, oldest age, service, reason. A reason too
    long for the line is cut with ``...`` (made one line first: driver errors span several), or
    with ``verbose`` wrapped in full under its column. Returns the lines and whether any reason
    was cut."""
    if not waiting:
        return [], False
    rows = [[str(w.count), format_age(w.age_seconds(now)), w.to_service_name] for w in waiting]
    head = ["COUNT", "OLDEST", "TO SERVICE"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    indent = "  "

    def cells(row: Sequence[str]) -> str:
        return f"{indent}{row[0]:>{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:<{widths[2]}}  "

    reason_at = len(cells(head))
    room = max(width - reason_at, MIN_REASON_WIDTH)
    lines = [(cells(head) + "REASON").rstrip()]
    cut = False
    for w, row in zip(waiting, rows, strict=True):
        reason = w.transmission_status.strip() or NO_REASON
        if verbose:
            wrapped = [
                part
                for paragraph in reason.splitlines()
                for part in (textwrap.wrap(paragraph, room, break_on_hyphens=False) or [""])
            ]
            lines.append(cells(row) + wrapped[0])
            lines.extend(" " * reason_at + part for part in wrapped[1:])
            continue
        one_line = " ".join(reason.split())
        if len(one_line) > room:
            one_line = one_line[: room - 3].rstrip() + "..."
            cut = True
        lines.append(cells(row) + one_line)
    return lines, cut


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
# deliver


def format_report(report: DeliveryReport) -> str:
    """``delivered: 3, acknowledged: 3, delayed: 0, failed: 0, discarded: 0, forwarded: 0``."""
    return ", ".join(f"{f}: {getattr(report, f)}" for f in REPORT_FIELDS)


def _report_json(report: DeliveryReport) -> dict[str, int]:
    return {f: int(getattr(report, f)) for f in REPORT_FIELDS}


class _Stop(Exception):
    """Raised by the signal handler to end the wait between two delivery passes."""


def cmd_deliver(args: argparse.Namespace, out: TextIO) -> int:
    url, source = resolve_url(args.url)
    shown = shown_url(url)
    broker = _connect(url)
    try:
        if args.loop is None:
            report = broker.deliver(args.max_messages, retry_now=args.retry_now)
            if args.json:
                print(json.dumps(_report_json(report)), file=out)
            else:
                print(f"broker database: {shown} ({source})", file=out)
                print(format_report(report), file=out)
            return EXIT_OK
        return _deliver_loop(broker, args, out, f"{shown} ({source})")
    finally:
        broker.dispose()


def _deliver_loop(broker: Broker, args: argparse.Namespace, out: TextIO, database: str) -> int:
    """``deliver --loop SECONDS``: a pass, a pause, again, until Ctrl-C or SIGTERM.

    The first signal lets a pass in progress finish (it ends the pause at once); a second one
    interrupts the pass too (its transactions roll back, nothing is lost: the sender keeps every
    message until it is acknowledged). A pass that fails (the database restarting, say) is
    reported on stderr and the loop goes on: that is what a service under systemd should do.
    """
    from sqlalchemy.exc import SQLAlchemyError

    state = {"stop": False, "pausing": False}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if state["stop"]:
            raise KeyboardInterrupt
        state["stop"] = True
        if state["pausing"]:
            raise _Stop

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    totals = dict.fromkeys(REPORT_FIELDS, 0)
    passes = 0
    if not args.json:
        print(f"broker database: {database}", file=out)
        print(
            f"delivering every {args.loop:g}s; stop with Ctrl-C or SIGTERM "
            "(passes that move nothing are not shown)",
            file=out,
            flush=True,
        )
    try:
        while not state["stop"]:
            stamp = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
            try:
                report = broker.deliver(args.max_messages, retry_now=args.retry_now)
            except (BrokerError, SQLAlchemyError) as exc:
                print(f"{stamp} error: {_error_line(exc)}", file=sys.stderr, flush=True)
            else:
                passes += 1
                counts = _report_json(report)
                for key, value in counts.items():
                    totals[key] += value
                if args.json:
                    print(json.dumps({"at": stamp, **counts}), file=out, flush=True)
                elif any(counts.values()):
                    print(f"{stamp} {format_report(report)}", file=out, flush=True)
            if state["stop"]:
                break
            state["pausing"] = True
            try:
                time.sleep(args.loop)
            finally:
                state["pausing"] = False
    except _Stop:
        pass
    except KeyboardInterrupt:
        print("interrupted in the middle of a delivery pass", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not args.json:
        summary = ", ".join(f"{f}: {totals[f]}" for f in REPORT_FIELDS)
        plural = "" if passes == 1 else "es"
        print(f"stopped after {passes} pass{plural}; in all {summary}", file=out, flush=True)
    return EXIT_OK


def _error_line(exc: BaseException) -> str:
    """An error as one line: the driver's own message for database errors (see :func:`main`)."""
    detail = getattr(exc, "orig", None) or exc
    lines = str(detail).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


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

    status = sub.add_parser(
        "status",
        help="queues, the transmission queue, messages in transit, forwarding and principal",
        description="Queues (depth, oldest message, readers' rollbacks), this broker's settings, "
        "and the messages waiting to leave (transmission queue) or to be passed on (in transit, "
        "on a forwarding broker), by target service and reason.",
    )
    status.add_argument("--json", action="store_true", help="print JSON for machines")
    status.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show every reason in full (wrapped), not shortened to the terminal width",
    )
    status.set_defaults(func=cmd_status)

    deliver = sub.add_parser(
        "deliver",
        help="deliver the transmission queue (and messages in transit) to other brokers",
        description="Run one delivery pass (Broker.deliver) and print what it did, for cron or "
        "a systemd service outside Airflow. Routes name other broker databases broker://NAME; "
        "NAME's URL comes from $AIRFLOW_BROKER_ADDRESS_<NAME> (NAME upper-cased, other "
        "characters than letters and digits made _).",
    )
    deliver.add_argument(
        "--max-messages",
        type=_positive_int,
        metavar="N",
        help="stop each pass after about N messages (default: every message that is due)",
    )
    deliver.add_argument(
        "--retry-now",
        action="store_true",
        help="retry messages that failed before now, ignoring their backoff",
    )
    deliver.add_argument(
        "--loop",
        type=_positive_seconds,
        metavar="SECONDS",
        help="run a pass every SECONDS until Ctrl-C or SIGTERM, instead of once",
    )
    deliver.add_argument(
        "--json", action="store_true", help="print each pass's report as one JSON line"
    )
    deliver.set_defaults(func=cmd_deliver)
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
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`status | head`): not an error worth a traceback. Point stdout at
        # /dev/null so that the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:  # Ctrl-C: whatever transaction was open has rolled back
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
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
        print(
            f"error: the database refused: {_error_line(exc)} "
            "(is it reachable, and has `airflow-broker migrate` been run on it?)",
            file=sys.stderr,
        )
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
