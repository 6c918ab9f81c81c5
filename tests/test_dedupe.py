"""Idempotent SEND, BEGIN DIALOG and END CONVERSATION: ``dedupe_key`` (both engines, and two
PostgreSQL connections for the concurrent case).

A second call with a key already used (on the same conversation; for BEGIN DIALOG, by the same
initiating service) does nothing and returns what the first returned. The key is claimed inside
the caller's transaction: a rollback frees it, a concurrent claim waits for the first to end.
"""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
from helpers import (
    BUYER,
    CONTRACT,
    NOTE,
    ORDER,
    SUPPLIER,
    begin,
    declare_pair,
    open_order,
)
from races import _pid, _wait_until_blocked
from sqlalchemy import func, select

from airflow_broker import (
    Broker,
    ContractViolation,
    ConversationEnded,
    InvalidDefinition,
    UnknownObject,
)
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow


@pytest.fixture
def pair(broker: Broker) -> Broker:
    declare_pair(broker)
    return broker


def _count(broker: Broker, table: Any, *where: Any) -> int:
    with broker.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table).where(*where)).scalar_one())


def _send(broker: Broker, handles: Any, body: Any, key: str | None) -> None:
    with broker.transaction() as tx:
        tx.send(handles, NOTE, body, dedupe_key=key)


def _notes(broker: Broker) -> dict[uuid.UUID, list[str]]:
    """The notes in the queues, by the conversation (endpoint) they arrived on, in order."""
    m = s.message
    out: dict[uuid.UUID, list[str]] = {}
    with broker.engine.connect() as conn:
        for handle, body in conn.execute(
            select(m.c.conversation_handle, m.c.message_body)
            .where(m.c.message_type_name == NOTE)
            .order_by(m.c.message_sequence_number)
        ):
            out.setdefault(handle, []).append(bytes(body).decode())
    return out


def _bodies(broker: Broker) -> list[str]:
    with broker.engine.connect() as conn:
        rows = conn.execute(
            select(s.message.c.message_body).where(s.message.c.message_type_name == NOTE)
        ).scalars()
        return sorted(bytes(b).decode() for b in rows)


# --------------------------------------------------------------------------------------------
# SEND


def test_send_twice_with_one_key_sends_once(pair: Broker) -> None:
    h, _ = open_order(pair)
    _send(pair, h, "once", "k1")
    _send(pair, h, "once", "k1")
    with pair.transaction() as tx:  # again, in one transaction
        tx.send(h, NOTE, "twice", dedupe_key="k2")
        tx.send(h, NOTE, "twice", dedupe_key="k2")
    assert _bodies(pair) == ["once", "twice"]
    with pair.transaction() as tx:
        assert tx.conversation(h).send_sequence == 3  # the order, then one note per key


def test_different_keys_and_no_key_each_send(pair: Broker) -> None:
    h, _ = open_order(pair)
    _send(pair, h, "a", "k1")
    _send(pair, h, "b", "k2")
    _send(pair, h, "c", None)
    _send(pair, h, "c", None)
    assert _bodies(pair) == ["a", "b", "c", "c"]
    assert _count(pair, s.dedupe) == 2


def test_one_key_on_two_conversations_sends_on_each(pair: Broker) -> None:
    h1, _ = open_order(pair)
    h2, _ = open_order(pair)
    _send(pair, h1, "one", "same")
    _send(pair, h2, "two", "same")
    assert _bodies(pair) == ["one", "two"]


def test_a_list_send_skips_only_the_conversations_already_keyed(pair: Broker) -> None:
    (h1, t1), (h2, t2), (h3, t3) = (open_order(pair) for _ in range(3))
    _send(pair, h2, "first", "batch")
    _send(pair, [h1, h2, h3], "all", "batch")
    assert _notes(pair) == {t1: ["all"], t2: ["first"], t3: ["all"]}
    # Every conversation keyed now: nothing more goes.
    _send(pair, [h3, h1, h2], "again", "batch")
    assert _notes(pair) == {t1: ["all"], t2: ["first"], t3: ["all"]}
    with pair.transaction() as tx:
        assert [tx.conversation(h).send_sequence for h in (h1, h2, h3)] == [2, 2, 2]


def test_rollback_frees_the_key(pair: Broker) -> None:
    h, _ = open_order(pair)
    with pytest.raises(RuntimeError), pair.transaction() as tx:
        tx.send(h, NOTE, "lost", dedupe_key="k")
        raise RuntimeError("the task failed before its commit")
    assert _count(pair, s.dedupe) == 0
    _send(pair, h, "retried", "k")
    assert _bodies(pair) == ["retried"]


