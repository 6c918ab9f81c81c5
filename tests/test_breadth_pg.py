"""Breadth (issue 46): a million open conversations, each with a conversation timer, cost the
messaging paths nothing they did not cost without them.

The population is written by SQL, as BEGIN DIALOG + BEGIN CONVERSATION TIMER write it (an
initiator endpoint in state SO with a timer due in 30 days, and its conversation group,
spread over a few tenant queues), the indexes built after the rows, as a bulk load does: about
a minute for 10^6 (``BROKER_TEST_BREADTH_OPEN`` sets another count). Then, on that
broker: a timer due now fires within its usual time and RECEIVE returns it; SEND and RECEIVE on
a fresh dialog work; ``run_due()`` with nothing due stays far from a scan of the endpoints;
``check()`` finds nothing wrong.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest
from helpers import (
    BUYER,
    BUYER_QUEUE,
    CONTRACT,
    NOTE,
    SUPPLIER,
    SUPPLIER_QUEUE,
    declare_pair,
)
from sqlalchemy import make_url

from airflow_broker import DIALOG_TIMER, Broker

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

OPEN = int(os.environ.get("BROKER_TEST_BREADTH_OPEN", "1000000"))
TENANTS = 10


def _conninfo(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _open_dialogs(url: str, count: int) -> None:
    """``count`` open dialogs from the tenant services (round robin), each with a timer due
    in 30 days."""
    with psycopg.connect(_conninfo(url), autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        # As a bulk load does it: the groups' key to their queue is not checked row by row
        # (the queue ids are read below), and the two tables' indexes are built after.
        conn.execute("SET session_replication_role = replica")
        indexes = conn.execute(
            "SELECT i.indexname, i.indexdef FROM pg_indexes i"
            " JOIN pg_class c ON c.relname = i.indexname"
            " JOIN pg_index x ON x.indexrelid = c.oid AND NOT x.indisprimary"
            " WHERE i.tablename IN ('broker_conversation_group', 'broker_conversation_endpoint')"
        ).fetchall()
        for name, _ in indexes:
            conn.execute(f"DROP INDEX {name}")
        tenants = conn.execute(
            "SELECT array_agg(name ORDER BY name), array_agg(queue_id ORDER BY name) "
            "FROM broker_service WHERE name LIKE '//breadth/Tenant%'"
        ).fetchone()
        assert tenants is not None
        names, queues = tenants

        def key(prefix: str) -> str:  # ascending: the primary keys are appended to
            return f"('{prefix}-0000-4000-8000-' || lpad(to_hex(i), 12, '0'))::uuid"

        group, handle, conversation = key("10000000"), key("20000000"), key("30000000")
        pick = f"[1 + i %% {len(names)}]"
        conn.execute(
            "INSERT INTO broker_conversation_group (conversation_group_id, queue_id) "
            f"SELECT {group}, (%(queues)s::int[]){pick} "
            "FROM generate_series(0, %(count)s - 1) AS i",
            {"queues": queues, "count": count},
        )
        conn.execute(
            "INSERT INTO broker_conversation_endpoint ("
            " conversation_handle, conversation_id, is_initiator, conversation_group_id,"
            " queue_id, service_name, far_service, contract_name, state, priority,"
            " timer_due_at, send_sequence, receive_sequence, created_at, encryption) "
            f"SELECT {handle}, {conversation}, true, {group}, (%(queues)s::int[]){pick},"
            f" (%(names)s::text[]){pick}, %(far)s, %(contract)s, 'SO', 5,"
            " now() + interval '30 days' + i * interval '1 millisecond', 0, 0, now(), false "
            "FROM generate_series(0, %(count)s - 1) AS i",
            {"queues": queues, "names": names, "far": SUPPLIER, "contract": CONTRACT,
             "count": count},
        )  # fmt: skip
        for _, definition in indexes:
            conn.execute(definition)
        conn.execute("VACUUM ANALYZE broker_conversation_endpoint")
        conn.execute("VACUUM ANALYZE broker_conversation_group")


def _median_ms(fn: Callable[[], object], times: int) -> float:
    spent = []
    for _ in range(times):
        started = time.perf_counter()
        fn()
        spent.append(time.perf_counter() - started)
    return statistics.median(spent) * 1000


@pytest.fixture
def crowded(make_pg_database: Callable[..., str]) -> Iterator[Broker]:
    url = make_pg_database()
    broker = Broker.connect(url)
    declare_pair(broker)
    with broker.definitions() as d:
        for i in range(TENANTS):
            d.create_queue(f"breadth_tenant_{i}_q")
            d.create_service(
                f"//breadth/Tenant{i}", queue=f"breadth_tenant_{i}_q", contracts=[CONTRACT]
            )
    started = time.monotonic()
    _open_dialogs(url, OPEN)
    print(f"{OPEN:,} open dialogs written in {time.monotonic() - started:.1f} s")
    yield broker
    broker.dispose()


def test_a_million_open_conversations_cost_a_due_timer_nothing(crowded: Broker) -> None:
    broker = crowded
    with broker.engine.connect() as conn:
        assert (
            conn.exec_driver_sql(
                "SELECT count(*) FROM broker_conversation_endpoint WHERE timer_due_at IS NOT NULL"
            ).scalar()
            == OPEN
        )

    # Nothing due: one look, however many timers and lifetimes wait (a scan of the endpoints
    # took 177 ms at 10^6). The bound is loose: the machine may be busy.
    broker.run_due()
    idle = _median_ms(broker.run_due, 30)
    assert idle < 25, f"run_due() with nothing due took {idle:.1f} ms (median)"

    # A timer due now fires within its usual time, and RECEIVE returns it.
    with broker.transaction() as tx:
        handle = tx.begin_dialog(BUYER, SUPPLIER, CONTRACT, encryption=False)
        tx.begin_conversation_timer(handle, 0.5)
    armed = time.monotonic()
    with broker.transaction() as tx:
        got = tx.receive(BUYER_QUEUE, wait_seconds=10)
    waited = time.monotonic() - armed
    assert [(m.message_type_name, m.conversation_handle) for m in got] == [(DIALOG_TIMER, handle)]
    # Due after 0.5 s; a waiting RECEIVE runs the due work by then (its process armed it) or
    # within a second (DUE_POLL_SECONDS): the slack is for a busy machine.
    assert waited < 3.5, f"the DialogTimer came {waited:.2f} s after it was armed"

    # SEND and RECEIVE on a fresh dialog, and the answer back.
    with broker.transaction() as tx:
        fresh = tx.begin_dialog(BUYER, SUPPLIER, CONTRACT, encryption=False)
        tx.send(fresh, NOTE, b"hello")
    with broker.transaction() as tx:
        [m] = tx.receive(SUPPLIER_QUEUE, wait_seconds=5)
        assert m.message_body == b"hello"
        tx.send(m.conversation_handle, NOTE, b"back")
        tx.end_conversation(m.conversation_handle)
    with broker.transaction() as tx:
        back = tx.receive(BUYER_QUEUE, wait_seconds=5)
        assert [m.message_body for m in back][:1] == [b"back"]
        tx.end_conversation(fresh)

    # The population is whole, and nothing is wrong with it.
    report = broker.run_due()
    assert report.timers_fired == 0
    assert broker.check() == []
