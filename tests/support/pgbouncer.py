"""A PgBouncer in transaction mode in front of the test server, as Airflow's Helm chart deploys it.

``make test`` installs Debian's ``pgbouncer`` (``ensure_pgbouncer.py``) and runs the
PostgreSQL-facing tests a second time with ``BROKER_TEST_VIA_PGBOUNCER=1``: each test process
then starts one :class:`PgBouncer` of its own on a free port, and the test databases' URLs lead
through it (tests/conftest.py). The set-up a user would write: ``pool_mode = transaction``, a
small server pool, trust auth against the same server. ``max_prepared_statements`` is 0 (the
1.21+ setting is unknown to Debian's 1.18 and its default there is off anyway): nothing a
session prepares survives its transaction.

PgBouncer refuses to run as root, so as root it runs as the ``postgres`` user (``-u``), which
the Debian server package creates.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BINARY = "/usr/sbin/pgbouncer"
PREFIX = "broker-pgbouncer-"


def stop_orphans() -> None:
    """Stop the PgBouncers that test processes killed before their teardown left running
    (each directory names its owner's pid): their server connections count against the
    server's max_connections."""
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            owner = int((folder / "owner").read_text())
            pid = int((folder / "pgbouncer.pid").read_text())
        except (OSError, ValueError):
            continue
        try:
            os.kill(owner, 0)
            continue  # its test process is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
        shutil.rmtree(folder, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgBouncer:
    """One PgBouncer process: ``start()``, then connect to ``127.0.0.1:port``; ``stop()``."""

    def __init__(
        self,
        server_host: str = "127.0.0.1",
        server_port: int = 5432,
        *,
        pool_size: int = 10,
        pool_mode: str = "transaction",
    ) -> None:
        self.server_host = server_host
        self.server_port = server_port
        self.pool_size = pool_size
        self.pool_mode = pool_mode
        self.port = 0
        self.dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PgBouncer:
        if not Path(BINARY).exists():
            raise RuntimeError(
                f"{BINARY} is missing: the PgBouncer tests need Debian's pgbouncer "
                "(run tests/support/ensure_pgbouncer.py, or apt-get install pgbouncer)"
            )
        stop_orphans()
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX))
        (self.dir / "owner").write_text(str(os.getpid()))
        self.port = free_port()
        users = self.dir / "users.txt"
        users.write_text('"postgres" ""\n')
        ini = self.dir / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"* = host={self.server_host} port={self.server_port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            f"pool_mode = {self.pool_mode}\n"
            "max_client_conn = 2000\n"
            f"default_pool_size = {self.pool_size}\n"
            # test databases come and go: their idle server connections should not pile up
            "server_idle_timeout = 5\n"
            # JDBC (the Spark job) sends extra_float_digits; nothing of ours needs options
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
            f"pidfile = {self.dir / 'pgbouncer.pid'}\n"
        )
        command = [BINARY, str(ini)]
        if os.geteuid() == 0:
            command[1:1] = ["-u", "postgres"]
            owner = pwd.getpwnam("postgres")
            for path in (self.dir, users, ini):
                os.chown(path, owner.pw_uid, owner.pw_gid)
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited ({self.proc.returncode}):\n{self.log()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pgbouncer did not listen on {self.port}:\n{self.log()}")
            time.sleep(0.05)

    def url(self, database: str, user: str = "postgres") -> str:
        return f"postgresql+psycopg://{user}@127.0.0.1:{self.port}/{database}"

    def log(self) -> str:
        path = self.dir / "pgbouncer.log" if self.dir else None
        return path.read_text(errors="replace")[-4000:] if path and path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
