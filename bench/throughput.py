"""Throughput of airflow-broker against pgmq and pgqueuer on the same PostgreSQL server.

Run from the repository root::

    python -m bench.throughput                        # everything, a few minutes on 2 cores
    python -m bench.throughput --systems pgmq,pgqueuer --readers 1 --repeats 1
    python -m bench.throughput --messages 2000 --batched-messages 20000   # longer rounds

Workloads (the same for every system; see ``bench/_systems.py`` for the fairness rules):

- ``single``: one message per producing transaction and one per consuming transaction.
- ``batched``: 100 messages per producing transaction and up to 100 per consuming transaction.

Each (workload, readers, system) runs in its own scratch database, cloned from a template that
holds the system's schema, and dropped afterwards. Producers run *ahead*: one producer (this
process) enqueues the round's messages, timed; then 1 or 2 reader processes (multiprocessing,
spawn; started once and reused, so start-up and connecting are never timed) drain them, timed
from the first reader's start to the last committed consume. A round's
time is send time + receive time, and ``msgs/s`` is messages / that time: the end-to-end cost
of getting a message through the queue. Each configuration has a warm-up round, then
``--repeats`` measured rounds; the table shows the median round (by total time). The systems of
one (workload, readers) are set up side by side and take turns round by round, so a busy moment
of a shared machine hits all of them. ``VACUUM ANALYZE`` runs before every round (the dev
server runs with autovacuum off), and every round checks that the queue is empty afterwards.

After the table come the target lines, ``target NAME: RATIO (goal >= G)``: airflow-broker's
msgs/s over pgmq's, the lowest over the reader counts measured (a target must hold for each).
``info`` lines give the per-reader ratios and the ratios against pgqueuer.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import queue
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized
from typing import Any

from bench._reader import Command, DrainResult, Reply, reader_main
from bench._scratch import Database, ScratchServer, vacuum
from bench._systems import SYSTEMS, Producer, SetupState, System, Workload, get_system

#: (workload, peer) -> goal; the targets of DESIGN.md's bench section.
TARGETS: dict[tuple[str, str], float] = {
    ("single", "pgmq"): 0.8,
    ("batched", "pgmq"): 1.0,
}
OURS = "airflow-broker"
READY_TIMEOUT = 120.0
ROUND_TIMEOUT = 900.0


@dataclass(frozen=True, slots=True)
class Round:
    """One measured round."""

    send_seconds: float
    receive_seconds: float
    transactions: int

    @property
    def seconds(self) -> float:
        """Send time + receive time."""
        return self.send_seconds + self.receive_seconds


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table: the median round of one configuration."""

    system: str
    workload: str
    readers: int
    messages: int
    round: Round
    repeats: int

    @property
    def rate(self) -> float:
        """Messages per second through the queue (enqueue + consume)."""
        return self.messages / self.round.seconds


