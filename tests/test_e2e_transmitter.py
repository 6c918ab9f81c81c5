"""End to end: the transmitter runs itself under a real scheduler, DAG processor and triggerer.

Two PostgreSQL broker databases: ``broker_default`` (the initiator's) and ``far`` (the target's),
each an Airflow connection. The only DAG is the one-line ``transmitter_dag()``. Messages SENT
from outside Airflow arrive in the far queue exactly once and in order with no manual step;
while the far database refuses connections they wait (nothing lost, nothing doubled) and arrive
once it is back; a backlog above the Spark threshold is moved by the Spark routing job; a
conversation timer on a queue nobody reads fires within 5 seconds. Under CeleryExecutor (two
workers) the transmitter's runs are the workers' tasks, and deliver the same way: every message
once and in order, a conversation carried on across runs.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, make_url, text
from support.airflow_stack import AirflowStack, airflow_stack
from transport_procs import (
    INIT_QUEUE,
    INITIATOR,
    TARGET,
    TARGET_QUEUE,
    assert_exactly_once_in_order,
    by_conversation,
    conversation_ids,
    drain_all,
    host_initiator,
    host_target,
    message_count,
    send_dialogs,
    send_more,
)

from airflow_broker import DIALOG_TIMER, Broker

DAGS = Path(__file__).parent / "dags" / "transmit"
DAG_ID = "broker_transmitter"
SPARK_THRESHOLD = 250

pytestmark = [pytest.mark.xdist_group("airflow_e2e"), pytest.mark.postgres, pytest.mark.slow]


def _conn(url: str) -> str:
    return json.dumps({"conn_type": "broker", "extra": {"url": url}})


def _admin(url: str) -> tuple[Any, str]:
    u = make_url(url)
    return create_engine(u.set(database="postgres"), isolation_level="AUTOCOMMIT"), str(u.database)


def _set_reachable(url: str, reachable: bool) -> None:
    """Let the far database take connections again, or refuse them and end the open ones."""
    engine, name = _admin(url)
    try:
        with engine.connect() as conn:
            conn.execute(
                text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(reachable).lower()}')
            )
            if not reachable:
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = :d AND pid <> pg_backend_pid()"
                    ),
                    {"d": name},
                )
    finally:
        engine.dispose()


def _reports(af: AirflowStack) -> list[dict[str, Any]]:
    rows = af.query(
        "SELECT value FROM xcom WHERE dag_id = :d AND task_id = 'transmit'"
        " AND key = 'return_value'",
        d=DAG_ID,
    )
    out = []
    for (value,) in rows:
        out.append(value if isinstance(value, dict) else json.loads(value))
    return out


def _arrived(far: Broker) -> int:
    return message_count(far, TARGET_QUEUE)


def _network(
    make_pg_database: Callable[..., str],
) -> tuple[Broker, Broker, str, dict[str, str]]:
    """The near and far broker databases, routed both ways; the far URL and the deployment's
    connections."""
    near_url, far_url = make_pg_database(), make_pg_database()
    resolver = {"broker_default": near_url, "far": far_url}
    near = Broker.connect(near_url, resolver=resolver)
    far = Broker.connect(far_url, resolver=resolver)
    host_initiator(near)
    host_target(far)
    near.create_route("ToFar", TARGET, None, "broker://far")
    far.create_route("Back", INITIATOR, near.instance_id, "broker://broker_default")
    env = {
        "AIRFLOW_CONN_BROKER_DEFAULT": _conn(near_url),
        "AIRFLOW_CONN_FAR": _conn(far_url),
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[2]"}),
        "E2E_SPARK_THRESHOLD": str(SPARK_THRESHOLD),
    }
    return near, far, far_url, env


def test_the_transmitter_delivers_by_itself_through_outages_and_by_spark(
    tmp_path: Path, make_pg_database: Callable[..., str]
) -> None:
    near, far, far_url, env = _network(make_pg_database)
    expected: dict[uuid.UUID, range] = {}
    got: dict[uuid.UUID, list[Any]] = {}

    def sent(handles: list[uuid.UUID], first: int, count: int) -> None:
        for h, cid in conversation_ids(near, handles).items():
            del h
            expected[cid] = range(first, first + count)

    def collect() -> None:
        for cid, msgs in by_conversation(far, drain_all(far, TARGET_QUEUE)).items():
            got.setdefault(cid, []).extend(msgs)

    try:
        with airflow_stack(tmp_path, DAGS, extra_env=env) as af:
            af.wait_for_dags(DAG_ID)

            # 1. 200 messages from outside Airflow, no manual step.
            handles = send_dialogs(near, [10] * 20)
            sent(handles, 0, 10)
            af.wait_for("200 messages in the far queue", lambda: _arrived(far) >= 200, timeout=180)
            collect()

            # 2. The far database goes away for a while: everything waits, then arrives once.
            _set_reachable(far_url, False)
            try:
                more = send_dialogs(near, [5] * 10)
                sent(more, 0, 5)
                af.wait_for(
                    "a transmitter run to find the far database unreachable",
                    lambda: any(r["left_waiting"] >= 50 for r in _reports(af)),
                    timeout=120,
                )
                waiting = near.transmission_queue()
                assert len(waiting) == 50
                assert all(w.transmission_status for w in waiting), waiting[:3]
            finally:
                _set_reachable(far_url, True)
                far.engine.dispose()  # this process's connections there were ended too
            af.wait_for("the 50 after the outage", lambda: _arrived(far) >= 50, timeout=180)
            collect()

            # 3. A backlog above the threshold goes to the Spark job (one commit: one wake).
            big = send_dialogs(near, [20] * 20, per_transaction=20)
            sent(big, 0, 20)
            af.wait_for("the Spark backlog", lambda: _arrived(far) >= 400, timeout=420)
            collect()
            af.wait_for(
                "the transmitter to go idle",
                lambda: not [r for r in af.runs(DAG_ID) if r.state in ("queued", "running")],
                timeout=120,
            )
            reports = _reports(af)

            # 4. A timer on a queue nobody reads fires within 5 s (the watcher's due work).
            (timed,) = send_dialogs(near, [0])
            with near.transaction() as tx:
                tx.begin_conversation_timer(timed, 1)
            started = time.monotonic()
            af.wait_for("the DialogTimer", lambda: message_count(near, INIT_QUEUE) >= 1, timeout=30)
            fired_in = time.monotonic() - started
            runs = af.runs(DAG_ID)
        left = near.transmission_queue()
        timer = drain_all(near, INIT_QUEUE)
    finally:
        near.dispose()
        far.dispose()

    assert_exactly_once_in_order(got, expected, "far")
    assert sum(len(m) for m in got.values()) == 200 + 50 + 400
    assert left == []
    assert all(r.state == "success" for r in runs), [(r.run_id, r.state) for r in runs]
    assert sum(r["spark_runs"] for r in reports) >= 1, reports
    assert fired_in <= 5.0, f"the timer fired after {fired_in:.1f} s"
    assert [m.message_type_name for m in timer] == [DIALOG_TIMER]


# Eight processes to start (Redis, two workers) and a PostgreSQL metadata database to migrate:
# about 200 s on two loaded cores, where the suite's 300 s default leaves too little room.
@pytest.mark.timeout(480)
def test_under_celery_the_transmitter_runs_on_the_workers_and_delivers_once_in_order(
    tmp_path: Path, make_pg_database: Callable[..., str]
) -> None:
    """The executor-dependent subset of the test above: the transmitter's runs, started by the
    triggerer, run on the Celery workers and deliver between the two databases. Two batches on
    the same conversations: the second is delivered by a later run and lands after the first,
    each message once."""
    near, far, _, env = _network(make_pg_database)
    got: dict[uuid.UUID, list[Any]] = {}

    def collect() -> None:
        for cid, msgs in by_conversation(far, drain_all(far, TARGET_QUEUE)).items():
            got.setdefault(cid, []).extend(msgs)

    try:
        with airflow_stack(
            tmp_path,
            DAGS,
            metadata_url=make_pg_database(migrated=False),
            extra_env=env,
            executor="CeleryExecutor",
        ) as af:
            af.wait_for_dags(DAG_ID)
            handles = send_dialogs(near, [10] * 20)
            expected = {cid: range(0, 15) for cid in conversation_ids(near, handles).values()}
            af.wait_for("200 messages in the far queue", lambda: _arrived(far) >= 200, timeout=180)
            collect()
            runs_before = len(af.runs(DAG_ID))

            send_more(near, handles, 10, 5)
            af.wait_for("the 100 more", lambda: _arrived(far) >= 100, timeout=180)
            collect()
            af.wait_for(
                "the transmitter to go idle",
                lambda: not [r for r in af.runs(DAG_ID) if r.state in ("queued", "running")],
                timeout=120,
            )
            runs = af.runs(DAG_ID)
            tasks = af.tasks_by_worker(DAG_ID)  # fails unless each ran on one worker
        left = near.transmission_queue()
    finally:
        near.dispose()
        far.dispose()

    assert_exactly_once_in_order(got, expected, "far")
    assert sum(len(m) for m in got.values()) == 300
    assert left == []
    assert len(runs) > runs_before >= 1, "the second batch was not a run of its own"
    assert all(r.state == "success" for r in runs), [(r.run_id, r.state) for r in runs]
    # One task a run, each handed to one of the workers. Which worker takes a run is Celery's
    # choice (the activation test shows both at work, with two tasks at once; runs here follow
    # one another).
    assert sum(tasks.values()) == len(runs), tasks
