"""A real Airflow 3 deployment for end-to-end tests: API server, scheduler, DAG processor and
triggerer as separate processes, LocalExecutor, a SQLite or PostgreSQL metadata database; or
CeleryExecutor (``executor="CeleryExecutor"``): the same four, a redis-server of its own as the
Celery broker, two ``airflow celery worker`` processes, a PostgreSQL metadata database that is
also Celery's result backend.

`airflow dags test` runs tasks in the test process and hides what matters here: tasks blocked
from Airflow's ORM, triggers that the triggerer cannot import, serialization of DAGs. This
harness runs the same commands an operator would, each in its own process group, so a test can
restart one of them (the triggerer) mid-way. The test process reads the metadata database with
plain SQL to watch DAG runs; it never goes through Airflow's ORM either.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

BIN = Path(sys.executable).parent
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
EXECUTORS = ("LocalExecutor", "CeleryExecutor")

#: CeleryExecutor: the Celery workers started with the deployment (each ``-H NAME@host``), and
#: the variable that tells a task which worker started it. Each runs one task at a time, and with
#: Airflow's Celery defaults (prefetch multiplier 1, late acknowledgment) holds no other while it
#: does: two tasks running at once run on the two workers.
CELERY_WORKERS = ("celery-worker-1", "celery-worker-2")
CELERY_CONCURRENCY = 1
WORKER_ENV = "E2E_CELERY_WORKER"
#: Debian's Redis (tests/support/ensure_redis.py installs it): the Celery broker.
REDIS_SERVER = Path("/usr/bin/redis-server")
#: What a Celery worker logs for each task it is handed (celery_executor_utils.execute_workload;
#: ``ti=TaskInstanceDTO(id=...`` from Airflow 3.3, ``ti=TaskInstance(id=...`` before).
_WORKLOAD = re.compile(
    r"Executing workload in Celery: .*?TaskInstance\w*\(id=UUID\('([0-9a-f-]{36})'\)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class AirflowStack:
    """One Airflow deployment under ``home``; start it with :meth:`start`."""

    home: Path
    dags_folder: Path
    metadata_url: str
    extra_env: Mapping[str, str] = field(default_factory=dict)
    executor: str = "LocalExecutor"
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    redis_port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor {self.executor!r}: one of {EXECUTORS}")
        if self.celery and not self.metadata_url.startswith("postgresql"):
            # Airflow refuses CeleryExecutor on SQLite, and Celery's results live there too.
            raise ValueError("CeleryExecutor needs a PostgreSQL metadata database")

    @property
    def celery(self) -> bool:
        return self.executor == "CeleryExecutor"

    @property
    def env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_BROKER_ADDRESS_"))
        }
        env.update(
            {
                "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
                "AIRFLOW_HOME": str(self.home),
                "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
                "AIRFLOW__CORE__EXECUTOR": self.executor,
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.metadata_url,
                "AIRFLOW__API__PORT": str(self.port),
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": (
                    f"http://127.0.0.1:{self.port}/execution/"
                ),
                # Parse the DAGs folder often: tests add nothing after start, but the first
                # parse should not wait for the default interval.
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
                "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "1",
                # A task's calls to the API server wait 5 s by default, then the supervisor
                # kills the task: on two cores shared with Spark tests the server can be slower
                # than that (seen once in CI: "httpx.ReadTimeout" before the task started).
                "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "30",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.metadata_url.startswith("postgresql"):
            # Airflow's async engine defaults to asyncpg for PostgreSQL; psycopg 3 does both.
            env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC"] = self.metadata_url
        if self.celery:
            # Celery's results in the metadata database (its tables are made on first use),
            # through psycopg 3 as Airflow's own connections: there is no psycopg2 here.
            backend = self.metadata_url.replace("postgresql://", "postgresql+psycopg://", 1)
            env.update(
                {
                    "AIRFLOW__CELERY__BROKER_URL": f"redis://127.0.0.1:{self.redis_port}/0",
                    "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{backend}",
                    # Sending a task to Redis waits 1 s by default: too short on two busy cores.
                    "AIRFLOW__CELERY__OPERATION_TIMEOUT": "10",
                }
            )
        env.update(self.extra_env)
        return env

    # -- lifecycle -----------------------------------------------------------------------------
    def airflow(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run one ``airflow`` command to completion; raise with its output if it fails."""
        done = subprocess.run(
            [str(BIN / "airflow"), *args],
            env=self.env,
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"`airflow {' '.join(args)}` failed ({done.returncode}):\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done

    def start(self, components: tuple[str, ...] = COMPONENTS) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        if self.celery:
            self.start_redis()
        self.airflow("db", "migrate", timeout=300)
        for name in components:
            self.start_component(name)
        if self.celery:
            for name in CELERY_WORKERS:
                self.start_component(name)
        if {"api-server", "standalone"} & set(components):
            self.wait_for_api()
        if self.celery:
            self.wait_for_workers()

    # -- CeleryExecutor ------------------------------------------------------------------------
    def start_redis(self) -> None:
        """Start a Redis of this deployment's own on a free loopback port, in memory only."""
        if importlib.util.find_spec("airflow.providers.celery") is None:
            raise RuntimeError(
                "CeleryExecutor needs apache-airflow-providers-celery, which is not installed: "
                "pip install -e '.[dev]'"
            )
        if not REDIS_SERVER.exists():
            raise RuntimeError(
                f"{REDIS_SERVER} is missing: run tests/support/ensure_redis.py "
                "(apt-get install redis-server)"
            )
        data = self.home / "redis"
        data.mkdir(parents=True, exist_ok=True)
        log = (self.home / "redis.log").open("ab")
        command = [
            str(REDIS_SERVER),
            "--port", str(self.redis_port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(data),
            "--daemonize", "no",
        ]  # fmt: skip
        self.procs["redis"] = subprocess.Popen(
            command,
            cwd=data,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def pong() -> bool:
            with socket.create_connection(("127.0.0.1", self.redis_port), timeout=2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")

        self.wait_for("redis-server to answer PING", pong, timeout=30, every=0.1)

    def wait_for_workers(self, timeout: float = 180) -> None:
        """Wait until each Celery worker has connected to Redis and is ready for tasks."""

        def ready() -> bool:
            return all(" ready." in self.log(name) for name in CELERY_WORKERS)

        self.wait_for("the Celery workers to be ready", ready, timeout=timeout)

    def celery_task_instances(self) -> dict[str, set[str]]:
        """For each Celery worker, the ids of the task instances it was handed (its log)."""
        return {name: set(_WORKLOAD.findall(self.log(name))) for name in CELERY_WORKERS}

    def tasks_by_worker(self, dag_id: str) -> dict[str, int]:
        """How many of ``dag_id``'s task instances each Celery worker ran; fails unless every
        task instance that started ran on exactly one of the workers."""
        started = {
            str(r.id)
            for r in self.query(
                "SELECT id FROM task_instance WHERE dag_id = :d AND start_date IS NOT NULL",
                d=dag_id,
            )
        }
        handed = self.celery_task_instances()
        elsewhere = {ti for ti in started if sum(ti in tis for tis in handed.values()) != 1}
        if not started or elsewhere:
            raise AssertionError(
                f"{dag_id}: {len(started)} task instances started, {len(elsewhere)} of them "
                f"not handed to exactly one Celery worker: {sorted(elsewhere)[:5]}"
            )
        return {name: len(tis & started) for name, tis in handed.items()}

    def wait_for_api(self, timeout: float = 180) -> None:
        """Wait until the API server answers. A task started before it does fails without
        running: the Task SDK gives up on the execution API after a few seconds (seen on a
        loaded machine, whose API server took ten seconds to come up)."""

        def healthy() -> bool:
            url = f"http://127.0.0.1:{self.port}/api/v2/monitor/health"
            with urllib.request.urlopen(url, timeout=5) as answer:
                return bool(answer.status == 200)

        self.wait_for("the API server to answer", healthy, timeout=timeout)

    def start_component(self, name: str) -> None:
        """Start ``airflow <name>``: one of :data:`COMPONENTS`, or ``standalone`` (all four in
        one command, as a person tries Airflow out; its API server takes AIRFLOW__API__PORT)."""
        env = self.env
        if name == "api-server":
            args = ["api-server", "--port", str(self.port)]
        elif name in CELERY_WORKERS:
            args = [
                "celery", "worker",
                "--celery-hostname", f"{name}@%h",
                "--concurrency", str(CELERY_CONCURRENCY),
                # Two workers on one host: the log server of each would want the same port;
                # the API server reads the task logs from the shared logs folder instead.
                "--skip-serve-logs",
                "--without-mingle", "--without-gossip",
            ]  # fmt: skip
            env[WORKER_ENV] = name
        else:
            args = [name]
        log = (self.home / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [str(BIN / "airflow"), *args],
            env=env,
            cwd=self.home,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped with its children
        )

    def stop_component(self, name: str, *, kill: bool = False) -> None:
        self.stop_components([name], kill=kill)

    def stop_components(self, names: list[str], *, kill: bool = False, grace: float = 30) -> None:
        """Signal the process groups of ``names`` all at once (SIGTERM, or SIGKILL with
        ``kill``), wait up to ``grace`` seconds for them, SIGKILL what is left; then SIGKILL
        whatever of each group outlived its leader (a task process, a pool child)."""
        procs = [proc for name in names if (proc := self.procs.pop(name, None)) is not None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    def restart_component(self, name: str, *, kill: bool = False) -> None:
        self.stop_component(name, kill=kill)
        self.start_component(name)

    def stop(self) -> None:
        """Stop every process group: Airflow's processes and the Celery workers together,
        Redis once they are gone."""
        self.stop_components([name for name in self.procs if name != "redis"])
        self.stop_components(["redis"])

    def log(self, name: str) -> str:
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"airflow {name} exited ({proc.returncode}):\n{self.log(name)[-4000:]}"
                )

    # -- the metadata database, read with plain SQL ----------------------------------------
    def metadata(self) -> Engine:
        url = self.metadata_url
        if url.startswith("postgresql://"):
            url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
        return create_engine(url)

    def query(self, sql: str, **params: Any) -> list[Any]:
        engine = self.metadata()
        try:
            with engine.connect() as conn:
                return list(conn.execute(text(sql), params))
        finally:
            engine.dispose()

    def wait_for(
        self, what: str, check: Callable[[], Any], timeout: float = 120, every: float = 0.5
    ) -> Any:
        """Poll ``check`` until it returns something truthy; fail with the logs if it never does."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            with contextlib.suppress(Exception):
                value = check()
                if value:
                    return value
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n} ---\n{self.log(n)[-3000:]}" for n in self.procs)
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}\n{logs}")
            time.sleep(every)

    def wait_for_dags(self, *dag_ids: str, timeout: float = 180) -> None:
        def parsed() -> bool:
            rows = self.query("SELECT dag_id FROM serialized_dag")
            return set(dag_ids) <= {r.dag_id for r in rows}

        self.wait_for(f"DAGs {dag_ids} to be parsed", parsed, timeout=timeout)

    def runs(self, dag_id: str) -> list[Any]:
        return self.query(
            "SELECT run_id, state, start_date, end_date, run_type FROM dag_run "
            "WHERE dag_id = :d ORDER BY id",
            d=dag_id,
        )


@contextlib.contextmanager
def airflow_stack(
    tmp_path: Path,
    dags_folder: Path,
    metadata_url: str | None = None,
    extra_env: Mapping[str, str] | None = None,
    components: tuple[str, ...] = COMPONENTS,
    executor: str = "LocalExecutor",
) -> Iterator[AirflowStack]:
    """A running deployment; stopped (process groups terminated) when the block ends.
    ``executor="CeleryExecutor"`` needs a PostgreSQL ``metadata_url``."""
    home = tmp_path / "airflow_home"
    url = metadata_url or f"sqlite:///{home / 'airflow.db'}"
    stack = AirflowStack(home, dags_folder, url, dict(extra_env or {}), executor=executor)
    try:
        stack.start(components)
        yield stack
    finally:
        stack.stop()
