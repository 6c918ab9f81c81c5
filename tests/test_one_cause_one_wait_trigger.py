"""One cause, one wait under the real transmission trigger (issue 46).

:class:`~airflow_broker.provider.triggers.transmission.TransmissionTrigger` runs as the
triggerer runs it (its ``run()`` iterated by an asyncio task, the broker named by an Airflow
connection in the environment) while every message of the broker waits for one cause, a route
nobody created yet: it yields no event (no transmitter run that could deliver nothing), however
many dialogs wait and whenever they were sent; creating the route makes it yield at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import transport_procs as tp
from transport_procs import INITIATOR, TARGET, send_dialogs

from airflow_broker.activation import transmitter as tm
from airflow_broker.provider.compat import TriggerEvent
from airflow_broker.provider.triggers import activation as trigger_module
from airflow_broker.provider.triggers.transmission import TransmissionTrigger
from airflow_broker.storage import clock
from airflow_broker.storage.clock import utcnow

CONN_ID = "broker_one_wait"
POLL = 0.2
#: how long "no event" is watched for: many looks of the trigger
QUIET = 3.0


@pytest.fixture
def net(network: Callable[..., tp.Net], monkeypatch: pytest.MonkeyPatch) -> Iterator[tp.Net]:
    """``a`` (watched by the trigger) hosts the initiator, ``b`` the target; ``a`` has no route
    to it yet."""
    clock.reset()
    n = network("a", "b")
    tp.host_initiator(n["a"])
    tp.host_target(n["b"])
    n["b"].create_route("ReturnRoute", INITIATOR, n.id("a"), "broker://a")
    conn = json.dumps({"conn_type": "broker", "extra": {"url": n.urls["a"]}})
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", conn)
    yield n
    clock.reset()
    assert trigger_module._brokers == {}, "a trigger kept its broker after cleanup()"


async def next_event(task: asyncio.Task[None], events: asyncio.Queue[Any], timeout: float) -> Any:
    getter = asyncio.ensure_future(events.get())
    done, _ = await asyncio.wait({getter, task}, timeout=timeout, return_when="FIRST_COMPLETED")
    if getter not in done:
        getter.cancel()
        if task in done:
            task.result()  # the trigger's exception, if any
        return None
    return getter.result()


def test_the_trigger_starts_no_run_while_every_dialog_waits_for_a_route(net: tp.Net) -> None:
    a = net["a"]
    # Dialogs sent over a while, each wave tried (and found without a route) when it came: the
    # cause backs off to half a minute, and the last wave waits with the others.
    send_dialogs(a, [1] * 300)
    tm.transmit(a)
    for _ in range(6):
        seen = tm.backlog(a)
        assert seen.next_attempt_at is not None
        clock.advance(max((seen.next_attempt_at - utcnow()).total_seconds(), 0) + 0.01)
        send_dialogs(a, [2] * 20)
        tm.transmit(a)
    send_dialogs(a, [1] * 100)
    tm.transmit(a)
    seen = tm.backlog(a)
    assert seen.due == 0 and seen.waiting == 300 + 6 * 40 + 100

    async def scenario() -> None:
        trigger = TransmissionTrigger(broker_conn_id=CONN_ID, poll_interval=POLL)
        events: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            async for event in trigger.run():
                assert isinstance(event, TriggerEvent)
                await events.put(event.payload)

        task = asyncio.create_task(pump())
        try:
            quiet = await next_event(task, events, QUIET)
            assert quiet is None, f"a transmitter run was started with nothing to deliver: {quiet}"
            started = time.monotonic()
            await asyncio.to_thread(a.create_route, "ToTarget", TARGET, None, "broker://b")
            fired = await next_event(task, events, 5.0)
            assert fired is not None, "creating the route started no transmitter run"
            assert fired["due"] == seen.waiting
            assert time.monotonic() - started < 5.0
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await trigger.cleanup()

    asyncio.run(scenario())
    report = tm.transmit(a)
    assert report.delivery.delivered == seen.waiting and report.left == tm.Backlog()
