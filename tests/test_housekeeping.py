"""Housekeeping: the purge removes what is past its retention and keeps the rest (both engines).

Time is moved by ``purge(now=...)``: the rows are written now, and the purge is asked to act
as if later.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from helpers import BUYER_QUEUE, SUPPLIER_QUEUE, declare_pair, open_order
from sqlalchemy import func, select

from airflow_broker import Broker
from airflow_broker.cli import main
from airflow_broker.errors import InvalidDefinition
from airflow_broker.messaging.events import record_event
from airflow_broker.operations import housekeeping
from airflow_broker.operations.housekeeping import PurgeReport, Retention
from airflow_broker.operations.sampling import sample_queue_depths
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow


def _count(broker: Broker, table: object, *where: object) -> int:
    with broker.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table).where(*where)).scalar_one())


def _events(broker: Broker, n: int) -> None:
    with broker.engine.begin() as conn:
        for i in range(n):
            record_event(conn, "test_event", f"object {i}", "written by the housekeeping test")


def _closed_dialog(broker: Broker) -> tuple[object, object]:
    """A dialog both sides have ENDed: two CD endpoints."""
    h, t = open_order(broker)
    with broker.transaction() as tx:
        tx.end_conversation(t)
    with broker.transaction() as tx:
        assert [m.message_type_name for m in tx.receive(BUYER_QUEUE)][-1].endswith("EndDialog")
        tx.end_conversation(h)
    return h, t


def test_events_past_their_retention_go_and_newer_ones_stay(broker: Broker) -> None:
    _events(broker, 3)
    kept = broker.purge(now=utcnow() + timedelta(days=29))
    assert kept.events == 0 and _count(broker, s.event) >= 3
    gone = broker.purge(now=utcnow() + timedelta(days=31))
    assert gone.events >= 3
    assert _count(broker, s.event) == 0
    # A retention of its own.
    _events(broker, 2)
    assert broker.purge(Retention(events=timedelta(hours=1)), now=utcnow()).events == 0
    assert (
        broker.purge(Retention(events=timedelta(hours=1)), now=utcnow() + timedelta(hours=2)).events
        == 2
    )


def test_events_are_purged_in_bounded_batches(broker: Broker) -> None:
    _events(broker, 7)
    later = utcnow() + timedelta(days=31)
    first = housekeeping.purge(broker, now=later, batch=3, max_batches=2)
    assert first.events == 6 and _count(broker, s.event) == 1
    assert housekeeping.purge(broker, now=later, batch=3, max_batches=2).events == 1


def test_depth_samples_past_their_retention_go(broker: Broker) -> None:
    declare_pair(broker)
    assert sample_queue_depths(broker, min_interval=0) is not None
    queues = _count(broker, s.queue_sample)
    assert queues >= 2
    assert broker.purge(now=utcnow() + timedelta(days=6)).samples == 0
    assert broker.purge(now=utcnow() + timedelta(days=8)).samples == queues
    assert _count(broker, s.queue_sample) == 0


def test_closed_endpoints_go_after_their_retention_and_open_ones_never(broker: Broker) -> None:
    declare_pair(broker)
    closed = _closed_dialog(broker)
    open_h, open_t = open_order(broker)
    e = s.conversation_endpoint
    assert _count(broker, e, e.c.conversation_handle.in_(closed), e.c.state == "CD") == 2

    # Younger than 30 minutes: kept, to recognise late duplicates.
    assert broker.purge(now=utcnow() + timedelta(minutes=20)).endpoints == 0
    assert _count(broker, e, e.c.conversation_handle.in_(closed)) == 2

    report = broker.purge(now=utcnow() + timedelta(minutes=31))
    assert report.endpoints == 2
    assert _count(broker, e, e.c.conversation_handle.in_(closed)) == 0
    # The open dialog is untouched however old, and still works.
    assert broker.purge(now=utcnow() + timedelta(days=365)).endpoints == 0
    with broker.transaction() as tx:
        assert tx.conversation(open_h).state == "CO"
        tx.send(open_h, "//po/Note", "still here")
    with broker.transaction() as tx:
        got = tx.receive(SUPPLIER_QUEUE)
    assert [m.conversation_handle for m in got] == [open_t]
    # Groups left without endpoints went with them; the open dialog's groups stayed.
    g = s.conversation_group
    assert _count(broker, g) == 2
    assert broker.check() == []


def test_a_retention_of_zero_purges_every_closed_endpoint_at_once(broker: Broker) -> None:
    declare_pair(broker)
    _closed_dialog(broker)
    assert broker.purge(Retention(closed_endpoints=timedelta(0))).endpoints == 2


def test_retention_refuses_negative_or_non_timedelta_values() -> None:
    with pytest.raises(InvalidDefinition, match="retention of events"):
        Retention(events=timedelta(days=-1))
    with pytest.raises(InvalidDefinition, match="retention of samples"):
        Retention(samples=7)  # type: ignore[arg-type]


def test_housekeeping_step_purges_at_most_once_per_interval(broker: Broker) -> None:
    _events(broker, 1)
    zero = Retention(events=timedelta(0))
    first = housekeeping.housekeeping_step(broker, zero, every=3600)
    assert isinstance(first, PurgeReport) and first.events >= 1
    _events(broker, 1)
    assert housekeeping.housekeeping_step(broker, zero, every=3600) is None
    assert _count(broker, s.event) == 1
    broker.next_housekeeping = 0.0
    again = housekeeping.housekeeping_step(broker, zero, every=3600)
    assert again is not None and again.events == 1


def test_housekeeping_step_never_raises(broker: Broker) -> None:
    with broker.engine.begin() as conn:
        # CASCADE: on PostgreSQL the restricted roles' view of it (broker_client) goes too.
        cascade = " CASCADE" if broker.dialect == "postgresql" else ""
        conn.exec_driver_sql("DROP TABLE broker_event" + cascade)
    assert housekeeping.housekeeping_step(broker, every=0) is None


def test_cli_purge(broker_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    broker = Broker.connect(broker_url)
    try:
        _events(broker, 2)
    finally:
        broker.dispose()
    assert main(["--url", broker_url, "purge", "--events-days", "1"]) == 0
    out = capsys.readouterr().out
    assert "events: 0, depth samples: 0, closed endpoints: 0" in out
    assert main(["--url", broker_url, "purge", "--events-days", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "events": 2,
        "samples": 0,
        "endpoints": 0,
        "dedupe_keys": 0,
    }
    assert main(["--url", broker_url, "purge", "--events-days", "-1"]) == 2
    assert "must be >= 0" in capsys.readouterr().err
