"""airflow-broker through PgBouncer in transaction mode against the same server reached directly.

Run from the repository root (Debian's ``pgbouncer`` installed: ``make test`` installs it)::

    python -m bench.pgbouncer                          # about 5 minutes on 2 cores
    python -m bench.pgbouncer --messages 300 --batched-messages 3000 --repeats 1   # a smoke run

The rounds are ``bench.throughput``'s (the same rigs, producers and reader processes): SEND in a
transaction of its own, and readers that RECEIVE and COMMIT, retention off. Two systems take
turns round by round in one run: ``airflow-broker`` straight to the server, and
``airflow-broker-pgbouncer``, whose producer and readers connect to a PgBouncer this run starts
in front of the same server (``pool_mode = transaction``, as Airflow's Helm chart deploys it;
tests/support/pgbouncer.py). Behind it the broker finds the pooler on its first connection
(storage.pooler) and sends its statements whole instead of preparing them, except the claim,
which it prepares on each server process that runs it, and its receive leases as unnamed
statements; every statement also takes the pooler's hop.

Output: the table, then::

    target single_pgbouncer_vs_direct: RATIO (goal >= 0.7)
    target batched_pgbouncer_vs_direct: RATIO (goal >= 0.8)

each the lower of the 1- and 2-reader ratios of msgs/s through PgBouncer over msgs/s direct,
and ``info`` lines with every reader count.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from sqlalchemy import make_url

from bench._broker_system import PGBOUNCER_PORT_ENV
from bench._registry import get_system
from bench._scratch import ScratchServer
from bench._throughput_report import Row, format_table
from bench.throughput import ReaderPool, measure, workloads

DIRECT = "airflow-broker"
POOLED = "airflow-broker-pgbouncer"
GOALS = {"single": 0.7, "batched": 0.8}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    p = argparse.ArgumentParser(
        prog="python -m bench.pgbouncer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", default=None, help="the server (default BROKER_BENCH_POSTGRES_URL)")
    p.add_argument("--workloads", type=lambda t: t.split(","), default=["single", "batched"])
    p.add_argument("--readers", type=ints, default=[1, 2], help="reader counts, e.g. 1,2")
    p.add_argument("--messages", type=int, default=1000, help="messages per single round")
    p.add_argument("--batched-messages", type=int, default=10000, help="per batched round")
    p.add_argument("--batch", type=int, default=100, help="messages per batched transaction")
    p.add_argument("--dialogs", type=int, default=10, help="dialogs of the single workload")
    p.add_argument("--groups", type=int, default=0, help="groups of the batched workload")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds (median is shown)")
    return p.parse_args(argv)


def ratio_lines(rows: Sequence[Row]) -> list[str]:
    """The target and info lines: through PgBouncer over direct, per workload."""
    rate = {(r.system, r.workload, r.readers): r.rate for r in rows}
    lines: list[str] = []
    infos: list[str] = []
    for workload, goal in GOALS.items():
        ratios = {
            readers: rate[(POOLED, workload, readers)] / rate[(DIRECT, workload, readers)]
            for (system, w, readers) in rate
            if system == DIRECT and w == workload and (POOLED, w, readers) in rate
        }
        if not ratios:
            continue
        held = [ratios[n] for n in (1, 2) if n in ratios] or list(ratios.values())
        name = f"{workload}_pgbouncer_vs_direct"
        lines.append(f"target {name}: {min(held):.2f} (goal >= {goal})")
        every = ", ".join(f"{n} readers {ratios[n]:.2f}" for n in sorted(ratios))
        infos.append(f"info {name}: {every}")
    return lines + infos


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.backlog = 0
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))
    from support.pgbouncer import PgBouncer

    server = ScratchServer(args.url)
    server.check()
    admin = make_url(server.admin.sqlalchemy_url)
    bouncer = PgBouncer(admin.host or "127.0.0.1", admin.port or 5432).start()
    # The reader processes are spawned after this: they inherit it.
    os.environ[PGBOUNCER_PORT_ENV] = str(bouncer.port)
    print(f"PgBouncer (transaction mode) on port {bouncer.port}", file=sys.stderr, flush=True)
    systems = [get_system(DIRECT), get_system(POOLED)]
    rows: list[Row] = []
    started = time.perf_counter()
    pool = ReaderPool(max(args.readers))
    try:
        for workload in workloads(args):
            for readers in args.readers:
                for row in measure(server, pool, systems, workload, readers, args.repeats):
                    rows.append(row)
                    print(
                        f"  {row.system:25} {row.workload:8} readers={readers} "
                        f"{row.rate:>9,.0f} msgs/s  (median round {row.round.seconds:.2f}s)",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        pool.close()
        server.drop_all()
        bouncer.stop()
    print(format_table(rows))
    print()
    for line in ratio_lines(rows):
        print(line)
    print(f"\n(total wall time {time.perf_counter() - started:.0f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
