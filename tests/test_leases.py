"""Leases on both engines: ``Broker.lease`` hands out a conversation group's messages and
commits at once, the group stays held with no open transaction, and the lease ends by
``tx.complete`` (exactly the leased messages go, with whatever that transaction does),
``Broker.release`` or expiry by due work (a failed attempt: receive counts, dead-lettering)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import pytest
from helpers import (
    BUYER_QUEUE,
    NOTE,
    SUPPLIER_QUEUE,
    begin,
    bodies,
    declare_pair,
    queue_rows,
    receive,
    send,
)
from sqlalchemy import select

from airflow_broker import Broker, InvalidDefinition, Lease, LeaseExpired, Message
from airflow_broker.constants import DEAD_LETTERED, ERROR
from airflow_broker.storage import schema as s

DLQ = "supplier_dead_letters"


class HandlerFailed(Exception):
    """The handler failed: its transaction rolls back."""


def setup(broker: Broker, **kwargs: bool) -> None:
    declare_pair(broker, **kwargs)
    broker.create_queue(DLQ)


@pytest.fixture
def pair(broker: Broker) -> Broker:
    setup(broker)
    return broker


def take(broker: Broker, **kwargs: Any) -> Lease:
    """A lease on the supplier queue (60 s unless told); it must find messages."""
    kwargs.setdefault("lease_seconds", 60)
    lease = broker.lease(SUPPLIER_QUEUE, **kwargs)
    assert lease is not None, "nothing to lease"
    return lease


def counts(messages: Sequence[Message]) -> list[tuple[bytes | None, int]]:
    return [(m.message_body, m.receive_count) for m in messages]


def url_of(broker: Broker) -> str:
    return broker.engine.url.render_as_string(hide_password=False)


def expire(broker: Broker, lease: Lease) -> None:
    """Wait out ``lease`` and let due work process its expiry."""
    time.sleep(max(0.0, (lease.expires_at - datetime.now(lease.expires_at.tzinfo)).total_seconds()))
    time.sleep(0.05)
    assert broker.run_due().leases_expired == 1


def target_of(broker: Broker, initiator: uuid.UUID) -> uuid.UUID:
    """The target handle of ``initiator``'s dialog (its first message must be waiting)."""
    e = s.conversation_endpoint
    with broker.engine.connect() as conn:
        row = conn.execute(
            select(e.c.conversation_handle).where(
                e.c.conversation_id
                == select(e.c.conversation_id)
                .where(e.c.conversation_handle == initiator)
                .scalar_subquery(),
                e.c.conversation_handle != initiator,
            )
        ).first()
    assert row is not None
    return row.conversation_handle


def group_of(broker: Broker, initiator: uuid.UUID) -> uuid.UUID:
    """The supplier-side conversation group of ``initiator``'s dialog."""
    m = s.message
    with broker.engine.connect() as conn:
        row = conn.execute(
            select(m.c.conversation_group_id).where(
                m.c.conversation_handle == target_of(broker, initiator)
            )
        ).first()
    assert row is not None
    return row.conversation_group_id


# --------------------------------------------------------------------------------------------
# taking a lease


def test_lease_hands_out_one_group_in_order_and_holds_it(pair: Broker) -> None:
    broker = pair
    h1, h2 = begin(broker), begin(broker)
    send(broker, h1, NOTE, b"a", b"b", b"c")
    send(broker, h2, NOTE, b"x")
    before = datetime.now().astimezone()
    lease = take(broker)
    assert isinstance(lease.token, uuid.UUID)
    assert lease.queue == SUPPLIER_QUEUE
    assert bodies(lease.messages) == [b"a", b"b", b"c"]
    assert [m.receive_count for m in lease.messages] == [1, 1, 1]
    assert [m.message_sequence_number for m in lease.messages] == [0, 1, 2]
    assert {m.conversation_group_id for m in lease.messages} == {lease.conversation_group_id}
    assert 55 <= (lease.expires_at - before).total_seconds() <= 65
    # The group is held without a transaction: RECEIVE skips it, the other group still flows.
    [x] = receive(broker, SUPPLIER_QUEUE)
    assert (x.message_body, x.receive_count) == (b"x", 1)
    assert receive(broker, SUPPLIER_QUEUE) == []
    assert receive(broker, SUPPLIER_QUEUE, conversation_group=lease.conversation_group_id) == []
    handle = lease.messages[0].conversation_handle
    assert receive(broker, SUPPLIER_QUEUE, conversation_handle=handle) == []
    assert broker.lease(SUPPLIER_QUEUE, lease_seconds=60) is None
    # A message sent into the leased conversation waits for the lease, then comes after it.
    send(broker, h1, NOTE, b"d")
    assert receive(broker, SUPPLIER_QUEUE) == []
    broker.release(lease.token)
    got = receive(broker, SUPPLIER_QUEUE)
    assert counts(got) == [(b"a", 2), (b"b", 2), (b"c", 2), (b"d", 1)]


