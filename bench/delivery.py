"""Delivery between two broker databases on PostgreSQL, against the floor of a plain copy.

Run from the repository root::

    python -m bench.delivery                          # 1,000 dialogs x 10 messages, 3 rounds
    python -m bench.delivery --dialogs 2000           # the issue's size (slower)
    python -m bench.delivery --profile 25             # + cProfile of deliver()
    python -m bench.delivery --statements 15          # + time per SQL statement of deliver()

What is measured: messages per second that ``Broker.deliver()`` moves from broker database A to
broker database B on the same PostgreSQL server, batched (``Transport.BATCH`` messages per push),
and the same rows moved by the simplest exactly-once copy a Python program can do between two
databases (``bench/_delivery_floor.py``): SELECT a batch from A, INSERT it into B and commit on B,
DELETE it from A and commit on A. That copy is the floor of this design: the broker does the same
work plus routing, the far broker's accept code (endpoints, sequence numbers, the target queue)
and the acknowledgments.

Setup (untimed, once): two scratch databases, each created empty and migrated with
``Broker.migrate()``, so each has its own broker instance id. On B: a queue, the service
``//bench/Target`` (contract DEFAULT) and a route for ``//bench/Initiator`` to ``broker://a``;
on A: a queue, the service ``//bench/Initiator`` and a route for ``//bench/Target`` to
``broker://b``; the resolver maps ``a`` and ``b`` to the two URLs. A then begins ``--dialogs``
dialogs and SENDs ``--messages`` messages with a 200-byte body on each, in batches (one
transaction begins ``--send-batch`` dialogs and sends to all of them with ``tx.send(handles,
...)``, ``--messages`` times); they wait in A's transmission queue. These two databases are
the templates of the rounds.

Each round (``--rounds``, default 3) runs on fresh data: new databases A and B cloned from the
templates (A from A's, B from B's: they never share an instance id), so every round starts
from the same undelivered messages and empty target tables, and pays nothing for the
previous round's dead rows. Loading once keeps the run short.

Timed, in each round (the order of the two alternates between rounds):

- broker: ``a.deliver()`` in a loop until A's transmission queue is empty. The reports must add
  up (delivered = acknowledged = messages, nothing delayed, failed or discarded) and B's
  target queue must then hold exactly dialogs x messages messages.
- floor: the same rows (a snapshot of A's transmission queue taken before delivery, all its
  columns) copied from a table in A to an equivalent table in B, with the three insert methods of
  ``bench/_delivery_floor.py``; the fastest one's median is the floor.

Before every timed part the databases are ``VACUUM ANALYZE``d (the dev server runs with
autovacuum off) and a ``CHECKPOINT`` is taken, so no part pays for the previous one's writes.
The table shows each method's median round; the target line is
``target delivery_vs_copy: RATIO (goal >= 0.5)`` with RATIO = broker median msgs/s / floor
median msgs/s.

Secure dialogs (seed 004's dialog security), in every round beside the plain run: a second pair
of templates where B's target service has a certificate, A imports it and binds the target
service to it, A's initiator service has a certificate that B imports, and the dialogs are
begun with ``encryption=True``: each dialog's session key is agreed at SEND (untimed, in the
load) and every body is sealed; ``deliver()`` carries the key exchanges, B checks them and
opens every body. ``target secure_delivery_vs_plain: RATIO (goal >= 0.7)`` is the secure
median msgs/s over the plain one. The scratch databases are dropped at the end, also on error.

A broker that hangs (``bench/_hung_peer.py``), after those rounds: messages per second to a
healthy broker C while broker B, reached through a proxy that stops answering, hangs, against
the same with B healthy (``--hung-rounds`` of each, ``--hung-dialogs`` dialogs to C):
``target delivery_with_hung_peer_vs_healthy: RATIO (goal >= 0.8)``.

Known dialogs (``bench/_known_dialogs.py``), last: ``--known-dialogs`` dialogs B knows, 10
messages each a round, 5 rounds, delivered with the far broker's one-statement accept against
its general accept: ``target known_dialogs_one_statement_vs_general: RATIO (goal >= 1.0)``.

Request and reply (``bench/_request_reply.py``), before it: ``--exchanges`` exchanges a round (a
request SENT, delivered, RECEIVEd and answered, the answer delivered and RECEIVEd, one message
per transaction) between two broker databases, against the same exchange inside one database:
``target request_reply_two_brokers_vs_one: RATIO (goal >= 0.5)``.

What the broker adds to the floor: per batch the copy writes the rows once and deletes them once.
The broker does that too, and on top: a target endpoint and conversation group for every new dialog,
the far endpoints' sequence numbers, the target queue's three indexes and its NOTIFY trigger,
routing, and the acknowledgments applied at the sender (binding the far broker instance). Each of
those is one set-based statement or COPY per batch (``airflow_broker/storage/bulk.py``); what is
left is server work the copy does not have, and the broker's Python.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psycopg

from bench import _delivery_floor as floor
from bench import _hung_peer, _known_dialogs, _request_reply
from bench._scratch import Database, ScratchServer, quiesce
from bench._statement_times import StatementTimes

MASTER_KEY_ENV = "AIRFLOW_BROKER_MASTER_KEY"

if TYPE_CHECKING:
    from airflow_broker import Broker

#: issue 16: deliver() at half the floor of a plain exactly-once copy
GOAL = 0.5
TARGET_NAME = "delivery_vs_copy"
INITIATOR = "//bench/Initiator"
TARGET = "//bench/Target"
INITIATOR_QUEUE = "bench_initiator_q"
TARGET_QUEUE = "bench_target_q"
BROKER = "airflow-broker deliver()"
SECURE = "deliver(), secure dialogs"
SECURE_TARGET = "secure_delivery_vs_plain"
SECURE_GOAL = 0.7
#: 200 bytes, not all alike
BODY = (b"bench-delivery:" + bytes(range(32, 127)) * 3)[:200]
#: a deliver() loop that takes longer than this is reported as stuck
DELIVER_TIMEOUT = 900.0
REPORT_FIELDS = ("delivered", "acknowledged", "delayed", "failed", "discarded", "forwarded")


@dataclass(frozen=True, slots=True)
class Timed:
    """One timed run of one method."""

    messages: int
    seconds: float
    #: deliver() passes, or copy batches
    steps: int

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


@dataclass
class Results:
    """Every timed run, by method, plus what the rounds observed on the way."""

    runs: dict[str, list[Timed]] = field(default_factory=dict)
    load_rates: list[float] = field(default_factory=list)
    reports: list[dict[str, int]] = field(default_factory=list)

    def add(self, method: str, run: Timed) -> None:
        self.runs.setdefault(method, []).append(run)

    def median(self, method: str) -> Timed:
        """The median run of ``method`` (by time)."""
        runs = sorted(self.runs[method], key=lambda r: r.seconds)
        return runs[len(runs) // 2]


def _batch_size() -> int:
    from airflow_broker.transport import Transport

    return int(Transport.BATCH)


def _run_sql(db: Database, *statements: str) -> None:
    with psycopg.connect(db.conninfo, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def _count(conn: psycopg.Connection, query: str) -> int:
    row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def _define(a: Broker, b: Broker, *, secure: bool = False) -> None:
    """B hosts the target and routes the initiator to ``broker://a``; A the other way round;
    ``secure``: with dialog security from A's initiator service to B's target service."""
    from airflow_broker import DEFAULT
    from airflow_broker.security.certificates import certificate_pem

    with b.definitions() as d:
        d.create_queue(TARGET_QUEUE)
        d.create_service(TARGET, queue=TARGET_QUEUE, contracts=[DEFAULT])
        d.create_route("bench_to_initiator", service_name=INITIATOR, address="broker://a")
    with a.definitions() as d:
        d.create_queue(INITIATOR_QUEUE)
        d.create_service(INITIATOR, queue=INITIATOR_QUEUE, contracts=[DEFAULT])
        d.create_route("bench_to_target", service_name=TARGET, address="broker://b")
    if secure:
        b.create_certificate("bench_target", owner=TARGET)
        a.create_certificate("bench_initiator", owner=INITIATOR)
        with a.engine.connect() as ca, b.engine.connect() as cb:
            target_pem = certificate_pem(cb, "bench_target")
            initiator_pem = certificate_pem(ca, "bench_initiator")
        a.import_certificate("bench_target_public", target_pem, owner=TARGET)
        a.create_remote_service_binding(
            "bench_to_target", service=TARGET, certificate="bench_target_public"
        )
        b.import_certificate("bench_initiator_public", initiator_pem, owner=INITIATOR)


def _load(a: Broker, dialogs: int, messages: int, send_batch: int, secure: bool) -> None:
    """Begin ``dialogs`` dialogs on A and send ``messages`` messages on each, in batches."""
    for first in range(0, dialogs, send_batch):
        with a.transaction() as tx:
            handles = [
                tx.begin_dialog(INITIATOR, TARGET, encryption=secure)
                for _ in range(min(send_batch, dialogs - first))
            ]
            for _ in range(messages):
                tx.send(handles, body=BODY)


def _waiting(db: Database) -> int:
    with psycopg.connect(db.conninfo) as conn:
        return _count(conn, "SELECT count(*) FROM broker_transmission_queue")


class Loaded:
    """The loaded state every round starts from, built once: templates of A and B.

    A and B are each created empty (from ``template0``) and migrated, so each has its own broker
    instance id; A holds the loaded transmission queue and the floor's snapshot table. A round
    clones A's template into its A and B's into its B: the two never share an instance id, and
    every round starts from the same undelivered messages in new databases.
    """

    def __init__(
        self, server: ScratchServer, args: argparse.Namespace, *, secure: bool = False
    ) -> None:
        from airflow_broker import Broker

        self.server = server
        self.secure = secure
        self.total = args.dialogs * args.messages
        label = "stpl" if secure else "tpl"
        self.db_a = server.create("template0", "delivery", label, "a")
        self.db_b = server.create("template0", "delivery", label, "b")
        resolver = {"a": self.db_a.sqlalchemy_url, "b": self.db_b.sqlalchemy_url}
        a = Broker.connect(self.db_a.sqlalchemy_url, resolver=resolver)
        b = Broker.connect(self.db_b.sqlalchemy_url, resolver=resolver)
        try:
            a.migrate()
            b.migrate()
            self.instance_ids = (a.instance_id, b.instance_id)
            if self.instance_ids[0] == self.instance_ids[1]:
                raise RuntimeError("A and B have the same broker instance id")
            _define(a, b, secure=secure)
            start = time.perf_counter()
            _load(a, args.dialogs, args.messages, args.send_batch, secure)
            self.load_rate = self.total / (time.perf_counter() - start)
        finally:
            a.dispose()
            b.dispose()
        waiting = _waiting(self.db_a)
        if waiting != self.total:
            raise RuntimeError(
                f"load: {waiting} messages in A's transmission queue, not {self.total}"
            )
        if not secure:
            snap = floor.prepare(self.db_a, self.db_b)
            if snap != self.total:
                raise RuntimeError(f"snapshot holds {snap} rows, not {self.total}")
        quiesce(self.db_a, self.db_b)


class Pair:
    """One round's A and B: fresh clones of the loaded templates, with their brokers."""

    def __init__(self, server: ScratchServer, loaded: Loaded, label: str) -> None:
        from airflow_broker import Broker

        self.server = server
        self.dbs: list[Database] = []
        self.brokers: list[Broker] = []
        try:
            self.db_a = self._clone(loaded.db_a, label, "a")
            self.db_b = self._clone(loaded.db_b, label, "b")
            resolver = {"a": self.db_a.sqlalchemy_url, "b": self.db_b.sqlalchemy_url}
            for db in (self.db_a, self.db_b):
                self.brokers.append(Broker.connect(db.sqlalchemy_url, resolver=resolver))
            self.a, self.b = self.brokers
            for broker in self.brokers:
                # A clone carries its template's identity, and would be refused as a copy
                # (airflow_broker.storage.identity): each round's clone is that broker, moved.
                broker.reset_identity("keep")
            if (self.a.instance_id, self.b.instance_id) != loaded.instance_ids:
                raise RuntimeError("the clones do not carry their templates' instance ids")
            waiting = _waiting(self.db_a)
            if waiting != loaded.total:
                raise RuntimeError(f"{waiting} messages waiting in A, not {loaded.total}")
        except BaseException:
            self.close()
            raise

    def _clone(self, template: Database, label: str, side: str) -> Database:
        db = self.server.create(template.name, "delivery", label, side)
        self.dbs.append(db)
        return db

    def deliver(
        self,
        total: int,
        profile: cProfile.Profile | None,
        times: StatementTimes | None = None,
    ) -> tuple[Timed, dict[str, int]]:
        """``a.deliver()`` until A's transmission queue is empty (timed); checked afterwards."""
        sums = dict.fromkeys(REPORT_FIELDS, 0)
        passes = 0
        with psycopg.connect(self.db_a.conninfo, autocommit=True) as watch:
            left_query = "SELECT count(*) FROM broker_transmission_queue"
            _count(watch, left_query)
            if profile is not None:
                profile.enable()
            start = time.perf_counter()
            while True:
                with times.timing() if times is not None else nullcontext():
                    report = self.a.deliver()
                passes += 1
                for name in REPORT_FIELDS:
                    sums[name] += int(getattr(report, name))
                left = _count(watch, left_query)
                if left == 0:
                    break
                if report.delivered == 0 or time.perf_counter() - start > DELIVER_TIMEOUT:
                    if profile is not None:
                        profile.disable()
                    raise RuntimeError(
                        f"deliver() is stuck with {left} messages left after {passes} passes "
                        f"(last report {report}); waiting: {self.a.transmission_summary()}"
                    )
            seconds = time.perf_counter() - start
            if profile is not None:
                profile.disable()
        problems = [
            f"{name}={sums[name]}"
            for name in ("delayed", "failed", "discarded", "forwarded")
            if sums[name]
        ]
        for name in ("delivered", "acknowledged"):
            if sums[name] != total:
                problems.insert(0, f"{name}={sums[name]} of {total}")
        depth = sum(q.depth for q in self.b.queue_status() if q.name == TARGET_QUEUE)
        if depth != total:
            problems.append(f"B's queue {TARGET_QUEUE} holds {depth} messages, not {total}")
        if problems:
            raise RuntimeError(f"deliver(): the numbers do not add up: {', '.join(problems)}")
        return Timed(total, seconds, passes), sums

    def copy(self, total: int, batch: int, method: str) -> Timed:
        """The floor: the snapshot copied from A to B by ``method`` (timed); checked afterwards."""
        floor.fill(self.db_a, self.db_b)
        _run_sql(self.db_a, "CHECKPOINT")
        result = floor.copy(self.db_a, self.db_b, batch, method)
        in_b = floor.count(self.db_b, floor.TARGET)
        in_a = floor.count(self.db_a, floor.SOURCE)
        if result.rows != total or in_b != total or in_a:
            raise RuntimeError(
                f"copy ({method}): moved {result.rows}, {in_b} rows in B, {in_a} left in A; "
                f"expected {total}"
            )
        return Timed(total, result.seconds, result.batches)

    def close(self) -> None:
        """Dispose of the brokers' engines and drop both databases."""
        try:
            for broker in self.brokers:
                broker.dispose()
        finally:
            for db in self.dbs:
                self.server.drop(db)


