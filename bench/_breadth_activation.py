"""Breadth, the triggerer's side: a thousand activated queues in one event loop.

Part of ``python -m bench.breadth`` (also runs alone: ``python -m bench._breadth_activation``).
One process runs :class:`~airflow_broker.provider.triggers.activation.QueueActivationTrigger` s
in one event loop, as Airflow's triggerer does: 1,000 of them, one per queue of a database with
1,000 queues, against one trigger on a database with one queue. Both phases run twice, in
alternating order.

- ``target activation_connections_1000_queues: N (goal <= 4)``: the most connections to the
  broker database the 1,000 triggers' process held at once (``pg_stat_activity``, sampled every
  100 ms, by the triggers' own ``application_name``, from their start: each phase begins
  once the connections of the phase before are gone, since a look of the triggers just
  cancelled can still be finishing on a connection of theirs);
- ``target activation_p50_1000_vs_1_queue: RATIO (goal <= 1.2)``: from a SEND's commit to the
  trigger's event, median, 1,000 queues over one. Each sample SENDs one message to a queue
  (another each time, among the 1,000) and, once the trigger fired, RECEIVEs it, so that the
  queue is empty again;
- ``info activation_burst_1000_queues``: one message to each of the 1,000 queues in one
  transaction: how long until every trigger fired, and how many full looks the triggers made
  in the 2 s after (none is needed: every queue waits for the reader fired for).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg

from bench._breadth_schema import define
from bench._scratch import Database, ScratchServer

APP = "bench_breadth_triggerer"
CONN_ID = "bench_breadth_activation"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _queue(i: int) -> str:
    return f"breadth_tenant_{i}_q"


def _service(i: int) -> str:
    return f"//breadth/Tenant{i}"


class _Phase:
    """``count`` triggers on ``db``'s first ``count`` tenant queues, running in this loop."""

    def __init__(self, db: Database, count: int, poll: float) -> None:
        from airflow_broker import Broker
        from airflow_broker.provider.triggers.activation import QueueActivationTrigger

        url = f"{db.sqlalchemy_url}?application_name={APP}"
        os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(
            {"conn_type": "broker", "extra": {"url": url}}
        )
        self.db, self.count = db, count
        self.sender = Broker.connect(db.sqlalchemy_url)
        self.triggers = [
            QueueActivationTrigger(queue=_queue(i), broker_conn_id=CONN_ID, poll_interval=poll)
            for i in range(count)
        ]
        self.events: dict[str, asyncio.Queue[dict[str, Any]]] = {
            _queue(i): asyncio.Queue() for i in range(count)
        }
        self.tasks: list[asyncio.Task[None]] = []
        self.most = 0
        self._stop_counting = asyncio.Event()

    async def _pump(self, trigger: Any) -> None:
        async for event in trigger.run():
            await self.events[event.payload["queue"]].put(event.payload)

    def connections(self) -> int:
        with psycopg.connect(self.db.conninfo, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = %s AND application_name = %s",
                (self.db.name, APP),
            ).fetchone()
        return int(row[0]) if row else 0

    async def _count(self, io: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop_counting.is_set():
            self.most = max(self.most, await loop.run_in_executor(io, self.connections))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_counting.wait(), 0.1)

    async def start(self, io: ThreadPoolExecutor) -> None:
        from airflow_broker.provider.triggers.hub import _listeners

        # The last phase's triggers are gone, but a look of theirs that was in flight when
        # they were cancelled may still hold a connection for a moment: not this phase's.
        loop = asyncio.get_running_loop()
        settle = time.monotonic() + 30
        while await loop.run_in_executor(io, self.connections) and time.monotonic() < settle:
            await asyncio.sleep(0.1)
        self.tasks = [asyncio.create_task(self._pump(t)) for t in self.triggers]
        self.tasks.append(asyncio.create_task(self._count(io)))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            hubs = list(_listeners.get(loop, {}).values())
            if sum(h.refs for h in hubs) >= self.count:
                await asyncio.sleep(2.0)  # every first look done
                return
            await asyncio.sleep(0.2)
        raise SystemExit(f"bench: {self.count} triggers did not all LISTEN within 300 s")

    def _send(self, i: int) -> float:
        with self.sender.transaction() as tx:
            h = tx.begin_dialog(_service(i), _service(i), encryption=False)
            tx.send(h, body=b"hello")
        return time.perf_counter()

    def _receive(self, i: int) -> None:
        with self.sender.transaction() as tx:
            for m in tx.receive(_queue(i), top=10):
                tx.end_conversation(m.conversation_handle, cleanup=True)

    async def sample(self, io: ThreadPoolExecutor, i: int) -> float:
        loop = asyncio.get_running_loop()
        sent = await loop.run_in_executor(io, self._send, i)
        await asyncio.wait_for(self.events[_queue(i)].get(), 60)
        took = time.perf_counter() - sent
        await loop.run_in_executor(io, self._receive, i)
        return took

    async def burst(self, io: ThreadPoolExecutor) -> tuple[float, int]:
        """One message to every queue in one transaction: seconds until every trigger fired,
        and the full looks made in the 2 s after (nobody reads: every queue waits for the
        reader fired for). The queues are read empty again afterwards."""
        from airflow_broker.provider.triggers.hub import _looks

        loop = asyncio.get_running_loop()
        batch = next(iter(_looks[loop].values()))

        def send_all() -> float:
            with self.sender.transaction() as tx:
                handles = [
                    tx.begin_dialog(_service(i), _service(i), encryption=False)
                    for i in range(self.count)
                ]
                tx.send(handles, body=b"burst")
            return time.perf_counter()

        sent = await loop.run_in_executor(io, send_all)
        for i in range(self.count):
            await asyncio.wait_for(self.events[_queue(i)].get(), 300)
        took = time.perf_counter() - sent
        full = batch.full_looks
        await asyncio.sleep(2.0)
        after = batch.full_looks - full
        for i in range(self.count):
            await loop.run_in_executor(io, self._receive, i)
        return took, after

    async def stop(self) -> None:
        self._stop_counting.set()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for trigger in self.triggers:
            await trigger.cleanup()
        self.sender.dispose()


