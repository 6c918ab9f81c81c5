"""Activation latency under the real triggerer, beside the scheduler's own latency.

Run from the repository root::

    python -m bench.activation                  # 50 activations, 20 plain runs
    python -m bench.activation --activations 20
    python -m bench.activation --scheduler-idle-sleep 0.2 --metadata sqlite

What is measured, on a real Airflow deployment (API server, scheduler, DAG processor, triggerer,
LocalExecutor; ``tests/support/airflow_stack.py``) with the broker on a scratch PostgreSQL
database:

- activation: a SEND is committed from outside Airflow (the message body carries the commit
  time); the triggerer's ``QueueActivationTrigger`` notices, the scheduler starts a run of the
  reader DAG ``latency_reader`` (``bench/dags/activation_latency.py``), whose task RECEIVEs the
  message and records when. Latency = first RECEIVE - committed SEND. One activation at a time:
  the next SEND waits until no reader run is active, so every measurement is a fresh start, and
  then a random delay (uniform over ``--jitter`` seconds, 1 s by default; seeded). Without it
  the SENDs lock onto Airflow's loops: each one followed the last run's end by a nearly fixed
  time, so it met the triggerer's once-a-second loop at nearly the same point every time, and
  the triggerer's step measured about a constant set by the machine's speed (p50 0.37 s on
  one machine; 0.68 s on the next, p95 0.85 s) instead of the spread a SEND from outside
  Airflow meets (with the delays: p50 0.35 and 0.45 s, p95 0.92 s). The same code's
  activation p50 was 1.18 s without the delays and 0.85 and 0.96 s in two runs with them;
  TriggerDagRunOperator's was 2.09 to 2.11 s in all three.
- scheduler: the same deployment's latency for a plain ``TriggerDagRunOperator`` run: a task
  stamps the time and triggers ``latency_target``, whose first task records when it started.
  Each run is triggered after the same random delays as the SENDs.

The metadata database is a scratch PostgreSQL database (``--metadata sqlite`` for a SQLite
file). Both latencies are mostly the scheduler's: its loop sleeps up to
``[scheduler] scheduler_idle_sleep_time`` (Airflow's default 1 s; ``--scheduler-idle-sleep``)
when it found nothing to do, and an asset event becomes a run, the run's task is queued and the
task starts on successive loops. The settings used are printed with the results.

Prints p50 and p95 of both, the activation's steps by the metadata database's timestamps (the
asset event, the reader run, its task instance), then
``target activation_p50: SECONDS (goal <= 2.0)`` and
``target activation_vs_scheduler_p50: RATIO (goal <= 0.5)`` (activation p50 over the
scheduler's).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import text

from airflow_broker import Activation, Broker
from airflow_broker.provider.compat import AIRFLOW_VERSION as airflow_version
from bench._scratch import ScratchServer
from tests.support.airflow_stack import AirflowStack, airflow_stack

DAGS = Path(__file__).parent / "dags"
QUEUE = "latency_q"
GOAL_P50 = 2.0
#: the seed of the delays before each SEND (the same delays in every run)
JITTER_SEED = 16
#: issue 16: cold activation at most half the scheduler's own start latency
GOAL_VS_SCHEDULER = 0.5


def _setup_broker(url: str) -> Broker:
    broker = Broker.connect(url)
    broker.migrate()
    with broker.definitions() as d:
        d.create_queue(QUEUE, activation=Activation(max_readers=4, reader="latency_reader"))
        d.create_queue("latency_sender_q")
        d.create_service("//bench/LatencyTarget", queue=QUEUE, contracts=["DEFAULT"])
        d.create_service("//bench/LatencySender", queue="latency_sender_q")
    with broker.engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE bench_latency (id SERIAL PRIMARY KEY, kind TEXT NOT NULL, "
                "started DOUBLE PRECISION NOT NULL, seen DOUBLE PRECISION NOT NULL)"
            )
        )
    return broker


def _count(broker: Broker, kind: str) -> int:
    with broker.engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM bench_latency WHERE kind = :k"), {"k": kind}
            ).scalar_one()
        )


def _latencies(broker: Broker, kind: str) -> list[float]:
    with broker.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT seen - started FROM bench_latency WHERE kind = :k ORDER BY id"),
            {"k": kind},
        ).scalars()
        return [float(v) for v in rows]


def _send(broker: Broker) -> None:
    with broker.transaction() as tx:
        h = tx.begin_dialog("//bench/LatencySender", "//bench/LatencyTarget")
        tx.send(h, body={"sent_at": time.time()})
        tx.end_conversation(h)


def send_delays(jitter: float) -> Callable[[], None]:
    """A pause before each SEND, uniform over ``jitter`` seconds (seeded: the same delays in
    every run), so that SENDs meet Airflow's loops at any point of them, as SENDs from outside
    Airflow do, instead of locking onto them one activation after another."""
    delays = random.Random(JITTER_SEED)
    return lambda: time.sleep(delays.uniform(0.0, jitter))


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value:g}")
    return value


def add_jitter(p: argparse.ArgumentParser) -> None:
    """``--jitter``: the longest delay :func:`send_delays` waits before a SEND."""
    p.add_argument(
        "--jitter",
        type=_seconds,
        default=1.0,
        help="seconds: each SEND waits a random delay up to this long (0: none)",
    )


def _idle(af: AirflowStack, dag_id: str) -> bool:
    return not [r for r in af.runs(dag_id) if r.state in ("queued", "running")]


def measure(
    af: AirflowStack, broker: Broker, activations: int, plain: int, jitter: float = 0.0
) -> None:
    af.wait_for_dags("latency_reader", "latency_plain", "latency_target")
    # Warm up: the watcher's trigger is running once one activation went through.
    _send(broker)
    af.wait_for("the first activation", lambda: _count(broker, "activation") >= 1, timeout=240)
    af.wait_for("the reader to finish", lambda: _idle(af, "latency_reader"))
    base = _count(broker, "activation")
    pause = send_delays(jitter)
    for i in range(activations):
        pause()
        _send(broker)
        want = base + i + 1
        af.wait_for(
            f"activation {i + 1}", lambda w=want: _count(broker, "activation") >= w, every=0.05
        )
        af.wait_for("the reader to finish", lambda: _idle(af, "latency_reader"), every=0.1)
        print(f"  activation {i + 1}/{activations}", file=sys.stderr, flush=True)
    for i in range(plain):
        pause()  # the same delays: the peer's run meets the scheduler's loop at any point too
        af.airflow("dags", "trigger", "latency_plain")
        af.wait_for(
            f"plain run {i + 1}", lambda w=i + 1: _count(broker, "scheduler") >= w, every=0.1
        )
        af.wait_for("the target to finish", lambda: _idle(af, "latency_target"), every=0.1)


#: Where an activation's time goes, by the metadata database's own timestamps (segment name,
#: from, to): each reader run's asset event, the run, and its task instance.
STEPS = (
    ("SEND -> asset event logged", "sent", "event"),
    ("asset event -> run queued", "event", "run_queued"),
    ("run queued -> run started", "run_queued", "run_started"),
    ("run started -> task scheduled", "run_started", "ti_scheduled"),
    ("task scheduled -> task queued", "ti_scheduled", "ti_queued"),
    ("task queued -> task started", "ti_queued", "ti_started"),
    ("task started -> execute()", "ti_started", "executed"),
)

_READER_RUNS = text(
    """
    SELECT EXTRACT(EPOCH FROM ae.timestamp) AS event,
           EXTRACT(EPOCH FROM r.queued_at) AS run_queued,
           EXTRACT(EPOCH FROM r.start_date) AS run_started,
           EXTRACT(EPOCH FROM ti.scheduled_dttm) AS ti_scheduled,
           EXTRACT(EPOCH FROM ti.queued_dttm) AS ti_queued,
           EXTRACT(EPOCH FROM ti.start_date) AS ti_started
    FROM dag_run r
    JOIN task_instance ti ON ti.dag_id = r.dag_id AND ti.run_id = r.run_id
    JOIN dagrun_asset_event dae ON dae.dag_run_id = r.id
    JOIN asset_event ae ON ae.id = dae.event_id
    WHERE r.dag_id = 'latency_reader'
    ORDER BY r.queued_at
    """
)


def _airflow_steps(af: AirflowStack, broker: Broker) -> dict[str, list[float]]:
    """Each step's durations over the measured activations (the warm-up left out), matched to
    the reader runs in order (one activation at a time); empty when they do not match up, or
    when the metadata database is not PostgreSQL."""
    if not af.metadata_url.startswith("postgresql"):
        return {}
    with af.metadata().connect() as conn:
        runs = [dict(r._mapping) for r in conn.execute(_READER_RUNS)]
    with broker.engine.connect() as conn:
        sent = [
            float(v)
            for v in conn.execute(
                text("SELECT started FROM bench_latency WHERE kind = 'activation' ORDER BY id")
            ).scalars()
        ]
        executed = [
            float(v)
            for v in conn.execute(
                text("SELECT seen FROM bench_latency WHERE kind = 'activation_execute' ORDER BY id")
            ).scalars()
        ]
    if not (len(runs) == len(sent) == len(executed)):
        return {}
    steps: dict[str, list[float]] = {name: [] for name, _, _ in STEPS}
    for run, at, ex in list(zip(runs, sent, executed, strict=True))[1:]:
        times = {
            **{k: float(v) for k, v in run.items() if v is not None},
            "sent": at,
            "executed": ex,
        }
        for name, start, end in STEPS:
            if start in times and end in times:
                steps[name].append(times[end] - times[start])
    return steps


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.activation", description=__doc__)
    p.add_argument("--activations", type=int, default=50)
    p.add_argument("--plain", type=int, default=20, help="TriggerDagRunOperator runs")
    p.add_argument(
        "--scheduler-idle-sleep",
        type=float,
        default=1.0,
        help="[scheduler] scheduler_idle_sleep_time, seconds (Airflow's default: 1)",
    )
    p.add_argument("--metadata", choices=("postgres", "sqlite"), default="postgres")
    add_jitter(p)
    args = p.parse_args(argv)

    server = ScratchServer()
    server.check()
    try:
        empty = server.template("empty", lambda _db: None)
        db = server.create(empty, "activation")
        metadata = (
            server.create(empty, "metadata").sqlalchemy_url if args.metadata == "postgres" else None
        )
        broker = _setup_broker(db.sqlalchemy_url)
        conn_json = json.dumps({"conn_type": "broker", "extra": {"url": db.sqlalchemy_url}})
        env = {
            "AIRFLOW_CONN_BROKER_DEFAULT": conn_json,
            "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": str(args.scheduler_idle_sleep),
        }
        with (
            tempfile.TemporaryDirectory() as tmp,
            airflow_stack(Path(tmp), DAGS, metadata_url=metadata, extra_env=env) as af,
        ):
            measure(af, broker, args.activations, args.plain, args.jitter)
            steps = _airflow_steps(af, broker)
        activation = _latencies(broker, "activation")[1:]  # without the warm-up
        execute = _latencies(broker, "activation_execute")[1:]
        scheduler = _latencies(broker, "scheduler")
        broker.dispose()
    finally:
        server.drop_all()

    print(
        f"Airflow {airflow_version}, metadata {args.metadata}, LocalExecutor, "
        f"scheduler_idle_sleep_time {args.scheduler_idle_sleep:g} s, SENDs delayed by up to "
        f"{args.jitter:g} s"
    )
    print(f"{'latency (s)':<34} {'n':>4} {'p50':>7} {'p95':>7} {'mean':>7}")
    for name, values in (
        ("SEND -> first RECEIVE (activation)", activation),
        ("TriggerDagRunOperator -> 1st task", scheduler),
    ):
        print(
            f"{name:<34} {len(values):>4} {_pct(values, 0.5):>7.2f} {_pct(values, 0.95):>7.2f} "
            f"{statistics.mean(values):>7.2f}"
        )
    if execute:
        # The operator's own part: from execute() to the first RECEIVE of the same message.
        own = [a - x for a, x in zip(activation, execute, strict=False)]
        print(
            f"{'  of which SEND -> execute()':<34} {len(execute):>4} {_pct(execute, 0.5):>7.2f} "
            f"{_pct(execute, 0.95):>7.2f} {statistics.mean(execute):>7.2f}"
        )
        print(
            f"{'  of which execute() -> RECEIVE':<34} {len(own):>4} {_pct(own, 0.5):>7.2f} "
            f"{_pct(own, 0.95):>7.2f} {statistics.mean(own):>7.2f}"
        )
    if steps:
        print()
        print(f"{'where an activation goes (s)':<34} {'n':>4} {'p50':>7} {'p95':>7} {'mean':>7}")
        for name, values in steps.items():
            if values:
                print(
                    f"{name:<34} {len(values):>4} {_pct(values, 0.5):>7.2f} "
                    f"{_pct(values, 0.95):>7.2f} {statistics.mean(values):>7.2f}"
                )
    print()
    print(f"target activation_p50: {_pct(activation, 0.5):.2f} (goal <= {GOAL_P50})")
    ratio = _pct(activation, 0.5) / _pct(scheduler, 0.5)
    print(f"target activation_vs_scheduler_p50: {ratio:.2f} (goal <= {GOAL_VS_SCHEDULER})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
