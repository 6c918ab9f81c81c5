"""Breadth on PostgreSQL: the broker's costs with many queues and many open conversations.

Run from the repository root::

    python -m bench.breadth                      # 10^6 open conversations, 1,000 queues
    python -m bench.breadth --open 100000        # a smaller population (faster)

Two broker databases are built once (untimed) and measured side by side, in alternating order:

- ``none``: the bench's two services and their queues, nothing else;
- ``open``: the same, plus ``--queues`` queues each with a service (a queue per tenant), and
  ``--open`` open dialogs begun from those services, each with a conversation timer due in 30
  days (a purchase order waiting for its deadline). They are written in bulk, by SQL, as BEGIN
  DIALOG + BEGIN CONVERSATION TIMER write them (an initiator endpoint, state ``SO``, and its
  conversation group): BEGIN DIALOG itself would take most of an hour for 10^6.

Printed, each measured in this run:

- ``target round_trip_1e6_open_vs_none: RATIO (goal >= 0.8)``: BEGIN DIALOG + SEND, RECEIVE,
  END CONVERSATION on both sides, one transaction each, on a fresh dialog; the ``none``
  database's median time over the ``open`` one's;
- ``target run_due_idle_1e6_open_ms: MS (goal <= 5)``: ``run_due()`` with nothing due, median,
  on ``open``;
- ``target begin_dialog_batched_vs_send_batched: RATIO (goal >= 0.25)``: BEGIN DIALOG with a
  timer, 100 per transaction, dialogs per second, over batched SEND (100 dialogs per SEND),
  messages per second, both on ``open``;
- ``target overview_1000_queues_ms: MS (goal <= 300)``: the broker page's overview API
  (``GET /broker/api/overview``, the plugin's FastAPI app called in-process through its test
  client, authorization stubbed), median, on ``open``; ``info page_api``: the other requests
  the page makes on each refresh (a page of queues, of conversations, the counts by state,
  the services), median each, on ``open``;
- ``target check_1e6_open_s: SECONDS (goal <= 60)``: ``check()`` on ``open``;
- ``info``: ``queue_status()`` and the broker page's overview on both, and ``queue_status()``
  with the same queues and no conversation open (``queues``, a third clone made before the
  dialogs were written): what the open conversations add to it;
- ``target activation_connections_1000_queues: N (goal <= 4)`` and
  ``target activation_p50_1000_vs_1_queue: RATIO (goal <= 1.2)``: 1,000 activation triggers
  in one event loop, as a triggerer runs them (``bench/_breadth_activation.py``: the
  connections they hold at most, and SEND to the trigger's event against one trigger);
  ``--no-activation`` leaves them out.

"1e6" in the names is the default population; with ``--open`` the lines say the count used.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import psycopg

from bench import _breadth_activation
from bench._breadth_schema import (
    INITIATOR,
    INITIATOR_QUEUE,
    TARGET,
    TARGET_QUEUE,
    define,
)
from bench._scratch import Database, ScratchServer, quiesce

if TYPE_CHECKING:
    from airflow_broker import Broker

BODY = b"breadth" * 20


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _open_dialogs(db: Database, count: int) -> None:
    """``count`` open dialogs from the tenant services (round robin), each with a timer due in
    30 days: an initiator endpoint in state SO and its conversation group, by SQL."""
    with psycopg.connect(db.conninfo, autocommit=True) as conn:
        services = conn.execute(
            "SELECT count(*) FROM broker_service WHERE name LIKE '//breadth/Tenant%%'"
        ).fetchone()
        # The modulus a constant: the join is hashed (with the services' own count it was a
        # nested loop, 10^6 x 1,000 comparisons, most of the build's time).
        conn.execute(
            """
            CREATE TEMP TABLE breadth_new AS
            SELECT gen_random_uuid() AS grp, gen_random_uuid() AS handle,
                   s.queue_id, s.name, i
            FROM generate_series(0, %s - 1) AS i
            JOIN (SELECT name, queue_id, row_number() OVER (ORDER BY name) - 1 AS k
                  FROM broker_service WHERE name LIKE '//breadth/Tenant%%') s
              ON s.k = i %% %s
            """,
            (count, max(services[0], 1) if services else 1),
        )
        conn.execute(
            "INSERT INTO broker_conversation_group (conversation_group_id, queue_id) "
            "SELECT grp, queue_id FROM breadth_new"
        )
        conn.execute(
            """
            INSERT INTO broker_conversation_endpoint (
                conversation_handle, conversation_id, is_initiator, conversation_group_id,
                queue_id, service_name, far_service, contract_name, state, priority,
                timer_due_at, send_sequence, receive_sequence, created_at, encryption)
            SELECT handle, gen_random_uuid(), true, grp, queue_id, name, %s, 'DEFAULT', 'SO',
                   5, now() + interval '30 days' + i * interval '1 millisecond', 0, 0, now(),
                   false
            FROM breadth_new
            """,
            (TARGET,),
        )
        conn.execute("ANALYZE")


def _timed(fn: Callable[[], object], times: int) -> list[float]:
    out = []
    for _ in range(times):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def _round_trip(broker: Broker) -> None:
    with broker.transaction() as tx:
        handle = tx.begin_dialog(INITIATOR, TARGET, encryption=False)
        tx.send(handle, body=BODY)
    with broker.transaction() as tx:
        [m] = tx.receive(TARGET_QUEUE, top=1, wait_seconds=5)
        tx.end_conversation(m.conversation_handle)
    with broker.transaction() as tx:
        for m in tx.receive(INITIATOR_QUEUE, top=10, wait_seconds=5):
            tx.end_conversation(m.conversation_handle)


def _begin_batched(broker: Broker, dialogs: int) -> float:
    """Dialogs per second: BEGIN DIALOG + a timer, 100 per transaction."""
    started = time.perf_counter()
    for _ in range(dialogs // 100):
        with broker.transaction() as tx:
            for _ in range(100):
                handle = tx.begin_dialog(INITIATOR, TARGET, encryption=False)
                tx.begin_conversation_timer(handle, 30 * 86400)
    return (dialogs // 100 * 100) / (time.perf_counter() - started)


def _send_batched(broker: Broker, rounds: int) -> float:
    """Messages per second: one SEND to 100 dialogs per transaction."""
    with broker.transaction() as tx:
        handles = [tx.begin_dialog(INITIATOR, TARGET, encryption=False) for _ in range(100)]
    started = time.perf_counter()
    for _ in range(rounds):
        with broker.transaction() as tx:
            tx.send(handles, body=BODY)
    return rounds * 100 / (time.perf_counter() - started)


#: What the broker page requests on each refresh, besides the overview (bench line page_api).
PAGE_REQUESTS = {
    "queues": "/broker/api/queues?limit=20",
    "conversations": "/broker/api/conversations?limit=20",
    "conversation_states": "/broker/api/conversations/states",
    "services": "/broker/api/services",
}


def _page_api(broker: Broker, times: int) -> dict[str, list[float]]:
    """The broker page's requests through the plugin's app in-process (FastAPI's test client),
    the reading right granted without Airflow's auth manager: seconds per request, by name."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from airflow_broker.provider.plugin import URL_PREFIX
    from airflow_broker.provider.plugin.api import create_app
    from airflow_broker.provider.plugin.security import require_read

    app = create_app(broker=broker)
    app.dependency_overrides[require_read] = lambda: None
    root = FastAPI()
    root.mount(URL_PREFIX, app)
    out: dict[str, list[float]] = {}
    with TestClient(root) as http:

        def get(path: str) -> None:
            r = http.get(path)
            assert r.status_code == 200, (path, r.status_code, r.text[:300])

        for name, path in {"overview": "/broker/api/overview", **PAGE_REQUESTS}.items():
            get(path)  # warm: the first request opens the connection, plans the statements
            out[name] = _timed(functools.partial(get, path), times)
    return out


def _ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1000


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.breadth", description=__doc__)
    p.add_argument("--open", type=int, default=1_000_000, help="open dialogs with timers")
    p.add_argument("--queues", type=int, default=1000, help="tenant queues")
    p.add_argument("--repeat", type=int, default=30, help="timed repetitions of each step")
    p.add_argument("--url", default=None)
    p.add_argument(
        "--no-activation", action="store_true", help="leave out the triggers' 1,000 queues"
    )
    args = p.parse_args(argv)
    from airflow_broker import Broker
    from airflow_broker.operations.monitoring.overview import overview

    server = ScratchServer(args.url)
    server.check()
    scale = "1e6" if args.open == 1_000_000 else f"{args.open:.0e}".replace("+0", "")
    lines: list[str] = []
    try:
        started = time.perf_counter()
        none_tpl = server.template("breadth_none", lambda db: define(db, 0))
        open_tpl = server.template("breadth_open", lambda db: define(db, args.queues))
        dbs = {
            "none": server.create(none_tpl, "breadth", "none"),
            "open": server.create(open_tpl, "breadth", "open"),
            "queues": server.create(open_tpl, "breadth", "queues"),  # the queues, none open
        }
        _open_dialogs(dbs["open"], args.open)
        _say(f"breadth: built {args.open:,} open dialogs, {args.queues} queues in "
             f"{time.perf_counter() - started:.0f}s")  # fmt: skip
        quiesce(*dbs.values())
        brokers = {k: Broker.connect(db.sqlalchemy_url) for k, db in dbs.items()}
        for b in brokers.values():
            b.reset_identity("keep")  # clones of a template: the same broker, moved
        try:
            trip: dict[str, list[float]] = {"none": [], "open": []}
            for i in range(args.repeat):
                for kind in ("none", "open") if i % 2 == 0 else ("open", "none"):
                    trip[kind] += _timed(lambda k=kind: _round_trip(brokers[k]), 1)
            none_ms = statistics.median(trip["none"]) * 1000
            open_ms = statistics.median(trip["open"]) * 1000
            lines.append(
                f"info round_trip: {none_ms:.1f} ms with none open, {open_ms:.1f} ms with "
                f"{args.open:,} open"
            )
            lines.append(
                f"target round_trip_{scale}_open_vs_none: {none_ms / open_ms:.2f} (goal >= 0.8)"
            )
            idle = _timed(brokers["open"].run_due, args.repeat)
            lines.append(
                f"target run_due_idle_{scale}_open_ms: {statistics.median(idle) * 1000:.1f} "
                "(goal <= 5)"
            )
            begin = _begin_batched(brokers["open"], 2000)
            send = _send_batched(brokers["open"], 40)
            lines.append(
                f"info begin_dialog: {begin:,.0f} dialogs/s with a timer (100 per transaction); "
                f"batched SEND {send:,.0f} msgs/s"
            )
            lines.append(
                f"target begin_dialog_batched_vs_send_batched: {begin / send:.2f} (goal >= 0.25)"
            )
            for kind in ("none", "open"):
                status = _timed(brokers[kind].queue_status, 5)
                view = _timed(lambda k=kind: overview(brokers[k]), 5)
                lines.append(
                    f"info {kind}: queue_status() {statistics.median(status) * 1000:.1f} ms, "
                    f"overview {statistics.median(view) * 1000:.1f} ms"
                )
            status_ms = {k: _ms(_timed(brokers[k].queue_status, args.repeat)) for k in dbs}
            lines.append(
                f"info queue_status: {status_ms['queues']:.1f} ms with {args.queues} queues and "
                f"none open, {status_ms['open']:.1f} ms with {args.open:,} open"
            )
            page = _page_api(brokers["open"], args.repeat)
            lines.append(
                "info page_api: "
                + ", ".join(f"{name} {_ms(times):.1f} ms" for name, times in page.items())
            )
            lines.append(
                f"target overview_{args.queues}_queues_ms: {_ms(page['overview']):.1f} "
                "(goal <= 300)"
            )
            checked = _timed(brokers["open"].check, 1)[0]
            lines.append(f"target check_{scale}_open_s: {checked:.1f} (goal <= 60)")
        finally:
            for b in brokers.values():
                b.dispose()
        for db in dbs.values():
            server.drop(db)  # room for the activation phases' databases
        if not args.no_activation:
            lines += _breadth_activation.measure(server, args.queues)
    finally:
        server.drop_all()
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
