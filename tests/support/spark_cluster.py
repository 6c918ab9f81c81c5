"""A Spark standalone cluster on this machine, and the packed Python environment its executors
unpack: what tests/test_spark_cluster.py runs the routing job on (docs/spark.md, "On a Spark
standalone cluster", is the same thing step by step for a user).

- :func:`packed_env`: a fresh virtual environment with ``airflow-broker[postgres]`` and pyarrow
  (not Airflow, not PySpark: the executors take PySpark from the worker's Spark installation),
  at the versions the test environment has, packed with ``venv-pack`` into ``env.tar.gz``. It is
  built once and cached under the temporary directory, keyed by a hash of ``pyproject.toml``
  and the engine's sources, so a changed engine gets a new one. The job's Spark conf names its
  Python as ``./environment/bin/python``: a path that exists only in an executor's working
  directory, where Spark unpacks ``env.tar.gz#environment``.
- :class:`SparkCluster`: a master and one worker started from the PySpark installation
  (``spark-class org.apache.spark.deploy.master.Master`` / ``...worker.Worker``) on free ports,
  each in its own process group, with their work and scratch directories under the test's
  temporary directory. They run with a minimal environment: a ``PATH`` without this virtual
  environment, no ``PYTHONPATH``, no broker URLs, and ``PYSPARK_PYTHON`` set to
  :data:`WORKER_PYTHON`, a Python that cannot import ``airflow_broker``
  (:func:`check_worker_python` makes sure). The worker has a small budget
  (:data:`WORKER_CORES` task slots, :data:`WORKER_MEMORY`).

Nothing here skips: a missing Java, ``venv-pack`` or ``uv`` fails with what to install.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.airflow_stack import free_port

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
#: Where packed environments are kept between test sessions (one per key).
CACHE = Path(os.environ.get("TMPDIR", "/tmp")) / "airflow-broker-spark-env"
#: The executors' Python as the job's conf names it: inside the unpacked archive.
ARCHIVE_ALIAS = "environment"
EXECUTOR_PYTHON = f"./{ARCHIVE_ALIAS}/bin/python"
#: The Python the worker's own environment offers: Debian's, without airflow_broker.
WORKER_PYTHON = "/usr/bin/python3"
WORKER_CORES = 2
WORKER_MEMORY = "1536m"
#: Each executor's heap: one executor per application fits the worker.
EXECUTOR_MEMORY = "768m"


def spark_home() -> Path:
    """The PySpark installation: its ``bin/spark-class``, ``jars`` and ``python/lib``."""
    import pyspark

    return Path(pyspark.__file__).parent


# -- the executors' environment ------------------------------------------------------------------


def env_key() -> str:
    """A hash of what goes into the packed environment: pyproject.toml, the engine's sources
    and the Python version."""
    digest = hashlib.sha256()
    digest.update(sys.version.encode())
    digest.update((REPO / "pyproject.toml").read_bytes())
    for path in sorted((REPO / "airflow_broker").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(REPO)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _uv() -> str:
    found = BIN / "uv" if (BIN / "uv").exists() else shutil.which("uv")
    if not found:
        raise RuntimeError("uv is missing: `make install-dev` installs it into the venv")
    return str(found)


def _constraints(path: Path) -> Path:
    """Every distribution of this environment at its version: the executors run the same
    psycopg, pyarrow, SQLAlchemy... as the driver."""
    pins = sorted(
        {
            f"{d.metadata['Name']}=={d.version}"
            for d in importlib.metadata.distributions()
            if d.metadata["Name"] and d.metadata["Name"].lower() != "airflow-broker"
        }
    )
    path.write_text("\n".join(pins) + "\n")
    return path


def build_env(out: Path) -> Path:
    """Build and pack the executors' environment into ``out`` (``env.tar.gz``)."""
    try:
        import venv_pack
    except ImportError as exc:
        raise RuntimeError(
            "venv-pack is missing: `uv pip install venv-pack` (the dev extra lists it)"
        ) from exc
    work = out.parent / f"build-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    venv = work / "env"
    pyarrow = importlib.metadata.version("pyarrow")
    # The interpreter this venv is based on: the nodes must have it at the same path (a
    # packed virtual environment carries its packages, not Python itself).
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([_uv(), "venv", "--quiet", "--python", base, str(venv)], check=True)
    subprocess.run(
        [
            _uv(), "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
            "--constraint", str(_constraints(work / "constraints.txt")),
            f"{REPO}[postgres]", f"pyarrow=={pyarrow}",
        ],
        check=True,
    )  # fmt: skip
    partial = work / "env.tar.gz"
    venv_pack.pack(prefix=str(venv), output=str(partial), compress_level=1)
    partial.replace(out)
    shutil.rmtree(work, ignore_errors=True)
    return out


@dataclass(frozen=True)
class PackedEnv:
    archive: Path
    seconds: float  # what building it took in this session (0.0 when it was cached)
    cached: bool

    @property
    def spark_archives(self) -> str:
        """The value of ``archives`` (``--archives``): unpacked as ``./environment``."""
        return f"{self.archive}#{ARCHIVE_ALIAS}"