def test_lease_of_a_given_group_and_none_when_nothing_is_ready(pair: Broker) -> None:
    broker = pair
    assert broker.lease(SUPPLIER_QUEUE, lease_seconds=60) is None
    started = time.monotonic()
    assert broker.lease(SUPPLIER_QUEUE, lease_seconds=60, wait_seconds=0.3) is None
    assert time.monotonic() - started >= 0.25
    h1, h2 = begin(broker), begin(broker)
    send(broker, h1, NOTE, b"first")
    send(broker, h2, NOTE, b"second")
    [second] = receive(broker, SUPPLIER_QUEUE, conversation_handle=target_of(broker, h2))
    send(broker, h2, NOTE, b"third")
    lease = take(broker, conversation_group_id=second.conversation_group_id)
    assert bodies(lease.messages) == [b"third"]
    assert lease.conversation_group_id == second.conversation_group_id


@pytest.mark.parametrize(
    "bad", [0, -1, -0.5, True, "5", None, float("nan"), float("inf")], ids=repr
)
def test_bad_lease_seconds_are_refused(pair: Broker, bad: object) -> None:
    send(pair, begin(pair), NOTE, b"a")
    with pytest.raises(InvalidDefinition, match="lease_seconds"):
        pair.lease(SUPPLIER_QUEUE, lease_seconds=bad)  # type: ignore[arg-type]
    # Nothing was taken.
    assert counts(receive(pair, SUPPLIER_QUEUE)) == [(b"a", 1)]


# --------------------------------------------------------------------------------------------
# complete


def test_complete_commits_with_what_the_transaction_sends(pair: Broker) -> None:
    broker = pair
    h = begin(broker)
    send(broker, h, NOTE, b"a", b"b")
    lease = take(broker)
    target = lease.messages[0].conversation_handle
    with broker.transaction() as tx:
        assert tx.complete(lease.token) == 2
        tx.send(target, NOTE, b"reply")
    assert bodies(receive(broker, BUYER_QUEUE)) == [b"reply"]
    assert queue_rows(url_of(broker), SUPPLIER_QUEUE) == []
    # The group is free again: a new message flows at once; the lease is gone.
    send(broker, h, NOTE, b"c")
    assert counts(receive(broker, SUPPLIER_QUEUE)) == [(b"c", 1)]
    with pytest.raises(LeaseExpired), broker.transaction() as tx:
        tx.complete(lease.token)


def test_a_completing_transaction_that_rolls_back_leaves_the_lease_held(pair: Broker) -> None:
    broker = pair
    h = begin(broker)
    send(broker, h, NOTE, b"a", b"b")
    lease = take(broker)
    target = lease.messages[0].conversation_handle
    with pytest.raises(HandlerFailed), broker.transaction() as tx:
        assert tx.complete(lease.token) == 2
        tx.send(target, NOTE, b"reply")
        raise HandlerFailed
    assert receive(broker, BUYER_QUEUE) == []
    # Still held: nothing of the group can be received, the messages are all there.
    assert receive(broker, SUPPLIER_QUEUE) == []
    assert broker.lease(SUPPLIER_QUEUE, lease_seconds=60) is None
    url = url_of(broker)
    assert [b for _, _, b in queue_rows(url, SUPPLIER_QUEUE)] == [b"a", b"b"]
    # ... and it completes later, exactly once.
    with broker.transaction() as tx:
        assert tx.complete(lease.token) == 2
        tx.send(target, NOTE, b"reply")
    assert bodies(receive(broker, BUYER_QUEUE)) == [b"reply"]
    assert queue_rows(url, SUPPLIER_QUEUE) == []


