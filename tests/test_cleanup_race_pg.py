"""The lock order that ties every message to its endpoint, held by each writer against END
CONVERSATION WITH CLEANUP (and MOVE) on PostgreSQL.

Each race is played deterministically on two connections: one transaction takes its step and
stays open, the other starts its conflicting step in a thread, the test waits until PostgreSQL
shows that thread waiting for a lock (or a short while, if nothing makes it wait), then the first
commits. Without the lock order nothing waits: the message is written after the cleanup removed
the endpoint and stays behind, an orphan that RECEIVE hands out and ``tx.conversation()`` cannot
find. Each case runs in both orders (the writer first, the remover first), and a threaded run of
many rounds checks the same with real timing.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from helpers import (
    BUYER,
    CONTRACT,
    NOTE,
    ORDER,
    SUPPLIER,
    SUPPLIER_QUEUE,
    declare_pair,
    open_order,
)
from races import Step, orphans, race
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from airflow_broker import Broker, Transaction
from airflow_broker.errors import BrokerError
from airflow_broker.messaging.definitions import Definitions
from airflow_broker.storage.endpoint_locks import ADVISORY_BUDGET

pytestmark = pytest.mark.postgres


@pytest.fixture
def pair(pg_broker: Broker) -> Broker:
    declare_pair(pg_broker)
    return pg_broker


def _cleanup(handle: uuid.UUID) -> Step:
    return lambda tx: tx.end_conversation(handle, cleanup=True)


def _assert_consistent(pair: Broker) -> None:
    assert orphans(pair) == []
    assert [p for p in pair.check() if p.kind.startswith("message")] == []


# ---------------------------------------------------------------------------------------------
# Each writer of a target's messages against its cleanup, in both orders
# ---------------------------------------------------------------------------------------------


def _send_one(h: uuid.UUID, *_: uuid.UUID) -> Step:
    """SEND on one conversation: the one-statement fast path."""
    return lambda tx: tx.send(h, NOTE, "racing the cleanup")


def _send_many(h: uuid.UUID, h2: uuid.UUID) -> Step:
    """SEND on several conversations at once: the set-based fast path."""
    return lambda tx: tx.send([h, h2], NOTE, "racing the cleanup")


def _send_general(h: uuid.UUID, *_: uuid.UUID) -> Step:
    """SEND of a message type the fast path leaves to the general path (it validates JSON in
    Python first, then routes through Delivery)."""
    return lambda tx: tx.send(h, ORDER, {"order": 2})


def _end_plain(h: uuid.UUID, *_: uuid.UUID) -> Step:
    """END CONVERSATION: the broker's own EndDialog into the far queue."""
    return lambda tx: tx.end_conversation(h)


def _end_with_error(h: uuid.UUID, *_: uuid.UUID) -> Step:
    """END CONVERSATION WITH ERROR: the broker's own Error into the far queue."""
    return lambda tx: tx.end_conversation(h, error_code=7, error_description="racing")


def _row_locked(step: Callable[..., Step]) -> Callable[..., Step]:
    """The same SEND past the transaction's budget of advisory locks: the fast path then locks
    the far endpoints' rows (FOR KEY SHARE) instead."""

    def make(h: uuid.UUID, h2: uuid.UUID) -> Step:
        send = step(h, h2)

        def run(tx: Transaction) -> Any:
            tx._advisory_locked = {uuid.uuid4() for _ in range(ADVISORY_BUDGET)}
            return send(tx)

        return run

    return make


WRITERS = {
    "send_one": _send_one,
    "send_many": _send_many,
    "send_one_row_locked": _row_locked(_send_one),
    "send_many_row_locked": _row_locked(_send_many),
    "send_general": _send_general,
    "end_plain": _end_plain,
    "end_with_error": _end_with_error,
}


