"""The lock order's rule 0 and its two companions, each race played deterministically (PostgreSQL).

These are the races the stress run (``test_stress_pg.py``) found; each test failed before its fix:

- END CONVERSATION (any kind) racing a reader that holds the conversation's group and answers on
  it: END locked the endpoint, then waited for the message rows the reader had taken, while the
  reader waited for the endpoint to send its answer. A deadlock; now END takes the group first,
  as RECEIVE does, and simply waits for the reader.
- Both sides of a dialog ENDing at once: each locked its own endpoint, then the far one to
  deliver its EndDialog. A deadlock; now a message whose far endpoint another transaction holds
  waits in the transmission queue, and due work delivers it a moment later.
- A SEND that waited for another SEND on the same endpoint, whose message had gone to the
  transmission queue, took the fast path on its stale snapshot and overtook that message. Now
  the fast path notices the sender changed under it and leaves the message to the general path.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from helpers import (
    BUYER_QUEUE,
    NOTE,
    ORDER,
    SUPPLIER_QUEUE,
    declare_pair,
    open_order,
    send,
)
from races import orphans, race
from sqlalchemy import text
from transport_procs import (
    TARGET_QUEUE,
    connect_all,
    deliver_until_empty,
    send_dialogs,
    send_more,
    two_way,
)

from airflow_broker import Broker, ConversationEnded, Transaction
from airflow_broker.messaging import transaction
from airflow_broker.storage import clock
from airflow_broker.storage.endpoint_locks import exclude_writers

pytestmark = pytest.mark.postgres


@pytest.fixture
def pair(pg_broker: Broker) -> Broker:
    declare_pair(pg_broker)
    return pg_broker


def _state(pair: Broker, handle: uuid.UUID) -> str:
    with pair.transaction() as tx:
        return tx.conversation(handle).state


@pytest.mark.parametrize(
    "how", [{"cleanup": True}, {"error_code": 50001, "error_description": "no"}, {}]
)
def test_end_waits_for_the_reader_that_holds_the_conversation_group(
    pair: Broker, how: dict[str, object]
) -> None:
    h, t = open_order(pair)
    send(pair, h, ORDER, {"order": 2})

    def reader(tx: Transaction) -> object:
        return tx.receive(SUPPLIER_QUEUE)

    def answers(tx: Transaction) -> None:
        tx.send(t, NOTE, "on it")

    got, ended = race(pair, reader, lambda tx: tx.end_conversation(t, **how), then=answers)
    assert not isinstance(got, Exception), got
    assert ended is None, ended
    assert [m.json() for m in got] == [{"order": 2}]  # type: ignore[attr-defined]
    assert pair.check() == []
    with pair.transaction() as tx:
        assert b"on it" in [m.message_body for m in tx.receive(BUYER_QUEUE)]


def test_both_sides_ending_at_once_do_not_deadlock(pair: Broker) -> None:
    h, t = open_order(pair)
    send(pair, h, ORDER, {"order": 2})

    def target_answers(tx: Transaction) -> None:
        tx.receive(SUPPLIER_QUEUE)
        tx.send(t, NOTE, "last words")

    def initiator_ends(tx: Transaction) -> None:
        tx.end_conversation(h)

    def target_ends(tx: Transaction) -> None:
        tx.end_conversation(t)

    first, second = race(pair, target_answers, initiator_ends, then=target_ends)
    assert not isinstance(first, Exception), first
    assert second is None, second
    pair.run_due()  # the EndDialog that waited for the target's endpoint
    assert (_state(pair, h), _state(pair, t)) == ("CD", "CD")
    assert pair.transmission_queue() == []
    with pair.transaction() as tx:
        assert tx.receive(SUPPLIER_QUEUE) == [] and tx.receive(BUYER_QUEUE) == []
    assert pair.check() == []


@pytest.mark.parametrize("far_lock", ["advisory", "row"])
def test_end_after_the_far_end_does_not_wait_for_a_send_that_holds_the_far_endpoint(
    pair: Broker, far_lock: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The initiator has ended (DO) and the target, told (DI), ends too: its END closes the
    initiator's endpoint. Meanwhile a SEND on several conversations, the ended initiator among
    them, waits for the target's endpoint, which the END holds: for its advisory lock before it
    locks anything, or (row locks, past the transaction's advisory budget) with its senders
    locked, for the row. The END once updated the initiator's endpoint there and then: a
    deadlock in the second case (the stress run found it). Now it does not wait for a far
    endpoint someone holds (rule 4): its EndDialog waits in the transmission queue, and due
    work closes the initiator with it."""
    if far_lock == "row":
        monkeypatch.setattr(transaction, "ADVISORY_BUDGET", 0)
    h, t = open_order(pair)
    other, _ = open_order(pair)
    with pair.transaction() as tx:
        tx.end_conversation(h)
    assert (_state(pair, h), _state(pair, t)) == ("DO", "DI")

    def end_locks_its_endpoint(tx: Transaction) -> None:
        # END CONVERSATION's first step (after the group): its own endpoint exclusively, the
        # advisory lock and the row FOR UPDATE.
        exclude_writers(tx.connection, [t])
        tx.connection.execute(
            text(
                "SELECT 1 FROM broker_conversation_endpoint"
                " WHERE conversation_handle = :h FOR UPDATE"
            ),
            {"h": t},
        )

    def send_on_both(tx: Transaction) -> None:
        tx.send([other, h], NOTE, "both")

    ended, sent = race(
        pair, end_locks_its_endpoint, send_on_both, then=lambda tx: tx.end_conversation(t)
    )
    assert ended is None, ended
    assert isinstance(sent, ConversationEnded), sent
    assert _state(pair, t) == "CD"
    pair.run_due()  # the EndDialog that waited for the initiator's endpoint
    assert _state(pair, h) == "CD"
    assert pair.transmission_queue() == []
    assert pair.check() == []


