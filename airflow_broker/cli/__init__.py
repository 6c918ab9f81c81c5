"""The ``airflow-broker`` command: migrate a broker database, apply declarations, show status,
deliver, check.

::

    airflow-broker [--url URL] migrate
    airflow-broker [--url URL] apply FILE.yaml [--dry-run]
    airflow-broker [--url URL] status [--json] [--verbose]
    airflow-broker [--url URL] deliver [--max-messages N] [--retry-now] [--loop SECONDS] [--json]
    airflow-broker [--url URL] check [--repair] [--json]
    airflow-broker [--url URL] reset-identity (--new-broker | --error-conversations | --keep)
    airflow-broker [--url URL] certificate (create | import | list | export | drop) ...
    airflow-broker [--url URL] binding (create | alter | list | drop) ...
    airflow-broker [--url URL] (grant | revoke) (send SERVICE | receive QUEUE) ROLE
    airflow-broker [--url URL] permissions [--json]

The database is ``--url``, else ``$AIRFLOW_BROKER_URL``, else ``sqlite:///broker.db`` in the
current directory. Other broker databases that routes name (``broker://NAME``) are resolved by
``Broker.connect``: outside Airflow, from ``$AIRFLOW_BROKER_ADDRESS_<NAME>``. Exit codes: 0 done,
1 the broker or the database refused (``error: ...`` on stderr, no traceback), ``check``
found a problem it did not repair or ``deliver`` ran on a database detected as a restored or
cloned copy, 2 a usage error or an invalid declarations file.

argparse is enough for five subcommands with a handful of options, and keeps the engine free of
a CLI dependency (click or typer would add one for no gain here).

Modules: :mod:`.parser` (the parser and :func:`main`), :mod:`.common`, and one per subcommand
group: :mod:`.definitions` (migrate, apply), :mod:`.status`, :mod:`.deliver`, :mod:`.check`,
:mod:`.identity` (reset-identity), :mod:`.certificates` (certificate, binding),
:mod:`.permissions` (grant, revoke, permissions).
"""

from __future__ import annotations

from airflow_broker.cli.common import (
    DEFAULT_URL,
    ENV_URL,
    EXIT_BROKEN_PIPE,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    broker_settings,
    format_age,
    resolve_url,
    shown_url,
)
from airflow_broker.cli.deliver import format_report
from airflow_broker.cli.parser import build_parser, main

__all__ = [
    "DEFAULT_URL",
    "ENV_URL",
    "EXIT_BROKEN_PIPE",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "UsageError",
    "broker_settings",
    "build_parser",
    "format_age",
    "format_report",
    "main",
    "resolve_url",
    "shown_url",
]
