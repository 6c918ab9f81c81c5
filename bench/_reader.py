"""Reader processes: each holds consumers of several systems and drains a queue when told to.

The processes are spawned once per benchmark run and reused by every configuration, so process
start-up, imports and connecting are never timed (and not paid per configuration). A shared
counter says when a round's messages are all consumed: a reader that finds nothing while others
still hold the last groups (or rows) retries instead of leaving, so every reader works to the
end of the round.

Protocol (one command queue per process, one shared result queue), each command answered once:

- ``("open", key, system_name, db, workload, state)`` -> ``("opened", key)``
- ``("drain", key, total)`` -> ``("done", DrainResult)``
- ``("close", key)`` -> ``("closed", key)``
- ``None`` ends the process; any failure answers ``("error", text)``.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized
from typing import Any

from bench._registry import get_system
from bench._systems import AsyncConsumer, Consumer

#: Pause after an empty receive while other readers finish the round.
IDLE_SLEEP = 0.0005

Command = tuple[Any, ...] | None
Reply = tuple[str, Any]


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
    # Untimed: what a reader still holds is beyond the round's count (a deep queue's backlog).
    messages += consumer.end_round()
    return DrainResult(started, last, messages, transactions)


async def drain_async(
    consumer: AsyncConsumer, counter: Synchronized[int], total: int
) -> DrainResult:
    """:func:`drain_sync` for asyncio consumers, inside the reader's long-lived event loop."""
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


class _Reader:
    """The state of one reader process: its consumers by key, and one event loop for the async
    ones (pgqueuer's connection belongs to the loop it was opened in)."""

    def __init__(self, counter: Synchronized[int]) -> None:
        self.counter = counter
        self.sync: dict[int, Consumer] = {}
        self.aio: dict[int, AsyncConsumer] = {}
        self.runner: asyncio.Runner | None = None

    def _loop(self) -> asyncio.Runner:
        if self.runner is None:
            self.runner = asyncio.Runner()
        return self.runner

    def handle(self, command: tuple[Any, ...]) -> Reply:
        kind, key = command[0], command[1]
        if kind == "open":
            system_name, db, workload, state = command[2:]
            consumer = get_system(system_name).consumer(db, workload, state)
            if inspect.iscoroutinefunction(consumer.receive):
                aio: AsyncConsumer = consumer  # type: ignore[assignment]
                self._loop().run(aio.open())
                self.aio[key] = aio
            else:
                self.sync[key] = consumer  # type: ignore[assignment]
            return ("opened", key)
        if kind == "drain":
            total: int = command[2]
            if key in self.aio:
                return ("done", self._loop().run(drain_async(self.aio[key], self.counter, total)))
            return ("done", drain_sync(self.sync[key], self.counter, total))
        if kind == "close":
            if key in self.aio:
                self._loop().run(self.aio.pop(key).close())
            else:
                self.sync.pop(key).close()
            return ("closed", key)
        raise ValueError(f"unknown command {kind!r}")

    def shutdown(self) -> None:
        for key in list(self.sync):
            self.sync.pop(key).close()
        for key in list(self.aio):
            self._loop().run(self.aio.pop(key).close())
        if self.runner is not None:
            self.runner.close()


def reader_main(
    commands: Queue[Command], results: Queue[Reply], counter: Synchronized[int]
) -> None:
    """Process entry point: answer commands until ``None``."""
    reader = _Reader(counter)
    results.put(("ready", None))
    try:
        while (command := commands.get()) is not None:
            try:
                reply = reader.handle(command)
            except Exception as exc:
                reply = ("error", f"{command[0]}: {type(exc).__name__}: {exc}")
            results.put(reply)
    finally:
        reader.shutdown()