def test_a_failed_send_gives_its_key_back(pair: Broker) -> None:
    """A caller that catches the error and commits anyway has not recorded a SEND that did not
    happen: a later SEND with the key goes."""
    _, t = open_order(pair)
    with pair.transaction() as tx, pytest.raises(ContractViolation):
        tx.send(t, ORDER, {"order": 2}, dedupe_key="k")  # the initiator's message type
    assert _count(pair, s.dedupe) == 0
    _send(pair, t, "after", "k")
    assert _bodies(pair) == ["after"]


def test_send_key_is_checked(pair: Broker) -> None:
    h, _ = open_order(pair)
    with pair.transaction() as tx:
        with pytest.raises(InvalidDefinition, match="dedupe_key must be a string, not int 7"):
            tx.send(h, NOTE, "x", dedupe_key=7)  # type: ignore[arg-type]
        with pytest.raises(InvalidDefinition, match="dedupe_key must not be empty"):
            tx.send(h, NOTE, "x", dedupe_key="")
        with pytest.raises(InvalidDefinition, match="is 513 characters long; at most 512"):
            tx.send(h, NOTE, "x", dedupe_key="k" * 513)
        tx.send(h, NOTE, "x", dedupe_key="k" * 512)
    assert _bodies(pair) == ["x"]


# --------------------------------------------------------------------------------------------
# BEGIN DIALOG


def test_begin_twice_with_one_key_returns_the_first_handle(pair: Broker) -> None:
    first = begin(pair, dedupe_key="order-1001")
    again = begin(pair, dedupe_key="order-1001")
    assert again == first
    with pair.transaction() as tx:  # in one transaction too
        assert tx.begin_dialog(BUYER, SUPPLIER, CONTRACT, dedupe_key="order-1001") == first
    assert _count(pair, s.conversation_endpoint) == 1
    other = begin(pair, dedupe_key="order-1002")
    assert other != first
    assert begin(pair) not in (first, other)
    assert _count(pair, s.conversation_endpoint) == 3


def test_begin_keys_are_per_initiating_service(pair: Broker) -> None:
    first = begin(pair, dedupe_key="k")
    with pair.transaction() as tx:  # the supplier may begin dialogs too (DEFAULT contract)
        other = tx.begin_dialog(SUPPLIER, BUYER, dedupe_key="k")
    assert other != first
    with pair.transaction() as tx:
        assert tx.conversation(other).service_name == SUPPLIER


def test_begin_rolled_back_frees_its_key(pair: Broker) -> None:
    with pytest.raises(RuntimeError), pair.transaction() as tx:
        lost = tx.begin_dialog(BUYER, SUPPLIER, CONTRACT, dedupe_key="k")
        raise RuntimeError("failed before the commit")
    kept = begin(pair, dedupe_key="k")
    assert kept != lost
    assert begin(pair, dedupe_key="k") == kept


def test_begin_key_is_checked_before_anything_is_written(pair: Broker) -> None:
    with pair.transaction() as tx, pytest.raises(InvalidDefinition, match="dedupe_key"):
        tx.begin_dialog(BUYER, SUPPLIER, CONTRACT, dedupe_key="x" * 600)
    assert _count(pair, s.conversation_endpoint) == 0
    assert _count(pair, s.dedupe) == 0


# --------------------------------------------------------------------------------------------
# END CONVERSATION


def test_end_twice_with_one_key_ends_once(pair: Broker) -> None:
    _h, t = open_order(pair)
    with pair.transaction() as tx:
        tx.end_conversation(t, dedupe_key="end")
    with pair.transaction() as tx:
        tx.end_conversation(t, dedupe_key="end")  # no ConversationEnded
        assert tx.conversation(t).state == "DO"  # waits for the buyer's END, as after one END
    with pair.transaction() as tx, pytest.raises(ConversationEnded):
        tx.end_conversation(t)  # without the key, the error as before
    with pair.transaction() as tx, pytest.raises(ConversationEnded):
        tx.end_conversation(t, dedupe_key="another")
    assert _count(pair, s.dedupe) == 1  # the failed END gave its key back


def test_end_with_cleanup_twice_with_one_key(pair: Broker) -> None:
    h, _ = open_order(pair)
    for _ in range(2):
        with pair.transaction() as tx:
            tx.end_conversation(h, cleanup=True, dedupe_key="gone")
    with pair.transaction() as tx, pytest.raises(UnknownObject):
        tx.end_conversation(h, cleanup=True, dedupe_key="other")


def test_end_key_is_checked(pair: Broker) -> None:
    h, _ = open_order(pair)
    with pair.transaction() as tx, pytest.raises(InvalidDefinition, match="dedupe_key"):
        tx.end_conversation(h, dedupe_key=b"bytes")  # type: ignore[arg-type]
    with pair.transaction() as tx:
        assert tx.conversation(h).state == "CO"


# --------------------------------------------------------------------------------------------
# housekeeping


