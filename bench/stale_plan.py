"""RECEIVE and SEND after a burst, with plans made while their tables were small (PostgreSQL).

Run from the repository root::

    python -m bench.stale_plan
    python -m bench.stale_plan --burst 50000

A connection keeps a prepared statement's plan until the statistics of a table it reads change.
Autovacuum often analyzes a queue's table while it is nearly empty, and the transmission queue
stays empty until a far broker falls behind; then a burst comes, and no ANALYZE has run yet.
Each case runs in a scratch database of its own:

- RECEIVE: 60 messages waiting, VACUUM ANALYZE, the reader claims 10 (its plan is made now), then
  ``--burst`` messages in batched SENDs; timed: the reader's next ``--count`` single RECEIVEs.
  ``as shipped`` is the engine as it is (the claim planned with sequential scans off,
  ``direct.Prepared(index_scans=True)``); ``without index_scans`` builds the claim without it;
  ``statistics fresh`` runs ANALYZE after the burst, the time the others should come close to.
- SEND: the SEND function is called with an empty, analyzed transmission queue (its plan is made
  now), then ``--burst`` rows wait in the transmission queue for 1,000 other dialogs; timed: the
  next ``--count`` single SENDs on local dialogs. ``without index_scans`` resets the function's
  ``enable_seqscan`` setting (migration 0022) first.

Prints the time per message of each case, and ``info stale_plan_receive_vs_fresh`` and
``info stale_plan_send_vs_fresh``: as shipped over statistics fresh (1.0 is no penalty).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from bench._broker_system import INITIATOR, TARGET, AirflowBrokerSystem
from bench._scratch import Database, ScratchServer
from bench._systems import Workload

SEND_FUNCTION = "broker_send_one(uuid, varchar, smallint, varchar, bytea, timestamptz, boolean)"
#: messages waiting when the statistics are taken
SMALL = 50
#: claims before the burst: more than the five after which the server keeps a generic plan
CLAIMS = 10


def _sql(db: Database, statement: str, params: Any = None) -> None:
    with psycopg.connect(db.conninfo, autocommit=True) as conn:
        conn.execute(statement, params)


@contextmanager
def _claims_without_index_scans() -> Iterator[None]:
    """Claims built as before ``index_scans``: no plan setting around them."""
    from airflow_broker.storage import direct, queries

    class Plain(direct.Prepared):
        def __init__(self, sql: str, types: Any, *, index_scans: bool = False) -> None:
            super().__init__(sql, types)

    original = direct.Prepared
    queries.claim_prepared.cache_clear()
    direct.Prepared = Plain  # type: ignore[misc]
    try:
        yield
    finally:
        direct.Prepared = original  # type: ignore[misc]
        queries.claim_prepared.cache_clear()


def _receive_case(server: ScratchServer, template: str, case: str, burst: int, count: int) -> float:
    """Seconds per RECEIVE of the first ``count`` after the burst."""
    system = AirflowBrokerSystem()
    workload = Workload("single", 1, count, 0, 100, 0)
    db = server.create(template, "stale", "receive", case.replace(" ", "_"))
    state = system.prepare(db, workload)
    producer = system.producer(db, workload, state)
    with _claims_without_index_scans() if case == "without index_scans" else _nothing():
        consumer = system.consumer(db, workload, state)
        try:
            for i in range(SMALL + CLAIMS):
                producer.send(i, 1)
            _sql(db, "VACUUM ANALYZE broker_message")
            # Planned on the small queue; after five runs the server keeps the generic plan.
            if sum(consumer.receive() for _ in range(CLAIMS)) != CLAIMS:
                raise RuntimeError("a RECEIVE before the burst took nothing")
            for k in range(burst // 100):
                producer.send(k, 100)
            if case == "statistics fresh":
                _sql(db, "ANALYZE broker_message")
            got, start = 0, time.perf_counter()
            while got < count:
                got += consumer.receive()
            return (time.perf_counter() - start) / got
        finally:
            consumer.end_round()
            consumer.close()
            producer.close()
            server.drop(db)


def _send_case(server: ScratchServer, template: str, case: str, burst: int, count: int) -> float:
    """Seconds per local SEND of the first ``count`` after the transmission queue filled."""
    from airflow_broker import Broker

    system = AirflowBrokerSystem()
    workload = Workload("single", 1, count, 0, 100, 0)
    db = server.create(template, "stale", "send", case.replace(" ", "_"))
    state = system.prepare(db, workload)
    broker = Broker.connect(db.sqlalchemy_url)
    try:
        with broker.transaction() as tx:
            spare = [tx.begin_dialog(INITIATOR, TARGET) for _ in range(1000)]
    finally:
        broker.dispose()
    if case == "without index_scans":
        _sql(db, f"ALTER FUNCTION {SEND_FUNCTION} RESET enable_seqscan")
    producer = system.producer(db, workload, state)
    try:
        _sql(db, "VACUUM ANALYZE broker_transmission_queue")
        for i in range(SMALL):  # planned on the empty transmission queue
            producer.send(i, 1)
        # Rows as the engine writes them for a far service, spread over the spare dialogs.
        _sql(
            db,
            "INSERT INTO broker_transmission_queue (conversation_handle, conversation_id, "
            "is_initiator, from_service_name, from_broker_instance, to_service_name, "
            "service_contract_name, message_type_name, message_sequence_number, priority, "
            "validation, enqueued_at) "
            "SELECT (%(spare)s::uuid[])[1 + g %% 1000], gen_random_uuid(), true, %(init)s, "
            "'here', '//far/s', 'DEFAULT', 'DEFAULT', g, 5, 'N', now() "
            "FROM generate_series(1, %(burst)s) AS g",
            {"spare": [str(h) for h in spare], "init": INITIATOR, "burst": burst},
        )
        if case == "statistics fresh":
            _sql(db, "ANALYZE broker_transmission_queue")
        start = time.perf_counter()
        for i in range(count):
            producer.send(i, 1)
        return (time.perf_counter() - start) / count
    finally:
        producer.close()
        server.drop(db)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


CASES = ("as shipped", "without index_scans", "statistics fresh")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stale_plan", description=__doc__)
    p.add_argument("--burst", type=int, default=20_000, help="messages in the burst")
    p.add_argument("--count", type=int, default=2_000, help="operations timed after it")
    args = p.parse_args(argv)
    server = ScratchServer()
    server.check()
    results: dict[tuple[str, str], float] = {}
    try:
        template = server.template("airflow-broker", AirflowBrokerSystem().install)
        for case in CASES:
            results["receive", case] = _receive_case(server, template, case, args.burst, args.count)
            results["send", case] = _send_case(server, template, case, args.burst, args.count)
            print(f"  {case}: done", file=sys.stderr, flush=True)
    finally:
        server.drop_all()
    print(f"burst of {args.burst:,}, then {args.count:,} operations timed (µs each)")
    print(f"{'case':<22} {'RECEIVE':>9} {'SEND':>9}")
    for case in CASES:
        print(
            f"{case:<22} {results['receive', case] * 1e6:>9.0f} {results['send', case] * 1e6:>9.0f}"
        )
    for op in ("receive", "send"):
        ratio = results[op, "as shipped"] / results[op, "statistics fresh"]
        print(f"info stale_plan_{op}_vs_fresh: {ratio:.2f} (1.0: no penalty)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
