"""A hung broker database behind one activated queue does not delay activation of queues in
other databases (issue 45, the triggers' side).

One event loop runs every trigger, as Airflow's triggerer does: eight
:class:`QueueActivationTrigger` s (each its own Airflow connection and broker) on a database of
a private cluster (``support.frozen_cluster``), a ninth on a second database of that cluster,
and two on healthy databases of the shared test server. The cluster is *frozen* (SIGSTOP:
connections neither refused nor answered, as in a partition):

- after the eight started and LISTEN, so their connections are made and then hang: each one's
  next look at its queue waits for good, in a thread;
- before the ninth made its first connection: opening its broker waits for good.

More looks hang than the event loop has default threads: the loop's default executor is given
:data:`LOOP_THREADS` threads, asyncio's own default on a 2-core machine (the CI), fewer than the
eight on any machine. Meanwhile each healthy trigger (one started before the freeze, one after
the ninth began to connect) must fire within :data:`FIRE_WITHIN` seconds of a message's SEND.
After the thaw the hung triggers look again, and fire for their own queues.

Before commit d3257cd this failed two ways: the triggers' blocking work ran in the loop's
default threads, all held by hung looks; and ``acquire_broker`` opened a broker under the lock
that every trigger takes, which the ninth held while it waited for its first connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from helpers import BUYER, CONTRACT, ORDER, SUPPLIER, SUPPLIER_QUEUE, declare_pair
from support.frozen_cluster import FrozenCluster, frozen_cluster

from airflow_broker import Activation, Broker
from airflow_broker.provider.compat import TriggerEvent
from airflow_broker.provider.triggers import activation as trigger_module
from airflow_broker.provider.triggers.activation import QueueActivationTrigger

pytestmark = [pytest.mark.postgres, pytest.mark.xdist_group("hung_peer")]

#: Triggers whose looks hang (each its own Airflow connection and broker on the frozen database).
HUNG = 8
#: asyncio's default executor on a 2-core machine: min(32, cpu + 4). Fewer than HUNG everywhere.
LOOP_THREADS = min(min(32, (os.cpu_count() or 1) + 4), HUNG - 2)
#: A healthy trigger fires within this many seconds of a SEND to its queue.
FIRE_WITHIN = 5.0
#: How long the cluster stays frozen (the healthy triggers fire again and again meanwhile).
FROZEN = 12.0
#: The hung triggers' poll interval: each looks (and hangs) at most this long after the freeze.
HUNG_POLL = 0.2
#: The healthy triggers' poll interval (they LISTEN; this is only the fallback).
HEALTHY_POLL = 1.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[FrozenCluster]:
    with frozen_cluster() as c:
        yield c


class WatchedTrigger(QueueActivationTrigger):
    """The activation trigger, telling whether one of its looks at the queue is under way."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: time.monotonic() when the look under way began (None: none is)
        self.looking_since: float | None = None
        self.looks = 0

    async def _next_look(self, *args: Any) -> Any:
        self.looking_since = time.monotonic()
        try:
            return await super()._next_look(*args)
        finally:
            self.looking_since = None
            self.looks += 1