def test_complete_removes_exactly_the_leased_messages(pair: Broker) -> None:
    broker = pair
    h, other = begin(broker), begin(broker)
    send(broker, h, NOTE, b"a", b"b", b"c")
    send(broker, other, NOTE, b"x")
    lease = take(broker, top=1)
    assert counts(lease.messages) == [(b"a", 1)]
    # The rest of the group waits behind the lease; the other group flows.
    assert bodies(receive(broker, SUPPLIER_QUEUE)) == [b"x"]
    assert receive(broker, SUPPLIER_QUEUE) == []
    send(broker, h, NOTE, b"d")
    with broker.transaction() as tx:
        assert tx.complete(lease.token) == 1
    assert counts(receive(broker, SUPPLIER_QUEUE)) == [(b"b", 1), (b"c", 1), (b"d", 1)]


def test_complete_of_an_unknown_token_raises_and_changes_nothing(pair: Broker) -> None:
    broker = pair
    send(broker, begin(broker), NOTE, b"a")
    lease = take(broker)
    for token in (uuid.uuid4(), str(uuid.uuid4())):
        with pytest.raises(LeaseExpired, match="no longer held"), broker.transaction() as tx:
            tx.complete(token)
        with pytest.raises(LeaseExpired):
            broker.release(token)
        with pytest.raises(LeaseExpired):
            broker.extend(token, 10)
    # The real lease is untouched.
    with broker.transaction() as tx:
        assert tx.complete(lease.token) == 1


def test_complete_on_a_retention_queue_keeps_the_messages_as_received(broker: Broker) -> None:
    setup(broker, supplier_retention=True)
    h = begin(broker)
    send(broker, h, NOTE, b"a", b"b")
    lease = take(broker)
    url = url_of(broker)
    assert [st for st, _, _ in queue_rows(url, SUPPLIER_QUEUE)] == [1, 1]
    with broker.transaction() as tx:
        assert tx.complete(lease.token) == 2
    assert queue_rows(url, SUPPLIER_QUEUE) == [(0, NOTE, b"a"), (0, NOTE, b"b")]
    assert receive(broker, SUPPLIER_QUEUE) == []
    send(broker, h, NOTE, b"c")
    assert bodies(receive(broker, SUPPLIER_QUEUE)) == [b"c"]


# --------------------------------------------------------------------------------------------
# release and extend


def test_release_makes_the_messages_ready_again_as_a_failed_attempt(pair: Broker) -> None:
    broker = pair
    send(broker, begin(broker), NOTE, b"a", b"b")
    lease = take(broker)
    broker.release(lease.token)
    with pytest.raises(LeaseExpired):
        broker.release(lease.token)
    assert counts(receive(broker, SUPPLIER_QUEUE)) == [(b"a", 2), (b"b", 2)]


def test_release_with_a_delay_holds_the_group_that_long(pair: Broker) -> None:
    broker = pair
    h, other = begin(broker), begin(broker)
    send(broker, h, NOTE, b"a")
    lease = take(broker)
    send(broker, other, NOTE, b"x")
    for bad in (-1, float("nan"), float("inf"), "1"):
        with pytest.raises(InvalidDefinition, match="delay"):
            broker.release(lease.token, delay=bad)  # type: ignore[arg-type]
    released = time.monotonic()
    broker.release(lease.token, delay=0.6)
    # Held for the delay: the other group flows, this one waits.
    assert bodies(receive(broker, SUPPLIER_QUEUE)) == [b"x"]
    assert receive(broker, SUPPLIER_QUEUE) == []
    assert broker.lease(SUPPLIER_QUEUE, lease_seconds=60) is None
    got: list[Message] = []
    deadline = released + 5
    while not got and time.monotonic() < deadline:
        got = receive(broker, SUPPLIER_QUEUE)
        if not got:
            time.sleep(0.02)
    waited = time.monotonic() - released
    assert counts(got) == [(b"a", 2)]
    assert 0.55 <= waited <= 2.0, waited


