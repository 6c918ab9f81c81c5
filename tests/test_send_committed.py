"""Broker.send: a SEND in a transaction of its own, committed when it returns.

On PostgreSQL the COMMIT travels in the SEND's own query when the fast path takes every
conversation; otherwise (and on SQLite) it is a SEND and a COMMIT. Either way a SEND on several
conversations reaches all of them or none, and an error leaves nothing behind.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import (
    BUYER_QUEUE,
    INVOICE,
    NOTE,
    ORDER,
    SUPPLIER_QUEUE,
    begin,
    bodies,
    declare_pair,
)
from sqlalchemy import text

from airflow_broker import Broker, ContractViolation, ConversationEnded, MessageValidationError
from airflow_broker.storage import direct


def supplier_bodies(broker: Broker) -> list[Any]:
    with broker.transaction() as tx:
        return bodies(m for m in tx.receive(SUPPLIER_QUEUE) if m.message_type_name == NOTE)


def message_count(broker: Broker) -> int:
    with broker.engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM broker_message")).scalar_one())


@pytest.fixture
def paired(broker: Broker) -> Broker:
    declare_pair(broker)
    return broker


def test_send_commits_on_its_own(paired: Broker) -> None:
    broker = paired
    h1, h2 = begin(broker), begin(broker)
    broker.send(h1, NOTE, b"one")
    broker.send([h1, h2], NOTE, b"both")
    seen = supplier_bodies(broker) + supplier_bodies(broker)  # two groups
    assert sorted(seen) == [b"both", b"both", b"one"]
    # The sender's sequence numbers went up, as a transactional SEND's do.
    with broker.transaction() as tx:
        assert tx.conversation(h1).send_sequence == 2


def test_send_on_several_reaches_all_or_none(paired: Broker) -> None:
    broker = paired
    h1, h2 = begin(broker), begin(broker)
    with broker.transaction() as tx:
        tx.end_conversation(h2)  # the initiator ended h2: nothing more can be sent on it
    before = message_count(broker)
    with pytest.raises(ConversationEnded):
        broker.send([h1, h2], NOTE, b"x")
    assert message_count(broker) == before
    broker.send(h1, NOTE, b"after")  # the broker is fine afterwards
    assert message_count(broker) == before + 1


def test_errors_name_the_problem_and_leave_nothing(paired: Broker) -> None:
    broker = paired
    h = begin(broker)
    with pytest.raises(MessageValidationError):
        broker.send(h, ORDER, b"not json")
    with pytest.raises(ContractViolation):
        broker.send(h, INVOICE, {"total": 1})  # the target's message type, not ours
    assert message_count(broker) == 0


def test_a_conversation_off_the_fast_path_goes_the_usual_way(broker: Broker) -> None:
    """The sender keeps retained copies of what it sends: not on the fast path, so the SEND
    runs the usual way (and its COMMIT after it), with the same outcome."""
    declare_pair(broker, buyer_retention=True)
    h1, h2 = begin(broker), begin(broker)
    broker.send([h1, h2], NOTE, b"kept")
    assert sorted(supplier_bodies(broker) + supplier_bodies(broker)) == [b"kept", b"kept"]
    with broker.engine.connect() as conn:
        retained = conn.execute(text("SELECT count(*) FROM broker_message WHERE status = 3"))
        assert retained.scalar_one() == 2


@pytest.mark.postgres
def test_postgres_sends_the_commit_in_the_send_query(
    pg_broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    declare_pair(pg_broker)
    h1, h2 = begin(pg_broker), begin(pg_broker)
    # A dialog's first message creates the far endpoint: that SEND goes the usual way.
    with pg_broker.transaction() as tx:
        tx.send([h1, h2], NOTE, b"first")
    sent: list[bytes] = []
    monkeypatch.setattr(direct, "observer", lambda query, _seconds: sent.append(query))
    pg_broker.send(h1, NOTE, b"a")
    pg_broker.send([h1, h2], NOTE, b"b")
    assert len(sent) == 2, sent  # one query each
    for q in sent:
        # PREPARE; BEGIN; EXECUTE; COMMIT the first time on a direct connection; behind a
        # pooler one unnamed statement the server commits (the extended protocol's Sync).
        committing = b";BEGIN;EXECUTE " in q or q.startswith(b"BEGIN;")
        assert (committing and q.endswith(b";COMMIT")) or q.endswith(b" autocommit)"), q
    monkeypatch.setattr(direct, "observer", None)
    got = supplier_bodies(pg_broker) + supplier_bodies(pg_broker)
    assert sorted(got) == [b"a", b"b", b"b", b"first", b"first"]


def test_the_other_side_can_answer_with_send(paired: Broker) -> None:
    broker = paired
    h = begin(broker)
    broker.send(h, ORDER, {"sku": "x"})
    with broker.transaction() as tx:
        [order] = tx.receive(SUPPLIER_QUEUE)
    broker.send(order.conversation_handle, INVOICE, {"total": 3})
    with broker.transaction() as tx:
        got = [m for m in tx.receive(BUYER_QUEUE) if m.message_type_name == INVOICE]
    assert [m.json() for m in got] == [{"total": 3}]
