"""Exactly once when the Spark job dies: spark-submit is SIGKILLed (its whole process group:
the JVM and the Python driver) at each point of a run, then the job runs again; every message
arrives once, in order, and the source's transmission queue is empty."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from transport_procs import (
    TARGET_QUEUE,
    Net,
    assert_exactly_once_in_order,
    by_conversation,
    drain_all,
    send_dialogs,
    two_way,
)

from airflow_broker.spark import job
from airflow_broker.spark.jdbc import DEBIAN_JARS
from airflow_broker.transport import env_name

pytestmark = [pytest.mark.xdist_group("spark"), pytest.mark.timeout(600)]

BIN = Path(sys.executable).parent
Network = Callable[..., Net]


def spark_submit(
    net: Net, pause_at: str | None = None, *, master: str = "local[2]", args: tuple[str, ...] = ()
) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        **{env_name(name): url for name, url in net.urls.items()},
    }
    env.pop(job.PAUSE_ENV, None)
    if pause_at:
        env[job.PAUSE_ENV] = pause_at
    return subprocess.Popen(
        [
            str(BIN / "spark-submit"),
            "--master",
            master,
            "--conf",
            "spark.ui.enabled=false",
            "--jars",
            ",".join(DEBIAN_JARS),
            job.__file__,
            "--source",
            "a",
            *args,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for(proc: subprocess.Popen[str], line: str, timeout: float = 240) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        out = proc.stdout.readline()
        if not out:
            break
        seen.append(out)
        if out.startswith(line):
            return seen
    proc.kill()
    raise AssertionError(f"the job never printed {line!r}:\n{''.join(seen[-40:])}")


#: Where the job is killed, whether it stages every message (``--staged``), and what the next
#: run delivers: ``all``, ``none`` (everything was in the far queues), or ``some``.
KILLS = [
    ("planned", False, "all"),
    # One task at a time (local[1], four partitions): the first one's transaction is open...
    ("task-written", False, "all"),
    # ... or committed, the other three not begun.
    ("task-committed", False, "some"),
    ("written", False, "none"),
    ("committed", False, "none"),
    ("acknowledged", False, "none"),
    ("staged", True, "all"),
    ("committed", True, "none"),
]
#: Each kill is two spark-submits (about two minutes on two cores): ``make test`` runs one of
#: each kind (before anything is written, between the tasks, after the far side committed,
#: staged), ``make soak`` (BROKER_SOAK=1) all eight.
SUITE_KILLS = [
    ("planned", False, "all"),
    ("task-committed", False, "some"),
    ("acknowledged", False, "none"),
    ("staged", True, "all"),
]


@pytest.mark.parametrize("new_db", ["postgres"], indirect=True)
@pytest.mark.parametrize(
    ("kill_at", "staged", "rerun"), KILLS if os.environ.get("BROKER_SOAK") else SUITE_KILLS
)
def test_killed_anywhere_and_run_again_every_message_arrives_once(
    network: Network, kill_at: str, staged: bool, rerun: str
) -> None:
    net = network("a", "b")
    two_way(net)
    a, b = net["a"], net["b"]
    counts = [1 + i % 9 for i in range(150)]
    send_dialogs(a, counts)
    args = ("--partitions", "4", *(("--staged",) if staged else ()))
    first = spark_submit(net, pause_at=kill_at, master="local[1]", args=args)
    wait_for(first, f"checkpoint {kill_at}")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(30)
    assert first.returncode == -signal.SIGKILL
    again = spark_submit(net, args=args)
    lines = wait_for(again, job.REPORT_PREFIX)
    assert again.wait(60) == 0, "".join(lines[-40:])
    report = json.loads(lines[-1][len(job.REPORT_PREFIX) :])
    if rerun == "all":
        # nothing had reached b's queues: the rerun delivers all
        assert report["delivered"] == sum(counts), report
    elif rerun == "some":
        # the first task's conversations were in; the rerun delivers the others'
        assert 0 < report["delivered"] < sum(counts), report
    else:
        # b had committed everything: the rerun finds duplicates (or nothing left to do)
        assert report["delivered"] == 0, report
    if kill_at != "acknowledged":
        assert report["acknowledged"] == sum(counts), report
    assert a.transmission_queue() == []
    got = by_conversation(b, drain_all(b, TARGET_QUEUE))
    assert sorted(len(v) for v in got.values()) == sorted(counts)
    assert_exactly_once_in_order(
        got, {c: list(range(len(v))) for c, v in got.items()}, f"killed at {kill_at}"
    )
    # No staging rows are left behind by the dead run.
    from sqlalchemy import func, select

    from airflow_broker.storage import schema as s

    with b.engine.connect() as conn:
        for table in (s.spark_staging, s.spark_staged_conversation):
            assert conn.execute(select(func.count()).select_from(table)).scalar_one() == 0