def run_secure(server: ScratchServer, loaded: Loaded, index: int, results: Results) -> None:
    """One fresh pair of the secure templates: deliver() of sealed dialogs."""
    pair = Pair(server, loaded, f"r{index}s")
    try:
        quiesce(pair.db_a, pair.db_b)
        run, _sums = pair.deliver(loaded.total, None)
        results.add(SECURE, run)
        _say(
            f"  round {index + 1}: {SECURE:28} {run.rate:>9,.0f} msgs/s "
            f"({run.seconds:.2f}s, {run.steps} passes)"
        )
    finally:
        pair.close()


def run_round(
    server: ScratchServer,
    loaded: Loaded,
    index: int,
    batch: int,
    results: Results,
    profile: cProfile.Profile | None,
    times: StatementTimes | None = None,
) -> None:
    """One fresh pair of databases: the broker and the floor, in alternating order."""
    total = loaded.total
    pair = Pair(server, loaded, f"r{index}")
    try:
        methods = list(floor.METHODS) if index % 2 == 0 else list(reversed(floor.METHODS))

        def broker_part() -> None:
            quiesce(pair.db_a, pair.db_b)
            run, sums = pair.deliver(total, profile, times)
            results.add(BROKER, run)
            results.reports.append(sums)
            _say(
                f"  round {index + 1}: {BROKER:28} {run.rate:>9,.0f} msgs/s "
                f"({run.seconds:.2f}s, {run.steps} passes)"
            )

        def floor_part() -> None:
            for method in methods:
                run = pair.copy(total, batch, method)
                results.add(_floor_name(method), run)
                _say(
                    f"  round {index + 1}: {_floor_name(method):28} {run.rate:>9,.0f} msgs/s "
                    f"({run.seconds:.2f}s, {run.steps} batches)"
                )

        parts = [broker_part, floor_part] if index % 2 == 0 else [floor_part, broker_part]
        for part in parts:
            part()
    finally:
        pair.close()


