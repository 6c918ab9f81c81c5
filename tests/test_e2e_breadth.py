"""End to end, issue 46 ("breadth"): a real triggerer holding 500 activated queues, served by
ONE family reader DAG, on a PostgreSQL whose ``max_connections`` is 100.

A real scheduler, DAG processor, triggerer and API server (``support.airflow_stack``,
LocalExecutor) run tests/dags/breadth_family.py: ``queue_family_dag`` over :data:`QUEUES`
queues, each with its ``QueueActivationTrigger`` in the triggerer. The broker database and
Airflow's metadata database are on a PostgreSQL cluster of the test's own
(``support.sized_cluster``) with PostgreSQL's default ``max_connections`` of 100, so that the
count is this deployment's alone, and so that a triggerer that took a connection per queue
would exhaust that cluster, not the server other tests share.

One message is SENT to each queue (one dialog per queue, all in one transaction). Each must be
handled exactly once: the handler records it in the application table ``breadth_seen`` in the
RECEIVE's transaction, and every queue ends empty. Throughout, from the triggerer's start to
the end, a sampler looks at ``pg_stat_activity`` of the broker database every
:data:`SAMPLE_EVERY` seconds and attributes connections to the triggerer by client port (the
local ports of the TCP connections that the triggerer process and its children, the trigger
runner, hold to the cluster, through psutil); the most seen at once must not exceed
:data:`TRIGGERER_CONNECTIONS`, the constant docs/airflow.md states.

A connection opened and closed between two samples is not seen: the bound is on the
connections the triggerer holds, which is what exhausts a server.

``BREADTH_QUEUES`` (environment) runs it with fewer queues, for a quick look.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
from sqlalchemy import text
from support.airflow_stack import AirflowStack, airflow_stack
from support.frozen_cluster import FrozenCluster
from support.sized_cluster import sized_cluster
from support.tls_cluster import SUPERUSER

from airflow_broker import Activation, Broker

DAG_FILE = Path(__file__).parent / "dags" / "breadth_family.py"
DAG_ID = "breadth_family"

pytestmark = [pytest.mark.xdist_group("airflow_e2e"), pytest.mark.postgres, pytest.mark.slow]

#: activated queues, all served by the one family DAG
QUEUES = int(os.environ.get("BREADTH_QUEUES", "500"))
#: the queues' names (as tests/dags/breadth_family.py makes them)
PREFIX = "breadth_q"
#: the cluster's max_connections: PostgreSQL's default, shared by the broker and Airflow
MAX_CONNECTIONS = 100
#: The most connections to the broker database a triggerer holds, whatever the number of
#: activation triggers it runs: docs/airflow.md, "Connections from a triggerer" (one LISTEN
#: connection per broker database, and one for each of hub.DATABASE_THREADS threads).
TRIGGERER_CONNECTIONS = 4
#: how often the sampler looks at pg_stat_activity and the triggerer's sockets (seconds)
SAMPLE_EVERY = 0.2
SENDER, SENDER_QUEUE = "//breadth/Sender", "breadth_sender_q"
#: the test's timeout (seconds); the wait for the messages ends a minute before it, so that a
#: slow run fails saying how far it got
TIMEOUT = 600


def queue_name(i: int) -> str:
    return f"{PREFIX}{i:03d}"


def service_name(i: int) -> str:
    return f"//breadth/{queue_name(i)}"


@pytest.fixture(scope="module")
def cluster() -> Iterator[FrozenCluster]:
    with sized_cluster(MAX_CONNECTIONS) as c:
        yield c


def declare(b: Broker) -> None:
    """QUEUES activated queues (max_readers 1), each with its service; a sender; the
    application table."""
    with b.definitions() as d:
        for i in range(QUEUES):
            d.create_queue(queue_name(i), activation=Activation(max_readers=1))
            d.create_service(service_name(i), queue=queue_name(i), contracts=["DEFAULT"])
        d.create_queue(SENDER_QUEUE)
        d.create_service(SENDER, queue=SENDER_QUEUE)
    with b.engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE breadth_seen (service VARCHAR(128) NOT NULL, "
                "conversation_handle VARCHAR(36) NOT NULL, seq BIGINT NOT NULL, body TEXT)"
            )
        )


def send_one_to_each(b: Broker) -> dict[str, str]:
    """One dialog to each queue's service, one message on each, in one transaction; returns
    handle -> service."""
    with b.transaction() as tx:
        handles = {tx.begin_dialog(SENDER, service_name(i)): service_name(i) for i in range(QUEUES)}
        tx.send(list(handles), body="hello")
    return {str(h): s for h, s in handles.items()}


def seen(b: Broker) -> list[Any]:
    with b.engine.connect() as conn:
        return list(conn.execute(text("SELECT service, conversation_handle FROM breadth_seen")))


def waiting(b: Broker) -> int:
    """Messages still in the family's queues."""
    with b.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM broker_message m JOIN broker_queue q"
                    " ON q.queue_id = m.queue_id WHERE q.name LIKE :p"
                ),
                {"p": f"{PREFIX}%"},
            ).scalar_one()
        )


