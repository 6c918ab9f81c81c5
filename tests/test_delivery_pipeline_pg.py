"""A delivery pass on PostgreSQL runs its batches in overlapping stages
(:mod:`airflow_broker.transport.pipeline`): batches in flight at once, never two sharing a
conversation, every message once and in order; a stage that fails stops the pass with nothing
lost."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.pool import QueuePool
from transport_procs import (
    TARGET_QUEUE,
    Net,
    assert_exactly_once_in_order,
    by_conversation,
    connect_all,
    conversation_ids,
    deliver_until_empty,
    drain_all,
    send_dialogs,
    two_way,
)

from airflow_broker import Broker
from airflow_broker.transport import Transport
from airflow_broker.transport.pipeline import Batch

pytestmark = [pytest.mark.postgres, pytest.mark.xdist_group("transport")]

#: dialog lengths around a batch of 10: shorter, across one boundary, longer than a batch plus
#: its room (the pipeline drains), exactly a batch
COUNTS = [3, 7, 13, 1, 25, 10, 4, 9, 2, 31, 6, 10, 5, 8, 11] * 4


@pytest.fixture
def net(make_pg_database: Callable[..., str]) -> Iterator[Net]:
    n = connect_all({"a": make_pg_database(), "b": make_pg_database()})
    two_way(n)
    yield n
    n.close()


class Watched(Transport):
    """Batches of 10, and a record of what was in flight together."""

    BATCH = 10

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lock = threading.Lock()
        self.flying: dict[int, set[uuid.UUID]] = {}
        self.most = 0
        self.shared: list[set[uuid.UUID]] = []
        self.threads: set[str] = set()

    def _take(self, *args: Any, **kwargs: Any) -> Batch | None:
        batch = super()._take(*args, **kwargs)
        if batch is not None:
            handles = {r.conversation_handle for r in batch.rows}
            with self.lock:
                for other in self.flying.values():
                    if other & handles:
                        self.shared.append(other & handles)
                self.flying[id(batch)] = handles
                self.most = max(self.most, len(self.flying))
        return batch

    def _send(self, plan: dict[str, Any]) -> Any:
        self.threads.add(threading.current_thread().name)
        return super()._send(plan)

    def _finish(self, batch: Batch, results: Any, counts: dict[str, int]) -> None:
        try:
            super()._finish(batch, results, counts)
        finally:
            with self.lock:
                self.flying.pop(id(batch), None)


def checked_out(broker: Broker) -> int:
    """Connections of the broker's pool in use."""
    pool = broker.engine.pool
    assert isinstance(pool, QueuePool)
    return pool.checkedout()


def sent_and_got(net: Net, handles: list[uuid.UUID]) -> None:
    a, b = net["a"], net["b"]
    conv_of = conversation_ids(a, handles)
    expected = {conv_of[h]: range(c) for h, c in zip(handles, COUNTS, strict=True)}
    got = by_conversation(b, drain_all(b, TARGET_QUEUE))
    assert_exactly_once_in_order(got, expected, "b")


def test_one_pipelined_pass_delivers_every_message_once_in_order(net: Net) -> None:
    a = net["a"]
    handles = send_dialogs(a, COUNTS)
    t = Watched(a)
    report = t.deliver()
    assert report.delivered == report.acknowledged == sum(COUNTS)
    assert a.transmission_queue() == []
    assert checked_out(a) == 0
    sent_and_got(net, handles)
    # The pass did overlap, on its own threads, and never with a conversation in two batches.
    assert t.most >= 2
    assert any(name.startswith("airflow-broker-push") for name in t.threads)
    assert t.shared == []


def test_one_batch_at_a_time_delivers_the_same(net: Net) -> None:
    a = net["a"]
    handles = send_dialogs(a, COUNTS)
    t = Watched(a)
    t.IN_FLIGHT = 1
    report = t.deliver()
    assert report.delivered == sum(COUNTS)
    assert t.most == 1
    assert t.threads == {threading.current_thread().name}
    sent_and_got(net, handles)


def test_a_budget_holds_when_full_batches_take_the_rest_of_their_conversation(net: Net) -> None:
    a = net["a"]
    handles = send_dialogs(a, COUNTS)
    report = Watched(a).deliver(max_messages=25)
    assert 0 < report.delivered <= 25
    assert len(a.transmission_queue()) == sum(COUNTS) - report.delivered
    deliver_until_empty(a, retry_now=True)
    sent_and_got(net, handles)


class FailsThirdPush(Watched):
    """The third batch's push fails as a bug would (not as an unreachable broker)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pushes = 0

    def _send(self, plan: dict[str, Any]) -> Any:
        self.pushes += 1
        if self.pushes == 3:
            raise RuntimeError("push failed")
        return super()._send(plan)


def test_a_failed_stage_stops_the_pass_and_loses_nothing(net: Net) -> None:
    a, b = net["a"], net["b"]
    handles = send_dialogs(a, COUNTS)
    t = FailsThirdPush(a)
    with pytest.raises(RuntimeError, match="push failed"):
        t.deliver()
    # The batches pushed before the failure were recorded; the failed one rolled back; the pass
    # took no batch after the ones already in flight.
    waiting = len(a.transmission_queue())
    assert 0 < waiting < sum(COUNTS)
    assert t.pushes <= 3 + t.IN_FLIGHT
    assert checked_out(a) == 0  # every batch's connection closed
    with b.engine.connect() as conn:
        arrived = conn.execute(text("SELECT count(*) FROM broker_message")).scalar()
    assert arrived == sum(COUNTS) - waiting
    deliver_until_empty(a, retry_now=True)
    sent_and_got(net, handles)


class SendsDuringThePass(Watched):
    """After taking the first batch that is not open-ended, another transaction sends one more
    message on that batch's last conversation (as a SEND while the pass runs would)."""

    def __init__(self, broker: Broker, sent: dict[uuid.UUID, int]) -> None:
        super().__init__(broker)
        self.broker = broker
        #: messages sent so far, by handle
        self.sent = sent
        self.sent_on: uuid.UUID | None = None

    def _take(self, *args: Any, **kwargs: Any) -> Batch | None:
        batch = super()._take(*args, **kwargs)
        if batch is not None and not batch.open_ended and self.sent_on is None:
            self.sent_on = batch.rows[-1].conversation_handle
            with self.broker.transaction() as tx:
                tx.send(self.sent_on, body={"n": self.sent[self.sent_on]})
        return batch


def test_a_message_sent_on_a_batch_conversation_meanwhile_waits_for_the_next_pass(
    net: Net,
) -> None:
    """The batches after a closed one start after its last conversation: a message sent on it
    while the batch is in flight is not taken by a later batch of the same pass (which would
    then share the conversation), and the next pass delivers it in order."""
    a = net["a"]
    handles = send_dialogs(a, COUNTS)
    t = SendsDuringThePass(a, dict(zip(handles, COUNTS, strict=True)))
    t.deliver()
    assert t.sent_on is not None
    assert t.shared == []
    left = a.transmission_queue()
    assert [r.conversation_handle for r in left] == [t.sent_on]
    deliver_until_empty(a, retry_now=True)
    counts = [c + (h == t.sent_on) for h, c in zip(handles, COUNTS, strict=True)]
    conv_of = conversation_ids(a, handles)
    expected = {conv_of[h]: range(c) for h, c in zip(handles, counts, strict=True)}
    got = by_conversation(net["b"], drain_all(net["b"], TARGET_QUEUE))
    assert_exactly_once_in_order(got, expected, "b")
