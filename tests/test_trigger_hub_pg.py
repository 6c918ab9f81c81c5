"""Many triggers, one database: one LISTEN connection, a few threads, batched looks (issue 46).

One event loop runs the triggers, as Airflow's triggerer does. The broker's connections from
the loop's process are counted in ``pg_stat_activity`` by the triggers' own
``application_name``, sampled every 50 ms while they run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import text

from airflow_broker import DEFAULT, Broker
from airflow_broker.provider.compat import TriggerEvent
from airflow_broker.provider.triggers import activation as trigger_module
from airflow_broker.provider.triggers import hub as hub_module
from airflow_broker.provider.triggers.activation import QueueActivationTrigger
from airflow_broker.provider.triggers.conversation import ConversationMessageTrigger

pytestmark = [pytest.mark.postgres, pytest.mark.direct_connection]

CONN_ID = "broker_hub_test"
APP = "trigger_hub_test"
#: what docs/airflow.md promises: one LISTEN connection and one per thread
MOST_CONNECTIONS = 1 + hub_module.DATABASE_THREADS
QUEUES = 120


def queue(i: int) -> str:
    return f"hub_q{i}"


def service(i: int) -> str:
    return f"//hub/S{i}"


@pytest.fixture
def db(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Broker, str]]:
    broker = Broker.connect(pg_url)
    with broker.definitions() as d:
        for i in range(QUEUES):
            d.create_queue(queue(i))
            d.create_service(service(i), queue=queue(i), contracts=[DEFAULT])
    url = f"{pg_url}?application_name={APP}"
    conn = json.dumps({"conn_type": "broker", "extra": {"url": url}})
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", conn)
    try:
        yield broker, pg_url
    finally:
        broker.dispose()


class Connections(threading.Thread):
    """Samples the triggers' connections to the database every 50 ms; ``most`` is the peak."""

    def __init__(self, broker: Broker) -> None:
        super().__init__(daemon=True)
        self.broker, self.most, self.samples = broker, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            with self.broker.engine.connect() as conn:
                n = conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND application_name = :app"
                    ),
                    {"app": APP},
                ).scalar_one()
            self.most, self.samples = max(self.most, int(n)), self.samples + 1
            self.done.wait(0.05)

    def stop(self) -> int:
        self.done.set()
        self.join(10)
        return self.most


class Runs:
    """Triggers run by tasks of this loop; events by queue (or conversation)."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []
        self.triggers: list[Any] = []
        self.events: dict[str, list[dict[str, Any]]] = {}

    def start(self, trigger: Any, key: str) -> None:
        self.triggers.append(trigger)
        self.events[key] = []

        async def pump() -> None:
            async for event in trigger.run():
                assert isinstance(event, TriggerEvent)
                self.events[key].append(event.payload)

        self.tasks.append(asyncio.create_task(pump()))

    def fired(self) -> set[str]:
        return {key for key, events in self.events.items() if events}

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for trigger in self.triggers:
            await trigger.cleanup()


async def until(what: str, condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.02)


def hub_of_loop() -> hub_module.Hub:
    [found] = hub_module._listeners[asyncio.get_running_loop()].values()
    return found


def listening() -> int:
    """The waits the loop's hub LISTENs for (0 before it exists)."""
    hubs = hub_module._listeners.get(asyncio.get_running_loop(), {})
    return sum(h.refs for h in hubs.values())


def send(broker: Broker, i: int) -> None:
    with broker.transaction() as tx:
        handle = tx.begin_dialog(service(i), service(i), encryption=False)
        tx.send(handle, body=b"x")


@pytest.mark.timeout(240)
def test_a_hundred_activated_queues_share_one_listen_connection_and_a_few_threads(
    db: tuple[Broker, str],
) -> None:
    broker, _url = db
    sampler = Connections(broker)

    async def scenario() -> None:
        runs = Runs()
        sampler.start()
        try:
            for i in range(QUEUES):
                runs.start(
                    QueueActivationTrigger(
                        queue=queue(i), broker_conn_id=CONN_ID, poll_interval=0.2
                    ),
                    queue(i),
                )
            await until("every trigger LISTENs", lambda: listening() == QUEUES, 120)
            found = hub_of_loop()
            assert len(found._listening) == QUEUES  # one channel per queue, on one connection

            # Idle queues: their triggers poll every IDLE_POLL_SECONDS, not every 0.2 s, and
            # the polls that come are sorted out in one statement for all of them.
            batch = hub_module._looks[asyncio.get_running_loop()][found.key]
            full = batch.full_looks
            await asyncio.sleep(2.0)
            assert batch.full_looks - full <= 2, "idle queues made looks of their own"

            # A message wakes its queue's trigger only: it fires, no other does.
            chosen = [3, 57, 111]
            for i in chosen:
                full = batch.full_looks
                sent = time.monotonic()
                await asyncio.to_thread(send, broker, i)
                await until(f"{queue(i)} fires", lambda i=i: queue(i) in runs.fired(), 10)
                print(f"{queue(i)} fired {time.monotonic() - sent:.3f} s after the SEND")
                assert batch.full_looks - full <= 2, "a NOTIFY woke more than its queue's trigger"
            await asyncio.sleep(0.5)
            assert runs.fired() == {queue(i) for i in chosen}
        finally:
            await runs.stop()
        # The last trigger out closed the connection.
        assert hub_module._listeners.get(asyncio.get_running_loop(), {}) == {}

    try:
        asyncio.run(scenario())
    finally:
        most = sampler.stop()
    print(f"{sampler.samples} samples, at most {most} connections")
    assert sampler.samples > 20
    assert 1 <= most <= MOST_CONNECTIONS, f"{most} connections for {QUEUES} triggers"
    assert trigger_module._brokers == {}


