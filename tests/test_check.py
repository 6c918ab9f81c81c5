"""``Broker.check()``: each impossible state, made by hand in SQL on both engines, is reported
with its kind, object and a sentence; ``repair=True`` fixes what it says it fixes and leaves the
rest reported."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator

import pytest
from helpers import BUYER_QUEUE, NOTE, ORDER, SUPPLIER_QUEUE, begin, declare_pair, send
from sqlalchemy import text
from sqlalchemy.engine import Connection

from airflow_broker import Broker
from airflow_broker.operations.check import KINDS, REPAIRS, Problem


@pytest.fixture
def pair(broker: Broker) -> Broker:
    declare_pair(broker)
    return broker


@contextlib.contextmanager
def unchecked(broker: Broker) -> Iterator[Connection]:
    """A connection that may break the schema's own rules (foreign keys off), as a bug or a
    hand-made fix in production could."""
    with broker.engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        if broker.dialect == "postgresql":
            conn.execute(text("SET session_replication_role = replica"))
            conn.commit()
        else:
            raw.execute("PRAGMA foreign_keys = OFF")  # only outside a transaction
        try:
            yield conn
            conn.commit()
        finally:
            if broker.dialect == "postgresql":
                conn.execute(text("SET session_replication_role = DEFAULT"))
                conn.commit()
            else:
                raw.execute("PRAGMA foreign_keys = ON")


def _target(broker: Broker, h: uuid.UUID) -> str:
    with broker.transaction() as tx:
        far = tx.conversation(h)
    with broker.engine.connect() as conn:
        handle = conn.execute(
            text(
                "SELECT conversation_handle FROM broker_conversation_endpoint "
                "WHERE conversation_id = :id AND NOT is_initiator"
            ),
            {
                "id": far.conversation_id
                if broker.dialect == "postgresql"
                else far.conversation_id.hex
            },
        ).scalar_one()
    return str(handle)


def _sql_id(broker: Broker, value: str | uuid.UUID) -> str:
    """A UUID as each engine stores it (SQLite: 32 hex digits)."""
    u = uuid.UUID(str(value))
    return str(u) if broker.dialect == "postgresql" else u.hex


def _kinds(problems: list[Problem]) -> list[str]:
    return sorted({p.kind for p in problems})


def test_a_consistent_broker_has_no_problems(pair: Broker) -> None:
    h = begin(pair)
    send(pair, h, ORDER, {"order": 1}, {"order": 2})
    with pair.transaction() as tx:
        tx.begin_conversation_timer(h, 60)
    assert pair.check() == []
    assert pair.events(1)[0].event == "consistency_check"
    assert pair.events(1)[0].detail == "no problems"


def test_every_kind_has_a_meaning_and_every_repair_a_kind() -> None:
    assert set(REPAIRS) <= set(KINDS)


def _one_message(pair: Broker) -> tuple[uuid.UUID, str]:
    h = begin(pair)
    send(pair, h, ORDER, {"order": 1})
    return h, _target(pair, h)


def _message_without_endpoint(pair: Broker) -> None:
    _, target = _one_message(pair)
    with unchecked(pair) as conn:
        conn.execute(
            text("DELETE FROM broker_conversation_endpoint WHERE conversation_handle = :h"),
            {"h": _sql_id(pair, target)},
        )


def _message_misfiled(pair: Broker) -> None:
    _one_message(pair)
    with unchecked(pair) as conn:
        conn.execute(
            text(
                "UPDATE broker_message SET queue_id = "
                "(SELECT queue_id FROM broker_queue WHERE name = :q)"
            ),
            {"q": BUYER_QUEUE},
        )


def _duplicate_message(pair: Broker) -> None:
    _one_message(pair)
    cols = (
        "queue_id, conversation_group_id, conversation_handle, message_sequence_number, status, "
        "priority, precedence, service_name, service_contract_name, message_type_name, "
        "validation, message_body, enqueued_at"
    )
    with unchecked(pair) as conn:
        conn.execute(text(f"INSERT INTO broker_message ({cols}) SELECT {cols} FROM broker_message"))


def _message_ahead_of_sender(pair: Broker) -> None:
    h, _ = _one_message(pair)
    with unchecked(pair) as conn:
        conn.execute(
            text(
                "UPDATE broker_conversation_endpoint SET send_sequence = 0 "
                "WHERE conversation_handle = :h"
            ),
            {"h": _sql_id(pair, h)},
        )


def _endpoint_without_group(pair: Broker) -> None:
    h = begin(pair)
    with pair.transaction() as tx:
        group = tx.conversation(h).conversation_group_id
    with unchecked(pair) as conn:
        conn.execute(
            text("DELETE FROM broker_conversation_group WHERE conversation_group_id = :g"),
            {"g": _sql_id(pair, group)},
        )


def _endpoint_without_queue(pair: Broker) -> None:
    begin(pair)
    with unchecked(pair) as conn:
        conn.execute(
            text(
                "UPDATE broker_conversation_endpoint SET queue_id = "
                "(SELECT max(queue_id) + 100 FROM broker_queue)"
            )
        )
        conn.execute(text("UPDATE broker_conversation_group SET queue_id = queue_id"))


def _endpoint_without_service(pair: Broker) -> None:
    begin(pair)
    with unchecked(pair) as conn:
        conn.execute(text("UPDATE broker_conversation_endpoint SET service_name = '//po/Gone'"))


def _impossible_state(pair: Broker) -> None:
    begin(pair)
    with unchecked(pair) as conn:
        conn.execute(text("UPDATE broker_conversation_endpoint SET state = 'ZZ'"))


def _transmission_after_end(pair: Broker) -> None:
    pair.create_route("far", service_name="//far/Service", address="broker://nowhere")
    with pair.transaction() as tx:
        h = tx.begin_dialog("//po/Buyer", "//far/Service", "//po/OrderContract")
        tx.send(h, NOTE, "waits for a broker that is not there")
    assert len(pair.transmission_queue()) == 1
    with unchecked(pair) as conn:
        conn.execute(
            text(
                "UPDATE broker_conversation_endpoint SET state = 'ER' "
                "WHERE conversation_handle = :h"
            ),
            {"h": _sql_id(pair, h)},
        )


def _dead_reader_lease(pair: Broker) -> None:
    send(pair, begin(pair), ORDER, {"order": 1})
    with pair.engine.connect() as conn:
        queue_id = conn.execute(
            text("SELECT queue_id FROM broker_queue WHERE name = :q"), {"q": SUPPLIER_QUEUE}
        ).scalar_one()
    if pair.dialect == "postgresql":
        with pair.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO broker_receive_lease (lease_key, queue_id, pid, started_at) "
                    "VALUES (424242, :q, 2147483000, now())"
                ),
                {"q": queue_id},
            )
    else:
        lease_dir = pair.adapter._lease_dir  # type: ignore[union-attr]
        assert lease_dir is not None
        lease_dir.mkdir(exist_ok=True)
        # a lease file nobody holds a lock on: its reader died
        (lease_dir / f"{os.getpid()}-{uuid.uuid4().hex}.lease").write_text(str(queue_id))


def _stray_lease_mark(pair: Broker) -> None:
    send(pair, begin(pair), ORDER, {"order": 1})
    lease = pair.lease(SUPPLIER_QUEUE, lease_seconds=600)
    assert lease is not None
    with unchecked(pair) as conn:
        conn.execute(text("DELETE FROM broker_lease"))


CASES: dict[str, Callable[[Broker], None]] = {
    "message_without_endpoint": _message_without_endpoint,
    "message_misfiled": _message_misfiled,
    "duplicate_message": _duplicate_message,
    "message_ahead_of_sender": _message_ahead_of_sender,
    "endpoint_without_group": _endpoint_without_group,
    "endpoint_without_queue": _endpoint_without_queue,
    "endpoint_without_service": _endpoint_without_service,
    "impossible_state": _impossible_state,
    "transmission_after_end": _transmission_after_end,
    "dead_reader_lease": _dead_reader_lease,
    "stray_lease_mark": _stray_lease_mark,
}


def test_every_kind_has_a_test() -> None:
    assert set(CASES) == set(KINDS)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_check_reports_each_problem_and_repair_fixes_what_it_can(pair: Broker, kind: str) -> None:
    CASES[kind](pair)
    found = pair.check()
    assert kind in _kinds(found), found
    for p in found:
        assert p.object and p.detail and not p.repaired
        assert p.kind in KINDS
    assert pair.events(1)[0].event == "consistency_check"
    assert kind in pair.events(1)[0].detail

    after_repair = pair.check(repair=True)
    mine = [p for p in after_repair if p.kind == kind]
    assert mine
    assert all(p.repaired == (kind in REPAIRS) for p in mine), mine
    again = _kinds(pair.check())
    if kind in REPAIRS:
        assert kind not in again
    else:
        assert kind in again


def test_repair_keeps_every_message_that_can_still_be_received(pair: Broker) -> None:
    """A misfiled message is moved, not deleted: it is received from its endpoint's queue."""
    _message_misfiled(pair)
    pair.check(repair=True)
    with pair.transaction() as tx:
        got = tx.receive(SUPPLIER_QUEUE)
    assert [m.json() for m in got] == [{"order": 1}]


def test_the_overview_shows_the_last_check(pair: Broker) -> None:
    from airflow_broker.operations import monitoring

    assert monitoring.overview(pair).last_check is None
    pair.check()
    first = monitoring.overview(pair)
    assert first.last_check == "no problems" and first.last_check_at is not None
    _message_without_endpoint(pair)
    pair.check()
    assert monitoring.overview(pair).last_check == "1 problem: 1 message_without_endpoint"
    assert monitoring.to_json(monitoring.overview(pair))["last_check"].startswith("1 problem")