def test_a_send_that_waited_does_not_overtake_a_message_in_the_transmission_queue(
    pair: Broker,
) -> None:
    h, _ = open_order(pair)
    pair.alter_queue(SUPPLIER_QUEUE, status=False)

    def waits_for_the_queue(tx: Transaction) -> None:
        tx.send(h, ORDER, {"order": "A"})  # the queue is off: it waits in the transmission queue
        pair.alter_queue(SUPPLIER_QUEUE, status=True)  # on again, before "B" is sent

    first, second = race(pair, waits_for_the_queue, lambda tx: tx.send(h, ORDER, {"order": "B"}))
    assert first is None and second is None, (first, second)
    with pair.transaction() as tx:
        early = [m.json() for m in tx.receive(SUPPLIER_QUEUE)]
    assert early in ([], [{"order": "A"}], [{"order": "A"}, {"order": "B"}]), early
    try:
        clock.advance(60)
        pair.run_due()
    finally:
        clock.reset()
    with pair.transaction() as tx:
        late = [m.json() for m in tx.receive(SUPPLIER_QUEUE)]
    assert early + late == [{"order": "A"}, {"order": "B"}]


@pytest.mark.parametrize("remover_first", [True, False], ids=["cleanup-first", "delivery-first"])
def test_delivery_racing_cleanup_of_its_target_leaves_no_orphan(
    make_pg_database: Callable[..., str], remover_first: bool
) -> None:
    """The inbound accept locks the receiving endpoints FOR UPDATE before it writes (rule 1):
    a cleanup of the target in the receiving database either waits for it or goes first, and
    the message is then removed with its endpoint or answered with an Error."""
    net = connect_all({"a": make_pg_database(), "b": make_pg_database()})
    try:
        two_way(net)
        (h,) = send_dialogs(net["a"], [1])
        deliver_until_empty(net["a"])
        with net["b"].transaction() as tx:
            (m,) = tx.receive(TARGET_QUEUE)
        t = m.conversation_handle
        send_more(net["a"], [h], 1, 2)

        def cleanup(tx: Transaction) -> None:
            tx.end_conversation(t, cleanup=True)

        def deliver(_: Transaction) -> object:
            return net["a"].deliver(retry_now=True)

        if remover_first:
            first, second = race(net["b"], cleanup, deliver)
        else:
            # The delivery's transaction in b holds the endpoint; the cleanup waits for it.
            first, second = race(net["b"], lambda tx: tx.receive(TARGET_QUEUE), cleanup)
            deliver(None)  # type: ignore[arg-type]
        assert not isinstance(first, Exception) and not isinstance(second, Exception)
        deliver_until_empty(net["a"], retry_now=True)
        deliver_until_empty(net["b"], retry_now=True)
        assert orphans(net["b"]) == [] and orphans(net["a"]) == []
        assert net["b"].check() == [] and net["a"].check() == []
        assert net["a"].transmission_queue() == []
    finally:
        net.close()
