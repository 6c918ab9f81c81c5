"""Alerts (airflow_broker.operations.alerts), on both engines: a queue disabled by poison
handling and transmissions that wait too long are raised once per episode, per watcher name;
the Airflow trigger that turns them into asset events is tested in test_e2e_alerts.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from helpers import NOTE, SUPPLIER, SUPPLIER_QUEUE, begin, declare_pair, poison, send

from airflow_broker import Broker, InvalidDefinition
from airflow_broker.operations import alerts
from airflow_broker.storage.clock import utcnow


@pytest.fixture
def pair(broker: Broker) -> Broker:
    declare_pair(broker)
    return broker


def test_a_queue_disabled_by_poison_handling_is_raised_once_per_episode(pair: Broker) -> None:
    assert alerts.raise_alerts(pair) == []
    poison(pair)
    (alert,) = alerts.raise_alerts(pair)
    assert (alert.kind, alert.object, alert.count) == ("queue_disabled", SUPPLIER_QUEUE, 1)
    assert "poison message handling" in alert.detail and SUPPLIER_QUEUE in alert.detail
    assert alert.payload()["object"] == SUPPLIER_QUEUE
    assert alerts.raise_alerts(pair) == []  # the same episode
    # Another watcher has its own memory.
    assert [a.object for a in alerts.raise_alerts(pair, watcher="pager")] == [SUPPLIER_QUEUE]
    # Re-enabled: the episode ends; disabled again: a new one.
    pair.alter_queue(SUPPLIER_QUEUE, status=True)
    assert alerts.raise_alerts(pair) == []
    poison(pair)
    assert [a.object for a in alerts.raise_alerts(pair)] == [SUPPLIER_QUEUE]


def test_a_queue_an_operator_disabled_is_not_an_alert(pair: Broker) -> None:
    pair.alter_queue(SUPPLIER_QUEUE, status=False)
    assert alerts.raise_alerts(pair) == []


def test_transmissions_waiting_too_long_are_raised_per_service(pair: Broker) -> None:
    pair.alter_queue(SUPPLIER_QUEUE, status=False)  # the supplier's messages wait to leave
    send(pair, begin(pair), NOTE, "a", "b")
    kinds = ("transmission_waiting",)
    assert alerts.raise_alerts(pair, kinds=kinds) == []  # not waiting long yet
    later = utcnow() + timedelta(minutes=20)
    (alert,) = alerts.raise_alerts(pair, kinds=kinds, now=later)
    assert (alert.kind, alert.object, alert.count) == ("transmission_waiting", SUPPLIER, 2)
    assert alert.oldest_age_seconds >= 20 * 60 - 5
    assert alert.reason is not None and "disabled" in alert.reason
    assert alerts.raise_alerts(pair, kinds=kinds, now=later) == []
    # A threshold of its own.
    assert len(alerts.raise_alerts(pair, kinds=kinds, watcher="x", waiting_threshold=timedelta(0)))
    # They leave: the episode ends.
    pair.alter_queue(SUPPLIER_QUEUE, status=True)
    pair.run_due()
    pair.deliver(retry_now=True)
    assert pair.transmission_queue() == []
    assert alerts.raise_alerts(pair, kinds=kinds, now=later) == []
    with pair.engine.connect() as conn:
        from sqlalchemy import func, select

        from airflow_broker.storage import schema as s

        left = conn.execute(
            select(func.count()).select_from(s.alert).where(s.alert.c.watcher == "alerts")
        ).scalar_one()
    assert left == 0


def test_alert_arguments_are_checked(pair: Broker) -> None:
    with pytest.raises(InvalidDefinition, match="alert kinds"):
        alerts.raise_alerts(pair, kinds=("fire",))
    with pytest.raises(InvalidDefinition, match="waiting_threshold"):
        alerts.raise_alerts(pair, waiting_threshold=timedelta(seconds=-1))
