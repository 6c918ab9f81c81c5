"""``reset-identity``: decide about a broker database that is a restored, cloned or copied copy.

A copy carries its original's broker instance id; the broker detects it (the database is no
longer where its identity was recorded: :mod:`airflow_broker.storage.identity`) and refuses
delivery to and from other brokers until one of these is run (SQL Server's ``NEW_BROKER``,
``ERROR_BROKER_CONVERSATIONS`` and ``ENABLE_BROKER``; see
:mod:`airflow_broker.operations.identity`)::

    airflow-broker reset-identity --new-broker            # a copy that lives on: a new id
    airflow-broker reset-identity --error-conversations   # keep the id, end every conversation
    airflow-broker reset-identity --keep                  # the same broker, moved
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import TextIO

from airflow_broker.cli.common import EXIT_OK, _connect, resolve_url, shown_url


def cmd_reset_identity(args: argparse.Namespace, out: TextIO) -> int:
    from airflow_broker.operations.identity import FLAGS

    url, source = resolve_url(args.url)
    shown = shown_url(url)
    broker = _connect(url)
    try:
        before = broker.identity_status()
        done = broker.reset_identity(args.mode)
    finally:
        broker.dispose()
    if args.json:
        doc = {"copy_detected": before.copied, **dataclasses.asdict(done), "database": shown}
        print(json.dumps(doc, indent=2), file=out)
        return EXIT_OK
    print(f"broker database: {shown} ({source})", file=out)
    print(
        "copy detected: "
        + (f"yes (identity recorded at {before.recorded_fingerprint})" if before.copied else "no"),
        file=out,
    )
    instance = (
        f"{done.previous_instance_id} -> {done.instance_id} (new)"
        if done.instance_id != done.previous_instance_id
        else f"{done.instance_id} (kept)"
    )
    print(f"reset-identity {FLAGS[done.mode]}: broker instance {instance}", file=out)
    print(
        f"conversations ended with an error: {done.conversations_ended}; closed: "
        f"{done.conversations_closed}; messages removed from the transmission queue: "
        f"{done.transmissions_removed}",
        file=out,
    )
    print(f"fingerprint recorded: {done.fingerprint}", file=out)
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    reset = sub.add_parser(
        "reset-identity",
        help="after a restore or clone: a new broker id, end conversations, or keep (moved)",
        description="A broker database restored from a backup, cloned or copied carries its "
        "original's broker instance id, and refuses delivery to and from other brokers until "
        "one of these is chosen (in one transaction). `status` shows whether a copy was "
        "detected.",
    )
    modes = reset.add_mutually_exclusive_group(required=True)
    modes.add_argument(
        "--new-broker",
        dest="mode",
        action="store_const",
        const="new_broker",
        help="a copy that lives on beside its original (SQL Server's NEW_BROKER): a new broker "
        "instance id; conversations with other brokers end with an error, their messages leave "
        "the transmission queue; conversations inside this database go on",
    )
    modes.add_argument(
        "--error-conversations",
        dest="mode",
        action="store_const",
        const="error_conversations",
        help="keep the broker instance id and end every conversation with an error "
        "(ERROR_BROKER_CONVERSATIONS); the transmission queue is emptied",
    )
    modes.add_argument(
        "--keep",
        dest="mode",
        action="store_const",
        const="keep",
        help="the same broker, moved (ENABLE_BROKER): record where it is now, change nothing else",
    )
    reset.add_argument("--json", action="store_true", help="print JSON for machines")
    reset.set_defaults(func=cmd_reset_identity)