class ReaderPool:
    """Reader processes (spawned once per run) that open, drain and close consumers by key."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.counter: Synchronized[int] = ctx.Value("q", 0)
        self.results: Queue[Reply] = ctx.Queue()
        self.commands: list[Queue[Command]] = [ctx.Queue() for _ in range(size)]
        self.procs: list[BaseProcess] = [
            ctx.Process(
                target=reader_main,
                args=(q, self.results, self.counter),
                name=f"bench-reader-{i}",
                daemon=True,
            )
            for i, q in enumerate(self.commands)
        ]
        self._keys = itertools.count()
        for proc in self.procs:
            proc.start()
        self._collect("ready", len(self.procs), READY_TIMEOUT)

    def _collect(self, kind: str, count: int, timeout: float) -> list[Any]:
        got: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            try:
                tag, value = self.results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"readers did not report {kind!r} in {timeout}s") from None
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"reader process(es) died: {dead}") from None
                continue
            if tag == "error":
                raise RuntimeError(f"reader failed: {value}")
            if tag != kind:
                raise RuntimeError(f"reader said {tag!r}, expected {kind!r}")
            got.append(value)
        return got

    def _ask(self, readers: int, command: tuple[Any, ...], kind: str, timeout: float) -> list[Any]:
        if readers > len(self.procs):
            raise ValueError(f"{readers} readers asked of a pool of {len(self.procs)}")
        for q in self.commands[:readers]:
            q.put(command)
        return self._collect(kind, readers, timeout)

    def open(
        self, readers: int, system: System, db: Database, workload: Workload, state: SetupState
    ) -> int:
        """A consumer of ``system`` in each of the first ``readers`` processes; their key."""
        key = next(self._keys)
        self._ask(readers, ("open", key, system.name, db, workload, state), "opened", READY_TIMEOUT)
        return key

    def drain(self, key: int, readers: int, total: int) -> list[DrainResult]:
        """The consumers ``key`` drain ``total`` messages together; their reports."""
        with self.counter.get_lock():
            self.counter.value = 0
        return self._ask(readers, ("drain", key, total), "done", ROUND_TIMEOUT)

    def close_consumers(self, key: int, readers: int) -> None:
        """Close the consumers ``key`` (their connections go before the database is dropped)."""
        self._ask(readers, ("close", key), "closed", READY_TIMEOUT)

    def close(self) -> None:
        """Stop the processes and reap them."""
        for q in self.commands:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)


class Rig:
    """One system set up for one (workload, readers): scratch database, consumers, producer."""

    def __init__(
        self,
        server: ScratchServer,
        pool: ReaderPool,
        system: System,
        workload: Workload,
        readers: int,
    ) -> None:
        self.server = server
        self.pool = pool
        self.system = system
        self.workload = workload
        self.readers = readers
        template = server.template(system.name, system.install)
        self.db = server.create(template, system.name, workload.name, f"r{readers}")
        self.key: int | None = None
        self.producer: Producer | None = None
        try:
            self.state = system.prepare(self.db, workload)
            self.key = pool.open(readers, system, self.db, workload, self.state)
            self.producer = system.producer(self.db, workload, self.state)
        except BaseException:
            self.close()
            raise
        self.seq = 0
        self.rounds: list[Round] = []

    def run_round(self, count: int, *, record: bool) -> None:
        """Produce ``count`` messages (timed), then drain them with the readers (timed)."""
        assert self.producer is not None and self.key is not None
        vacuum(self.db)
        start = time.perf_counter()
        for k in range(0, count, self.workload.batch):
            self.producer.send(self.seq + k, self.workload.batch)
        send_seconds = time.perf_counter() - start
        self.seq += count
        drains = self.pool.drain(self.key, self.readers, count)
        consumed = sum(d.messages for d in drains)
        left = self.system.remaining(self.db, self.state)
        if consumed != count or left:
            raise RuntimeError(
                f"{self.system.name} {self.workload.name}: sent {count}, consumed {consumed}, "
                f"{left} left on the queue"
            )
        receive_seconds = max(d.last_commit for d in drains) - min(d.started for d in drains)
        if record:
            self.rounds.append(
                Round(send_seconds, receive_seconds, sum(d.transactions for d in drains))
            )

    def row(self) -> Row:
        """The median recorded round (by total time)."""
        median = sorted(self.rounds, key=lambda r: r.seconds)[len(self.rounds) // 2]
        return Row(
            self.system.name,
            self.workload.name,
            self.readers,
            self.workload.messages,
            median,
            len(self.rounds),
        )

    def close(self) -> None:
        """Close the producer and the consumers; drop the scratch database."""
        try:
            if self.producer is not None:
                self.producer.close()
            if self.key is not None:
                self.pool.close_consumers(self.key, self.readers)
        finally:
            self.server.drop(self.db)


def measure(
    server: ScratchServer,
    pool: ReaderPool,
    systems: Sequence[System],
    workload: Workload,
    readers: int,
    repeats: int,
) -> list[Row]:
    """Warm-up round, then ``repeats`` measured rounds of every system, interleaved.

    All systems are set up side by side and take turns round by round (in a rotating order), so
    that a slow minute of a shared machine lands on every system rather than on one.
    """
    rigs: list[Rig] = []
    try:
        for system in systems:
            rigs.append(Rig(server, pool, system, workload, readers))
        for i in range(repeats + 1):
            turn = i % len(rigs)
            for rig in rigs[turn:] + rigs[:turn]:
                rig.run_round(workload.warmup if i == 0 else workload.messages, record=i > 0)
        return [rig.row() for rig in rigs]
    finally:
        for rig in rigs:
            rig.close()


def _round_up(n: int, batch: int) -> int:
    return max(batch, -(-n // batch) * batch)


def workloads(args: argparse.Namespace) -> list[Workload]:
    """The workloads the flags ask for."""
    chosen: list[Workload] = []
    for name in args.workloads:
        if name == "single":
            messages = _round_up(args.messages, 1)
            chosen.append(Workload("single", 1, messages, max(1, messages // 10), args.dialogs, 0))
        elif name == "batched":
            messages = _round_up(args.batched_messages, args.batch)
            warmup = _round_up(messages // 10, args.batch)
            chosen.append(
                Workload("batched", args.batch, messages, warmup, args.batch, args.groups)
            )
        else:
            raise SystemExit(f"unknown workload {name!r}; known: single, batched")
    return chosen


def format_table(rows: Sequence[Row]) -> str:
    """The results as an aligned text table."""
    header = (
        "system",
        "workload",
        "readers",
        "messages",
        "seconds",
        "msgs/s",
        "send s",
        "receive s",
        "consume tx",
    )
    lines = [header]
    for r in rows:
        lines.append(
            (
                r.system,
                r.workload,
                str(r.readers),
                str(r.messages),
                f"{r.round.seconds:.3f}",
                f"{r.rate:,.0f}",
                f"{r.round.send_seconds:.3f}",
                f"{r.round.receive_seconds:.3f}",
                str(r.round.transactions),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        cells = [
            cell.ljust(w) if i < 2 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def ratio_lines(rows: Sequence[Row]) -> list[str]:
    """``target`` lines for DESIGN's targets, ``info`` lines for the rest."""
    rate = {(r.system, r.workload, r.readers): r.rate for r in rows}
    lines: list[str] = []
    for workload in dict.fromkeys(r.workload for r in rows):
        for peer in (name for name in SYSTEMS if name != OURS):
            per_readers = {
                readers: rate[(OURS, workload, readers)] / rate[(peer, workload, readers)]
                for (system, w, readers) in rate
                if system == OURS and w == workload and (peer, workload, readers) in rate
            }
            if not per_readers:
                continue
            name = f"{workload}_vs_{peer}"
            worst = min(per_readers.values())
            detail = ", ".join(f"readers {k}: {v:.2f}" for k, v in sorted(per_readers.items()))
            goal = TARGETS.get((workload, peer))
            if goal is not None:
                lines.append(f"target {name}: {worst:.2f} (goal >= {goal})")
                lines.append(f"info {name}: {detail}")
            else:
                lines.append(f"info {name}: {worst:.2f} (lowest; {detail})")
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""

    def csv(text: str) -> list[str]:
        return [part.strip() for part in text.split(",") if part.strip()]

    def ints(text: str) -> list[int]:
        return [int(part) for part in csv(text)]

    p = argparse.ArgumentParser(
        prog="python -m bench.throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--systems", type=csv, default=list(SYSTEMS), help="comma-separated; default: %(default)s"
    )
    p.add_argument("--workloads", type=csv, default=["single", "batched"])
    p.add_argument("--readers", type=ints, default=[1, 2], help="reader process counts")
    # Single messages are bound by one WAL flush per commit (about 400 msgs/s for pgmq on the
    # 2-core dev box): these sizes keep a round at a few seconds and a full run near 2 minutes.
    p.add_argument("--messages", type=int, default=1000, help="messages per single round")
    p.add_argument("--batched-messages", type=int, default=10000, help="messages per batched round")
    p.add_argument("--batch", type=int, default=100, help="messages per batched transaction")
    p.add_argument(
        "--dialogs", type=int, default=100, help="airflow-broker dialogs of the single workload"
    )
    p.add_argument(
        "--groups",
        type=int,
        default=4,
        help="airflow-broker conversation groups of the batched workload",
    )
    p.add_argument("--repeats", type=int, default=3, help="measured rounds (median is shown)")
    p.add_argument(
        "--url",
        default=None,
        help="server URL (default: $BROKER_BENCH_POSTGRES_URL or local postgres)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the table and the ratio lines."""
    args = parse_args(argv)
    chosen = workloads(args)
    systems: list[System] = []
    for name in args.systems:
        try:
            systems.append(get_system(name))
        except ImportError as exc:
            print(f"skipping {name}: {exc}", file=sys.stderr)
    server = ScratchServer(args.url)
    server.check()
    rows: list[Row] = []
    started = time.perf_counter()
    pool = ReaderPool(max(args.readers))
    try:
        for workload in chosen:
            for readers in args.readers:
                for row in measure(server, pool, systems, workload, readers, args.repeats):
                    rows.append(row)
                    print(
                        f"  {row.system:15} {row.workload:8} readers={readers} "
                        f"{row.rate:>9,.0f} msgs/s  (median round {row.round.seconds:.2f}s)",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        pool.close()
        server.drop_all()
    print(format_table(rows))
    print()
    for line in ratio_lines(rows):
        print(line)
    print(f"\n(total wall time {time.perf_counter() - started:.0f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
