"""Deterministic races on two PostgreSQL connections, for the lock-order tests.

One transaction takes its step and stays open; the other starts its conflicting step in a thread;
the test waits until PostgreSQL shows that thread waiting for a lock (or a short while, if nothing
makes it wait), then the first goes on and commits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import text

from airflow_broker import Broker, Transaction

Step = Callable[[Transaction], Any]


def _pid(tx: Transaction) -> int:
    pid: int = tx.connection.execute(text("SELECT pg_backend_pid()")).scalar_one()
    return pid


def _wait_until_blocked(broker: Broker, pid: int, timeout: float = 3.0) -> bool:
    """True once backend ``pid`` waits for a lock; False after ``timeout`` (nothing blocked it:
    the race then plays out as it would without the lock order)."""
    deadline = time.monotonic() + timeout
    with broker.engine.connect() as conn:
        while time.monotonic() < deadline:
            waiting = conn.execute(
                text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :p"), {"p": pid}
            ).scalar()
            conn.rollback()
            if waiting == "Lock":
                return True
            time.sleep(0.02)
    return False


def race(
    broker: Broker, first: Step, second: Step, then: Step | None = None
) -> tuple[object, object]:
    """``first`` runs in an open transaction; ``second`` starts in another transaction (thread);
    once it waits for ``first``'s locks (or cannot be made to), ``then`` (if given) runs in the
    first transaction, which commits. Returns each side's result or the exception it raised
    (``first``'s includes ``then``'s exception, if it raised one)."""
    outcome: dict[str, object] = {}
    started = threading.Event()
    pid: list[int] = []

    def run_second() -> None:
        try:
            with broker.transaction() as tx:
                pid.append(_pid(tx))
                started.set()
                outcome["second"] = second(tx)
        except BaseException as exc:  # the outcome under test
            outcome["second"] = exc
        finally:
            started.set()

    try:
        with broker.transaction() as tx:
            outcome["first"] = first(tx)
            thread = threading.Thread(target=run_second)
            thread.start()
            started.wait(10)
            if pid:
                _wait_until_blocked(broker, pid[0])
            if then is not None:
                then(tx)
    except Exception as exc:  # e.g. PostgreSQL's deadlock detector: the outcome under test
        outcome["first"] = exc
    thread.join(30)
    assert not thread.is_alive()
    return outcome["first"], outcome["second"]


def orphans(broker: Broker) -> list[str]:
    """Messages whose conversation endpoint does not exist."""
    with broker.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT m.conversation_handle FROM broker_message m "
                "WHERE NOT EXISTS (SELECT 1 FROM broker_conversation_endpoint e "
                "                  WHERE e.conversation_handle = m.conversation_handle)"
            )
        ).scalars()
        return [str(h) for h in rows]
