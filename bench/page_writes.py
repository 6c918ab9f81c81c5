"""WAL written per message by SEND and RECEIVE, on an empty queue and with a backlog waiting.

A diagnostic beside ``bench.throughput`` (no targets): what its deep-queue round costs in page
writes. Run from the repository root::

    python -m bench.page_writes                          # empty, then 300,000 waiting
    python -m bench.page_writes --backlogs 0,1000000 --rounds 3

The batched workload of ``bench.throughput`` (100 dialogs in 4 groups, SEND to all 100 per
transaction, RECEIVE TOP (100)) in this one process, on a scratch database per backlog. The
backlog is loaded as ``bench.throughput`` loads it (ten batched SENDs per transaction). Each
round VACUUMs and CHECKPOINTs first, as ``bench.throughput`` does, then SENDs 10,000 messages
and RECEIVEs as many, and prints seconds and WAL bytes per message for each half
(``pg_current_wal_lsn()`` before and after) and the endpoint table's size; after the last
round, how many of the database's endpoint updates (the load's included) stayed on their
page (HOT). The first change of a page after a checkpoint writes the whole page to the WAL,
which is what a deep queue pays for scattered writes.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import psycopg

from bench._broker_system import AirflowBrokerSystem
from bench._scratch import ScratchServer, vacuum
from bench._systems import Workload

WORKLOAD = Workload("batched", 100, 10_000, 0, 100, 4)


#: An idle backend reports its table counters within PostgreSQL's idle interval (10 s).
STATS_DELAY = 11.0


def run(server: ScratchServer, backlog: int, rounds: int) -> None:
    """Rounds on one scratch database with ``backlog`` messages waiting."""
    system = AirflowBrokerSystem()
    db = server.create(server.template(system.name, system.install), "pages", str(backlog))
    try:
        state = system.prepare(db, WORKLOAD)
        if backlog:
            system.load(db, WORKLOAD, state, backlog)
        producer = system.producer(db, WORKLOAD, state)
        consumer = system.consumer(db, WORKLOAD, state)
        with psycopg.connect(db.conninfo, autocommit=True) as admin:

            def lsn() -> str:
                row = admin.execute("SELECT pg_current_wal_lsn()::text").fetchone()
                assert row is not None
                return str(row[0])

            def per_message(before: str, after: str) -> float:
                row = admin.execute("SELECT pg_wal_lsn_diff(%s, %s)", (after, before)).fetchone()
                assert row is not None
                return float(row[0]) / WORKLOAD.messages

            for r in range(rounds):
                vacuum(db)
                admin.execute("CHECKPOINT")
                l0, t0 = lsn(), time.perf_counter()
                for k in range(0, WORKLOAD.messages, WORKLOAD.batch):
                    producer.send(k, WORKLOAD.batch)
                l1, t1 = lsn(), time.perf_counter()
                got = 0
                while got < WORKLOAD.messages:
                    got += consumer.receive()
                l2, t2 = lsn(), time.perf_counter()
                size = admin.execute(
                    "SELECT pg_relation_size('broker_conversation_endpoint')"
                ).fetchone()
                assert size is not None
                print(
                    f"backlog {backlog:>9,} round {r}: "
                    f"send {t1 - t0:.3f} s {per_message(l0, l1):,.0f} B/msg; "
                    f"receive {t2 - t1:.3f} s {per_message(l1, l2):,.0f} B/msg; "
                    f"endpoint table {int(size[0]) // 1024:,} kB",
                    flush=True,
                )
            time.sleep(STATS_DELAY)
            row = admin.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                "WHERE relname = 'broker_conversation_endpoint'"
            ).fetchone()
            assert row is not None
            print(f"backlog {backlog:>9,}: endpoint updates {row[0]:,}, HOT {row[1]:,}")
        producer.close()
        consumer.close()
    finally:
        server.drop(db)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the diagnostic."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backlogs", default="0,300000", help="comma-separated; default: %(default)s")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    server = ScratchServer()
    server.check()
    try:
        for backlog in (int(b) for b in args.backlogs.split(",")):
            run(server, backlog, args.rounds)
    finally:
        server.drop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