@dataclass(eq=False)  # a Thread: hashed by identity
class Sampler(threading.Thread):
    """Every SAMPLE_EVERY seconds: the connections to database ``dbname`` of the cluster
    (pg_stat_activity's client ports) that the process ``pid`` and its children hold (their
    sockets' local ports, psutil); the most at once, and the cluster's busiest moment."""

    cluster: FrozenCluster
    dbname: str
    pid: int
    most: int = 0
    most_ports: list[int] = field(default_factory=list)
    #: the most connections to the cluster (every database, every client) seen at once
    cluster_most: int = 0
    #: the most connections to the broker database (every client) seen at once
    database_most: int = 0
    samples: int = 0
    error: BaseException | None = None

    def __post_init__(self) -> None:
        super().__init__(name="breadth-sampler", daemon=True)
        self._halt = threading.Event()

    def tree_ports(self) -> set[int]:
        """Local ports of the TCP connections the process and its children hold to the
        cluster."""
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return set()
        ports: set[int] = set()
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                for c in proc.net_connections(kind="tcp"):
                    if c.raddr and c.raddr.port == self.cluster.port:
                        ports.add(c.laddr.port)
        return ports

    def run(self) -> None:
        try:
            with psycopg.connect(
                host="127.0.0.1",
                port=self.cluster.port,
                user=SUPERUSER,
                dbname="postgres",
                autocommit=True,
            ) as conn:
                while not self._halt.is_set():
                    rows = conn.execute(
                        "SELECT datname, client_port FROM pg_stat_activity"
                        " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
                    ).fetchall()
                    ports = self.tree_ports()
                    mine = sorted(p for d, p in rows if d == self.dbname and p in ports)
                    if len(mine) > self.most:
                        self.most, self.most_ports = len(mine), mine
                    self.cluster_most = max(self.cluster_most, len(rows) + 1)
                    self.database_most = max(
                        self.database_most, sum(d == self.dbname for d, _ in rows)
                    )
                    self.samples += 1
                    self._halt.wait(SAMPLE_EVERY)
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)
        if self.error is not None:
            raise self.error


def triggers_running(af: AirflowStack) -> int:
    """Activation triggers a triggerer has taken (the metadata database's ``trigger`` rows)."""
    rows = af.query(
        "SELECT count(*) AS n FROM trigger WHERE classpath LIKE '%QueueActivationTrigger'"
        " AND triggerer_id IS NOT NULL"
    )
    return int(rows[0].n)


def asset_events(af: AirflowStack) -> int:
    """Asset events of the family's assets: one per reader a trigger started."""
    rows = af.query(
        "SELECT count(*) AS n FROM asset_event e JOIN asset a ON a.id = e.asset_id"
        " WHERE a.name LIKE :p",
        p=f"broker_queue_{PREFIX}%",
    )
    return int(rows[0].n)