async def _phase(
    db: Database, count: int, samples: int, poll: float, burst: list[tuple[float, int]] | None
) -> tuple[list[float], int]:
    """``samples`` SEND-to-event times with ``count`` triggers running, the most connections
    they held; with ``burst`` given, a burst to every queue is measured too (appended)."""
    io = ThreadPoolExecutor(4, thread_name_prefix="bench-io")
    phase = _Phase(db, count, poll)
    try:
        started = time.perf_counter()
        await phase.start(io)
        _say(f"breadth: {count} triggers listening in {time.perf_counter() - started:.1f} s")
        picks = random.sample(range(count), min(samples, count)) if count > 1 else [0] * samples
        times = []
        for i in picks:
            times.append(await phase.sample(io, i))
            await asyncio.sleep(random.uniform(0.05, 0.3))  # land anywhere in the poll cycle
        if burst is not None:
            burst.append(await phase.burst(io))
        return times, phase.most
    finally:
        await phase.stop()
        io.shutdown(wait=True)


def measure(server: ScratchServer, queues: int = 1000, samples: int = 40) -> list[str]:
    """The activation lines of ``bench.breadth`` (see the module docstring)."""
    many_tpl = server.template("breadth_act_many", lambda db: define(db, queues))
    one_tpl = server.template("breadth_act_one", lambda db: define(db, 1))
    many = server.create(many_tpl, "breadth", "act_many")
    one = server.create(one_tpl, "breadth", "act_one")
    p50: dict[str, list[float]] = {"one": [], "many": []}
    most = 0
    bursts: list[tuple[float, int]] = []
    for rnd in range(2):
        for kind in ("one", "many") if rnd == 0 else ("many", "one"):
            db, count = (one, 1) if kind == "one" else (many, queues)
            burst = bursts if kind == "many" else None
            times, held = asyncio.run(_phase(db, count, samples // 2, 1.0, burst))
            p50[kind] += times
            if kind == "many":
                most = max(most, held)
    one_ms = statistics.median(p50["one"]) * 1000
    many_ms = statistics.median(p50["many"]) * 1000
    fired = ", ".join(f"{took:.2f} s" for took, _ in bursts)
    looks = ", ".join(str(after) for _, after in bursts)
    return [
        f"info activation: SEND to event p50 {one_ms:.1f} ms with 1 queue, {many_ms:.1f} ms with "
        f"{queues} queues activated in one event loop",
        f"info activation_burst_{queues}_queues: a message to every queue in one transaction, "
        f"every trigger fired after {fired}; full looks in the 2 s after, while every queue "
        f"waits for its reader: {looks}",
        f"target activation_connections_{queues}_queues: {most} (goal <= 4)",
        f"target activation_p50_{queues}_vs_1_queue: {many_ms / one_ms:.2f} (goal <= 1.2)",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench._breadth_activation", description=__doc__)
    p.add_argument("--queues", type=int, default=1000)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--url", default=None)
    args = p.parse_args(argv)
    server = ScratchServer(args.url)
    server.check()
    try:
        lines = measure(server, args.queues, args.samples)
    finally:
        server.drop_all()
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
