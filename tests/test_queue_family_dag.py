"""``queue_family_dag``: one reader DAG for many queues (issue 46), and its
``DrainFamilyOperator``, which reads the queues named by the asset events that started the run.

The DAG is checked as Airflow sees it (its schedule, serialized and back); the operator runs
against real SQLite and PostgreSQL broker databases with a fake context holding asset events
whose payloads the queues' monitors made (``Monitor.check()``, as the trigger does).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import text

from airflow_broker import Activation, Broker, InvalidDefinition
from airflow_broker.activation import Fire, Monitor, readers
from airflow_broker.operators import DrainFamilyOperator
from airflow_broker.provider.readers import MAX_ACTIVE_RUNS, queue_family_dag
from airflow_broker.provider.triggers.activation import QueueActivationTrigger

CONN_ID = "broker_family"
QUEUES = ["fam_a", "fam_b", "fam_c"]
SENDER, SENDER_QUEUE = "//fam/Sender", "fam_sender_q"
HANDLER = "test_queue_family_dag:record"


def service(queue: str) -> str:
    return f"//fam/{queue}"


def record(tx: Any, messages: list[Any]) -> None:
    """The family's handler (``test_queue_family_dag:record``): one row per message, in the
    RECEIVE's transaction; a body ``"boom"`` raises (the transaction rolls back)."""
    for m in messages:
        if m.text() == "boom":
            raise RuntimeError("handler failed on a boom")
        tx.connection.execute(
            text("INSERT INTO fam_seen (queue, handle, body) VALUES (:q, :h, :b)"),
            {"q": m.service_name, "h": str(m.conversation_handle), "b": m.text()},
        )