def test_housekeeping_removes_the_keys_of_purged_endpoints(pair: Broker) -> None:
    h, t = open_order(pair)
    live = begin(pair, dedupe_key="live")
    _send(pair, live, "x", "live-send")
    _send(pair, h, "x", "s")
    with pair.transaction() as tx:
        tx.end_conversation(t, dedupe_key="e")
    with pair.transaction() as tx:
        tx.end_conversation(h, dedupe_key="e")
    assert _count(pair, s.dedupe) == 5
    # Closed, but not yet past their retention: the endpoints and their keys stay.
    assert pair.purge(now=utcnow()).dedupe_keys == 0
    report = pair.purge(now=utcnow() + timedelta(hours=1))
    assert report.endpoints == 2 and report.dedupe_keys == 3
    d = s.dedupe
    with pair.engine.connect() as conn:
        left = set(conn.execute(select(d.c.dedupe_key, d.c.conversation_handle)))
    assert left == {("live", live), ("live-send", live)}
    # The BEGIN key of a purged conversation is gone with it: a BEGIN with it begins anew.
    assert begin(pair, dedupe_key="live") == live


def test_housekeeping_keeps_a_cleaned_up_conversations_key_for_a_while(pair: Broker) -> None:
    h, _ = open_order(pair)
    with pair.transaction() as tx:
        tx.end_conversation(h, cleanup=True, dedupe_key="gone")
    assert pair.purge(now=utcnow()).dedupe_keys == 0
    assert pair.purge(now=utcnow() + timedelta(hours=1)).dedupe_keys == 1
    assert _count(pair, s.dedupe) == 0


# --------------------------------------------------------------------------------------------
# two transactions at once (PostgreSQL)


def _second_waits(pair: Broker, second: Any, first_commits: bool) -> tuple[bool, Any]:
    """Transaction one SENDs with key "k" and stays open; transaction two runs ``second`` in a
    thread. Returns whether two waited for a lock, and what it returned or raised."""
    h, _ = open_order(pair)
    outcome: dict[str, Any] = {}
    pid: list[int] = []
    started = threading.Event()

    def run() -> None:
        try:
            with pair.transaction() as tx:
                pid.append(_pid(tx))
                started.set()
                outcome["second"] = second(tx, h)
        except Exception as exc:
            outcome["second"] = exc
        finally:
            started.set()

    tx = pair.transaction()
    tx.send(h, NOTE, "first", dedupe_key="k")
    thread = threading.Thread(target=run)
    thread.start()
    started.wait(10)
    blocked = _wait_until_blocked(pair, pid[0])
    still_waiting = thread.is_alive()
    if first_commits:
        tx.commit()
    else:
        tx.rollback()
    thread.join(30)
    assert not thread.is_alive()
    return blocked and still_waiting, outcome.get("second")


@pytest.mark.postgres
def test_concurrent_same_key_sends_once(pg_broker: Broker) -> None:
    declare_pair(pg_broker)
    waited, result = _second_waits(
        pg_broker, lambda tx, h: tx.send(h, NOTE, "second", dedupe_key="k"), first_commits=True
    )
    assert waited and result is None
    assert _bodies(pg_broker) == ["first"]


@pytest.mark.postgres
def test_concurrent_same_key_sends_when_the_first_rolls_back(pg_broker: Broker) -> None:
    declare_pair(pg_broker)
    waited, result = _second_waits(
        pg_broker, lambda tx, h: tx.send(h, NOTE, "second", dedupe_key="k"), first_commits=False
    )
    assert waited and result is None
    assert _bodies(pg_broker) == ["second"]


@pytest.mark.postgres
def test_concurrent_same_key_begins_once(pg_broker: Broker) -> None:
    declare_pair(pg_broker)
    results: list[Any] = []
    gate = threading.Barrier(2)

    tx1 = pg_broker.transaction()
    first = tx1.begin_dialog(BUYER, SUPPLIER, CONTRACT, dedupe_key="b")

    def run() -> None:
        with pg_broker.transaction() as tx:
            results.append(_pid(tx))
            gate.wait(10)
            results.append(tx.begin_dialog(BUYER, SUPPLIER, CONTRACT, dedupe_key="b"))

    thread = threading.Thread(target=run)
    thread.start()
    gate.wait(10)
    assert _wait_until_blocked(pg_broker, results[0])  # on the key's unique index entry
    tx1.commit()
    thread.join(30)
    assert results[1] == first
    assert _count(pg_broker, s.conversation_endpoint) == 1


def test_unknown_handle_with_a_key_names_it(pair: Broker) -> None:
    missing = uuid.uuid4()
    with pair.transaction() as tx, pytest.raises(UnknownObject, match=str(missing)):
        tx.send(missing, NOTE, "x", dedupe_key="k")
    assert _count(pair, s.dedupe) == 0
    assert _bodies(pair) == []
