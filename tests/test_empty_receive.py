"""An empty RECEIVE: what it answers, and on PostgreSQL what it costs.

A claim that takes nothing says, in the same answer, whether there is more to know (the probe
row of ``storage.queries``): the queue is disabled or gone, or the claim locked a group whose
messages were already taken. Otherwise the queue is enabled with nothing free, and RECEIVE
returns at once: one round trip, with no question after it. Both engines answer the same.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from helpers import NOTE, SUPPLIER, SUPPLIER_QUEUE, begin, bodies, declare_pair, send
from sqlalchemy import text

from airflow_broker import Broker, QueueDisabled, UnknownObject
from airflow_broker.messaging.tx_core import TransactionCore
from airflow_broker.storage import direct, queries


@pytest.fixture
def paired(broker: Broker) -> Broker:
    declare_pair(broker)
    return broker


def test_an_empty_queue_answers_nothing(paired: Broker) -> None:
    with paired.transaction() as tx:
        assert tx.receive(SUPPLIER_QUEUE) == []
        assert tx.receive(SUPPLIER_QUEUE, top=5, wait_seconds=0.2) == []


def test_a_disabled_queue_still_raises(paired: Broker) -> None:
    h = begin(paired)
    send(paired, h, NOTE, b"a1")
    paired.alter_queue(SUPPLIER_QUEUE, status=False)
    with paired.transaction() as tx, pytest.raises(QueueDisabled, match=SUPPLIER_QUEUE):
        tx.receive(SUPPLIER_QUEUE)
    with paired.transaction() as tx, pytest.raises(QueueDisabled, match=SUPPLIER_QUEUE):
        tx.receive(SUPPLIER_QUEUE, wait_seconds=0.2)  # disabled and empty alike
    paired.alter_queue(SUPPLIER_QUEUE, status=True)
    with paired.transaction() as tx:
        assert bodies(tx.receive(SUPPLIER_QUEUE)) == [b"a1"]


def test_a_queue_dropped_under_a_reader_is_named(paired: Broker) -> None:
    with paired.transaction() as tx:
        assert tx.receive(SUPPLIER_QUEUE) == []  # the queue is known to this broker now
    other = Broker.connect(str(paired.engine.url.render_as_string(hide_password=False)))
    try:  # dropped by another process: this broker's definitions still know it
        other.drop_service(SUPPLIER)
        other.drop_queue(SUPPLIER_QUEUE)
    finally:
        other.dispose()
    with paired.transaction() as tx, pytest.raises(UnknownObject, match=SUPPLIER_QUEUE):
        tx.receive(SUPPLIER_QUEUE)


def test_the_reader_loop_ends_on_a_disabled_queue_with_the_commit_kept(paired: Broker) -> None:
    h = begin(paired)
    send(paired, h, NOTE, b"a1", b"a2")
    tx = paired.transaction()
    assert bodies(tx.receive(SUPPLIER_QUEUE, top=1)) == [b"a1"]
    tx.connection.execute(text("UPDATE broker_queue SET status = false"))  # poison handling
    with pytest.raises(QueueDisabled):
        tx.commit_and_receive(SUPPLIER_QUEUE, top=1)
    assert tx.ended


def test_negative_waits_are_refused_before_anything_commits(paired: Broker) -> None:
    h = begin(paired)
    send(paired, h, NOTE, b"a1")
    tx = paired.transaction()
    assert bodies(tx.receive(SUPPLIER_QUEUE)) == [b"a1"]
    with pytest.raises(Exception, match="wait_seconds must be >= 0"):
        tx.commit_and_receive(SUPPLIER_QUEUE, wait_seconds=-1)
    assert not tx.ended
    tx.rollback()
    with paired.transaction() as again:
        assert bodies(again.receive(SUPPLIER_QUEUE)) == [b"a1"]


# -- PostgreSQL: the cost -------------------------------------------------------------------------
@pytest.fixture
def counted(pg_broker: Broker, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """The broker's direct queries, and its questions whether a queue is disabled."""
    declare_pair(pg_broker)
    seen: dict[str, list[Any]] = {"queries": [], "disabled_checks": []}
    monkeypatch.setattr(direct, "observer", lambda query, _s: seen["queries"].append(query))
    real = TransactionCore._raise_if_disabled

    def check(self: TransactionCore, q: Any) -> None:
        seen["disabled_checks"].append(q.name)
        real(self, q)

    monkeypatch.setattr(TransactionCore, "_raise_if_disabled", check)
    return seen