@pytest.fixture
def broker(broker_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    """Three queues (fam_a: max_readers 2), each with a service, a sender, the handler's table;
    the Airflow connection ``broker_family`` names the database."""
    conn = json.dumps({"conn_type": "broker", "extra": {"url": broker_url}})
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", conn)
    b = Broker.connect(broker_url)
    with b.definitions() as d:
        for q in QUEUES:
            d.create_queue(q, activation=Activation(max_readers=2 if q == "fam_a" else 1))
            d.create_service(service(q), queue=q, contracts=["DEFAULT"])
        d.create_queue(SENDER_QUEUE)
        d.create_service(SENDER, queue=SENDER_QUEUE)
    with b.engine.begin() as c:
        c.execute(text("CREATE TABLE fam_seen (queue VARCHAR(64), handle VARCHAR(36), body TEXT)"))
    yield b
    b.dispose()


def send(b: Broker, queue: str, *bodies: str, dialogs: int = 1) -> list[Any]:
    with b.transaction() as tx:
        handles = [tx.begin_dialog(SENDER, service(queue)) for _ in range(dialogs)]
        for body in bodies:
            tx.send(handles, body=body)
    return handles


def seen(b: Broker) -> list[tuple[str, str]]:
    with b.engine.connect() as c:
        rows = c.execute(text("SELECT queue, body FROM fam_seen ORDER BY queue, body"))
        return [(str(q).removeprefix("//fam/"), str(body)) for q, body in rows]


def depth(b: Broker, queue: str) -> int:
    with b.engine.connect() as c:
        return int(
            c.execute(
                text(
                    "SELECT count(*) FROM broker_message m JOIN broker_queue q"
                    " ON q.queue_id = m.queue_id WHERE q.name = :q"
                ),
                {"q": queue},
            ).scalar_one()
        )


def fire(b: Broker, queue: str) -> Fire:
    found = Monitor(b, queue, sample_seconds=0).check()
    assert found is not None, f"the monitor of {queue} fired for nothing"
    return found


def event(payload: dict[str, Any] | None, asset: str = "", at: int = 0) -> SimpleNamespace:
    extra = {} if payload is None else {"from_trigger": True, "payload": payload}
    return SimpleNamespace(
        extra=extra, asset=SimpleNamespace(name=asset), timestamp=at, id=f"event-{at}"
    )


def context(*events: SimpleNamespace) -> dict[str, Any]:
    """A task's context whose ``triggering_asset_events`` hold ``events``, by asset."""
    by_asset: dict[str, list[SimpleNamespace]] = {}
    for e in events:
        by_asset.setdefault(e.asset.name or "asset", []).append(e)
    ti = SimpleNamespace(dag_id="family", run_id="run_1", task_id="drain")
    return {"ti": ti, "triggering_asset_events": by_asset}


def operator(**kwargs: Any) -> DrainFamilyOperator:
    kwargs.setdefault("handler", HANDLER)
    return DrainFamilyOperator(task_id="drain", queues=QUEUES, broker_conn_id=CONN_ID, **kwargs)


# --------------------------------------------------------------------------- the DAG


def _serialize(dag: Any) -> Any:
    import airflow.serialization.serialized_objects as serialized

    # DagSerialization from Airflow 3.2, SerializedDAG before
    codec: Any = getattr(serialized, "DagSerialization", None) or serialized.SerializedDAG
    return codec.from_dict(json.loads(json.dumps(codec.to_dict(dag))))


def test_the_dag_is_scheduled_on_every_queues_asset_each_with_its_trigger() -> None:
    queues = [f"tenant_{i}" for i in range(9)]
    dag = queue_family_dag(
        "family", queues=queues, handler=HANDLER, broker_conn_id="brk", max_readers=2
    )
    from airflow.sdk import AssetAny

    condition = dag.timetable.asset_condition
    assert isinstance(condition, AssetAny)
    assets: list[Any] = list(condition.objects)
    assert [a.name for a in assets] == [f"broker_queue_{q}" for q in queues]
    for queue, asset in zip(queues, assets, strict=True):
        (watcher,) = asset.watchers
        trigger = watcher.trigger
        assert isinstance(trigger, QueueActivationTrigger)
        assert (trigger.queue_name, trigger.broker_conn_id, trigger.max_readers) == (
            queue,
            "brk",
            2,
        )
    # One task, reading the family; as many runs (and tasks) at once as readers, capped.
    assert list(dag.task_dict) == ["drain"]
    task = dag.task_dict["drain"]
    assert isinstance(task, DrainFamilyOperator)
    assert task.queues == queues and task.max_readers == 2 and task.broker_conn_id == "brk"
    assert (dag.max_active_runs, dag.max_active_tasks) == (MAX_ACTIVE_RUNS, MAX_ACTIVE_RUNS)
    # As the scheduler and triggerer see it: serialized, every asset keeps its watcher.
    back = _serialize(dag)
    names = {a.name: a for a in back.timetable.asset_condition.objects}
    assert set(names) == {f"broker_queue_{q}" for q in queues}
    for queue in queues:
        (watcher,) = names[f"broker_queue_{queue}"].watchers
        trigger = watcher.trigger
        if not isinstance(trigger, dict):  # newest: the trigger's classpath and kwargs
            trigger = {"classpath": trigger.classpath, "kwargs": trigger.kwargs}
        assert trigger["classpath"].endswith("triggers.activation.QueueActivationTrigger")
        assert trigger["kwargs"]["queue"] == queue
    assert back.max_active_runs == MAX_ACTIVE_RUNS


def test_max_active_runs_follows_the_readers_capped_and_can_be_given() -> None:
    one = queue_family_dag("one", queues=["q"], handler=HANDLER)
    assert (one.max_active_runs, one.max_active_tasks) == (1, 1)
    assert one.timetable.asset_condition.name == "broker_queue_q"  # one asset, no AssetAny
    three = queue_family_dag("three", queues=QUEUES, handler=HANDLER, max_readers=2)
    assert three.max_active_runs == 6
    wide = queue_family_dag("wide", queues=[f"q{i}" for i in range(1000)], handler=HANDLER)
    assert wide.max_active_runs == MAX_ACTIVE_RUNS
    given = queue_family_dag(
        "given",
        queues=QUEUES,
        handler=HANDLER,
        max_active_runs=40,
        tags=["mine"],
        trigger_kwargs={"mode": "depth", "min_depth": 5},
        operator_kwargs={"wait_seconds": 0.5, "retries": 2},
    )
    assert (given.max_active_runs, given.max_active_tasks, given.tags) == (40, 40, {"mine"})
    trigger = given.timetable.asset_condition.objects[0].watchers[0].trigger
    assert (trigger.mode, trigger.min_depth) == ("depth", 5)
    task = given.task_dict["drain"]
    assert (task.wait_seconds, task.retries) == (0.5, 2)


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"queues": []}, "queues is empty"),
        ({"queues": ["a", "b", "a", "c", "b"]}, "named more than once: a, b"),
        ({"queues": "a"}, "must be a list of queue names, not str"),
        ({"queues": ["a", ""]}, "non-empty strings"),
        ({"handler": "pkg.mod.fn"}, "'package.module:function', not 'pkg.mod.fn'"),
        ({"handler": "pkg mod:fn"}, "'package.module:function'"),
        ({"handler": 42}, "'package.module:function', not 42"),
        ({"max_readers": 0}, "max_readers must be a whole number >= 1, not 0"),
        ({"max_active_runs": 0}, "max_active_runs must be a whole number >= 1"),
        ({"schedule": "@daily"}, "the schedule is the queues' assets"),
    ],
)
def test_bad_arguments_are_refused_naming_the_dag_and_the_problem(
    kwargs: dict[str, Any], problem: str
) -> None:
    arguments: dict[str, Any] = {"queues": QUEUES, "handler": HANDLER, **kwargs}
    with pytest.raises(InvalidDefinition, match="queue_family_dag 'readers'") as raised:
        queue_family_dag("readers", **arguments)
    assert problem in str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_a_callable_handler_is_taken() -> None:
    dag = queue_family_dag("callable", queues=QUEUES, handler=record)
    assert dag.task_dict["drain"].handler is record


