"""The argument parser and :func:`main`, which maps the engine's errors to exit codes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import airflow_broker.cli.certificates as certificates
import airflow_broker.cli.check as check
import airflow_broker.cli.identity as identity
import airflow_broker.cli.permissions as permissions
import airflow_broker.cli.purge as purge
from airflow_broker.cli.common import (
    DEFAULT_URL,
    ENV_URL,
    EXIT_BROKEN_PIPE,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    UsageError,
    _error_line,
    _positive_int,
    _positive_seconds,
)
from airflow_broker.cli.definitions import cmd_apply, cmd_migrate
from airflow_broker.cli.deliver import cmd_deliver
from airflow_broker.cli.status import cmd_status
from airflow_broker.errors import BrokerError
from airflow_broker.operations import declarations


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

    check.add_parser(sub)
    purge.add_parser(sub)
    identity.add_parser(sub)
    certificates.add_parser(sub)
    permissions.add_parser(sub)
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
