"""Throughput of airflow-broker against pgmq and pgqueuer on the same PostgreSQL server.

Run from the repository root::

    python -m bench.throughput                  # everything, about 10-15 minutes on 2 cores
    python -m bench.throughput --backlog 0      # no deep-queue rounds (no 10^6 load)
    python -m bench.throughput --messages 200 --batched-messages 2000 --repeats 1 --backlog 20000
    python -m bench.throughput --systems airflow-broker,pgmq-pop --readers 1,2 --backlog 0

(the third is a smoke run of about a minute.)

Systems (see ``bench/_systems.py`` for the fairness rules, ``bench/_peers.py`` for the peers):

- ``airflow-broker``: SEND, and RECEIVE + COMMIT (retention off).
- ``pgmq-pop``: pgmq at its fastest, the peer the targets are held against: autocommitted
  ``send``/``send_batch`` and ``pop(queue, qty)`` (one statement that reads and deletes).
- ``pgmq``: ``read`` + ``archive`` in one transaction (info lines).
- ``pgqueuer``: ``dequeue`` + ``log_jobs`` in one transaction (info lines).

Workloads (the same for every system):

- ``single``: one message per producing transaction and one per consuming transaction.
- ``batched``: 100 messages per producing transaction and up to 100 per consuming transaction.

Each (workload, readers, system) runs in its own scratch database, cloned from a template that
holds the system's schema, and dropped afterwards. Producers run *ahead*: one producer (this
process) enqueues the round's messages, timed; then 1, 2, 4 or 8 reader processes
(multiprocessing, spawn; started once and reused, so start-up and connecting are never timed)
drain them, timed from the first reader's start to the last committed consume. A round's time
is send time + receive time, and ``msgs/s`` is messages / that time: the end-to-end cost of
getting a message through the queue. Each configuration has a warm-up round, then ``--repeats``
measured rounds; the table shows the median round (by total time). The systems of one
(workload, readers) are set up side by side and take turns round by round, so a busy moment of
a shared machine hits all of them. ``VACUUM ANALYZE`` runs before every round (the dev server
runs with autovacuum off), and every round checks what is left on the queue.

Deep-queue rounds (``--backlog N``, default 10^6; ``--backlog 0`` skips them): for
airflow-broker and pgmq-pop, per workload, a template is set up as a round's database is, then
loaded with N messages through the system's own batched send (untimed: about a minute for
airflow-broker, 20 s for pgmq; its rate goes to stderr), frozen and checkpointed. Each
configuration of ``--backlog-readers`` (default: every reader count) clones it (file copy) and
runs the usual rounds beside the empty-queue systems: the round's messages are sent on top of
the N waiting and the readers drain as many from the head (FIFO: they take the oldest), so the
queue stays N deep. The readers' last transactions may take up to (readers - 1) x batch beyond
the round's count, and an airflow-broker reader ends a round holding the batch its last COMMIT
received (``commit_and_receive``), which it commits when the round is over (untimed: no
transaction stays open into the next round); the receive time is scaled to the round's count.

Output: the table (one row per configuration; ``backlog`` 0 is the empty queue), a scaling table
(msgs/s per system and backlog by reader count), then one line per target,
``target NAME: RATIO (goal >= G)``, then ``info`` lines:

- ``target single_vs_pgmq_pop`` (goal >= 1.0) and ``target batched_vs_pgmq_pop`` (goal >= 1.5):
  airflow-broker's msgs/s over pgmq-pop's, empty queues, the lower of the 1- and 2-reader
  ratios (the ``info`` line with the same name has every reader count).
- ``target deep_queue_vs_empty`` (goal >= 0.8): airflow-broker's msgs/s with N waiting over its
  msgs/s from an empty queue, same workload and readers; the lowest over both workloads at 1
  and 2 readers.
- ``info {workload}_vs_pgmq_read_archive`` / ``_vs_pgqueuer``: the same ratio against the other
  peers; ``info deep_queue_vs_empty_pgmq_pop``: pgmq-pop's own deep/empty ratio;
  ``info deep_queue_receive_vs_empty``: the deep/empty ratio of the receive time alone;
  ``info deep_queue_vs_pgmq_pop``: airflow-broker over pgmq-pop, both deep.

With 8 readers every system holds its consumers open at once (airflow-broker's hold three
connections each): the busiest configuration holds about 90 of the server's
``max_connections``; the run warns at the start when fewer are free.
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

import psycopg

from bench._reader import Command, DrainResult, Reply, reader_main
from bench._registry import DEFAULT_SYSTEMS, get_system
from bench._scratch import Database, ScratchServer, vacuum
from bench._systems import (
    Backlogged,
    Producer,
    SetupState,
    System,
    Workload,
)
from bench._throughput_report import (
    OURS,
    PEER,
    Round,
    Row,
    format_scaling,
    format_table,
    ratio_lines,
)

#: The systems the deep-queue round runs on (airflow-broker's target, pgmq-pop's info line).
BACKLOG_SYSTEMS = (OURS, PEER)
#: Connections one consumer holds (airflow-broker: three, as counted in pg_stat_activity during
#: a run); the others hold one. A producer holds about one.
CONSUMER_CONNECTIONS = {OURS: 3, "airflow-broker-remote": 5}
READY_TIMEOUT = 120.0
ROUND_TIMEOUT = 900.0


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


@dataclass(frozen=True, slots=True)
class Backlog:
    """A template database holding one system's queue, set up for one workload, already deep."""

    system: str
    db: Database
    state: SetupState
    depth: int
    load_seconds: float


