"""What every subcommand shares: the database URL, exit codes, usage errors, small formatters."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Final

from airflow_broker.errors import BrokerError

if TYPE_CHECKING:
    from airflow_broker.broker import Broker


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

    from airflow_broker.storage import schema

    t = schema.broker_instance
    with broker.read_connection() as conn:
        row = conn.execute(select(t.c.forwarding, t.c.principal)).first()
    if row is None:
        raise BrokerError(f"{broker!r} has no broker instance: run `airflow-broker migrate`")
    return {"forwarding": bool(row.forwarding), "principal": bool(row.principal)}


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


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
