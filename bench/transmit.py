"""Transmission latency through the transmitter, under a real Airflow deployment.

Run from the repository root::

    python -m bench.transmit                  # 50 transmissions, 20 local activations
    python -m bench.transmit --dialogs 20 --activations 10

What is measured, on a real Airflow deployment (API server, scheduler, DAG processor, triggerer,
LocalExecutor; ``tests/support/airflow_stack.py``) with two broker databases on scratch
PostgreSQL databases, ``broker_default`` (near) and ``far``:

- transmit: a dialog is begun and one message SENT from outside Airflow to a service of the far
  database (the body carries the commit time). The ``TransmissionTrigger`` (LISTENing) notices,
  the scheduler starts a run of ``broker_transmitter`` (``transmitter_dag()``, the one line a user
  writes), whose task delivers it. Latency = the message's ``enqueued_at`` in the far queue -
  committed SEND. One at a time: the next SEND waits until no transmitter run is active, so
  every measurement is a fresh start (the worst case: a steady stream finds a run going), and
  then a random delay of up to ``--jitter`` seconds, so that it meets Airflow's loops at any
  point of them (see ``bench/activation.py``).
- activation: the same deployment's activation latency of a local reader
  (``bench/dags/activation_latency.py``), as ``python -m bench.activation`` measures it.

Both are mostly the scheduler's latency: an asset event becomes a run, its task is queued and
starts on successive scheduler loops (``[scheduler] scheduler_idle_sleep_time``, Airflow's
default 1 s). Prints p50 and p95 of both, then ``target transmit_p50: SECONDS (goal <= 2.0)``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from sqlalchemy import text

from airflow_broker import Broker
from airflow_broker.provider.compat import AIRFLOW_VERSION as airflow_version
from bench._scratch import ScratchServer
from bench.activation import (
    _count,
    _latencies,
    _pct,
    _send,
    _setup_broker,
    add_jitter,
    send_delays,
)
from tests.support.airflow_stack import AirflowStack, airflow_stack

HERE = Path(__file__).parent
GOAL_P50 = 2.0
SENDER, FAR_SERVICE = "//bench/TransmitSender", "//bench/TransmitTarget"
FAR_QUEUE = "transmit_far_q"


def _setup(near: Broker, far: Broker) -> None:
    with near.definitions() as d:
        d.create_queue("transmit_sender_q")
        d.create_service(SENDER, queue="transmit_sender_q")
        d.create_route("to_far", FAR_SERVICE, None, "broker://far")
    with far.definitions() as d:
        d.create_queue(FAR_QUEUE)
        d.create_service(FAR_SERVICE, queue=FAR_QUEUE, contracts=["DEFAULT"])


def _send_far(near: Broker) -> float:
    with near.transaction() as tx:
        h = tx.begin_dialog(SENDER, FAR_SERVICE, encryption=False)
        tx.send(h, body={"sent_at": time.time()})
    return time.time()


def _arrivals(far: Broker) -> list[tuple[float, datetime]]:
    with far.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT m.message_body, m.enqueued_at FROM broker_message m"
                " JOIN broker_queue q ON q.queue_id = m.queue_id WHERE q.name = :q"
            ),
            {"q": FAR_QUEUE},
        ).all()
    return [(float(json.loads(bytes(b))["sent_at"]), at) for b, at in rows]


def _idle(af: AirflowStack, dag_id: str) -> bool:
    return not [r for r in af.runs(dag_id) if r.state in ("queued", "running")]


def measure(
    af: AirflowStack,
    near: Broker,
    far: Broker,
    dialogs: int,
    activations: int,
    jitter: float = 0.0,
) -> list[float]:
    af.wait_for_dags("broker_transmitter", "latency_reader")
    # Warm up: the first transmission and the first activation start their triggers' work.
    _send_far(near)
    af.wait_for("the first transmission", lambda: len(_arrivals(far)) >= 1, timeout=240)
    af.wait_for("the transmitter to finish", lambda: _idle(af, "broker_transmitter"))
    pause = send_delays(jitter)
    for i in range(dialogs):
        pause()
        _send_far(near)
        af.wait_for(f"transmission {i + 1}", lambda w=i + 2: len(_arrivals(far)) >= w, every=0.05)
        af.wait_for("the transmitter to finish", lambda: _idle(af, "broker_transmitter"), every=0.1)
        print(f"  transmission {i + 1}/{dialogs}", file=sys.stderr, flush=True)
    _send(near)
    af.wait_for("the first activation", lambda: _count(near, "activation") >= 1, timeout=240)
    af.wait_for("the reader to finish", lambda: _idle(af, "latency_reader"))
    for i in range(activations):
        pause()
        _send(near)
        af.wait_for(
            f"activation {i + 1}", lambda w=i + 2: _count(near, "activation") >= w, every=0.05
        )
        af.wait_for("the reader to finish", lambda: _idle(af, "latency_reader"), every=0.1)
        print(f"  activation {i + 1}/{activations}", file=sys.stderr, flush=True)
    arrivals = sorted(_arrivals(far))[1:]  # without the warm-up
    return [at.timestamp() - sent for sent, at in arrivals]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transmit", description=__doc__)
    p.add_argument("--dialogs", type=int, default=50)
    p.add_argument("--activations", type=int, default=20)
    add_jitter(p)
    args = p.parse_args(argv)

    server = ScratchServer()
    server.check()
    try:
        empty = server.template("empty", lambda _db: None)
        near_db, far_db = server.create(empty, "near"), server.create(empty, "far")
        metadata = server.create(empty, "metadata").sqlalchemy_url
        near = _setup_broker(near_db.sqlalchemy_url)  # also the local reader's queue
        far = Broker.connect(far_db.sqlalchemy_url)
        far.migrate()
        _setup(near, far)
        env = {
            "AIRFLOW_CONN_BROKER_DEFAULT": json.dumps(
                {"conn_type": "broker", "extra": {"url": near_db.sqlalchemy_url}}
            ),
            "AIRFLOW_CONN_FAR": json.dumps(
                {"conn_type": "broker", "extra": {"url": far_db.sqlalchemy_url}}
            ),
        }
        with tempfile.TemporaryDirectory() as tmp:
            dags = Path(tmp) / "dags"
            dags.mkdir()
            shutil.copy(HERE / "dags_transmit" / "transmitter.py", dags)
            shutil.copy(HERE / "dags" / "activation_latency.py", dags)
            with airflow_stack(Path(tmp), dags, metadata_url=metadata, extra_env=env) as af:
                transmit = measure(af, near, far, args.dialogs, args.activations, args.jitter)
        activation = _latencies(near, "activation")[1:]
        near.dispose()
        far.dispose()
    finally:
        server.drop_all()

    print(
        f"Airflow {airflow_version}, metadata postgres, LocalExecutor, Airflow's defaults, "
        f"SENDs delayed by up to {args.jitter:g} s"
    )
    print(f"{'latency (s)':<40} {'n':>4} {'p50':>7} {'p95':>7} {'mean':>7}")
    for name, values in (
        ("SEND -> far queue (transmitter)", transmit),
        ("SEND -> first RECEIVE (local activation)", activation),
    ):
        print(
            f"{name:<40} {len(values):>4} {_pct(values, 0.5):>7.2f} {_pct(values, 0.95):>7.2f} "
            f"{statistics.mean(values):>7.2f}"
        )
    print()
    print(f"target transmit_p50: {_pct(transmit, 0.5):.2f} (goal <= {GOAL_P50})")
    print(f"info transmit_vs_activation_p50: {_pct(transmit, 0.5) / _pct(activation, 0.5):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