class Backlogs:
    """The deep templates of one workload: set up, loaded and frozen once, cloned per rig."""

    def __init__(self, server: ScratchServer, workload: Workload, depth: int) -> None:
        self.server = server
        self.workload = workload
        self.depth = depth
        self._built: dict[str, Backlog] = {}

    def get(self, system: System) -> Backlog:
        """The deep template of ``system``, built on first use (untimed)."""
        if system.name not in self._built:
            self._built[system.name] = self._build(system)
        return self._built[system.name]

    def _build(self, system: System) -> Backlog:
        loader: Backlogged = system  # type: ignore[assignment]
        template = self.server.template(system.name, system.install)
        db = self.server.create(template, system.name, self.workload.name, "deep")
        state = system.prepare(db, self.workload)
        start = time.perf_counter()
        loader.load(db, self.workload, state, self.depth)
        load_seconds = time.perf_counter() - start
        depth = system.remaining(db, state)
        if depth != self.depth:
            raise RuntimeError(f"{system.name}: loaded {depth} messages, not {self.depth}")
        # Frozen and all-visible: no clone pays for hint bits or a first vacuum of the backlog.
        with psycopg.connect(db.conninfo, autocommit=True) as conn:
            conn.execute("VACUUM (FREEZE, ANALYZE)")
            conn.execute("CHECKPOINT")
        print(
            f"  {system.name:15} {self.workload.name:8} backlog of {depth:,} loaded in "
            f"{load_seconds:.0f}s ({depth / load_seconds:,.0f} msgs/s, untimed)",
            file=sys.stderr,
            flush=True,
        )
        return Backlog(system.name, db, state, depth, load_seconds)

    def drop(self) -> None:
        """Drop the deep templates."""
        for backlog in self._built.values():
            self.server.drop(backlog.db)
        self._built.clear()


