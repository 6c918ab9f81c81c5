"""What every measured system provides: a schema, a producer and a consumer, the same for all.

The rules that keep the comparison fair live here, not in each adapter:

- A message is *produced* by a committed transaction that enqueues it, and *consumed* by a
  committed transaction that takes it off the queue (airflow-broker RECEIVE without retention;
  pgmq-pop ``pop``; pgmq read + archive; pgqueuer dequeue + log_jobs). SEND and RECEIVE never
  share a transaction: the producer and the readers are different processes in real use. A
  transaction may be one autocommitted statement where the system's API allows it (pgmq-pop).
- ``Workload.batch`` messages per producing transaction and per consuming transaction: 1 for the
  "single" workload, 100 for "batched".
- Bodies are the same small JSON document for every system (:func:`payload`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from bench._scratch import Database

#: What ``System.prepare`` hands to producers and consumers; must pickle (consumers are spawned).
SetupState = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Workload:
    """One measured workload: how many messages, and how many per transaction."""

    name: str
    #: messages per producing transaction and per consuming transaction
    batch: int
    #: messages per measured round
    messages: int
    #: messages of the warm-up round (not measured)
    warmup: int
    #: airflow-broker: dialogs the messages are spread over
    dialogs: int
    #: airflow-broker: conversation groups on the receiving side; 0 = one group per dialog
    groups: int


def payload(seq: int) -> dict[str, Any]:
    """The body of message ``seq``: about 120 bytes of JSON."""
    return {"seq": seq, "kind": "bench", "data": "x" * 96}


def payload_bytes(seq: int) -> bytes:
    """:func:`payload` serialized, for systems whose bodies are bytes."""
    return json.dumps(payload(seq)).encode()


class Producer(Protocol):
    """Enqueues messages; one call is one committed transaction."""

    def send(self, first_seq: int, count: int) -> None:
        """Enqueue ``count`` messages numbered from ``first_seq`` in one transaction."""

    def close(self) -> None:
        """Release connections."""


class Consumer(Protocol):
    """Takes messages off the queue; one call is one committed transaction."""

    def receive(self) -> int:
        """Consume up to ``Workload.batch`` messages in one transaction; return how many."""

    def end_round(self) -> int:
        """The round's messages are all consumed: commit what this consumer still holds, so
        that no transaction stays open between rounds; return how many messages that took
        off the queue (beyond the round's count)."""

    def close(self) -> None:
        """Release connections."""


class AsyncConsumer(Protocol):
    """A :class:`Consumer` for asyncio-only clients (pgqueuer's dequeue is async). Its
    receive commits what it took, so it holds nothing between rounds (no ``end_round``)."""

    async def open(self) -> None:
        """Connect (inside the reader's event loop)."""

    async def receive(self) -> int:
        """Consume up to ``Workload.batch`` messages in one transaction; return how many."""

    async def close(self) -> None:
        """Release connections."""


class System(Protocol):
    """A message system under test."""

    name: str

    def install(self, db: Database) -> None:
        """Install the system's schema into an empty database (the template)."""

    def prepare(self, db: Database, workload: Workload) -> SetupState:
        """Create queues (and dialogs) in a fresh clone; untimed."""

    def producer(self, db: Database, workload: Workload, state: SetupState) -> Producer:
        """A producer connected to ``db``."""

    def consumer(
        self, db: Database, workload: Workload, state: SetupState
    ) -> Consumer | AsyncConsumer:
        """A consumer connected to ``db`` (built inside the reader process)."""

    def remaining(self, db: Database, state: SetupState) -> int:
        """Messages still on the queue (checked after every round: 0, or the backlog's depth)."""


class Backlogged(Protocol):
    """A system the deep-queue round runs on: it can fill its queue before the clock starts."""

    def load(self, db: Database, workload: Workload, state: SetupState, count: int) -> None:
        """Put ``count`` messages on the queue the consumers read (untimed, any way is fine)."""