def test_extend_pushes_the_expiry_out(pair: Broker) -> None:
    broker = pair
    send(broker, begin(broker), NOTE, b"a")
    lease = take(broker, lease_seconds=0.3)
    new_expiry = broker.extend(lease.token, 30)
    assert (new_expiry - lease.expires_at).total_seconds() > 25
    with pytest.raises(InvalidDefinition):
        broker.extend(lease.token, 0)
    time.sleep(0.45)
    assert broker.run_due().leases_expired == 0
    assert receive(broker, SUPPLIER_QUEUE) == []
    with broker.transaction() as tx:
        assert tx.complete(lease.token) == 1
    assert receive(broker, SUPPLIER_QUEUE) == []


# --------------------------------------------------------------------------------------------
# expiry


def test_an_expired_lease_is_a_failed_attempt(pair: Broker) -> None:
    broker = pair
    send(broker, begin(broker), NOTE, b"a", b"b")
    lease = take(broker, lease_seconds=0.3)
    # Not yet processed: still held.
    assert receive(broker, SUPPLIER_QUEUE) == []
    expire(broker, lease)
    assert counts(receive(broker, SUPPLIER_QUEUE)) == [(b"a", 2), (b"b", 2)]


def test_a_lease_past_its_expiry_but_not_yet_processed_completes(pair: Broker) -> None:
    broker = pair
    send(broker, begin(broker), NOTE, b"a")
    lease = take(broker, lease_seconds=0.2)
    time.sleep(0.3)
    with broker.transaction() as tx:
        assert tx.complete(lease.token) == 1
    assert broker.run_due().leases_expired == 0
    assert receive(broker, SUPPLIER_QUEUE) == []


def test_complete_after_expiry_and_a_new_lease_raises_and_changes_nothing(pair: Broker) -> None:
    broker = pair
    h = begin(broker)
    send(broker, h, NOTE, b"a", b"b")
    first = take(broker, lease_seconds=0.3)
    expire(broker, first)
    second = take(broker)
    assert counts(second.messages) == [(b"a", 2), (b"b", 2)]
    target = second.messages[0].conversation_handle
    with pytest.raises(LeaseExpired, match=str(first.token)), broker.transaction() as tx:
        tx.send(target, NOTE, b"late reply")
        tx.complete(first.token)
    for verb in (broker.release, broker.extend):
        with pytest.raises(LeaseExpired):
            verb(first.token, 1)
    # Nothing changed: no reply went, the second lease still holds both messages.
    assert receive(broker, BUYER_QUEUE) == []
    url = url_of(broker)
    assert [b for _, _, b in queue_rows(url, SUPPLIER_QUEUE)] == [b"a", b"b"]
    assert receive(broker, SUPPLIER_QUEUE) == []
    with broker.transaction() as tx:
        assert tx.complete(second.token) == 2
    assert queue_rows(url, SUPPLIER_QUEUE) == []


def test_leases_expiring_max_receives_times_dead_letter_the_conversation(pair: Broker) -> None:
    broker = pair
    broker.alter_queue(SUPPLIER_QUEUE, max_receives=2, dead_letter_queue=DLQ)
    h, other = begin(broker), begin(broker)
    send(broker, h, NOTE, b"a", b"b")
    send(broker, other, NOTE, b"x")
    first = take(broker, lease_seconds=0.2, conversation_group_id=group_of(broker, h))
    assert counts(first.messages) == [(b"a", 1), (b"b", 1)]
    expire(broker, first)
    second = take(broker, lease_seconds=0.2, conversation_group_id=first.conversation_group_id)
    assert counts(second.messages) == [(b"a", 2), (b"b", 2)]
    expire(broker, second)
    # Dead-lettered: gone from the queue, in order on the dead-letter queue.
    assert bodies(receive(broker, SUPPLIER_QUEUE)) == [b"x"]
    assert receive(broker, SUPPLIER_QUEUE) == []
    dead = receive(broker, DLQ)
    assert bodies(dead) == [b"a", b"b"]
    for m in dead:
        assert m.dead_letter is not None
        assert m.dead_letter.queue == SUPPLIER_QUEUE
        assert m.dead_letter.conversation_handle == first.messages[0].conversation_handle
        assert m.dead_letter.receive_count == 2
    errors = [m for m in receive(broker, BUYER_QUEUE) if m.message_type_name == ERROR]
    assert len(errors) == 1 and errors[0].error is not None
    assert errors[0].error[0] == DEAD_LETTERED
    assert broker.catalog().queues[SUPPLIER_QUEUE].status is True
