"""End to end: a SendOperator retried by the real scheduler sends once.

DAG ``dedupe_e2e`` (tests/dags/dedupe) runs under a real API server, scheduler and DAG processor
with the LocalExecutor. Its one task commits a SEND and then fails on its first try (injected
right after the commit, as a worker dying between the broker's commit and Airflow's record of
success would); Airflow retries it, and the retry's SEND carries the same dedupe key (the task
instance's identity, without the try number). The far queue holds the message once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select
from support.airflow_stack import airflow_stack

from airflow_broker import Broker
from airflow_broker.storage import schema as s

DAGS = Path(__file__).parent / "dags" / "dedupe"
DAG_ID = "dedupe_e2e"
FAR_QUEUE = "dedupe_far_q"

pytestmark = [pytest.mark.xdist_group("airflow_e2e"), pytest.mark.postgres, pytest.mark.slow]


def _setup(url: str) -> tuple[Broker, str]:
    b = Broker.connect(url)
    with b.definitions() as d:
        d.create_queue("dedupe_near_q")
        d.create_queue(FAR_QUEUE)
        d.create_service("//dedupe/Sender", queue="dedupe_near_q")
        d.create_service("//dedupe/Receiver", queue=FAR_QUEUE, contracts=["DEFAULT"])
    with b.transaction() as tx:
        handle = tx.begin_dialog("//dedupe/Sender", "//dedupe/Receiver")
    return b, str(handle)


def _far_bodies(b: Broker) -> list[bytes]:
    m, q = s.message, s.queue
    with b.engine.connect() as conn:
        return [
            bytes(body)
            for body in conn.execute(
                select(m.c.message_body)
                .join(q, q.c.queue_id == m.c.queue_id)
                .where(q.c.name == FAR_QUEUE)
            ).scalars()
        ]


def test_a_send_retried_after_its_commit_arrives_once(
    tmp_path: Path, make_pg_database: Callable[..., str]
) -> None:
    broker_url = make_pg_database()
    b, handle = _setup(broker_url)
    env = {
        "AIRFLOW_CONN_BROKER_DEFAULT": json.dumps(
            {"conn_type": "broker", "extra": {"url": broker_url}}
        )
    }
    with airflow_stack(
        tmp_path, DAGS, extra_env=env, components=("api-server", "scheduler", "dag-processor")
    ) as af:
        af.wait_for_dags(DAG_ID)
        conf = json.dumps({"handle": handle, "body": "order 1001"})
        af.airflow("dags", "trigger", DAG_ID, "--conf", conf)
        states = af.wait_for(
            "the run to finish",
            lambda: [r.state for r in af.runs(DAG_ID) if r.state in ("success", "failed")],
            timeout=240,
        )
        (ti,) = af.query(
            "SELECT run_id, try_number, state FROM task_instance "
            "WHERE dag_id = :d AND task_id = 'send'",
            d=DAG_ID,
        )
        history = af.query(
            "SELECT try_number, state FROM task_instance_history "
            "WHERE dag_id = :d AND task_id = 'send' ORDER BY try_number",
            d=DAG_ID,
        )
        log = "\n".join(
            p.read_text(errors="replace") for p in (af.home / "logs").rglob("*") if p.is_file()
        )
    assert states == ["success"], states
    # Ran twice: the first try failed (after its commit), the retry succeeded.
    assert (ti.try_number, ti.state) == (2, "success")
    assert [(h.try_number, h.state in ("failed", "up_for_retry")) for h in history] == [(1, True)]
    assert "injected failure after commit" in log
    # The far queue holds the message once; the key is the task instance's identity.
    assert _far_bodies(b) == [b"order 1001"]
    with b.engine.connect() as conn:
        keys = conn.execute(select(s.dedupe.c.dedupe_key)).scalars().all()
    assert keys == [f"{DAG_ID}/{ti.run_id}/send/-1"]
    with b.transaction() as tx:
        assert tx.conversation(handle).send_sequence == 1
    b.dispose()