def _claims(queries_sent: list[bytes]) -> list[bytes]:
    """The claims among the direct path's queries: prepared (``EXECUTE broker_...``), or
    written whole behind a pooler (``BROKER_TEST_VIA_PGBOUNCER``)."""
    return [
        q
        for q in queries_sent
        if b"EXECUTE broker_" in q or (b"FROM broker_message" in q and b"grp" in q)
    ]


@pytest.mark.postgres
def test_postgres_an_empty_receive_is_one_claim_and_nothing_else(
    pg_broker: Broker, counted: dict[str, list[Any]]
) -> None:
    with pg_broker.transaction() as tx:
        assert tx.receive(SUPPLIER_QUEUE, top=10) == []
    assert len(_claims(counted["queries"])) == 1
    assert counted["disabled_checks"] == []


@pytest.mark.postgres
def test_postgres_a_disabled_queue_is_told_by_the_claim(
    pg_broker: Broker, counted: dict[str, list[Any]]
) -> None:
    pg_broker.alter_queue(SUPPLIER_QUEUE, status=False)
    with pg_broker.transaction() as tx, pytest.raises(QueueDisabled):
        tx.receive(SUPPLIER_QUEUE)
    assert len(_claims(counted["queries"])) == 1
    assert counted["disabled_checks"] == [SUPPLIER_QUEUE]


@pytest.mark.postgres
def test_postgres_the_reader_loop_ends_on_its_pipelined_claim(
    pg_broker: Broker, counted: dict[str, list[Any]]
) -> None:
    """The claim sent with the last COMMIT finds the queue empty: that is the answer, with no
    claim after it."""
    h = begin(pg_broker)
    send(pg_broker, h, NOTE, b"a1")
    counted["queries"].clear()
    tx = pg_broker.transaction()
    assert bodies(tx.receive(SUPPLIER_QUEUE)) == [b"a1"]
    nxt, more = tx.commit_and_receive(SUPPLIER_QUEUE)
    assert more == []
    nxt.commit()
    claims = _claims(counted["queries"])
    # The first transaction's lease row goes with its COMMIT, in the same query.
    committed = re.match(
        rb"DELETE FROM broker_receive_lease WHERE lease_key IN \(\d+\);", claims[1]
    )
    assert len(claims) == 2 and committed is not None
    assert claims[1][committed.end() :].startswith(b"COMMIT;BEGIN;")
    assert counted["disabled_checks"] == []


@pytest.mark.postgres
def test_postgres_a_locked_group_that_held_nothing_is_claimed_again(
    pg_broker: Broker, counted: dict[str, list[Any]]
) -> None:
    """A claim that locks a group and takes nothing from it (here: the group's only ready
    message is marked by a lease it was moved away from, which no claim takes) answers with the
    probe row; RECEIVE asks whether the queue is disabled and claims again, a bounded number of
    times, then answers nothing. (Between readers this is the claim whose snapshot still saw a
    message another reader had just taken; a new claim takes the next free group.)"""
    h = begin(pg_broker)
    send(pg_broker, h, NOTE, b"a1")
    with pg_broker.engine.begin() as conn:
        conn.execute(text("UPDATE broker_message SET lease_token = gen_random_uuid()"))
    counted["queries"].clear()
    with pg_broker.transaction() as tx:
        assert tx.receive(SUPPLIER_QUEUE) == []
    assert len(_claims(counted["queries"])) == queries.CLAIM_ATTEMPTS
    assert counted["disabled_checks"] == [SUPPLIER_QUEUE]
