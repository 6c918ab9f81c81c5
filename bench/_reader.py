"""The reader process: builds one consumer, then drains the queue each time it is told to.

Readers are spawned once per measured configuration and live through the warm-up and every
repeat, so process start-up and connecting are never timed. A shared counter says when the round's
messages are all consumed: a reader that finds nothing while others still hold the last groups
(or rows) retries instead of leaving, so every reader works to the end of the round.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized
from typing import Any

from bench._scratch import Database
from bench._systems import AsyncConsumer, Consumer, SetupState, Workload, get_system

#: Pause after an empty receive while other readers finish the round.
IDLE_SLEEP = 0.0005


@dataclass(frozen=True, slots=True)
class DrainResult:
    """One reader's share of one round."""

    #: perf_counter (CLOCK_MONOTONIC, comparable across processes) when the reader started
    started: float
    #: perf_counter right after the reader's last committed, non-empty consume
    last_commit: float
    messages: int
    transactions: int


def _add(counter: Synchronized[int], n: int, total: int) -> bool:
    with counter.get_lock():
        counter.value += n
        return counter.value >= total


def drain_sync(consumer: Consumer, counter: Synchronized[int], total: int) -> DrainResult:
    """Consume until the round's ``total`` messages are consumed by all readers together."""
    started = last = time.perf_counter()
    messages = transactions = 0
    while True:
        n = consumer.receive()
        if n:
            last = time.perf_counter()
            messages += n
            transactions += 1
            if _add(counter, n, total):
                break
        elif counter.value >= total:
            break
        else:
            time.sleep(IDLE_SLEEP)
    return DrainResult(started, last, messages, transactions)


async def drain_async(
    consumer: AsyncConsumer, counter: Synchronized[int], total: int
) -> DrainResult:
    """:func:`drain_sync` for asyncio consumers, inside one long-lived event loop."""
    started = last = time.perf_counter()
    messages = transactions = 0
    while True:
        n = await consumer.receive()
        if n:
            last = time.perf_counter()
            messages += n
            transactions += 1
            if _add(counter, n, total):
                break
        elif counter.value >= total:
            break
        else:
            await asyncio.sleep(IDLE_SLEEP)
    return DrainResult(started, last, messages, transactions)


def reader_main(
    system_name: str,
    db: Database,
    workload: Workload,
    state: SetupState,
    commands: Queue[int | None],
    results: Queue[tuple[str, Any]],
    counter: Synchronized[int],
) -> None:
    """Process entry point: connect, report ready, drain once per command until ``None``."""
    try:
        consumer = get_system(system_name).consumer(db, workload, state)
        if inspect.iscoroutinefunction(consumer.receive):
            _serve_async(consumer, commands, results, counter)  # type: ignore[arg-type]
        else:
            _serve_sync(consumer, commands, results, counter)  # type: ignore[arg-type]
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _serve_sync(
    consumer: Consumer,
    commands: Queue[int | None],
    results: Queue[tuple[str, Any]],
    counter: Synchronized[int],
) -> None:
    results.put(("ready", None))
    try:
        while (total := commands.get()) is not None:
            results.put(("done", drain_sync(consumer, counter, total)))
    finally:
        consumer.close()


def _serve_async(
    consumer: AsyncConsumer,
    commands: Queue[int | None],
    results: Queue[tuple[str, Any]],
    counter: Synchronized[int],
) -> None:
    with asyncio.Runner() as runner:
        runner.run(consumer.open())
        results.put(("ready", None))
        try:
            while (total := commands.get()) is not None:
                results.put(("done", runner.run(drain_async(consumer, counter, total))))
        finally:
            runner.run(consumer.close())