# Alone on two cores, 500 queues: Airflow's start, the DAG file's parse and 500 triggers to
# start, then the messages handled by a few dozen runs. The timeout leaves room for a machine
# loaded by the other half of `make test -n 2`.
@pytest.mark.timeout(TIMEOUT)
def test_one_family_dag_serves_500_activated_queues_within_the_documented_connections(
    tmp_path: Path, cluster: FrozenCluster
) -> None:
    t_test = time.monotonic()
    suffix = uuid.uuid4().hex[:8]
    broker_db = cluster.create_database(f"breadth_broker_{suffix}")
    metadata_db = cluster.create_database(f"breadth_airflow_{suffix}")
    broker_url = cluster.url(broker_db)
    b = Broker.connect(broker_url)
    b.migrate()
    t0 = time.monotonic()
    declare(b)
    print(f"{QUEUES} queues declared in {time.monotonic() - t0:.1f} s")

    env = {
        "AIRFLOW_CONN_BROKER_DEFAULT": json.dumps(
            {"conn_type": "broker", "extra": {"url": broker_url}}
        ),
        "BREADTH_QUEUES": str(QUEUES),
        # One parse of the DAG file is enough: nothing changes in it (and a parse of 500
        # assets every 30 s only costs CPU here).
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
    }
    dags = tmp_path / "dags"
    dags.mkdir()
    shutil.copy(DAG_FILE, dags)
    sampler: Sampler | None = None
    try:
        with airflow_stack(
            tmp_path, dags, metadata_url=cluster.url(metadata_db), extra_env=env
        ) as af:
            sampler = Sampler(cluster, broker_db, af.procs["triggerer"].pid)
            sampler.start()
            t_start = time.monotonic()
            af.wait_for_dags(DAG_ID, timeout=300)
            t_parsed = time.monotonic()
            af.wait_for(
                f"the triggerer to run {QUEUES} activation triggers",
                lambda: triggers_running(af) >= QUEUES,
                timeout=300,
                every=1.0,
            )
            t_triggers = time.monotonic()
            time.sleep(10)  # the triggers look at their queues once and wait
            print(
                f"DAG parsed {t_parsed - t_start:.1f} s after the start; {QUEUES} triggers "
                f"running {t_triggers - t_parsed:.1f} s later; triggerer connections to the "
                f"broker database so far: at most {sampler.most}"
            )

            t_send = time.monotonic()
            sent = send_one_to_each(b)
            fired: list[float] = []  # when the triggers had fired for every queue
            progress = {"events": 0, "handled": 0}

            def all_handled() -> bool:
                progress["events"] = asset_events(af)
                if not fired and progress["events"] >= QUEUES:
                    fired.append(time.monotonic())
                progress["handled"] = len(seen(b))
                return progress["handled"] >= QUEUES

            try:
                left = TIMEOUT - 60 - (time.monotonic() - t_test)
                af.wait_for(f"{QUEUES} messages handled", all_handled, timeout=left, every=1.0)
            except TimeoutError as exc:
                raise AssertionError(
                    f"{time.monotonic() - t_send:.0f} s after the SEND: {progress['events']} "
                    f"asset events (the triggers' fires) for {QUEUES} queues, "
                    f"{progress['handled']} messages handled; the triggerer held at most "
                    f"{sampler.most} connections to the broker database"
                ) from exc
            t_handled = time.monotonic()
            af.wait_for(
                "the reader runs to end",
                lambda: not [r for r in af.runs(DAG_ID) if r.state in ("queued", "running")],
                timeout=max(10.0, TIMEOUT - 20 - (time.monotonic() - t_test)),
                every=1.0,
            )
            time.sleep(5)  # a second reader of some queue would have handled it again by now
            rows = seen(b)
            runs = af.runs(DAG_ID)
            events = asset_events(af)
            sampler.stop()
            print(
                f"the triggers fired for every queue "
                f"{(fired[0] if fired else t_handled) - t_send:.1f} s after the SEND; "
                f"{QUEUES} messages handled {t_handled - t_send:.1f} s after it, by "
                f"{len(runs)} runs of {DAG_ID} from {events} asset events; "
                f"{sampler.samples} samples: the triggerer held at most {sampler.most} "
                f"connection(s) to the broker database (ports {sampler.most_ports}); the broker "
                f"database had at most {sampler.database_most}, the cluster at most "
                f"{sampler.cluster_most} of {MAX_CONNECTIONS}"
            )
    finally:
        if sampler is not None and sampler.is_alive():
            with contextlib.suppress(BaseException):
                sampler.stop()
        left = waiting(b)
        b.dispose()

    # One dialog per queue, one message on each: each queue's service once, each (target
    # side) conversation once.
    services = [str(service) for service, _handle in rows]
    assert len(services) == QUEUES, f"{len(services)} messages handled, {QUEUES} sent"
    assert len({str(handle) for _service, handle in rows}) == QUEUES, "a message handled twice"
    assert sorted(services) == sorted(sent.values()), "not every queue's message was handled"
    assert left == 0, f"{left} message(s) left in the queues"
    assert all(r.state == "success" for r in runs), [(r.run_id, r.state) for r in runs]
    assert sampler is not None and sampler.samples > 0
    assert sampler.most >= 1, "no connection of the triggerer's was seen: the sampler is blind"
    assert sampler.most <= TRIGGERER_CONNECTIONS, (
        f"the triggerer held {sampler.most} connections to the broker database at once, "
        f"more than the {TRIGGERER_CONNECTIONS} docs/airflow.md states"
    )
