"""Leases in Airflow: ``ReceiveOperator(lease_seconds=...)``, ``CompleteLeaseOperator`` and
``ReleaseLeaseOperator`` executed for real against SQLite and PostgreSQL brokers
(``execute(context)``, as in test_operators.py); the long-jobs example's exactly-once finish;
and ``dags/long_handler.py`` run with ``dag.test()`` (a subprocess: this file, run as a script),
where a failed handler's lease is released at once and the run stays failed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    BUYER_QUEUE,
    NOTE,
    open_order,
    pair_behind_connection,
    receive,
    send,
)

from airflow_broker import END_DIALOG, Broker, InvalidDefinition, LeaseExpired
from airflow_broker.operators import CompleteLeaseOperator, ReceiveOperator, ReleaseLeaseOperator
from airflow_broker.provider.compat import AirflowFailException
from airflow_broker.provider.xcom import lease_from_xcom

ROOT = Path(__file__).resolve().parents[1]
CONN_ID = "broker_leases"


@pytest.fixture
def broker(broker_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    """The buyer/supplier pair on a fresh broker that Airflow connection ``broker_leases`` names."""
    yield from pair_behind_connection(broker_url, monkeypatch, CONN_ID)


class FakeTI:
    """Enough of a task instance for ``receive_task_id``."""

    def __init__(self, xcoms: dict[str, Any]) -> None:
        self.xcoms = xcoms

    def xcom_pull(self, task_ids: str, key: str = "return_value") -> Any:
        return self.xcoms.get(task_ids)


def notes_waiting(broker: Broker, *bodies: str) -> uuid.UUID:
    """A dialog whose target sent ``bodies`` to the buyer's queue; returns the buyer's handle."""
    h, target = open_order(broker)
    send(broker, target, NOTE, *bodies)
    return h


def lease_op(**kwargs: Any) -> ReceiveOperator:
    return ReceiveOperator(
        task_id="receive", broker_conn_id=CONN_ID, queue=BUYER_QUEUE, lease_seconds=60, **kwargs
    )


def xcom_safe(value: Any) -> Any:
    encoded = json.dumps(value, allow_nan=False)
    assert json.loads(encoded) == value
    return value


# --------------------------------------------------------------------------------------------
# ReceiveOperator(lease_seconds=...)


def test_receive_with_a_lease_returns_the_lease_in_xcom(broker: Broker) -> None:
    h = notes_waiting(broker, "one", "two")
    before = datetime.now(UTC)
    leased = xcom_safe(lease_op().execute({}))
    assert set(leased) == {"token", "queue", "conversation_group_id", "expires_at", "messages"}
    assert uuid.UUID(leased["token"]) and leased["queue"] == BUYER_QUEUE
    assert [m["body_text"] for m in leased["messages"]] == ["one", "two"]
    assert {m["conversation_handle"] for m in leased["messages"]} == {str(h)}
    assert leased["messages"][0]["conversation_group_id"] == leased["conversation_group_id"]
    expires_at = datetime.fromisoformat(leased["expires_at"])
    assert 55 <= (expires_at - before).total_seconds() <= 65
    # Read back as the engine's Lease, messages and all.
    lease = lease_from_xcom(leased)
    assert lease is not None
    assert (str(lease.token), lease.queue, lease.expires_at) == (
        leased["token"],
        BUYER_QUEUE,
        expires_at,
    )
    assert [m.text() for m in lease.messages] == ["one", "two"]
    assert [m.receive_count for m in lease.messages] == [1, 1]


def test_receive_with_a_lease_on_an_empty_queue_returns_none(broker: Broker) -> None:
    assert lease_op(wait_seconds=0.2).execute({}) is None


def test_a_lease_holds_its_group_and_only_its_group(broker: Broker) -> None:
    _, target = open_order(broker)
    send(broker, target, NOTE, "first")
    leased = lease_op().execute({})
    send(broker, target, NOTE, "meanwhile")  # a new message of the leased group waits too
    notes_waiting(broker, "another group")
    # Nobody else gets the leased group: not RECEIVE, not another lease. Other groups flow.
    assert [m.text() for m in receive(broker, BUYER_QUEUE)] == ["another group"]
    assert receive(broker, BUYER_QUEUE) == []
    assert receive(broker, BUYER_QUEUE, conversation_group=leased["conversation_group_id"]) == []
    assert lease_op().execute({}) is None


def test_complete_removes_exactly_the_leased_messages(broker: Broker) -> None:
    _, target = open_order(broker)
    send(broker, target, NOTE, "a", "b")
    leased = lease_op().execute({})
    send(broker, target, NOTE, "c")  # arrives while leased: waits behind the lease
    assert receive(broker, BUYER_QUEUE) == []
    op = CompleteLeaseOperator(task_id="complete", broker_conn_id=CONN_ID, receive_task_id="r")
    assert op.execute({"ti": FakeTI({"r": leased})}) is None
    assert [m.text() for m in receive(broker, BUYER_QUEUE)] == ["c"]
    # Completed: nothing left to release.
    release = ReleaseLeaseOperator(task_id="release", broker_conn_id=CONN_ID, lease=leased)
    assert release.execute({}) is False


def test_no_lease_means_nothing_to_do(broker: Broker) -> None:
    notes_waiting(broker, "untouched")
    for op in (
        CompleteLeaseOperator(task_id="c", broker_conn_id=CONN_ID, lease=""),
        CompleteLeaseOperator(task_id="c2", broker_conn_id=CONN_ID, receive_task_id="r"),
        ReleaseLeaseOperator(task_id="r1", broker_conn_id=CONN_ID, lease="None"),
        ReleaseLeaseOperator(task_id="r2", broker_conn_id=CONN_ID, receive_task_id="r"),
    ):
        assert not op.execute({"ti": FakeTI({})})
    assert [m.text() for m in receive(broker, BUYER_QUEUE)] == ["untouched"]


def test_release_gives_the_messages_back_at_once(broker: Broker) -> None:
    notes_waiting(broker, "again")
    leased = lease_op().execute({})
    # A lease pulled through a template arrives as the dict's Python literal.
    release = ReleaseLeaseOperator(task_id="release", broker_conn_id=CONN_ID, lease=repr(leased))
    assert release.execute({}) is True
    (m,) = receive(broker, BUYER_QUEUE)
    assert (m.text(), m.receive_count) == ("again", 2)  # the release was a failed attempt


def test_release_with_a_delay_keeps_them_back_for_that_long(broker: Broker) -> None:
    notes_waiting(broker, "later")
    leased = lease_op().execute({})
    ReleaseLeaseOperator(task_id="release", broker_conn_id=CONN_ID, lease=leased, delay=60).execute(
        {}
    )
    assert receive(broker, BUYER_QUEUE) == []
    assert lease_op().execute({}) is None


def test_complete_after_expiry_and_a_new_lease_fails_clearly(broker: Broker) -> None:
    notes_waiting(broker, "slow")
    first = ReceiveOperator(
        task_id="receive", broker_conn_id=CONN_ID, queue=BUYER_QUEUE, lease_seconds=0.5
    ).execute({})
    time.sleep(0.8)
    broker.run_due()  # the due-work pass returns the expired lease's messages
    second = lease_op().execute({})
    assert second["conversation_group_id"] == first["conversation_group_id"]
    assert [m["body_text"] for m in second["messages"]] == ["slow"]
    late = CompleteLeaseOperator(task_id="complete", broker_conn_id=CONN_ID, lease=first)
    with pytest.raises(AirflowFailException) as raised:
        late.execute({})
    text = str(raised.value)
    assert f"lease {first['token']} of queue {BUYER_QUEUE!r}" in text
    assert f"went back to queue {BUYER_QUEUE!r}" in text and "Nothing was removed" in text
    assert isinstance(raised.value.__cause__, LeaseExpired)
    # The old lease has nothing to release either; the new one completes normally.
    assert (
        ReleaseLeaseOperator(task_id="r", broker_conn_id=CONN_ID, lease=first).execute({}) is False
    )
    CompleteLeaseOperator(task_id="complete2", broker_conn_id=CONN_ID, lease=second).execute({})
    assert receive(broker, BUYER_QUEUE) == []


# --------------------------------------------------------------------------------------------
# Arguments, XCom shapes, Airflow settings


def test_lease_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="give conversation_group, not conversation_handle"):
        lease_op(conversation_handle=str(uuid.uuid4()))
    for bad in (0, -1, "600", True):
        with pytest.raises(ValueError, match="lease_seconds must be positive"):
            ReceiveOperator(task_id="r", queue="q", lease_seconds=bad)
    for cls in (CompleteLeaseOperator, ReleaseLeaseOperator):
        with pytest.raises(ValueError, match="exactly one of them"):
            cls(task_id="x")
        with pytest.raises(ValueError, match="exactly one of them"):
            cls(task_id="x", lease={}, receive_task_id="r")
    with pytest.raises(ValueError, match="delay must be 0 or more"):
        ReleaseLeaseOperator(task_id="x", lease={}, delay=-1)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("not a lease", r"lease 'not a lease' is not a lease"),
        (["x"], "lease must be a lease .* not list"),
        ({"token": "x"}, "lease is not a lease .*KeyError"),
        ({"token": "nope", "queue": "q", "messages": [], "conversation_group_id": "x",
          "expires_at": "2026-01-01T00:00:00+00:00"}, "badly formed hexadecimal UUID"),
    ],
)  # fmt: skip
def test_what_is_not_a_lease_is_refused(value: Any, message: str) -> None:
    with pytest.raises(InvalidDefinition, match=message):
        lease_from_xcom(value)


def test_lease_from_xcom_reads_json_text_and_nothing() -> None:
    token, group = uuid.uuid4(), uuid.uuid4()
    value = {
        "token": str(token),
        "queue": "q",
        "conversation_group_id": str(group),
        "expires_at": "2026-01-01T00:00:00",  # naive: read as UTC
        "messages": [],
    }
    lease = lease_from_xcom(json.dumps(value))
    assert lease is not None and (lease.token, lease.conversation_group_id) == (token, group)
    assert lease.expires_at == datetime(2026, 1, 1, tzinfo=UTC)
    assert [lease_from_xcom(v) for v in (None, "", " null ", {})] == [None] * 4


def test_airflow_settings_of_the_lease_operators() -> None:
    from airflow_broker.provider.compat import BaseOperator

    release = ReleaseLeaseOperator(task_id="release", lease={})
    assert release.trigger_rule == "one_failed"
    assert release.is_teardown is True  # left out of the DAG run's state
    plain = ReleaseLeaseOperator(task_id="plain", lease={}, teardown=False, trigger_rule="all_done")
    assert (plain.is_teardown, plain.trigger_rule) == (False, "all_done")
    complete = CompleteLeaseOperator(task_id="complete", lease={})
    assert complete.trigger_rule == "all_success" and complete.is_teardown is False
    assert (
        CompleteLeaseOperator.template_fields == ReleaseLeaseOperator.template_fields == ("lease",)
    )
    assert ReceiveOperator(task_id="r", queue="q", lease_seconds=5).template_fields == (
        "queue_name",
        "conversation_handle",
        "conversation_group",
    )
    for name in ("lease", "receive_task_id", "delay", "teardown", "lease_seconds"):
        assert not hasattr(BaseOperator, name), name


def test_the_provider_lists_the_lease_operators() -> None:
    from airflow_broker.provider import get_provider_info

    (operators,) = get_provider_info()["operators"]
    assert "airflow_broker.operators.lease" in operators["python-modules"]


# --------------------------------------------------------------------------------------------
# The long-jobs example, without Airflow: exactly once


def test_long_jobs_finish_exactly_once_even_when_a_lease_expired(broker_url: str) -> None:
    from sqlalchemy import select

    from airflow_broker.examples import long_jobs as lj

    b = Broker.connect(broker_url)
    lj.setup(b)
    lj.setup(b)  # again: changes nothing
    with b.transaction() as tx:
        lj.submit_job(tx, [1, 2, 3, 4], job_id="j1")
    slow = b.lease(lj.JOBS_QUEUE, lease_seconds=0.5)
    assert slow is not None
    slow_outcomes = lj.work(slow, 0)
    time.sleep(0.8)
    b.run_due()  # the slow handler's lease lapses; another reader takes the job
    fast = b.lease(lj.JOBS_QUEUE, lease_seconds=60)
    assert fast is not None and fast.conversation_group_id == slow.conversation_group_id
    assert fast.messages[0].receive_count == 2
    with pytest.raises(LeaseExpired), b.transaction() as tx:
        lj.finish(tx, slow, slow_outcomes)  # rolled back whole: no row, no reply
    with b.transaction() as tx:
        (result,) = lj.finish(tx, fast, lj.work(fast, 0.1, broker=b, lease_seconds=60))
    assert result == {"job_id": "j1", "count": 4, "total": 10, "mean": 2.5}
    with b.engine.connect() as conn:
        rows = conn.execute(select(lj.long_job_result)).all()
    assert [(r.job_id, r.receive_count, json.loads(r.result)) for r in rows] == [("j1", 2, result)]
    replies = receive(b, lj.RESULTS_QUEUE)
    assert [m.message_type_name for m in replies] == [lj.RESULT, END_DIALOG]
    assert replies[0].json() == result
    assert receive(b, lj.JOBS_QUEUE) == []
    b.dispose()


def test_long_jobs_work_extends_the_lease_while_it_works(broker: Broker) -> None:
    from airflow_broker.examples import long_jobs as lj

    lj.setup(broker)
    with broker.transaction() as tx:
        lj.submit_job(tx, [5], job_id="j")
    lease = broker.lease(lj.JOBS_QUEUE, lease_seconds=1)
    assert lease is not None
    # 2.5 s of work on a 1 s lease, extended each time less than half of it is left.
    lj.work(lease, 2.5, broker=broker, lease_seconds=1, sleep=lambda s: time.sleep(min(s, 0.2)))
    broker.run_due()
    with broker.transaction() as tx:
        (result,) = lj.finish(tx, lease, lj.work(lease, 0))
    assert result["total"] == 5


# --------------------------------------------------------------------------------------------
# dags/long_handler.py with dag.test()


def test_long_handler_dag(tmp_path: Path) -> None:
    home = tmp_path / "airflow"
    home.mkdir()
    broker_url = f"sqlite:///{tmp_path / 'broker.db'}"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_BROKER_ADDRESS_"))
    }
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(ROOT / "dags"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home / 'airflow.db'}",
        AIRFLOW_CONN_BROKER_DEFAULT=json.dumps(
            {"conn_type": "broker", "extra": {"url": broker_url}}
        ),
        PYTHONUNBUFFERED="1",
    )
    out, log = tmp_path / "result.json", tmp_path / "scenario.log"
    airflow = shutil.which("airflow", path=env["PATH"]) or "airflow"
    with log.open("w") as sink:
        for args in ([airflow, "db", "migrate"], [sys.executable, __file__, str(out), broker_url]):
            done = subprocess.run(
                args, env=env, cwd=home, stdout=sink, stderr=subprocess.STDOUT, timeout=280
            )
            assert done.returncode == 0, log.read_text(errors="replace")[-6000:]
    data = json.loads(out.read_text())
    assert data["import_errors"] == {}
    states = [(r["label"], r["state"], r["tasks"]) for r in data["runs"]]
    ok = "success"
    assert states == [
        ("setup", ok, {"migrate": ok, "declare": ok, "create_table": ok}),
        ("submit good", ok, {"submit": ok}),
        ("handle good", ok, {"receive": ok, "handle": ok, "release": "skipped"}),
        ("submit bad", ok, {"submit": ok}),
        # The handler failed: its lease was released at once, and the run stayed failed.
        ("handle bad", "failed", {"receive": ok, "handle": "failed", "release": ok}),
    ]
    assert data["results"] == [["good", 1, {"job_id": "good", "count": 3, "total": 6, "mean": 2.0}]]
    assert data["replies"] == [["Result", {"job_id": "good", "count": 3, "total": 6, "mean": 2.0}]]
    # The bad job is ready again at once (not after the 600 s lease), a second attempt.
    assert data["bad_job_again"] == {"job_id": "bad", "receive_count": 2}


def scenario(out: str, broker_url: str) -> None:
    """The DAG runs (in the subprocess): setup, a good job, a job the handler cannot do."""
    from airflow.dag_processing.dagbag import DagBag
    from sqlalchemy import select

    from airflow_broker.examples import long_jobs as lj

    bag = DagBag(dag_folder=str(ROOT / "dags" / "long_handler.py"))
    runs: list[dict[str, Any]] = []

    def run(dag_id: str, label: str, **conf: Any) -> None:
        dag_run = bag.dags[dag_id].test(run_conf=conf or None)
        tasks = {
            ti.task_id: str(getattr(ti.state, "value", ti.state))
            for ti in dag_run.get_task_instances()
        }
        state = str(getattr(dag_run.state, "value", dag_run.state))
        runs.append({"label": label, "state": state, "tasks": tasks})
        print(f"=== {label}: {state} {tasks}", flush=True)

    run("long_handler_setup", "setup")
    run("long_handler_submit", "submit good", numbers=[1, 2, 3], job_id="good")
    run(lj.HANDLER_DAG, "handle good", work_seconds=1)
    run("long_handler_submit", "submit bad", numbers=["x"], job_id="bad")
    run(lj.HANDLER_DAG, "handle bad", work_seconds=1)
    b = Broker.connect(broker_url)
    with b.engine.connect() as conn:
        rows = conn.execute(select(lj.long_job_result)).all()
    replies = [m for m in receive(b, lj.RESULTS_QUEUE) if m.message_type_name == lj.RESULT]
    again = receive(b, lj.JOBS_QUEUE)
    result = {
        "import_errors": {str(k): str(v) for k, v in bag.import_errors.items()},
        "runs": runs,
        "results": [[r.job_id, r.receive_count, json.loads(r.result)] for r in rows],
        "replies": [[m.message_type_name.rsplit("/", 1)[1], m.json()] for m in replies],
        "bad_job_again": {
            "job_id": again[0].json()["job_id"],
            "receive_count": again[0].receive_count,
        },
    }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    scenario(*sys.argv[1:])
