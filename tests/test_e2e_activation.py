"""End to end: messages SENT from outside Airflow activate reader DAG runs through the real
triggerer; the readers drain every message exactly once; no more runs than max_readers run at
once; tasks never touch Airflow's ORM (Airflow 3 refuses it in task processes: a task that did
would fail); a triggerer restarted mid-way fires nothing twice. Under CeleryExecutor (two
workers, one task each at a time) the same readers run on the workers: two at once, one on each,
and every message is handled once."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from support.airflow_stack import CELERY_WORKERS, AirflowStack, airflow_stack

from airflow_broker import Activation, Broker

DAGS = Path(__file__).parent / "dags" / "e2e"
QUEUE, MAX_READERS = "e2e_q", 2

pytestmark = pytest.mark.xdist_group("airflow_e2e")


def _setup(url: str) -> Broker:
    b = Broker.connect(url)
    with b.definitions() as d:
        d.create_queue(
            QUEUE, activation=Activation(max_readers=MAX_READERS, reader="activation_e2e")
        )
        d.create_queue("e2e_sender_q")
        d.create_service("//e2e/Reader", queue=QUEUE, contracts=["DEFAULT"])
        d.create_service("//e2e/Sender", queue="e2e_sender_q")
    with b.engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE e2e_seen (conversation_handle VARCHAR(36) NOT NULL, "
                "seq BIGINT NOT NULL, body TEXT, worker VARCHAR(64))"
            )
        )
    return b


def _send(b: Broker, dialogs: int, per_dialog: int, tag: str) -> None:
    with b.transaction() as tx:
        handles = [tx.begin_dialog("//e2e/Sender", "//e2e/Reader") for _ in range(dialogs)]
        for i in range(per_dialog):
            tx.send(handles, body=f"{tag}-{i}")


def _seen(b: Broker) -> list[Any]:
    with b.engine.connect() as conn:
        return list(conn.execute(text("SELECT conversation_handle, seq FROM e2e_seen")))


def _workers(b: Broker) -> dict[str | None, int]:
    """How many messages were handled under each Celery worker (None: not under one)."""
    with b.engine.connect() as conn:
        rows = conn.execute(text("SELECT worker, count(*) FROM e2e_seen GROUP BY worker"))
        return {worker: int(n) for worker, n in rows}


def _conn_env(broker_url: str) -> dict[str, str]:
    return {
        "AIRFLOW_CONN_BROKER_DEFAULT": json.dumps(
            {"conn_type": "broker", "extra": {"url": broker_url}}
        )
    }


def _max_overlap(runs: list[Any]) -> int:
    """The most runs that were running at the same moment (from their start and end)."""
    edges = []
    for r in runs:
        if r.start_date is None:
            continue
        edges.append((r.start_date, 1))
        if r.end_date is not None:
            edges.append((r.end_date, -1))
    edges.sort(key=lambda e: (e[0], e[1]))
    most = current = 0
    for _, step in edges:
        current += step
        most = max(most, current)
    return most


@pytest.mark.parametrize("metadata", ["sqlite", "postgres"])
def test_messages_from_outside_activate_readers_that_drain_them_once(
    metadata: str, tmp_path: Path, make_pg_database: Callable[..., str]
) -> None:
    broker_url = make_pg_database()
    b = _setup(broker_url)
    metadata_url = make_pg_database(migrated=False) if metadata == "postgres" else None
    env = _conn_env(broker_url)
    with airflow_stack(tmp_path, DAGS, metadata_url=metadata_url, extra_env=env) as af:
        af.wait_for_dags("activation_e2e")
        _send(b, dialogs=20, per_dialog=5, tag="first")
        af.wait_for("the first burst to be drained", lambda: len(_seen(b)) >= 100, timeout=240)

        # Restart the triggerer: it must not fire again for what it fired for already.
        af.wait_for("the readers to finish", lambda: _idle(af))
        runs_before = len(af.runs("activation_e2e"))
        af.restart_component("triggerer", kill=True)
        _wait_quiet(af, seconds=15)
        assert len(af.runs("activation_e2e")) == runs_before, "a restarted triggerer fired again"

        _send(b, dialogs=20, per_dialog=5, tag="second")
        af.wait_for("the second burst to be drained", lambda: len(_seen(b)) >= 200, timeout=240)
        af.wait_for("the readers to finish", lambda: _idle(af))

        seen = _seen(b)
        runs = af.runs("activation_e2e")
    assert len(seen) == 200
    assert len(set(seen)) == 200, "a message was handled twice"
    assert all(r.state == "success" for r in runs), [(r.run_id, r.state) for r in runs]
    assert 1 <= _max_overlap(runs) <= MAX_READERS
    assert _workers(b) == {None: 200}, "LocalExecutor's tasks ran under a Celery worker?"
    b.dispose()


# Eight processes to start (Redis, two workers) and a PostgreSQL metadata database to migrate:
# about 200 s on two loaded cores, where the suite's 300 s default leaves too little room.
@pytest.mark.timeout(480)
def test_under_celery_two_readers_run_on_the_two_workers_and_drain_once(
    tmp_path: Path, make_pg_database: Callable[..., str]
) -> None:
    """The subset of the test above that depends on the executor: activation starts reader runs
    whose tasks the Celery workers run, two at once, and every message is handled once.

    The workers run one task at a time each (the harness's ``--concurrency 1``, prefetching
    none): two readers running at once are on both workers. The handler pauses after each
    conversation group (E2E_HANDLE_PAUSE) so that the first reader is still draining when the
    second burst makes the queue grow and the monitor starts a second one: about 40 s for the
    second reader's task to start (it took 5 to 10 s on two loaded cores)."""
    broker_url = make_pg_database()
    b = _setup(broker_url)
    env = {**_conn_env(broker_url), "E2E_HANDLE_PAUSE": "1.0"}
    with airflow_stack(
        tmp_path,
        DAGS,
        metadata_url=make_pg_database(migrated=False),
        extra_env=env,
        executor="CeleryExecutor",
    ) as af:
        af.wait_for_dags("activation_e2e")
        _send(b, dialogs=20, per_dialog=5, tag="first")
        af.wait_for("the first reader to handle messages", lambda: _seen(b), timeout=240)
        _send(b, dialogs=20, per_dialog=5, tag="second")
        af.wait_for("both bursts to be drained", lambda: len(_seen(b)) >= 200, timeout=240)
        af.wait_for("the readers to finish", lambda: _idle(af))

        seen = _seen(b)
        runs = af.runs("activation_e2e")
        tasks = af.tasks_by_worker("activation_e2e")  # fails unless each ran on one worker
        handled = _workers(b)
    assert len(seen) == 200
    assert len(set(seen)) == 200, "a message was handled twice"
    assert all(r.state == "success" for r in runs), [(r.run_id, r.state) for r in runs]
    assert _max_overlap(runs) == MAX_READERS, runs
    assert all(tasks[w] >= 1 for w in CELERY_WORKERS), tasks
    assert set(handled) == set(CELERY_WORKERS), handled
    b.dispose()


def _idle(af: AirflowStack) -> bool:
    return not [r for r in af.runs("activation_e2e") if r.state in ("queued", "running")]


def _wait_quiet(af: AirflowStack, seconds: float) -> None:
    """Let the restarted triggerer come up and run its triggers for a while."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        af.check_alive()
        time.sleep(0.5)
