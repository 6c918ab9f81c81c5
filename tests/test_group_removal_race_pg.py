"""Conversation groups on PostgreSQL, where no foreign key ties an endpoint to its group
(migration 0021): the purge removes a group only when it is empty under the group's own lock,
and a transaction putting a new endpoint into an existing group (BEGIN DIALOG related to it,
MOVE CONVERSATION into it) locks it first, so that no endpoint is ever left without its group.

Each race is played on two connections (``races.race``): one step stays open while the other
runs in a thread; each case runs in both orders. Without the locks, the purge removes the group
under the new endpoint: ``Broker.check()`` then finds an endpoint without its group, which
RECEIVE cannot lock.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from helpers import BUYER, BUYER_QUEUE, CONTRACT, SUPPLIER, begin, declare_pair, open_order
from races import Step, race
from sqlalchemy import select, text

from airflow_broker import Broker
from airflow_broker.errors import UnknownObject
from airflow_broker.messaging.duework import DueWork
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow

pytestmark = pytest.mark.postgres


@pytest.fixture
def pair(pg_broker: Broker) -> Broker:
    declare_pair(pg_broker)
    return pg_broker


def _empty_group(broker: Broker) -> uuid.UUID:
    """A conversation group on the buyer's queue that its only conversation moved out of; and
    one closed dialog past its retention, so that the purge has endpoints to remove and then
    looks for empty groups."""
    h, target = open_order(broker)
    with broker.transaction() as tx:
        tx.end_conversation(target)
    with broker.transaction() as tx:
        tx.receive(BUYER_QUEUE)
        tx.end_conversation(h)
    with broker.engine.begin() as conn:
        conn.execute(
            text("UPDATE broker_conversation_endpoint SET closed_at = closed_at - interval '1 day'")
        )
    stays = begin(broker)
    moved = begin(broker)
    with broker.transaction() as tx:
        group = tx.conversation(moved).conversation_group_id
        tx.move_conversation(moved, tx.conversation(stays).conversation_group_id)
    return group


def _purge(broker: Broker) -> Step:
    return lambda tx: DueWork(broker, tx.connection).purge_closed(utcnow(), timedelta(0))


def _group_exists(broker: Broker, group: uuid.UUID) -> bool:
    g = s.conversation_group
    with broker.engine.connect() as conn:
        found = conn.execute(
            select(g.c.conversation_group_id).where(g.c.conversation_group_id == group)
        )
        return found.first() is not None


def _begin_in(group: uuid.UUID) -> Step:
    return lambda tx: tx.begin_dialog(BUYER, SUPPLIER, CONTRACT, related_conversation_group=group)


def _move(handle: uuid.UUID, group: uuid.UUID) -> Step:
    return lambda tx: tx.move_conversation(handle, group)


def _no_endpoint_without_group(broker: Broker) -> None:
    assert [p for p in broker.check() if p.kind == "endpoint_without_group"] == []


def test_the_purge_keeps_a_group_a_new_dialog_is_joining(pair: Broker) -> None:
    group = _empty_group(pair)
    handle, purged = race(pair, _begin_in(group), _purge(pair))
    assert isinstance(handle, uuid.UUID), handle
    assert purged == 2  # the closed dialog's two endpoints; the group was skipped, held
    assert _group_exists(pair, group)
    with pair.transaction() as tx:
        assert tx.conversation(handle).conversation_group_id == group
    _no_endpoint_without_group(pair)
    assert pair.run_due().endpoints_purged == 0
    assert _group_exists(pair, group)  # no longer empty


def test_a_dialog_joining_a_group_the_purge_removes_starts_it_again(pair: Broker) -> None:
    group = _empty_group(pair)
    purged, handle = race(pair, _purge(pair), _begin_in(group))
    assert purged == 2
    assert isinstance(handle, uuid.UUID), handle
    assert _group_exists(pair, group)
    with pair.transaction() as tx:
        assert tx.conversation(handle).conversation_group_id == group
    _no_endpoint_without_group(pair)


def test_a_move_into_a_group_the_purge_removes_fails_and_names_it(pair: Broker) -> None:
    group = _empty_group(pair)
    mover = begin(pair)
    purged, moved = race(pair, _purge(pair), _move(mover, group))
    assert purged == 2
    assert isinstance(moved, UnknownObject) and str(group) in str(moved)
    assert not _group_exists(pair, group)
    _no_endpoint_without_group(pair)


def test_a_move_into_a_group_holds_it_against_the_purge(pair: Broker) -> None:
    group = _empty_group(pair)
    mover = begin(pair)
    moved, purged = race(pair, _move(mover, group), _purge(pair))
    assert moved is None and purged == 2
    assert _group_exists(pair, group)
    with pair.transaction() as tx:
        assert tx.conversation(mover).conversation_group_id == group
    _no_endpoint_without_group(pair)
