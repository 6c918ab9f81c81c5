"""``status``: queues (depth: the messages a reader could take now, with those held after a
failed attempt and those leased apart), settings, whether the database is a copy
(``identity``), what waits to leave (transmission queue, in transit), by target service and
reason, and the certificates ending within 30 days (planning for expiry), as a table for people
or JSON for machines.
"""

from __future__ import annotations

import argparse
import json
import shutil
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, TextIO

from airflow_broker.cli.certificates import certificate_table, row_json
from airflow_broker.cli.common import (
    EXIT_OK,
    _aware,
    _connect,
    _table,
    broker_settings,
    format_age,
    resolve_url,
    shown_url,
)
from airflow_broker.security.certificates import EXPIRY_WARNING
from airflow_broker.security.crypto import format_time

if TYPE_CHECKING:
    from airflow_broker.messaging.objects import QueueStatus, TransitRow, TransmissionSummary


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    url, source = resolve_url(args.url)
    shown = shown_url(url)
    broker = _connect(url)
    try:
        instance_id = broker.instance_id
        settings = broker_settings(broker)
        identity = broker.identity_status()
        # On SQLite a forwarding broker holds messages in transit in the memory of the process
        # that delivers (see transport.hold): another process, this one, cannot see them.
        transit_visible = broker.dialect != "sqlite"
        queues = sorted(broker.queue_status(), key=lambda q: q.name)
        waiting = _from_summary(broker.transmission_summary())
        transit = _from_transit(broker.in_transit())
        certificates = broker.certificates()
    finally:
        broker.dispose()
    now = datetime.now(UTC)
    expiring = [c for c in certificates if c.expires_at <= now + EXPIRY_WARNING]
    transmission = sum(w.count for w in waiting)
    in_transit = sum(w.count for w in transit)
    if args.json:
        doc = {
            "database": shown,
            "broker": {"instance_id": instance_id, **settings},
            "identity": {
                "copy_detected": identity.copied,
                "recorded_fingerprint": identity.recorded_fingerprint,
                "current_fingerprint": identity.current_fingerprint,
                "reason": identity.reason,
            },
            "queues": [_queue_json(q) for q in queues],
            "transmission_queue": {
                "count": transmission,
                "waiting": [w.to_json(now) for w in waiting],
            },
            "in_transit": {
                "count": in_transit if transit_visible else None,
                "waiting": [w.to_json(now) for w in transit],
            },
            "certificates_expiring": [row_json(c) for c in expiring],
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
    if identity.reason is not None:
        print("identity: COPY DETECTED, delivery to and from other brokers refused", file=out)
        width = max(_terminal_width() - 2, MIN_REASON_WIDTH)
        # Whole words: the URL and the commands stay copyable.
        for line in textwrap.wrap(
            identity.reason, width, break_on_hyphens=False, break_long_words=False
        ):
            print(f"  {line}", file=out)
    elif identity.recorded_fingerprint is None:
        print("identity: not recorded (run `airflow-broker migrate`)", file=out)
    else:
        print("identity: where it was recorded (not a copy)", file=out)
    if queues:
        # DEPTH: what a reader could take now; HELD (until the first hold ends) and LEASED apart.
        headers = [
            "QUEUE",
            "STATUS",
            "DEPTH",
            "HELD",
            "UNTIL",
            "LEASED",
            "OLDEST",
            "GROUPS",
            "ROLLBACKS",
        ]
        rows = [
            [
                q.name,
                "enabled" if q.status else "DISABLED",
                str(q.depth),
                str(q.held),
                held_until(q.held_until, now),
                str(q.leased),
                format_age(q.oldest_age_seconds),
                str(q.groups_ready),
                str(q.rollback_count),
            ]
            for q in queues
        ]
        for line in _table([headers, *rows], right=(2, 3, 4, 5, 6, 7, 8)):
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
    # Dialog security's plan for expiry; nothing when it is not used.
    days = EXPIRY_WARNING.days
    if expiring:
        print(f"certificates ending within {days} days or expired: {len(expiring)}", file=out)
        for line in certificate_table(expiring, now):
            print(f"  {line}", file=out)
    elif certificates:
        count = len(certificates)
        print(
            f"certificates: {count}, none ending within {days} days (the first ends "
            f"{format_time(certificates[0].expires_at)})",
            file=out,
        )
    return EXIT_OK


def held_until(at: datetime | None, now: datetime) -> str:
    """When a queue's first hold ends, in UTC: ``12:04:05Z`` within a day of ``now``, else
    ``2026-11-29T12:04Z``; ``-`` when nothing is held. One word (the table splits on spaces)."""
    if at is None:
        return "-"
    at = at.astimezone(UTC)
    if abs((at - now).total_seconds()) < 86400:
        return at.strftime("%H:%M:%SZ")
    return at.strftime("%Y-%m-%dT%H:%MZ")


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
    """A queue's status as JSON: the fields of
    :class:`~airflow_broker.messaging.objects.QueueStatus`."""
    doc = asdict(q)
    for key, value in doc.items():
        if isinstance(value, datetime):
            doc[key] = value.isoformat()
    return doc