class Rig:
    """One system set up for one (workload, readers): scratch database, consumers, producer.

    With a ``backlog``, the database is a clone of the system's deep template: the queue holds
    ``backlog.depth`` messages before the first round, and keeps about that many throughout
    (each round sends its count on top and the readers take as many off the head).
    """

    def __init__(
        self,
        server: ScratchServer,
        pool: ReaderPool,
        system: System,
        workload: Workload,
        readers: int,
        backlog: Backlog | None = None,
    ) -> None:
        self.server = server
        self.pool = pool
        self.system = system
        self.workload = workload
        self.readers = readers
        self.backlog = backlog.depth if backlog else 0
        self.depth = self.backlog
        if backlog is None:
            template = server.template(system.name, system.install)
            self.db = server.create(template, system.name, workload.name, f"r{readers}")
        else:
            self.db = server.create(
                backlog.db.name, system.name, workload.name, f"r{readers}", "deep", file_copy=True
            )
        self.key: int | None = None
        self.producer: Producer | None = None
        try:
            self.state = system.prepare(self.db, workload) if backlog is None else backlog.state
            self.key = pool.open(readers, system, self.db, workload, self.state)
            self.producer = system.producer(self.db, workload, self.state)
        except BaseException:
            self.close()
            raise
        self.seq = 0
        self.rounds: list[Round] = []

    def run_round(self, count: int, *, record: bool) -> None:
        """Produce ``count`` messages (timed), then drain ``count`` with the readers (timed)."""
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
        # From an empty queue: exactly the round's messages, none left. From a deep one the
        # last transactions may take a few more off the backlog.
        if consumed < count or left != self.depth + count - consumed:
            raise RuntimeError(
                f"{self.system.name} {self.workload.name}: {self.depth} waiting, sent {count}, "
                f"consumed {consumed}, {left} left on the queue"
            )
        self.depth = left
        receive_seconds = max(d.last_commit for d in drains) - min(d.started for d in drains)
        if record:
            transactions = sum(d.transactions for d in drains)
            self.rounds.append(Round(send_seconds, receive_seconds, transactions, count, consumed))

    def row(self) -> Row:
        """The median recorded round (by total time)."""
        median = sorted(self.rounds, key=lambda r: r.seconds)[len(self.rounds) // 2]
        return Row(
            self.system.name,
            self.workload.name,
            self.readers,
            self.backlog,
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
    backlogs: Sequence[Backlog] = (),
) -> list[Row]:
    """Warm-up round, then ``repeats`` measured rounds of every system, interleaved.

    All systems (and the deep-queue rigs of ``backlogs``, in the same order) are set up side by
    side and take turns round by round (in a rotating order), so that a slow minute of a shared
    machine lands on every system rather than on one.
    """
    rigs: list[Rig] = []
    try:
        for system in systems:
            rigs.append(Rig(server, pool, system, workload, readers))
        by_name = {system.name: system for system in systems}
        for backlog in backlogs:
            rigs.append(Rig(server, pool, by_name[backlog.system], workload, readers, backlog))
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


def check_connections(
    server: ScratchServer,
    systems: Sequence[System],
    deep_systems: Sequence[System],
    readers: Sequence[int],
    deep_readers: set[int],
) -> None:
    """Warn when the busiest configuration may not fit in the server's free connections."""

    def needed(n: int) -> int:
        rigs = list(systems) + (list(deep_systems) if n in deep_readers else [])
        return sum(n * CONSUMER_CONNECTIONS.get(s.name, 1) + 2 for s in rigs)

    peak = max(needed(n) for n in readers)
    with psycopg.connect(server.admin.conninfo, autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('max_connections')::int - count(*) FROM pg_stat_activity"
            " WHERE backend_type = 'client backend'"
        ).fetchone()
    free = int(row[0]) if row else 0
    if peak > free:
        print(
            f"warning: the busiest configuration holds about {peak} connections and the server "
            f"has {free} free (max_connections); fewer --readers or --systems fit",
            file=sys.stderr,
            flush=True,
        )


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
        "--systems",
        type=csv,
        default=list(DEFAULT_SYSTEMS),
        help="comma-separated; default: %(default)s",
    )
    p.add_argument("--workloads", type=csv, default=["single", "batched"])
    p.add_argument(
        "--readers", type=ints, default=[1, 2, 4, 8], help="reader process counts: %(default)s"
    )
    p.add_argument(
        "--backlog",
        type=int,
        default=1_000_000,
        help="messages waiting before the deep-queue rounds start; 0 skips them: %(default)s",
    )
    p.add_argument(
        "--backlog-readers",
        type=ints,
        default=None,
        help="reader counts of the deep-queue rounds (default: every --readers count)",
    )
    # Single messages are bound by one WAL flush per commit (about 400-700 msgs/s on the 2-core
    # dev box): these sizes keep a round at a few seconds.
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
    deep_systems = [s for s in systems if s.name in BACKLOG_SYSTEMS] if args.backlog > 0 else []
    deep_readers = set(args.readers if args.backlog_readers is None else args.backlog_readers)
    check_connections(server, systems, deep_systems, args.readers, deep_readers)
    pool = ReaderPool(max(args.readers))
    try:
        for workload in chosen:
            backlogs = Backlogs(server, workload, args.backlog)
            try:
                for readers in args.readers:
                    deep = [backlogs.get(s) for s in deep_systems if readers in deep_readers]
                    for row in measure(
                        server, pool, systems, workload, readers, args.repeats, deep
                    ):
                        rows.append(row)
                        print(
                            f"  {row.system:15} {row.workload:8} readers={readers} "
                            f"backlog={row.backlog:<8} {row.rate:>9,.0f} msgs/s  "
                            f"(median round {row.round.seconds:.2f}s)",
                            file=sys.stderr,
                            flush=True,
                        )
            finally:
                backlogs.drop()
    finally:
        pool.close()
        server.drop_all()
    print(format_table(rows))
    print()
    print(format_scaling(rows))
    print()
    targets, infos = ratio_lines(rows, [s.name for s in systems])
    for line in targets + infos:
        print(line)
    print(f"\n(total wall time {time.perf_counter() - started:.0f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