def packed_env() -> PackedEnv:
    """The cached ``env.tar.gz`` for this tree, built under a lock if it is not there yet."""
    folder = CACHE / env_key()
    folder.mkdir(parents=True, exist_ok=True)
    archive = folder / "env.tar.gz"
    with (folder / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # xdist workers wait for the one that builds
        if archive.exists():
            return PackedEnv(archive, 0.0, True)
        started = time.monotonic()
        build_env(archive)
        seconds = time.monotonic() - started
        print(f"packed the executors' environment in {seconds:.1f} s: {archive}")
        return PackedEnv(archive, seconds, False)


def check_worker_python() -> str:
    """:data:`WORKER_PYTHON`, after making sure it exists and cannot import airflow_broker
    (else a test could pass without the archive)."""
    if not Path(WORKER_PYTHON).exists():
        raise RuntimeError(f"{WORKER_PYTHON} is missing: `apt-get install python3`")
    probe = subprocess.run(
        [WORKER_PYTHON, "-c", "import airflow_broker"],
        env={"PATH": "/usr/bin:/bin"},
        # not the checkout: `python -c` puts its working directory first on sys.path
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
    )
    if probe.returncode == 0:
        raise RuntimeError(f"{WORKER_PYTHON} imports airflow_broker: it must not")
    return WORKER_PYTHON


# -- master and worker --------------------------------------------------------------------------


@dataclass
class SparkCluster:
    """A standalone master and one worker under ``root``; :meth:`start`, then :meth:`stop`."""

    root: Path
    cores: int = WORKER_CORES
    memory: str = WORKER_MEMORY
    port: int = field(default_factory=free_port)
    ui_port: int = field(default_factory=free_port)
    worker_ui_port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    @property
    def work_dir(self) -> Path:
        """The worker's work directory: ``app-*/<executor>/`` holds each executor's files."""
        return self.root / "work"

    @property
    def env(self) -> dict[str, str]:
        keep = ("HOME", "LANG", "LC_ALL", "TMPDIR", "JAVA_HOME", "USER")
        env = {k: os.environ[k] for k in keep if k in os.environ}
        env.update(
            {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "SPARK_HOME": str(spark_home()),
                "SPARK_LOCAL_DIRS": str(self.root / "local"),
                "SPARK_LOG_DIR": str(self.root / "logs"),
                "SPARK_WORKER_DIR": str(self.work_dir),
                "SPARK_DAEMON_MEMORY": "256m",
                # No REST submission server: it would take port 6066 for every master.
                "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
                "PYSPARK_PYTHON": check_worker_python(),
            }
        )
        return env

    def _start(self, name: str, *args: str) -> None:
        log = (self.root / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [str(spark_home() / "bin" / "spark-class"), *args],
            env=self.env,
            cwd=self.root,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped with its children
        )

    def start(self, timeout: float = 180) -> None:
        self.launch()
        self.wait_until_ready(timeout)

    def launch(self) -> None:
        """Start the master and the worker, without waiting for them."""
        for sub in ("local", "logs", "work"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._start(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1", "--port", str(self.port), "--webui-port", str(self.ui_port),
        )  # fmt: skip
        self._start(
            "worker",
            "org.apache.spark.deploy.worker.Worker",
            self.master_url,
            "--host", "127.0.0.1", "--webui-port", str(self.worker_ui_port),
            "--cores", str(self.cores), "--memory", self.memory,
            "--work-dir", str(self.work_dir),
        )  # fmt: skip

    def wait_until_ready(self, timeout: float = 180) -> None:
        """Wait until the worker has registered with the master; fail with their logs."""
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"the Spark {name} exited: {self.log(name)[-3000:]}")
            with contextlib.suppress(OSError, ValueError):
                if self.state().get("aliveworkers", 0) >= 1:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no Spark worker registered with {self.master_url} in {timeout:.0f} s:\n"
                    f"{self.log('master')[-2000:]}\n{self.log('worker')[-2000:]}"
                )
            time.sleep(0.5)

    def state(self) -> dict[str, Any]:
        """The master's state (its web UI's ``/json/``): workers, applications."""
        url = f"http://127.0.0.1:{self.ui_port}/json/"
        with urllib.request.urlopen(url, timeout=5) as answer:
            state: dict[str, Any] = json.load(answer)
        return state

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def executor_logs(self) -> str:
        """Every executor's stdout and stderr, application by application."""
        parts = []
        for path in sorted(self.work_dir.glob("app-*/*/std*")):
            parts.append(
                f"== {path.relative_to(self.work_dir)}\n{path.read_text(errors='replace')}"
            )
        return "\n".join(parts)

    def stop(self) -> None:
        for name in ("worker", "master"):
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@contextlib.contextmanager
def spark_cluster(
    root: Path, meanwhile: Callable[[], object] = lambda: None
) -> Iterator[SparkCluster]:
    """A running master and worker; stopped (their process groups) when the block ends.
    ``meanwhile`` runs while their JVMs start (building the packed environment)."""
    cluster = SparkCluster(root)
    try:
        cluster.launch()
        meanwhile()
        cluster.wait_until_ready()
        yield cluster
    finally:
        cluster.stop()


def cluster_conf() -> dict[str, str]:
    """The Spark conf of a job on the cluster: its executors' Python from the archive, and a
    budget that fits the worker."""
    return {
        "spark.pyspark.python": EXECUTOR_PYTHON,
        "spark.executor.memory": EXECUTOR_MEMORY,
        "spark.cores.max": str(WORKER_CORES),
        "spark.ui.enabled": "false",
    }