@pytest.mark.parametrize("writer_first", [True, False], ids=["writer-first", "cleanup-first"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_writer_racing_cleanup_leaves_no_orphan(
    pair: Broker, writer: str, writer_first: bool
) -> None:
    h, target = open_order(pair)
    h2, _ = open_order(pair)
    write = WRITERS[writer](h, h2)
    if writer_first:
        _, cleaned = race(pair, write, _cleanup(target))
        assert cleaned is None  # the cleanup waited for the writer, then removed its message
    else:
        race(pair, _cleanup(target), write)
    _assert_consistent(pair)
    with pair.transaction() as tx:
        # whatever reached the supplier's queue belongs to a conversation that exists
        for m in tx.receive(SUPPLIER_QUEUE, top=100):
            assert m.conversation_handle != target
            tx.conversation(m.conversation_handle)


@pytest.mark.parametrize("writer_first", [True, False], ids=["writer-first", "drop-first"])
def test_a_send_racing_drop_service_leaves_no_orphan(pair: Broker, writer_first: bool) -> None:
    """DROP SERVICE removes its endpoints under the same lock order as a cleanup."""
    h, _ = open_order(pair)

    def drop(tx: Transaction) -> None:
        Definitions(pair, tx.connection).drop_service(SUPPLIER)  # inside the racing transaction

    if writer_first:
        race(pair, _send_one(h), drop)
    else:
        race(pair, drop, _send_one(h))
    _assert_consistent(pair)


def test_the_purge_skips_a_closed_endpoint_a_writer_holds(pair: Broker) -> None:
    """The purge of closed endpoints takes each FOR UPDATE SKIP LOCKED: one that a writer holds
    (KEY SHARE) waits for the next pass instead of being removed under the writer."""
    h, target = open_order(pair)
    with pair.transaction() as tx:
        tx.end_conversation(target)
    with pair.transaction() as tx:
        tx.receive("buyer_queue")
        tx.end_conversation(h)
    with pair.engine.begin() as conn:
        conn.execute(
            text("UPDATE broker_conversation_endpoint SET closed_at = closed_at - interval '1 day'")
        )
    with pair.engine.connect() as holder:
        holder.execute(
            text(
                "SELECT 1 FROM broker_conversation_endpoint WHERE conversation_handle = :h "
                "FOR KEY SHARE"
            ),
            {"h": target},
        )
        assert (
            pair.run_due().endpoints_purged == 1
        )  # the initiator's endpoint; the target's is held
        holder.rollback()
    assert pair.run_due().endpoints_purged == 1


def test_cleanup_first_then_send_reports_the_far_side_gone(pair: Broker) -> None:
    """Serialized after the cleanup, a SEND behaves as it does after any committed cleanup:
    the sender gets an Error back saying the far endpoint no longer exists."""
    h, target = open_order(pair)
    race(pair, _cleanup(target), _send_one(h))
    with pair.transaction() as tx:
        assert tx.conversation(h).state == "ER"
        (error,) = [m for m in tx.receive("buyer_queue") if m.error]
    assert "no longer exists" in error.error[1]  # type: ignore[index]


def test_send_first_then_cleanup_removes_the_message(pair: Broker) -> None:
    h, target = open_order(pair)
    race(pair, _send_one(h), _cleanup(target))
    with pair.transaction() as tx:
        assert tx.receive(SUPPLIER_QUEUE) == []


def test_a_move_racing_a_send_files_the_message_in_the_new_group(pair: Broker) -> None:
    """MOVE CONVERSATION takes the endpoint FOR UPDATE: a SEND into it waits, then writes into
    the group the endpoint is in now."""
    h, target = open_order(pair)
    _, other = open_order(pair)
    with pair.transaction() as tx:
        new_group = tx.conversation(other).conversation_group_id
    race(pair, lambda tx: tx.move_conversation(target, new_group), _send_one(h))
    assert [p for p in pair.check() if p.kind == "message_misfiled"] == []
    with pair.transaction() as tx:
        got = tx.receive(SUPPLIER_QUEUE, conversation_group=new_group)
    assert [m.text() for m in got] == ["racing the cleanup"]


def test_two_sides_sending_at_once_do_not_wait_for_each_other(pair: Broker) -> None:
    """The lock order keeps SEND's old promise: each side locks its own endpoint (NO KEY UPDATE)
    and the far one FOR KEY SHARE, which do not conflict, so the two directions of a dialog
    send at the same time."""
    h, target = open_order(pair)
    with pair.transaction() as tx:
        tx.send(h, NOTE, "from the buyer")
        done = threading.Event()

        def reply() -> None:
            with pair.transaction() as other:
                other.send(target, NOTE, "from the supplier")
            done.set()

        thread = threading.Thread(target=reply)
        thread.start()
        assert done.wait(5), "the supplier's SEND waited for the buyer's transaction"
    thread.join()


# ---------------------------------------------------------------------------------------------
# With real timing: many rounds of a sender looping while another connection cleans up
# ---------------------------------------------------------------------------------------------


def test_sending_in_a_loop_while_the_target_is_cleaned_up_leaves_no_orphan(pair: Broker) -> None:
    rounds = 40
    for _ in range(rounds):
        h, target = open_order(pair)
        stop = threading.Event()
        errors: list[BaseException] = []

        def sender(
            handle: uuid.UUID = h,
            stop: threading.Event = stop,
            errors: list[BaseException] = errors,
        ) -> None:
            while not stop.is_set():
                try:
                    with pair.transaction() as tx:
                        tx.send(handle, NOTE, "loop")
                except BrokerError:
                    return  # the conversation failed: the far side is gone
                except BaseException as exc:
                    errors.append(exc)
                    return

        thread = threading.Thread(target=sender)
        thread.start()
        time.sleep(0.01)
        with pair.transaction() as tx:
            tx.end_conversation(target, cleanup=True)
        time.sleep(0.01)
        stop.set()
        thread.join(10)
        assert errors == []
    _assert_consistent(pair)
    with pair.transaction() as tx:
        assert tx.receive(SUPPLIER_QUEUE) == []


def test_past_its_budget_a_transaction_locks_far_endpoints_by_row(pair: Broker) -> None:
    """PostgreSQL's lock table is shared by the whole server: a transaction that SENDs on more
    conversations than ADVISORY_BUDGET holds that many advisory locks at most, and locks the
    rest of the far endpoints' rows FOR KEY SHARE (a FOR UPDATE elsewhere must wait for those
    only); every message arrives."""
    count = ADVISORY_BUDGET + 5
    with pair.transaction() as tx:
        handles = [tx.begin_dialog(BUYER, SUPPLIER, CONTRACT) for _ in range(count)]
        tx.send(handles, NOTE, "first")  # the general path creates the target endpoints
    _drain_all(pair)
    far = text("SELECT far_handle FROM broker_conversation_endpoint WHERE conversation_handle = :h")

    def row_locked(conn: Any, h: uuid.UUID) -> bool:
        try:
            with conn.begin():
                conn.execute(text("SET LOCAL lock_timeout = '100ms'"))
                conn.execute(
                    text(
                        "SELECT 1 FROM broker_conversation_endpoint "
                        "WHERE conversation_handle = :f FOR UPDATE"
                    ),
                    {"f": conn.execute(far, {"h": h}).scalar_one()},
                )
            return False
        except OperationalError:
            return True

    with pair.transaction() as tx:
        for h in handles:
            tx.send(h, NOTE, "one by one")  # the fast path, one conversation at a time
        advisory = tx.connection.execute(
            text(
                "SELECT count(*) FROM pg_locks "
                "WHERE pid = pg_backend_pid() AND locktype = 'advisory'"
            )
        ).scalar_one()
        with pair.engine.connect() as other:
            locked = [row_locked(other, h) for h in (handles[0], handles[-1])]
    assert advisory == ADVISORY_BUDGET
    assert locked == [False, True]
    assert _drain_all(pair) == count


def _drain_all(pair: Broker) -> int:
    """RECEIVE from the supplier's queue until it is empty (one group at a time); how many."""
    taken = 0
    while True:
        with pair.transaction() as tx:
            got = tx.receive(SUPPLIER_QUEUE)
        if not got:
            return taken
        taken += len(got)