@pytest.mark.timeout(240)
def test_a_burst_to_every_queue_fires_each_once_and_waiting_readers_cost_no_looks(
    db: tuple[Broker, str],
) -> None:
    """A message to each of the queues in one transaction: every trigger fires once. Then,
    while the readers fired for have not come (nobody reads here), each trigger still polls
    every 0.2 s, and the polls are sorted out together (quiet_monitors): no full look, and no
    second fire. Without that batching each poll was a full look of its own, ten statements,
    and a burst to a thousand queues queued thousands of them behind the fires."""
    broker, _url = db

    async def scenario() -> None:
        runs = Runs()
        try:
            for i in range(QUEUES):
                runs.start(
                    QueueActivationTrigger(
                        queue=queue(i), broker_conn_id=CONN_ID, poll_interval=0.2
                    ),
                    queue(i),
                )
            await until("every trigger LISTENs", lambda: listening() == QUEUES, 120)
            batch = hub_module._looks[asyncio.get_running_loop()][hub_of_loop().key]

            def send_all() -> None:
                with broker.transaction() as tx:
                    handles = [
                        tx.begin_dialog(service(i), service(i), encryption=False)
                        for i in range(QUEUES)
                    ]
                    tx.send(handles, body=b"x")

            sent = time.monotonic()
            full = batch.full_looks
            await asyncio.to_thread(send_all)
            await until("every queue fires", lambda: len(runs.fired()) == QUEUES, 60)
            print(f"{QUEUES} queues fired {time.monotonic() - sent:.2f} s after the SEND")
            assert batch.full_looks - full <= QUEUES + 5, "more full looks than fires"

            full, batches = batch.full_looks, batch.batches
            await asyncio.sleep(2.0)  # ten polls of each trigger
            assert batch.batches - batches >= 5, "the triggers stopped polling"
            assert batch.full_looks == full, "queues waiting for their readers looked alone"
            assert all(len(events) == 1 for events in runs.events.values()), "a second fire"
        finally:
            await runs.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(180)
def test_a_trigger_that_stops_unlistens_its_channel_and_the_others_keep_theirs(
    db: tuple[Broker, str],
) -> None:
    broker, _url = db

    async def scenario() -> None:
        runs = Runs()
        try:
            for i in range(3):
                runs.start(
                    QueueActivationTrigger(queue=queue(i), broker_conn_id=CONN_ID, poll_interval=5),
                    queue(i),
                )
            await until("three LISTEN", lambda: listening() == 3, 60)
            found = hub_of_loop()
            runs.tasks[1].cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runs.tasks[1]
            await until("one UNLISTEN", lambda: len(found._listening) == 2, 10)
            assert found.refs == 2 and hub_of_loop() is found
            # The others still hear their queues (a 5 s poll: only the NOTIFY is this fast).
            await asyncio.to_thread(send, broker, 2)
            await until(f"{queue(2)} fires", lambda: queue(2) in runs.fired(), 3)
        finally:
            await runs.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(180)
def test_many_conversation_triggers_on_one_queue_wake_only_the_one_with_a_message(
    db: tuple[Broker, str],
) -> None:
    broker, _url = db
    n = 60
    with broker.transaction() as tx:
        initiators = [tx.begin_dialog(service(0), service(1), encryption=False) for _ in range(n)]
        tx.send(initiators, body=b"hello")
    targets = []
    with broker.transaction() as tx:
        while len(targets) < n:
            got = tx.receive(queue(1), top=100)
            assert got
            targets += [m.conversation_handle for m in got]
    sampler = Connections(broker)

    async def scenario() -> None:
        runs = Runs()
        sampler.start()
        try:
            for h in initiators:
                runs.start(
                    ConversationMessageTrigger(
                        queue=queue(0), conversation_handle=h, broker_conn_id=CONN_ID,
                        poll_interval=0.3,
                    ),
                    str(h),
                )  # fmt: skip
            await until("every trigger LISTENs", lambda: listening() == n, 60)
            found = hub_of_loop()
            assert found._listening == {f"airflow_broker_q{_queue_id(broker, queue(0))}"}
            batch = hub_module._looks[asyncio.get_running_loop()][found.key]
            await asyncio.sleep(0.7)
            full = batch.full_looks
            await asyncio.sleep(1.5)
            # Polled every 0.3 s: sorted out in batches, none of them looks alone.
            assert batch.full_looks == full, "conversations with nothing made looks of their own"
            # A reply on one conversation: the NOTIFY wakes all n (one queue), one fires.
            with broker.transaction() as tx:
                tx.send(targets[7], body=b"reply")
            await until("the conversation's trigger fires", lambda: len(runs.fired()) == 1, 10)
            [key] = runs.fired()
            [event] = runs.events[key]
            assert event["status"] == "ready" and event["ready"] == 1
            assert batch.full_looks - full <= 3
        finally:
            await runs.stop()

    try:
        asyncio.run(scenario())
    finally:
        most = sampler.stop()
    assert 1 <= most <= MOST_CONNECTIONS, f"{most} connections for {n} conversation triggers"


def _queue_id(broker: Broker, name: str) -> int:
    with broker.engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT queue_id FROM broker_queue WHERE name = :n"), {"n": name}
            ).scalar_one()
        )