# --------------------------------------------------------------------------- the operator


def test_the_run_reads_the_queue_its_event_names_and_takes_its_fire(broker: Broker) -> None:
    send(broker, "fam_a", "a1")
    send(broker, "fam_b", "b1", "b2", dialogs=2)
    fired = fire(broker, "fam_b")
    result = operator().execute(context(event(fired.payload(), "broker_queue_fam_b")))
    assert seen(broker) == [("fam_b", "b1"), ("fam_b", "b1"), ("fam_b", "b2"), ("fam_b", "b2")]
    assert list(result["queues"]) == ["fam_b"]
    assert result["queues"]["fam_b"] == {
        "admitted": True,
        "reader_id": fired.fire_id,
        "batches": 2,
        "messages": 4,
        "drained": True,
    }
    assert (result["batches"], result["messages"]) == (2, 4)
    [row] = readers(broker, "fam_b")
    assert (str(row.reader_id), row.outcome, row.label) == (
        fired.fire_id,
        "drained",
        "family/run_1/drain",
    )
    assert depth(broker, "fam_a") == 1 and readers(broker, "fam_a") == []  # not this run's


def test_a_run_merged_from_several_queues_events_reads_each_and_releases_the_rest(
    broker: Broker,
) -> None:
    """Airflow merged five events into one run: two fires of fam_a (max_readers 2: the queue
    grew before any reader came), one of fam_c, and fam_a's again. Each queue named is read
    once, in the order of its first event; fam_a's older fire is released (``merged``)."""
    a_handles = send(broker, "fam_a", "a1", dialogs=2)
    first_a = fire(broker, "fam_a")
    send(broker, "fam_c", "c1")
    c = fire(broker, "fam_c")
    with broker.transaction() as tx:
        tx.send(a_handles, body="a2")
    second_a = fire(broker, "fam_a")
    send(broker, "fam_b", "b1")  # no event names fam_b: left for its own run
    ctx = context(
        event(first_a.payload(), "broker_queue_fam_a", at=1),
        event(c.payload(), "broker_queue_fam_c", at=2),
        event(second_a.payload(), "broker_queue_fam_a", at=3),
        event(second_a.payload(), "broker_queue_fam_a", at=4),  # the same fire twice
    )
    result = operator().execute(ctx)
    assert list(result["queues"]) == ["fam_a", "fam_c"]
    assert result["queues"]["fam_a"]["reader_id"] == second_a.fire_id
    assert result["queues"]["fam_c"]["reader_id"] == c.fire_id
    assert seen(broker) == [
        ("fam_a", "a1"),
        ("fam_a", "a1"),
        ("fam_a", "a2"),
        ("fam_a", "a2"),
        ("fam_c", "c1"),
    ]
    outcomes = {str(r.reader_id): r.outcome for r in readers(broker, "fam_a")}
    assert outcomes == {first_a.fire_id: "merged", second_a.fire_id: "drained"}
    assert [r.outcome for r in readers(broker, "fam_c")] == ["drained"]
    assert depth(broker, "fam_b") == 1


