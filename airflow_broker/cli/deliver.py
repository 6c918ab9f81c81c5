"""``deliver``: one delivery pass, or a loop of them until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from datetime import UTC, datetime
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from airflow_broker.cli.common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    REPORT_FIELDS,
    _connect,
    _error_line,
    resolve_url,
    shown_url,
)
from airflow_broker.errors import BrokerError

if TYPE_CHECKING:
    from airflow_broker.broker import Broker
    from airflow_broker.transport import DeliveryReport


def format_report(report: DeliveryReport) -> str:
    """``delivered: 3, acknowledged: 3, delayed: 0, failed: 0, discarded: 0, forwarded: 0``,
    and a line ``no answer from ADDRESS: why`` for each far broker that did not answer."""
    lines = [", ".join(f"{f}: {getattr(report, f)}" for f in REPORT_FIELDS)]
    lines += [f"hung: {address}: {why}" for address, why in sorted(report.hung.items())]
    return "\n".join(lines)


def _report_json(report: DeliveryReport) -> dict[str, Any]:
    """The report's counts, and ``hung``: the far brokers that did not answer, with why."""
    return {**{f: int(getattr(report, f)) for f in REPORT_FIELDS}, "hung": dict(report.hung)}


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
            refused = broker.identity_status().reason  # a restored or cloned copy
            if refused is not None:
                print(f"error: {refused}", file=sys.stderr)
                return EXIT_ERROR
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
                for key in REPORT_FIELDS:
                    totals[key] += counts[key]
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
