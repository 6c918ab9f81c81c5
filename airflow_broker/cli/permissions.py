"""``grant``, ``revoke`` and ``permissions``: SEND on services and RECEIVE on queues, granted to
database roles (PostgreSQL; see :mod:`airflow_broker.security.permissions`)::

    airflow-broker grant send //po/Supplier clerk        # GRANT SEND ON SERVICE ... TO clerk
    airflow-broker grant receive supplier_q supplier_reader
    airflow-broker revoke send //po/Supplier clerk
    airflow-broker permissions [--json]                   # every grant
"""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from airflow_broker.cli.common import EXIT_OK, _connect, _table, resolve_url, shown_url

#: What each permission is granted on, as the command line names it.
_ON = {"send": "service", "receive": "queue"}


def cmd_grant(args: argparse.Namespace, out: TextIO) -> int:
    """``grant send SERVICE ROLE`` / ``grant receive QUEUE ROLE``, and the ``revoke`` twins."""
    url, _source = resolve_url(args.url)
    broker = _connect(url)
    verb = "grant" if args.command == "grant" else "revoke"
    try:
        with broker.definitions() as d:
            changed = getattr(d, f"{verb}_{args.permission}")(args.object, args.role)
    finally:
        broker.dispose()
    what = f"{args.permission.upper()} on {_ON[args.permission]} {args.object!r}"
    if verb == "grant":
        done = "granted" if changed else "already granted"
        print(f"{what} {done} to role {args.role!r} ({shown_url(url)})", file=out)
    else:
        done = "revoked" if changed else "was not granted"
        print(f"{what} {done} from role {args.role!r} ({shown_url(url)})", file=out)
    return EXIT_OK


def cmd_permissions(args: argparse.Namespace, out: TextIO) -> int:
    url, source = resolve_url(args.url)
    broker = _connect(url)
    try:
        granted = broker.permissions()
    finally:
        broker.dispose()
    if args.json:
        doc = [
            {
                "permission": p.permission,
                "object": p.object_name,
                "role": p.grantee,
                "granted_at": p.granted_at.isoformat(),
            }
            for p in granted
        ]
        print(json.dumps(doc, indent=2), file=out)
        return EXIT_OK
    print(f"permissions of {shown_url(url)} ({source})", file=out)
    if not granted:
        print("nothing granted: only the broker's owner uses it", file=out)
        return EXIT_OK
    rows = [["permission", "on", "role", "granted at"]]
    rows += [
        [p.permission, p.object_name, p.grantee, p.granted_at.strftime("%Y-%m-%d %H:%M:%S")]
        for p in granted
    ]
    for line in _table(rows):
        print(line, file=out)
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for verb, way, does in (
        ("grant", "to", "may from its next statement on"),
        ("revoke", "from", "may no longer, from its next statement on,"),
    ):
        parser = sub.add_parser(
            verb,
            help=f"{verb} SEND on a service or RECEIVE on a queue {way} a database role",
            description=f"{verb.upper()} SEND ON SERVICE (the role {does} begin dialogs to the "
            f"service and SEND on them) or RECEIVE ON a queue (the role {does} RECEIVE, lease and "
            "peek there, and answer its conversations). PostgreSQL enforces it: the role "
            "connects with its own credentials and reaches only what it was granted. Needs "
            "PostgreSQL.",
        )
        kinds = parser.add_subparsers(dest="permission", required=True, metavar="PERMISSION")
        for permission, obj in _ON.items():
            p = kinds.add_parser(
                permission, help=f"{permission.upper()} on a {obj} ({verb} {permission} OBJ ROLE)"
            )
            p.add_argument("object", metavar=obj.upper(), help=f"the {obj}'s name")
            p.add_argument("role", metavar="ROLE", help="a database role (CREATE ROLE it first)")
            p.set_defaults(func=cmd_grant)
    listing = sub.add_parser(
        "permissions",
        help="list SEND and RECEIVE granted to database roles",
        description="Every permission granted (grant send / grant receive), by permission, "
        "object and role.",
    )
    listing.add_argument("--json", action="store_true", help="print JSON for machines")
    listing.set_defaults(func=cmd_permissions)