def test_a_run_without_asset_events_reads_every_queue(broker: Broker) -> None:
    for q in QUEUES:
        send(broker, q, f"{q[-1]}1")
    result = operator().execute(context())
    assert list(result["queues"]) == QUEUES
    assert seen(broker) == [("fam_a", "a1"), ("fam_b", "b1"), ("fam_c", "c1")]


def test_an_event_made_by_hand_names_its_queue_by_its_asset(broker: Broker) -> None:
    send(broker, "fam_c", "c1")
    send(broker, "fam_b", "b1")
    ctx = context(event(None, "broker_queue_fam_c"), event({"queue": "elsewhere"}, "other"))
    result = operator().execute(ctx)
    assert list(result["queues"]) == ["fam_c"]
    assert seen(broker) == [("fam_c", "c1")]


def test_a_failing_queue_does_not_stop_the_others_and_fails_the_task(broker: Broker) -> None:
    send(broker, "fam_a", "boom")
    send(broker, "fam_b", "b1")
    ctx = context(
        event(fire(broker, "fam_a").payload(), "broker_queue_fam_a", at=1),
        event(fire(broker, "fam_b").payload(), "broker_queue_fam_b", at=2),
    )
    with pytest.raises(RuntimeError, match="boom") as raised:
        operator().execute(ctx)
    assert "1 of 2 queue(s) failed: fam_a" in "".join(getattr(raised.value, "__notes__", []))
    assert seen(broker) == [("fam_b", "b1")]
    assert depth(broker, "fam_a") == 1  # rolled back: still on its queue
    assert [r.outcome for r in readers(broker, "fam_a")] == ["failed"]


def test_the_operator_refuses_bad_queues_naming_the_task() -> None:
    with pytest.raises(InvalidDefinition, match=r"task 'drain': queue.*more than once: x"):
        DrainFamilyOperator(task_id="drain", queues=["x", "x"], handler=HANDLER)


def test_a_run_reads_its_queues_in_parallel_when_asked(broker: Broker) -> None:
    events = []
    for n, q in enumerate(QUEUES):
        send(broker, q, f"{q[-1]}1", f"{q[-1]}2", dialogs=2)
        events.append(event(fire(broker, q).payload(), f"broker_queue_{q}", at=n))
    result = operator(parallel=3).execute(context(*events))
    assert list(result["queues"]) == QUEUES  # in the events' order, whichever ended first
    assert result["messages"] == 12
    assert len(seen(broker)) == 12
    for q in QUEUES:
        assert [r.outcome for r in readers(broker, q)] == ["drained"]
    with pytest.raises(InvalidDefinition, match="parallel must be a whole number >= 1, not 0"):
        operator(parallel=0)
