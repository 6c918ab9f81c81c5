"""The Airflow side of activation: triggers, sensors, DrainQueueOperator and the ``broker``
scheme of MessageQueueTrigger, against real SQLite and PostgreSQL broker databases.

Triggers run as the triggerer runs them: their ``run()`` async generator is iterated by an
asyncio task and its events collected, while messages are SENT from other threads. The broker
comes from an Airflow connection given in the environment (``AIRFLOW_CONN_BROKER_TEST``), as in
a deployment.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import threading
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import BUYER, BUYER_QUEUE, CONTRACT, ORDER, SUPPLIER, SUPPLIER_QUEUE, declare_pair
from helpers import open_order as open_order_pair
from sqlalchemy import select, text

from airflow_broker import DIALOG_TIMER, Activation, Broker, ConversationEnded, UnknownObject
from airflow_broker.activation import Monitor, drain, readers, register_reader
from airflow_broker.operators.reader import DrainQueueOperator
from airflow_broker.provider.compat import (
    AssetWatcher,
    BaseEventTrigger,
    PokeReturnValue,
    TriggerEvent,
)
from airflow_broker.provider.triggers import activation as trigger_module
from airflow_broker.provider.triggers.activation import QueueActivationTrigger, QueueWaiter
from airflow_broker.provider.triggers.conversation import ConversationMessageTrigger
from airflow_broker.provider.triggers.queues import BrokerMessageQueueProvider
from airflow_broker.sensors import ConversationSensor, QueueActivationSensor
from airflow_broker.storage import schema

CONN_ID = "broker_test"
POLL = 0.1
#: How long "no event" is watched for: several polls and samples of the monitor.
QUIET = 0.6


@pytest.fixture
def broker(broker_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    """The buyer/supplier pair (supplier queue: max_readers 2) on a fresh broker that Airflow
    connection ``broker_test`` names."""
    conn = json.dumps({"conn_type": "broker", "extra": {"url": broker_url}})
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", conn)
    b = Broker.connect(broker_url)
    declare_pair(b)
    b.alter_queue(SUPPLIER_QUEUE, activation=Activation(max_readers=2))
    yield b
    b.dispose()
    assert trigger_module._brokers == {}, "a trigger kept its broker after cleanup()"


def dialogs(broker: Broker, groups: int, per_group: int = 1) -> list[Any]:
    with broker.transaction() as tx:
        handles = [tx.begin_dialog(BUYER, SUPPLIER, contract=CONTRACT) for _ in range(groups)]
        for i in range(per_group):
            tx.send(handles, message_type=ORDER, body={"line": i})
    return handles


def more(broker: Broker, handles: list[Any]) -> None:
    with broker.transaction() as tx:
        tx.send(handles, message_type=ORDER, body={"more": True})


def activation_trigger(**kwargs: Any) -> QueueActivationTrigger:
    kwargs.setdefault("queue", SUPPLIER_QUEUE)
    kwargs.setdefault("broker_conn_id", CONN_ID)
    kwargs.setdefault("poll_interval", POLL)
    return QueueActivationTrigger(**kwargs)


class Running:
    """A trigger's ``run()`` iterated by a task, as the triggerer does; events are collected."""

    def __init__(self, trigger: Any) -> None:
        self.trigger = trigger
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        async for event in self.trigger.run():
            assert isinstance(event, TriggerEvent)
            json.dumps(event.payload)  # an asset event's extra, an XCom: JSON only
            await self.events.put(event.payload)

    async def next(self, timeout: float = 15) -> dict[str, Any]:
        getter = asyncio.ensure_future(self.events.get())
        done, _ = await asyncio.wait(
            {getter, self.task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if getter not in done:
            getter.cancel()
            if self.task in done:
                self.task.result()  # the trigger's exception, if any
                raise AssertionError("the trigger ended without an event")
            raise AssertionError(f"no event within {timeout} s")
        return getter.result()

    async def quiet(self, seconds: float = QUIET) -> None:
        """No event for ``seconds`` (the trigger looks several times meanwhile)."""
        try:
            event = await asyncio.wait_for(self.events.get(), seconds)
        except TimeoutError:
            return
        raise AssertionError(f"unexpected event {event}")

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.trigger.cleanup()


def in_thread(fn: Any, *args: Any) -> Any:
    return asyncio.to_thread(fn, *args)


async def eventually(condition: Any, timeout: float = 15) -> None:
    """Wait until ``condition()`` holds (checked every few milliseconds), or fail."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- serialize()


TRIGGERS = [
    QueueActivationTrigger(queue="q"),
    QueueActivationTrigger(
        queue="//po/SupplierQueue",
        broker_conn_id="east",
        poll_interval=0.25,
        min_depth=10,
        max_readers=4,
        mode="growth",
        monitor_key="nightly",
    ),
    QueueActivationTrigger(broker_queue="q", mode="depth"),
    ConversationMessageTrigger(queue="q", conversation_handle=uuid.UUID(int=7)),
    ConversationMessageTrigger(
        queue="q",
        conversation_handle="2b1e1b0c-4bb5-4a55-a0c0-a1de3b1d5f11",
        broker_conn_id="west",
        poll_interval=5,
    ),
]


@pytest.mark.parametrize("trigger", TRIGGERS, ids=lambda t: repr(t)[:60])
def test_serialize_round_trips(trigger: Any) -> None:
    from airflow.sdk.serde import deserialize, serialize

    classpath, kwargs = trigger.serialize()
    module, _, name = classpath.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert cls is type(trigger)
    # Through Airflow's own encoding of trigger kwargs (the defer path) and back.
    decoded = deserialize(serialize(kwargs))
    again = cls(**decoded)
    assert again.serialize() == (classpath, kwargs)
    assert json.loads(json.dumps(kwargs)) == kwargs


def test_queue_asset_is_watched_by_the_queues_trigger() -> None:
    asset = trigger_module.queue_asset("SupplierQueue", broker_conn_id="west", mode="growth")
    assert asset.name == "broker_queue_SupplierQueue"
    (watcher,) = asset.watchers
    assert watcher.name == "SupplierQueue_activation"
    classpath, kwargs = watcher.trigger.serialize()
    assert classpath.endswith("QueueActivationTrigger")
    assert (kwargs["queue"], kwargs["broker_conn_id"], kwargs["mode"]) == (
        "SupplierQueue",
        "west",
        "growth",
    )


def test_activation_trigger_is_an_event_trigger_for_asset_watchers() -> None:
    trigger = QueueActivationTrigger(queue="q")
    assert isinstance(trigger, BaseEventTrigger)
    watcher = AssetWatcher(name="q_watcher", trigger=trigger)
    assert watcher.trigger is trigger
    classpath, kwargs = trigger.serialize()
    # AssetWatchers are deduplicated by this hash: it must be stable for equal kwargs.
    assert BaseEventTrigger.hash(classpath, kwargs) == BaseEventTrigger.hash(
        *QueueActivationTrigger(queue="q").serialize()
    )


def test_bad_arguments_are_refused_when_the_dag_is_parsed() -> None:
    from airflow_broker import InvalidDefinition

    for kwargs in (
        {},
        {"queue": "q", "mode": "often"},
        {"queue": "q", "poll_interval": 0},
        {"queue": "q", "min_depth": 0},
        {"queue": "q", "max_readers": 0},
        {"queue": "q", "broker_queue": "other"},
    ):
        with pytest.raises(InvalidDefinition):
            QueueActivationTrigger(**kwargs)
    with pytest.raises(InvalidDefinition):
        ConversationMessageTrigger(queue="q", conversation_handle="not-a-uuid")


# --------------------------------------------------------------------------- activation trigger


def test_trigger_fires_once_per_arrival_and_not_again_after_a_restart(broker: Broker) -> None:
    async def scenario() -> None:
        run = Running(activation_trigger())
        await run.quiet()  # nothing waits
        handles = await in_thread(dialogs, broker, 1)
        event = await run.next()
        assert event["queue"] == SUPPLIER_QUEUE
        assert (event["depth"], event["groups_ready"], event["readers"], event["running"]) == (
            1,
            1,
            1,
            0,
        )
        assert event["mode"] == "arrival" and event["fire_id"]
        await run.quiet()  # the same messages: once
        await run.stop()

        # A restarted triggerer: a new trigger with the same key, a new broker.
        run = Running(activation_trigger())
        await run.quiet()

        # The reader it fired for runs and drains; new messages then fire again.
        def read_all() -> int:
            reader_id, admitted = register_reader(broker, SUPPLIER_QUEUE)
            assert admitted
            assert str(reader_id) == event["fire_id"]
            n = drain(broker, SUPPLIER_QUEUE, lambda tx, msgs: None).messages
            from airflow_broker.activation import finish_reader

            finish_reader(broker, reader_id)
            return n

        assert await in_thread(read_all) == 1
        await run.quiet()
        await in_thread(more, broker, handles)
        again = await run.next()
        assert again["fire_id"] != event["fire_id"]
        await run.quiet()
        await run.stop()

    asyncio.run(scenario())


def test_trigger_respects_max_readers_and_groups(broker: Broker) -> None:
    """max_readers 2 (the queue's): a growing queue gets a second reader, never a third; a
    queue with one group never gets a second reader, whatever max_readers says."""

    async def scenario() -> None:
        run = Running(activation_trigger())
        handles = await in_thread(dialogs, broker, 3)
        first = await run.next()
        await in_thread(register_reader, broker, SUPPLIER_QUEUE)  # the first reader runs
        await in_thread(more, broker, handles)  # ... and the queue grows
        second = await run.next()
        assert second["running"] == 1
        await in_thread(register_reader, broker, SUPPLIER_QUEUE)
        for _ in range(3):
            await in_thread(more, broker, handles)
            await run.quiet(0.3)  # two run: no third
        await run.stop()
        assert first["fire_id"] != second["fire_id"]

    asyncio.run(scenario())


def test_trigger_one_group_one_reader(broker: Broker) -> None:
    async def scenario() -> None:
        run = Running(activation_trigger(max_readers=5))
        handles = await in_thread(dialogs, broker, 1)
        await run.next()
        await in_thread(register_reader, broker, SUPPLIER_QUEUE)
        for _ in range(3):
            await in_thread(more, broker, handles)  # grows, but in one conversation group
            await run.quiet(0.3)
        await run.stop()

    asyncio.run(scenario())


def test_two_triggerers_fire_once_between_them(broker: Broker) -> None:
    async def scenario() -> None:
        runs = [Running(activation_trigger()), Running(activation_trigger())]
        await in_thread(dialogs, broker, 2)
        events: list[dict[str, Any]] = []
        for _ in range(2):
            for run in runs:
                with contextlib.suppress(TimeoutError):
                    events.append(await asyncio.wait_for(run.events.get(), QUIET))
        for run in runs:
            await run.stop()
        assert len(events) == 1

    asyncio.run(scenario())


def test_trigger_mode_depth(broker: Broker) -> None:
    async def scenario() -> None:
        run = Running(activation_trigger(mode="depth", min_depth=3, monitor_key="depth"))
        handles = await in_thread(dialogs, broker, 1, 2)
        await run.quiet()  # 2 < 3
        await in_thread(more, broker, handles)
        event = await run.next()
        assert (event["mode"], event["depth"], event["fire_id"]) == ("depth", 3, None)
        await run.quiet()  # nothing new
        await in_thread(more, broker, handles)
        assert (await run.next())["depth"] == 4
        await run.stop()

    asyncio.run(scenario())


def sampled_depth(broker: Broker, monitor_key: str) -> int | None:
    """The depth a monitor last sampled (None before its first look)."""
    a = schema.activation_monitor
    with broker.engine.connect() as conn:
        return conn.execute(
            select(a.c.last_depth).where(a.c.monitor_key == monitor_key)
        ).scalar_one_or_none()


def test_trigger_mode_growth(broker: Broker) -> None:
    async def scenario() -> None:
        run = Running(activation_trigger(mode="growth", monitor_key="growth"))
        # Its baseline: empty. Waited for, not slept on: on a loaded machine the trigger's
        # first look can come after the SEND below, and 2 would be its baseline (seen in CI).
        await eventually(lambda: sampled_depth(broker, "growth") == 0)
        await run.quiet()
        handles = await in_thread(dialogs, broker, 1, 2)
        assert (await run.next())["depth"] == 2
        await run.quiet()  # not growing
        await in_thread(more, broker, handles)
        assert (await run.next())["depth"] == 3
        await in_thread(drain, broker, SUPPLIER_QUEUE, lambda tx, msgs: None)
        await run.quiet()  # shrinking
        await run.stop()

    asyncio.run(scenario())


def test_trigger_waits_for_a_queue_declared_later(broker: Broker) -> None:
    async def scenario() -> None:
        run = Running(activation_trigger(queue="later_q"))
        await run.quiet(0.3)

        def declare_and_send() -> None:
            with broker.definitions() as d:
                d.create_queue("later_q")
                d.create_service("//t/Later", queue="later_q", contracts=["DEFAULT"])
            with broker.transaction() as tx:
                tx.send(tx.begin_dialog(BUYER, "//t/Later"), body=b"x")

        await in_thread(declare_and_send)
        event = await run.next()
        assert event["queue"] == "later_q"
        await run.stop()

    asyncio.run(scenario())


@pytest.mark.direct_connection  # its LISTEN connection; behind a pooler it polls
def test_cleanup_closes_the_trigger_connections(broker: Broker) -> None:
    def listeners() -> int:
        if broker.dialect != "postgresql":
            return 0
        with broker.engine.connect() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND query LIKE 'LISTEN%'"
                    )
                ).scalar_one()
            )

    async def scenario() -> None:
        runs = [Running(activation_trigger(monitor_key=f"k{i}")) for i in range(3)]
        await in_thread(dialogs, broker, 1)
        getters = [asyncio.ensure_future(run.events.get()) for run in runs]
        done, pending = await asyncio.wait(getters, timeout=15, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1  # one reader for one arrival, whichever monitor saw it first
        for getter in pending:
            getter.cancel()
        if broker.dialect == "postgresql":
            loop = asyncio.get_running_loop()
            await eventually(lambda: loop in trigger_module._listeners)
            table = trigger_module._listeners[loop]
            await eventually(lambda: [lst.refs for lst in table.values()] == [3])
            assert await in_thread(listeners) == 1  # one LISTEN for the three
        assert len(trigger_module._brokers) == 1  # and one broker
        for run in runs:
            await run.stop()
        # The connection is closed now; its server process leaves pg_stat_activity a moment
        # later (on a loaded machine, after the first look: seen once in CI).
        await eventually(lambda: listeners() == 0, timeout=10)
        assert trigger_module._brokers == {}

    asyncio.run(scenario())


def test_triggers_starting_together_look_their_connection_up_once(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty triggers of one Airflow connection start at once: one looks the connection up
    (in a triggerer that is a round trip to the API server) and opens the broker; the others
    share it. A trigger started while they run shares it too. When the last one stops, the
    next start looks the connection up again (and so sees a changed connection)."""
    from airflow_broker.hooks.broker import BrokerHook

    lookups: list[str] = []
    real = BrokerHook.broker_url

    def counted(self: BrokerHook) -> Any:
        lookups.append(self.broker_conn_id)
        return real(self)

    monkeypatch.setattr(BrokerHook, "broker_url", counted)

    async def scenario() -> None:
        runs = [Running(activation_trigger(monitor_key=f"k{i}")) for i in range(20)]
        await eventually(lambda: all(run.trigger._held is not None for run in runs))
        late = Running(activation_trigger(monitor_key="late"))
        await eventually(lambda: late.trigger._held is not None)
        assert lookups == [CONN_ID], f"{len(lookups)} lookups for 21 triggers"
        assert len(trigger_module._brokers) == 1
        for run in [*runs, late]:
            await run.stop()
        assert trigger_module._brokers == {} and trigger_module._urls == {}
        again = Running(activation_trigger())
        await eventually(lambda: again.trigger._held is not None)
        assert lookups == [CONN_ID, CONN_ID]
        await again.stop()

    asyncio.run(scenario())


def test_a_cancel_that_meets_a_notify_stops_the_waiter(broker: Broker) -> None:
    """The triggerer cancels a trigger while it waits; a NOTIFY may set the waiter's event in
    the same loop turn. The cancel must win (CI once saw a cancelled trigger run on for good:
    Python 3.11's ``asyncio.wait_for`` returns the event's result and drops the cancel)."""

    async def scenario() -> None:
        waiter = QueueWaiter(broker, 1, poll_interval=30)
        for _ in range(20):
            waiter.clear()
            task = asyncio.create_task(waiter.wait())
            await asyncio.sleep(0)  # the task is inside wait()
            waiter.event.set()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(scenario())


@pytest.mark.direct_connection  # its LISTEN connection; behind a pooler it polls
def test_trigger_listens_again_after_its_connection_is_killed(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = json.dumps({"conn_type": "broker", "extra": {"url": pg_url}})
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", conn)
    broker = Broker.connect(pg_url)
    declare_pair(broker)

    def kill_listeners() -> int:
        with broker.engine.connect() as c:
            return len(
                c.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND query LIKE 'LISTEN%'"
                    )
                ).all()
            )

    async def scenario() -> None:
        # A long poll interval: only LISTEN can make it fire quickly.
        run = Running(activation_trigger(poll_interval=30))
        loop = asyncio.get_running_loop()
        await eventually(lambda: loop in trigger_module._listeners)
        table = trigger_module._listeners[loop]
        await eventually(lambda: [lst.refs for lst in table.values()] == [1])
        listener = next(iter(table.values()))
        assert await in_thread(kill_listeners) == 1
        # The listener connects and LISTENs again by itself (tests/test_listen_reconnect_pg.py
        # has the details), still the one the trigger waits on.
        await eventually(lambda: listener.reconnects == 1)
        assert list(table.values()) == [listener] and listener.refs == 1
        await in_thread(dialogs, broker, 1)
        assert (await run.next(timeout=10))["depth"] == 1
        await run.stop()

    try:
        asyncio.run(scenario())
    finally:
        broker.dispose()


# --------------------------------------------------------------------------- MessageQueueTrigger


def test_message_queue_trigger_scheme_broker_runs_our_trigger(broker: Broker) -> None:
    from airflow.providers.common.messaging.triggers import msg_queue

    names = [type(p).__name__ for p in msg_queue.MESSAGE_QUEUE_PROVIDERS]
    assert "BrokerMessageQueueProvider" in names, "provider info does not list the queue"
    by_scheme = msg_queue.MessageQueueTrigger(
        scheme="broker", broker_queue=SUPPLIER_QUEUE, broker_conn_id=CONN_ID, poll_interval=POLL
    )
    assert isinstance(by_scheme.trigger, QueueActivationTrigger)
    assert by_scheme.serialize() == activation_trigger().serialize()
    with pytest.warns(Warning, match="deprecated"):
        by_uri = msg_queue.MessageQueueTrigger(
            queue=f"broker://{SUPPLIER_QUEUE}", broker_conn_id=CONN_ID, poll_interval=POLL
        )
    assert by_uri.serialize() == activation_trigger().serialize()

    async def scenario() -> None:
        run = Running(by_scheme)
        await in_thread(dialogs, broker, 1)
        assert (await run.next())["queue"] == SUPPLIER_QUEUE
        run.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run.task
        await by_scheme.trigger.cleanup()

    asyncio.run(scenario())


def test_broker_message_queue_provider() -> None:
    provider = BrokerMessageQueueProvider()
    assert provider.scheme_matches("broker")
    assert not provider.scheme_matches("kafka")
    assert provider.queue_matches("broker://SupplierQueue")
    assert not provider.queue_matches("broker://")
    assert not provider.queue_matches("SupplierQueue")
    assert not provider.queue_matches("kafka://topic")
    assert provider.trigger_class() is QueueActivationTrigger
    assert provider.trigger_kwargs("broker://SupplierQueue") == {"queue": "SupplierQueue"}


# --------------------------------------------------------------------------- conversation trigger


def conversation_trigger(queue: str, handle: Any) -> ConversationMessageTrigger:
    return ConversationMessageTrigger(
        queue=queue, conversation_handle=str(handle), broker_conn_id=CONN_ID, poll_interval=POLL
    )


def test_conversation_trigger_fires_on_the_next_message_of_its_conversation(
    broker: Broker,
) -> None:
    buyer_h, supplier_h = open_order_pair(broker)
    _, other_supplier_h = open_order_pair(broker)

    def reply(handle: Any) -> None:
        # The supplier answers on its side; the message lands on the buyer's queue.
        with broker.transaction() as tx:
            tx.send(handle, message_type="//po/Invoice", body={"total": 1})

    async def scenario() -> None:
        run = Running(conversation_trigger(BUYER_QUEUE, buyer_h))
        await run.quiet()
        await in_thread(reply, other_supplier_h)  # same queue, another conversation
        await run.quiet()
        await in_thread(reply, supplier_h)
        event = await run.next()
        assert event["status"] == "ready"
        assert event["conversation_handle"] == str(buyer_h)
        assert event["ready"] == 1
        assert event["message_type_name"] == "//po/Invoice"
        await run.stop()

    asyncio.run(scenario())
    # Not received: the message is still there for the next task.
    with broker.transaction() as tx:
        assert len(tx.receive(BUYER_QUEUE, conversation_handle=buyer_h)) == 1


def test_conversation_trigger_fires_on_a_timer(broker: Broker) -> None:
    _, supplier_h = open_order_pair(broker)
    with broker.transaction() as tx:
        tx.begin_conversation_timer(supplier_h, 0.5)

    async def scenario() -> None:
        run = Running(conversation_trigger(SUPPLIER_QUEUE, supplier_h))
        event = await run.next()
        assert (event["status"], event["message_type_name"]) == ("ready", DIALOG_TIMER)
        await run.stop()

    asyncio.run(scenario())


def test_conversation_trigger_errors(broker: Broker) -> None:
    buyer_h, supplier_h = open_order_pair(broker)

    async def first(trigger: Any) -> dict[str, Any]:
        run = Running(trigger)
        event = await run.next()
        await run.stop()
        return event

    missing = asyncio.run(first(conversation_trigger(BUYER_QUEUE, "0" * 32)))
    assert (missing["status"], missing["reason"]) == ("error", "missing")
    elsewhere = asyncio.run(first(conversation_trigger(SUPPLIER_QUEUE, buyer_h)))
    assert (elsewhere["status"], elsewhere["reason"]) == ("error", "other_queue")
    no_queue = asyncio.run(first(conversation_trigger("nope", buyer_h)))
    assert no_queue["status"] == "error"
    with broker.transaction() as tx:
        tx.end_conversation(supplier_h)
    with broker.transaction() as tx:
        assert tx.receive(BUYER_QUEUE)  # EndDialog
        tx.end_conversation(buyer_h)
    closed = asyncio.run(first(conversation_trigger(BUYER_QUEUE, buyer_h)))
    assert (closed["status"], closed["reason"]) == ("error", "closed")


# --------------------------------------------------------------------------- sensors


def test_activation_sensor_defers_then_completes(broker: Broker) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    sensor = QueueActivationSensor(
        task_id="wait",
        queue=SUPPLIER_QUEUE,
        broker_conn_id=CONN_ID,
        poll_interval=POLL,
        timeout=600,
    )
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    trigger = deferred.value.trigger
    assert deferred.value.method_name == "execute_complete"
    assert deferred.value.timeout.total_seconds() == 600
    assert trigger.serialize() == (
        "airflow_broker.provider.triggers.activation.QueueActivationTrigger",
        {
            "queue": SUPPLIER_QUEUE,
            "broker_conn_id": CONN_ID,
            "poll_interval": POLL,
            "min_depth": 1,
            "max_readers": None,
            "mode": "arrival",
            "monitor_key": "adhoc_airflow.wait",
        },
    )

    async def scenario() -> dict[str, Any]:
        run = Running(trigger)
        await in_thread(dialogs, broker, 1)
        event = await run.next()
        await run.stop()
        return event

    event = asyncio.run(scenario())
    assert sensor.execute_complete({}, event) == event
    # The next run of the sensor finds a reader starting for those messages: it defers again.
    with pytest.raises(TaskDeferred):
        sensor.execute({})


def test_activation_sensor_returns_at_once_when_a_reader_is_needed(broker: Broker) -> None:
    dialogs(broker, 1)
    sensor = QueueActivationSensor(
        task_id="wait", queue=SUPPLIER_QUEUE, broker_conn_id=CONN_ID, monitor_key="s"
    )
    result = sensor.execute({})
    assert (result["queue"], result["depth"], result["monitor_key"]) == (SUPPLIER_QUEUE, 1, "s")


@pytest.mark.parametrize("how", ["wait_for", "mode"])
def test_activation_sensor_pokes_when_not_deferrable(broker: Broker, how: str) -> None:
    kwargs = {"wait_for": "depth"} if how == "wait_for" else {"mode": "depth"}
    sensor = QueueActivationSensor(
        task_id="wait",
        queue=SUPPLIER_QUEUE,
        broker_conn_id=CONN_ID,
        min_depth=2,
        deferrable=False,
        **kwargs,
    )
    assert (sensor.wait_for, sensor.mode) == ("depth", "poke")
    handles = dialogs(broker, 1)
    first = sensor.poke({})
    assert isinstance(first, PokeReturnValue) and not first.is_done
    more(broker, handles)
    done = sensor.poke({})
    assert done.is_done and done.xcom_value["depth"] == 2
    assert not sensor.poke({}).is_done  # nothing new since


def test_conversation_sensor_defers_then_completes(broker: Broker) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    buyer_h, supplier_h = open_order_pair(broker)
    sensor = ConversationSensor(
        task_id="wait_reply",
        queue=BUYER_QUEUE,
        conversation_handle=str(buyer_h),
        broker_conn_id=CONN_ID,
        poll_interval=POLL,
    )
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    trigger = deferred.value.trigger
    assert isinstance(trigger, ConversationMessageTrigger)
    assert trigger.serialize()[1] == {
        "queue": BUYER_QUEUE,
        "conversation_handle": str(buyer_h),
        "broker_conn_id": CONN_ID,
        "poll_interval": POLL,
    }

    async def scenario() -> dict[str, Any]:
        run = Running(trigger)

        def reply() -> None:
            with broker.transaction() as tx:
                tx.send(supplier_h, message_type="//po/Invoice", body={"total": 2})

        await in_thread(reply)
        event = await run.next()
        await run.stop()
        return event

    event = asyncio.run(scenario())
    assert sensor.execute_complete({}, event)["message_type_name"] == "//po/Invoice"
    # Ready now: the sensor returns without deferring, and pokes True.
    assert sensor.execute({})["ready"] == 1
    poking = ConversationSensor(
        task_id="poke",
        queue=BUYER_QUEUE,
        conversation_handle=str(buyer_h),
        broker_conn_id=CONN_ID,
        deferrable=False,
    )
    assert poking.poke({}).is_done


def test_conversation_sensor_fails_on_a_pointless_wait(broker: Broker) -> None:
    sensor = ConversationSensor(
        task_id="wait", queue=BUYER_QUEUE, conversation_handle="0" * 32, broker_conn_id=CONN_ID
    )
    with pytest.raises(UnknownObject, match="does not exist"):
        sensor.execute({})
    with pytest.raises(ConversationEnded, match="closed"):
        sensor.execute_complete(
            {}, {"status": "error", "reason": "closed", "error": "it is closed"}
        )


# --------------------------------------------------------------------------- DrainQueueOperator

HANDLED: list[Any] = []


def handle(tx: Any, messages: list[Any]) -> None:
    """A reader's handler, by name: ``test_triggers:handle``."""
    HANDLED.extend(m.message_sequence_number for m in messages)


def context_for(payload: dict[str, Any] | None = None) -> dict[str, Any]:
    ti = SimpleNamespace(dag_id="reader", run_id="run_1", task_id="drain")
    events = {}
    if payload is not None:
        events = {"asset": [SimpleNamespace(extra={"from_trigger": True, "payload": payload})]}
    return {"ti": ti, "triggering_asset_events": events}


def test_drain_operator_takes_its_fire_and_drains_the_queue(broker: Broker) -> None:
    HANDLED.clear()
    dialogs(broker, 3, per_group=2)
    fire = Monitor(broker, SUPPLIER_QUEUE).check()
    assert fire is not None
    op = DrainQueueOperator(
        task_id="drain",
        queue=SUPPLIER_QUEUE,
        handler="test_triggers:handle",
        broker_conn_id=CONN_ID,
    )
    result = op.execute(context_for(fire.payload()))
    assert result == {
        "admitted": True,
        "reader_id": fire.fire_id,
        "batches": 3,
        "messages": 6,
        "drained": True,
    }
    assert sorted(HANDLED) == [0, 0, 0, 1, 1, 1]  # two orders on each of three dialogs
    [row] = readers(broker, SUPPLIER_QUEUE)
    assert (str(row.reader_id), row.outcome, row.label) == (
        fire.fire_id,
        "drained",
        "reader/run_1/drain",
    )


def test_drain_operator_releases_fires_merged_into_its_run(broker: Broker) -> None:
    handles = dialogs(broker, 3)
    monitor = Monitor(broker, SUPPLIER_QUEUE, sample_seconds=0)
    first = monitor.check()
    more(broker, handles)  # grows before any reader came: a second fire (max_readers 2)
    second = monitor.check()
    assert first is not None and second is not None
    # Airflow merged both asset events into one run.
    ctx = context_for(first.payload())
    ctx["triggering_asset_events"]["asset"].append(
        SimpleNamespace(extra={"from_trigger": True, "payload": second.payload()})
    )
    op = DrainQueueOperator(
        task_id="drain", queue=SUPPLIER_QUEUE, handler=handle, broker_conn_id=CONN_ID
    )
    assert op.execute(ctx)["reader_id"] == second.fire_id
    outcomes = {str(r.reader_id): r.outcome for r in readers(broker, SUPPLIER_QUEUE)}
    assert outcomes == {first.fire_id: "merged", second.fire_id: "drained"}


def test_drain_operator_is_refused_beyond_max_readers(broker: Broker) -> None:
    dialogs(broker, 3)
    for _ in range(2):  # max_readers 2: both places taken
        assert register_reader(broker, SUPPLIER_QUEUE)[1]
    op = DrainQueueOperator(
        task_id="drain", queue=SUPPLIER_QUEUE, handler=handle, broker_conn_id=CONN_ID
    )
    result = op.execute(context_for())
    assert result["admitted"] is False and result["messages"] == 0


def test_drain_operator_failure_rolls_back_and_fails_the_task(broker: Broker) -> None:
    dialogs(broker, 1, per_group=3)

    def boom(tx: Any, messages: list[Any]) -> None:
        tx.send(messages[0].conversation_handle, message_type="//po/Invoice", body={"x": 1})
        raise RuntimeError("handler failed")

    op = DrainQueueOperator(
        task_id="drain", queue=SUPPLIER_QUEUE, handler=boom, broker_conn_id=CONN_ID
    )
    with pytest.raises(RuntimeError, match="handler failed"):
        op.execute(context_for())
    assert [r.outcome for r in readers(broker, SUPPLIER_QUEUE)] == ["failed"]
    with broker.transaction() as tx:
        assert len(tx.receive(SUPPLIER_QUEUE)) == 3  # back on the queue
        assert tx.receive(BUYER_QUEUE) == []  # and the SEND rolled back with them


def test_templated_fields_render_and_the_executor_queue_is_left_alone() -> None:
    """``queue`` is the broker queue (templated as ``queue_name``); ``BaseOperator.queue`` stays
    the executor's (``executor_queue``), and the DAG serializes."""
    from airflow.sdk import DAG
    from airflow.serialization.serialized_objects import DagSerialization

    params = {"q": SUPPLIER_QUEUE, "h": str(uuid.UUID(int=3))}
    with DAG("reader", params=params) as dag:
        ops = [
            DrainQueueOperator(
                task_id="d",
                queue="{{ params.q }}",
                handler=handle,
                executor_queue="readers",
                fire_id="{{ params.h }}",
            ),
            QueueActivationSensor(
                task_id="s", queue="{{ params.q }}", monitor_key="{{ dag.dag_id }}"
            ),
            ConversationSensor(
                task_id="c", queue="{{ params.q }}", conversation_handle="{{ params.h }}"
            ),
        ]
    assert DagSerialization.to_dict(dag)["dag"]["dag_id"] == "reader"
    context: dict[str, Any] = {"params": params, "dag": dag}
    for op in ops:
        op.render_template_fields(context)
        assert op.queue_name == SUPPLIER_QUEUE
    assert ops[0].queue == "readers"
    assert ops[0].fire_id == str(uuid.UUID(int=3))
    assert ops[1].queue == ops[2].queue == "default"
    assert ops[1].monitor_key == "reader"
    assert ops[2].conversation_handle == str(uuid.UUID(int=3))


def test_threads_do_not_leak_from_reader_slots(broker: Broker) -> None:
    before = threading.active_count()
    dialogs(broker, 1)
    DrainQueueOperator(
        task_id="drain", queue=SUPPLIER_QUEUE, handler=handle, broker_conn_id=CONN_ID
    ).execute(context_for())
    assert threading.active_count() == before
