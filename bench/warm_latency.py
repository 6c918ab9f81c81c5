"""Latency to a warm reader: a SEND committed by another process until a running reader's
handler has the message.

Run from the repository root::

    python -m bench.warm_latency                   # 1,000 messages at 20/s per reader
    python -m bench.warm_latency --messages 200 --rate 50 --readers operator

What is measured, on a scratch PostgreSQL database (``bench/_scratch.py``), for each reader in
a run of its own (a fresh clone of an empty database, migrated, declared and quiesced):

- a sender process SENDs ``--messages`` messages, one per transaction, at ``--rate`` per second
  on an absolute schedule, round robin over ``--dialogs`` dialogs begun (and conversing) before
  the clock starts. Each dialog's target endpoint is a conversation group of its own: a RECEIVE
  locks one group, so consecutive messages never wait for the group of the one before, and two
  readers can read at once; one dialog per message would time dialog creation (BEGIN DIALOG and
  a new endpoint and group per SEND) rather than a message reaching a reader. The body carries
  the sequence number; the sender stamps ``time.monotonic()`` right after COMMIT returns.
- the reader runs in a third process, started and waiting before the first measured SEND (one
  warm-up message, sent by the sender, has gone through it). Its handler stamps each sequence
  number when it is called, inside the RECEIVE's transaction. Latency = handler's stamp - the
  sender's COMMIT returned (CLOCK_MONOTONIC is one clock for the machine's processes).

The readers (``bench/_warm.py``):

- ``DrainQueueOperator.execute(context)`` with ``wait_seconds`` (``--wait-seconds``): the
  operator itself, called as a worker calls it but without scheduler or Task SDK (as
  ``tests/test_triggers.py`` does), its broker named by an Airflow connection in the
  environment. It registers as the queue's reader, then loops in ``activation.drain``: one
  transaction per conversation group, each RECEIVE waiting up to ``wait_seconds`` on the
  queue's LISTEN/NOTIFY channel.
- ``ActivationRunner`` (``max_readers`` 1, then 2), with the same ``wait_seconds``: its monitor
  thread starts reader threads, which loop in the same ``drain``.

Every run checks that each sequence number reached a handler exactly once and that the queue is
empty afterwards, and fails otherwise. Prints the table, then
``target warm_latency_p50_ms: MS (goal <= 50)`` (the higher p50 of the readers) and ``info``
lines: each reader's p99, and the SEND's COMMIT time in the sender.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any

from bench import _warm
from bench._scratch import ScratchServer, quiesce

GOAL_P50_MS = 50.0
READY_TIMEOUT = 120.0
READERS = ("operator", "runner1", "runner2")
LABELS = {
    "operator": "DrainQueueOperator.execute()",
    "runner1": "ActivationRunner max_readers=1",
    "runner2": "ActivationRunner max_readers=2",
}


@dataclass(frozen=True, slots=True)
class Result:
    """One reader's run."""

    reader: str
    #: latency of each measured message (ms), by sequence number
    latencies: list[float]
    #: the SEND's COMMIT in the sender (ms), by sequence number
    commits: list[float]
    #: the rate the sender achieved (messages/s)
    rate: float
    #: execute()'s return value, or the runner's report
    detail: dict[str, Any]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Run:
    """The processes of one reader's run, and what they answered."""

    def __init__(self, ctx: SpawnContext) -> None:
        self.ctx = ctx
        self.results: Queue[_warm.Reply] = ctx.Queue()
        self.counter = ctx.Value("q", 0)
        self.go = ctx.Event()
        self.stop = ctx.Event()
        self.procs: list[BaseProcess] = []
        self.got: dict[str, list[Any]] = {}

    def spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        proc = self.ctx.Process(target=target, args=args, name=name, daemon=True)
        proc.start()
        self.procs.append(proc)

    def _poll(self, timeout: float) -> None:
        try:
            tag, value = self.results.get(timeout=timeout)
        except queue.Empty:
            for proc in self.procs:
                if proc.exitcode not in (None, 0):
                    raise SystemExit(f"{proc.name} exited with {proc.exitcode}") from None
            return
        if tag == "error":
            raise SystemExit(f"bench process failed: {value}")
        self.got.setdefault(tag, []).append(value)

    def expect(self, tag: str, count: int, timeout: float) -> list[Any]:
        """Wait for ``count`` answers ``tag``; take them."""
        deadline = time.monotonic() + timeout
        while len(self.got.get(tag, [])) < count:
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out after {timeout:.0f} s waiting for {tag!r}")
            self._poll(0.2)
        taken, self.got[tag] = self.got[tag][:count], self.got[tag][count:]
        return taken

    def handled(self, count: int, timeout: float, what: str) -> None:
        """Wait until the handlers have seen ``count`` messages."""
        deadline = time.monotonic() + timeout
        while self.counter.value < count:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"timed out waiting for {what}: handlers saw {self.counter.value} of {count}"
                )
            self._poll(0.05)

    def close(self) -> None:
        self.go.set()
        self.stop.set()
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


