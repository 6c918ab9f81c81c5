"""Delivery passes running at once deliver every message once."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import text

from airflow_broker import Broker

pytestmark = pytest.mark.xdist_group("transport")


@pytest.mark.parametrize("how", ["run_due", "deliver"])
def test_two_passes_flushing_the_same_waiting_messages_deliver_each_once(
    pg_broker: Broker, how: str
) -> None:
    b = pg_broker
    b.create_queue("init_q")
    b.create_queue("target_q", status=False)  # disabled: everything waits
    b.create_service("//svc/Init", queue="init_q")
    b.create_service("//svc/Target", queue="target_q", contracts=["DEFAULT"])
    dialogs, per_dialog = 60, 5
    with b.transaction() as tx:
        handles = [
            tx.begin_dialog("//svc/Init", "//svc/Target", encryption=False) for _ in range(dialogs)
        ]
        for i in range(per_dialog):
            tx.send(handles, body=f"m{i}")
    assert len(b.transmission_queue()) == dialogs * per_dialog
    b.alter_queue("target_q", status=True)
    with b.engine.begin() as conn:  # due now, not after the first backoff
        conn.execute(text("UPDATE broker_transmission_queue SET next_attempt_at = now()"))

    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def flush() -> None:
        try:
            start.wait()
            for _ in range(3):
                if how == "run_due":
                    b.run_due()
                else:
                    b.deliver(retry_now=True)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=flush) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    b.deliver(retry_now=True)

    seen: Counter[tuple[object, int]] = Counter()
    with b.transaction() as tx:
        while msgs := tx.receive("target_q"):
            for m in msgs:
                seen[(m.conversation_handle, m.message_sequence_number)] += 1
    assert len(seen) == dialogs * per_dialog
    assert max(seen.values()) == 1
    assert b.transmission_queue() == []


@pytest.mark.parametrize("engine", ["sqlite", "postgres"])
def test_concurrent_delivery_passes_to_another_broker_deliver_each_message_once(
    engine: str, tmp_path: Path, make_pg_database: Callable[..., str]
) -> None:
    """On SQLite a pass holds no lock while it pushes, so four passes push the same rows at
    once: the far broker's sequence check (and its retry when two create one endpoint) is all
    that keeps them single."""
    if engine == "sqlite":
        urls = {n: f"sqlite:///{tmp_path / (n + '.db')}" for n in ("a", "b")}
        for url in urls.values():
            m = Broker.connect(url)
            m.migrate()
            m.dispose()
    else:
        urls = {"a": make_pg_database(), "b": make_pg_database()}
    a = Broker.connect(urls["a"], resolver=urls)
    b = Broker.connect(urls["b"], resolver=urls)
    a.create_queue("qa")
    a.create_service("//svc/A", queue="qa")
    a.create_route("to_b", service_name="//svc/B", address="broker://b")
    b.create_queue("qb")
    b.create_service("//svc/B", queue="qb", contracts=["DEFAULT"])
    dialogs, per_dialog = 40, 5
    with a.transaction() as tx:
        handles = [tx.begin_dialog("//svc/A", "//svc/B", encryption=False) for _ in range(dialogs)]
        for i in range(per_dialog):
            tx.send(handles, body=f"m{i}")

    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def deliver() -> None:
        try:
            start.wait()
            for _ in range(3):
                a.deliver(retry_now=True)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=deliver) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    a.deliver(retry_now=True)
    assert a.transmission_queue() == []

    seen: Counter[tuple[object, int]] = Counter()
    with b.transaction() as tx:
        while msgs := tx.receive("qb"):
            for m in msgs:
                seen[(m.conversation_handle, m.message_sequence_number)] += 1
    assert len(seen) == dialogs * per_dialog
    assert max(seen.values()) == 1
    with b.engine.connect() as conn:
        endpoints = conn.execute(text("SELECT count(*) FROM broker_conversation_endpoint")).scalar()
    assert endpoints == dialogs  # never two target endpoints for one dialog
    a.dispose()
    b.dispose()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["run_due", "deliver"])
def test_a_pass_delivers_the_run_it_holds_and_waits_for_no_other_pass(
    pg_broker: Broker, how: str
) -> None:
    """Passes lock transmission rows SKIP LOCKED, so two of them can split one dialog's rows.
    A pass delivers the run it can lock from the dialog's first row and stops where another
    pass holds one; it never waits for that row (two passes waiting for each other's rows
    deadlocked: seen once in 24 runs of the test above)."""
    b = pg_broker
    b.create_queue("init_q")
    b.create_queue("target_q", status=False)
    b.create_service("//svc/Init", queue="init_q")
    b.create_service("//svc/Target", queue="target_q", contracts=["DEFAULT"])
    with b.transaction() as tx:
        h = tx.begin_dialog("//svc/Init", "//svc/Target", encryption=False)
        for i in range(5):
            tx.send(h, body=f"m{i}")
    b.alter_queue("target_q", status=True)
    with b.engine.begin() as conn:
        conn.execute(text("UPDATE broker_transmission_queue SET next_attempt_at = now()"))

    def flush() -> None:
        if how == "run_due":
            b.run_due()
        else:
            b.deliver(retry_now=True)

    other = b.engine.connect()
    try:
        # Another pass holds the dialog's last three rows.
        held = other.execute(
            text(
                "SELECT id FROM broker_transmission_queue WHERE message_sequence_number >= 2 "
                "FOR UPDATE"
            )
        ).all()
        assert len(held) == 3
        done = threading.Event()
        worker = threading.Thread(target=lambda: (flush(), done.set()))
        worker.start()
        assert done.wait(15), "the pass waited for rows another pass holds"
        worker.join()
        with b.transaction() as tx:
            first = [m.message_body for m in tx.receive("target_q")]
        assert first == [b"m0", b"m1"]
        assert len(b.transmission_queue()) == 3
    finally:
        other.rollback()
        other.close()
    flush()
    with b.transaction() as tx:
        rest = [m.message_body for m in tx.receive("target_q")]
    assert rest == [b"m2", b"m3", b"m4"]
    assert b.transmission_queue() == []