def _floor_name(method: str) -> str:
    return f"copy floor: {method}"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def format_table(results: Results, batch: int) -> str:
    """The median run of each method as an aligned text table."""
    header = (
        "method",
        "messages",
        "batch",
        "rounds",
        "median s",
        "msgs/s",
        "min msgs/s",
        "max msgs/s",
        "steps",
    )
    lines = [header]
    for method, runs in results.runs.items():
        median = results.median(method)
        rates = [r.rate for r in runs]
        lines.append(
            (
                method,
                str(median.messages),
                str(batch),
                str(len(runs)),
                f"{median.seconds:.3f}",
                f"{median.rate:,.0f}",
                f"{min(rates):,.0f}",
                f"{max(rates):,.0f}",
                str(median.steps),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        cells = [
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def ratio_lines(results: Results) -> list[str]:
    """The target line (broker median / the fastest floor's median) and info lines."""
    broker = results.median(BROKER).rate
    floors = {
        m: results.median(_floor_name(m)).rate
        for m in floor.METHODS
        if _floor_name(m) in results.runs
    }
    best = max(floors, key=lambda m: floors[m])
    lines = [
        f"target {TARGET_NAME}: {broker / floors[best]:.2f} (goal >= {GOAL})",
        f"info {TARGET_NAME}: floor = {best}, {floors[best]:,.0f} msgs/s; "
        + ", ".join(f"vs {m}: {broker / rate:.2f}" for m, rate in floors.items()),
    ]
    if SECURE in results.runs:
        secure = results.median(SECURE).rate
        lines.append(f"target {SECURE_TARGET}: {secure / broker:.2f} (goal >= {SECURE_GOAL})")
    sums = {name: sum(r[name] for r in results.reports) for name in REPORT_FIELDS}
    lines.append(
        "info deliver_reports: "
        + ", ".join(f"{k} {v}" for k, v in sums.items())
        + f" (over {len(results.reports)} rounds)"
    )
    lines.append(
        f"info load: SEND on A {statistics.median(results.load_rates):,.0f} msgs/s "
        f"(untimed; A is loaded once and cloned for every round)"
    )
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m bench.delivery",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dialogs", type=int, default=1000, help="dialogs per round")
    p.add_argument("--messages", type=int, default=10, help="messages per dialog")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="measured rounds, each on fresh databases (median is shown)",
    )
    p.add_argument(
        "--send-batch",
        type=int,
        default=500,
        help="dialogs begun and sent to per loading transaction",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="run deliver() under cProfile and print its N hottest functions "
        "(the broker's timings then include the profiler's overhead)",
    )
    p.add_argument(
        "--statements",
        type=int,
        default=0,
        metavar="N",
        help="time every SQL statement of deliver() (plain dialogs) and print the N costliest",
    )
    p.add_argument(
        "--exchanges",
        type=int,
        default=300,
        help="request-reply exchanges per round, two brokers against one (0: none)",
    )
    p.add_argument(
        "--known-dialogs",
        type=int,
        default=500,
        help="known dialogs of the one-statement-accept rounds, 10 messages each (0: none)",
    )
    p.add_argument("--hung-rounds", type=int, default=2, help="hung-peer rounds (0: none)")
    p.add_argument("--hung-dialogs", type=int, default=2000, help="hung-peer dialogs to C")
    p.add_argument(
        "--url",
        default=None,
        help="server URL (default: $BROKER_BENCH_POSTGRES_URL or local postgres)",
    )
    args = p.parse_args(argv)
    for name in ("dialogs", "messages", "rounds", "send_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def _print_profile(profile: cProfile.Profile, top: int) -> None:
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        stats.strip_dirs().sort_stats(key).print_stats(top)
        _say(f"\n--- cProfile of deliver(), by {key} ---")
        _say(out.getvalue())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the table and the ratio lines."""
    args = parse_args(argv)
    try:
        batch = _batch_size()
    except ImportError as exc:
        raise SystemExit(f"airflow_broker.transport.Transport is not importable: {exc}") from exc
    server = ScratchServer(args.url)
    server.check()
    profile = cProfile.Profile() if args.profile else None
    times = StatementTimes() if args.statements else None
    results = Results()
    started = time.perf_counter()
    _say(
        f"delivery: {args.dialogs} dialogs x {args.messages} messages of {len(BODY)} bytes, "
        f"push batch {batch}, {args.rounds} rounds"
    )
    try:
        loaded = Loaded(server, args)
        _say(
            f"  loaded A once: SEND {loaded.load_rate:,.0f} msgs/s "
            f"({time.perf_counter() - started:.0f}s with setup)"
        )
        results.load_rates.append(loaded.load_rate)
        # The bench's own master key (dialog security seals keys under it).
        os.environ.setdefault(MASTER_KEY_ENV, "airflow-broker bench master key")
        secure = Loaded(server, args, secure=True)
        _say(f"  loaded the secure pair once: SEND {secure.load_rate:,.0f} msgs/s")
        for index in range(args.rounds):
            if index % 2:
                run_secure(server, secure, index, results)
            run_round(server, loaded, index, batch, results, profile, times)
            if not index % 2:
                run_secure(server, secure, index, results)
        hung = _hung_peer.run(
            server, args.hung_rounds, args.hung_dialogs, args.hung_dialogs // 5, args.messages
        )
        if args.exchanges:
            hung += _request_reply.measure(server, args.exchanges, args.rounds)
        if args.known_dialogs:
            hung += _known_dialogs.measure(server, args.known_dialogs, 10, 5)
    finally:
        server.drop_all()
    print(format_table(results, batch))
    print()
    for line in [*ratio_lines(results), *hung]:
        print(line)
    if profile is not None:
        _print_profile(profile, args.profile)
    if times is not None:
        _say(f"\n--- SQL statements of deliver(), plain dialogs, {args.rounds} rounds ---")
        _say(times.report(args.statements))
    _say(f"\n(total wall time {time.perf_counter() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