def measure(reader: str, url: str, handles: list[Any], args: argparse.Namespace) -> Result:
    """One run: warm the reader, SEND at a steady rate, collect, check exactly once."""
    n, wait = args.messages, args.wait_seconds
    send_seconds = n / args.rate
    run = _Run(mp.get_context("spawn"))
    try:
        sender = (_warm.sender_main, "bench-sender", url, handles, n, args.rate, run.go)
        if reader == "operator":
            # Started on an empty queue the operator is refused (nothing for it to read): the
            # warm-up message is queued first, as the monitor's arrival would be.
            run.spawn(*sender, run.results)
            run.expect("ready", 1, READY_TIMEOUT)
            run.spawn(_warm.operator_main, "bench-operator", url, wait, run.counter, run.results)
        else:
            max_readers = int(reader[-1])
            run.spawn(
                _warm.runner_main,
                "bench-runner",
                url,
                max_readers,
                wait,
                run.counter,
                run.stop,
                run.results,
            )
            run.expect("ready", 1, READY_TIMEOUT)
            run.spawn(*sender, run.results)
            run.expect("ready", 1, READY_TIMEOUT)
        run.handled(1, READY_TIMEOUT, "the warm-up message")
        run.go.set()
        (sent,) = run.expect("sent", 1, send_seconds * 2 + 60)
        run.handled(n + 1, 60, "the last messages")
        if reader != "operator":
            run.stop.set()
        # The operator returns once a RECEIVE found nothing for wait_seconds.
        ((records, detail),) = run.expect("records", 1, wait + 60)
    finally:
        run.close()

    seen = Counter(seq for seq, _ in records)
    want = {_warm.WARMUP_SEQ, *range(n)}
    missing = sorted(want - set(seen))
    extra = sorted(set(seen) - want)
    twice = sorted(seq for seq, c in seen.items() if c > 1)
    if missing or extra or twice:
        raise SystemExit(
            f"{LABELS[reader]}: not exactly once: missing {missing[:10]} ({len(missing)}), "
            f"unknown {extra[:10]}, seen more than once {twice[:10]} ({len(twice)})"
        )
    left = _warm.depth(url)
    if left:
        raise SystemExit(f"{LABELS[reader]}: {left} message(s) left on the queue")
    stamp = {seq: t for seq, t in records}
    latencies = [(stamp[seq] - sent[seq][1]) * 1000 for seq in range(n)]
    commits = [(done - issued) * 1000 for issued, done in sent]
    rate = (n - 1) / (sent[-1][1] - sent[0][1]) if n > 1 else float("nan")
    return Result(reader, latencies, commits, rate, detail)


def _readers_note(r: Result) -> str:
    if r.reader == "operator":
        d = r.detail
        return f"admitted {d['admitted']}, {d['batches']} transactions"
    d = r.detail
    return f"{d['readers_started']} started, at most {d['max_concurrent']} at once"


def report(results: list[Result], args: argparse.Namespace) -> None:
    print(
        f"warm reader latency: SEND committed in another process -> the reader's handler has "
        f"it; {args.messages} messages at {args.rate:g}/s over {args.dialogs} dialogs, "
        f"wait_seconds {args.wait_seconds:g}"
    )
    head = f"{'reader':<32} {'n':>5} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'max ms':>7}"
    print(f"{head}  readers")
    for r in results:
        v = r.latencies
        print(
            f"{LABELS[r.reader]:<32} {len(v):>5} {_pct(v, 0.5):>7.1f} {_pct(v, 0.95):>7.1f} "
            f"{_pct(v, 0.99):>7.1f} {max(v):>7.1f}  {_readers_note(r)}"
        )
    print()
    worst = max(results, key=lambda r: _pct(r.latencies, 0.5))
    print(f"target warm_latency_p50_ms: {_pct(worst.latencies, 0.5):.1f} (goal <= {GOAL_P50_MS:g})")
    for r in results:
        print(f"info warm_latency_p99_ms_{r.reader}: {_pct(r.latencies, 0.99):.1f}")
    for r in results:
        below = sum(1 for v in r.latencies if v < 0)
        print(
            f"info sender_{r.reader}: {r.rate:.1f} msgs/s sent, COMMIT p50 "
            f"{_pct(r.commits, 0.5):.1f} ms p99 {_pct(r.commits, 0.99):.1f} ms, "
            f"mean latency {statistics.mean(r.latencies):.1f} ms, "
            f"{below} handled before the sender's COMMIT returned"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.warm_latency", description=__doc__)
    p.add_argument("--messages", type=int, default=1000)
    p.add_argument("--rate", type=float, default=20.0, help="SENDs per second")
    p.add_argument("--dialogs", type=int, default=64, help="dialogs the SENDs go round")
    p.add_argument(
        "--wait-seconds", type=float, default=5.0, help="the readers' RECEIVE wait_seconds"
    )
    p.add_argument(
        "--readers",
        default=",".join(READERS),
        help=f"comma-separated, of {', '.join(READERS)}",
    )
    args = p.parse_args(argv)
    readers = [r.strip() for r in args.readers.split(",") if r.strip()]
    if unknown := set(readers) - set(READERS):
        p.error(f"unknown readers {sorted(unknown)}")
    if args.messages < 1 or args.rate <= 0 or args.dialogs < 1:
        p.error("--messages, --rate and --dialogs must be positive")
    if args.wait_seconds <= 2 / args.rate:
        p.error("--wait-seconds must be well over the gap between two SENDs")

    server = ScratchServer()
    server.check()
    results: list[Result] = []
    try:
        empty = server.template("empty", lambda _db: None)
        for reader in readers:
            db = server.create(empty, "warm", reader)
            handles = _warm.install(db.sqlalchemy_url, args.dialogs)
            quiesce(db)
            print(f"  {LABELS[reader]}: {args.messages} messages...", file=sys.stderr, flush=True)
            results.append(measure(reader, db.sqlalchemy_url, handles, args))
            server.drop(db)
    finally:
        server.drop_all()
    report(results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