class Running:
    """A trigger's ``run()`` iterated by a task, as the triggerer does; events are collected."""

    def __init__(self, name: str, trigger: WatchedTrigger) -> None:
        self.name = name
        self.trigger = trigger
        self.started = time.monotonic()
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.task = asyncio.create_task(self._pump(), name=f"trigger-{name}")

    async def _pump(self) -> None:
        async for event in self.trigger.run():
            assert isinstance(event, TriggerEvent)
            await self.events.put(event.payload)

    async def next(self, timeout: float) -> dict[str, Any]:
        getter = asyncio.ensure_future(self.events.get())
        done, _ = await asyncio.wait(
            {getter, self.task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if getter not in done:
            getter.cancel()
            if self.task in done:
                self.task.result()  # the trigger's exception, if any
                raise AssertionError(f"trigger {self.name} ended without an event")
            raise AssertionError(f"trigger {self.name}: no event within {timeout} s")
        return getter.result()

    def listening(self) -> bool:
        waiter = self.trigger._waiter
        return waiter is not None and waiter._listener is not None

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.trigger.cleanup()


def send_one(broker: Broker) -> None:
    """One new dialog with one order, to the supplier queue (a conversation group of its own)."""
    with broker.transaction() as tx:
        tx.send(tx.begin_dialog(BUYER, SUPPLIER, contract=CONTRACT), message_type=ORDER, body={})


def new_broker(url: str) -> Broker:
    """A migrated broker with the supplier queue, which may have many readers at once (each
    event of its trigger is a reader starting)."""
    broker = Broker.connect(url)
    broker.migrate()
    declare_pair(broker)
    broker.alter_queue(SUPPLIER_QUEUE, activation=Activation(max_readers=64))
    return broker


async def until(what: str, condition: Callable[[], bool], timeout: float) -> float:
    """Wait until ``condition()`` holds, checked every 20 ms; returns the seconds it took."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not condition():
        if loop.time() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.02)
    return loop.time() - start


@pytest.mark.timeout(180)
def test_a_hung_database_does_not_delay_the_triggers_of_other_databases(
    cluster: FrozenCluster,
    make_pg_database: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tag = uuid.uuid4().hex[:10]
    hung_url = cluster.url(cluster.create_database(f"hung_{tag}"))
    late_url = cluster.url(cluster.create_database(f"hung_late_{tag}"))
    urls: dict[str, str] = {"healthy_early": make_pg_database(), "healthy_late": make_pg_database()}
    urls["hung_late"] = late_url
    for i in range(HUNG):
        # One database, a broker (engine, pool, LISTEN connection) per connection id.
        urls[f"hung_{i}"] = f"{hung_url}?application_name=hung_trigger_{i}"
    for conn_id, url in urls.items():
        conn = json.dumps({"conn_type": "broker", "extra": {"url": url}})
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", conn)
    # Every trigger polls at its poll interval, idle or not (an idle queue's trigger that
    # LISTENs polls only every IDLE_POLL_SECONDS): the hung ones must look, and hang, at once.
    monkeypatch.setattr(trigger_module, "IDLE_POLL_SECONDS", 0.0)
    brokers = {
        "hung": new_broker(hung_url),
        "hung_late": new_broker(late_url),
        "healthy_early": new_broker(urls["healthy_early"]),
        "healthy_late": new_broker(urls["healthy_late"]),
    }
    timings: dict[str, list[float]] = {"healthy_early": [], "healthy_late": []}
    # The test's own blocking work (SENDs): never in the loop's default threads it measures.
    io = ThreadPoolExecutor(4, thread_name_prefix="hung-trigger-test")

    def trigger(conn_id: str, poll: float) -> WatchedTrigger:
        return WatchedTrigger(
            queue=SUPPLIER_QUEUE, broker_conn_id=conn_id, poll_interval=poll, monitor_key=conn_id
        )

    async def fires(run: Running, broker: Broker) -> float:
        """SEND to the run's queue; the seconds until its trigger fires (fails past
        FIRE_WITHIN)."""
        await asyncio.get_running_loop().run_in_executor(io, send_one, broker)
        sent = time.monotonic()
        event = await run.next(timeout=FIRE_WITHIN)
        took = time.monotonic() - sent
        assert event["queue"] == SUPPLIER_QUEUE
        timings[run.name].append(round(took, 2))
        return took

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(LOOP_THREADS))
        runs: dict[str, Running] = {}
        try:
            runs["healthy_early"] = Running("healthy_early", trigger("healthy_early", HEALTHY_POLL))
            for i in range(HUNG):
                runs[f"hung_{i}"] = Running(f"hung_{i}", trigger(f"hung_{i}", HUNG_POLL))
            await until(
                "every trigger LISTENs", lambda: all(r.listening() for r in runs.values()), 60
            )
            await fires(runs["healthy_early"], brokers["healthy_early"])  # before: the baseline

            # 1. The eight's connections are made; now they hang.
            cluster.freeze()
            frozen_at = time.monotonic()
            hung_runs = [runs[f"hung_{i}"] for i in range(HUNG)]

            def hanging() -> int:
                """Hung looks: under way for more than a second (a look takes milliseconds)."""
                now = time.monotonic()
                return sum(
                    1
                    for r in hung_runs
                    if (since := r.trigger.looking_since) is not None and now - since > 1.0
                )

            # Premise: the loop's default threads would all be taken by hung looks.
            await until(f"{LOOP_THREADS} looks hang", lambda: hanging() >= LOOP_THREADS, 10)
            with contextlib.suppress(AssertionError):
                await until(f"all {HUNG} looks hang", lambda: hanging() == HUNG, 3)
            print(f"{hanging()} of {HUNG} looks hang on the frozen database")
            await fires(runs["healthy_early"], brokers["healthy_early"])

            # 2. A trigger whose first connection is made while frozen; then one on a healthy
            # database starts, and must get its broker and fire all the same.
            runs["hung_late"] = late = Running("hung_late", trigger("hung_late", HUNG_POLL))
            await asyncio.sleep(1.0)
            assert late.trigger._held is None and not late.task.done(), (
                "the late trigger opened its broker on a frozen database (premise)"
            )
            runs["healthy_late"] = Running("healthy_late", trigger("healthy_late", HEALTHY_POLL))
            await fires(runs["healthy_late"], brokers["healthy_late"])
            # ... and so on, for as long as the hang lasts.
            while time.monotonic() < frozen_at + FROZEN:
                for name in ("healthy_early", "healthy_late"):
                    await fires(runs[name], brokers[name])
                await asyncio.sleep(1.0)
            assert cluster.frozen and cluster.all_stopped(), "the cluster thawed meanwhile"
            assert late.trigger._held is None, "the late trigger got a broker while frozen"
            still = hanging()
            assert still >= LOOP_THREADS, f"only {still} looks still hang (premise)"
            print(f"frozen for {time.monotonic() - frozen_at:.1f} s; {still} looks still hang")

            # 3. Thawed, the hung triggers go on by themselves and fire for their queues.
            looks = {r.name: r.trigger.looks for r in hung_runs}
            cluster.thaw()
            await until(
                "each hung trigger to end a look",
                lambda: all(r.trigger.looks > looks[r.name] for r in hung_runs),
                15,
            )
            await until("the late trigger's broker", lambda: late.trigger._held is not None, 15)
            await until("the late trigger LISTENs", late.listening, 15)
            await loop.run_in_executor(io, send_one, brokers["hung_late"])
            assert (await late.next(timeout=15))["queue"] == SUPPLIER_QUEUE
            await loop.run_in_executor(io, send_one, brokers["hung"])
            getters = [asyncio.ensure_future(r.events.get()) for r in hung_runs]
            done, pending = await asyncio.wait(
                getters, timeout=15, return_when=asyncio.FIRST_COMPLETED
            )
            for getter in pending:
                getter.cancel()
            assert done, "no trigger of the thawed database fired for its queue"
        finally:
            cluster.thaw()
            # Let looks and broker openings that waited for the server end before the cancel
            # (a cancelled await leaves its thread running; bounded: the test says what failed).
            with contextlib.suppress(AssertionError):
                await until(
                    "the triggers to be idle",
                    lambda: all(
                        r.trigger.looking_since is None and r.trigger._held is not None
                        for r in runs.values()
                    ),
                    15,
                )
            for run in runs.values():
                await run.stop()

    try:
        asyncio.run(scenario())
    finally:
        cluster.thaw()
        io.shutdown(wait=True)
        for broker in brokers.values():
            broker.dispose()
    # (healthy_early's first: before the freeze, the baseline)
    print(f"seconds from SEND to the healthy triggers' events: {timings}")
    assert min(len(t) for t in timings.values()) >= 5, timings
    assert trigger_module._brokers == {}, "a trigger kept its broker after cleanup()"
