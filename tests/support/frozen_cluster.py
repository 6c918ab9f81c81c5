"""A private PostgreSQL cluster that a test can *freeze* and *thaw*, for the hung-peer tests.

Frozen, every process of the cluster (the postmaster and each of its children) is stopped with
SIGSTOP: the kernel still accepts TCP connections and data on its sockets, but nothing ever
answers. That is how a network partition or a hung host looks to a client: connections are
neither refused nor answered. SIGCONT (:meth:`FrozenCluster.thaw`) lets the server go on from
where it stood; what clients sent meanwhile is still in its sockets and is read then.

It is a throw-away cluster of its own, never the shared test server: ``initdb`` in a temporary
directory, a free port on 127.0.0.1, ``trust`` authentication (Unix socket and
``host 127.0.0.1``), no TLS, small settings (40 connections, ``fsync`` off). As root (the CI)
it runs as the ``postgres`` OS user. The server binaries and the helpers that find and run them
are :mod:`support.tls_cluster`'s; without the binaries the test fails with what to install
(never a skip).

A stopped cluster must never outlive its test: :meth:`FrozenCluster.stop` thaws before it
stops, and a guardian process started with the cluster thaws it, stops it and removes its
directory if the test process dies without stopping it (a pytest-timeout kill, say).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.tls_cluster import (
    SERVER_OS_USER,
    SUPERUSER,
    PrivateCluster,
    _run_as_server,
    free_port,
    initdb,
    private_root,
    server_bindir,
    server_owner,
    start_server,
)

#: How long :meth:`FrozenCluster.freeze` waits for every process to be stopped.
STOP_WAIT = 10.0
#: Process states (/proc/PID/stat) that run nothing: stopped, or a child that exited and that
#: the stopped postmaster cannot reap (a zombie).
HELD = ("T", "Z", "X")

# The guardian: waits for EOF on its stdin (the test process closed it in stop(), or died),
# then thaws the cluster, stops it and removes its directory. Self-contained: it runs with -c.
_GUARDIAN = r"""
import os, shutil, signal, subprocess, sys
root, pg_ctl, runas = sys.argv[1], sys.argv[2], sys.argv[3]
sys.stdin.buffer.read()
data = os.path.join(root, "data")
try:
    with open(os.path.join(data, "postmaster.pid")) as f:
        postmaster = int(f.readline())
except (OSError, ValueError):
    postmaster = None
if postmaster is not None:
    pids = [postmaster]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == postmaster:
                        pids.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass
if os.path.isdir(data):
    cmd = [pg_ctl, "-D", data, "-m", "immediate", "-w", "-t", "30", "stop"]
    if runas:
        cmd = ["runuser", "-u", runas, "--", *cmd]
    subprocess.run(cmd, capture_output=True, timeout=60)
shutil.rmtree(root, ignore_errors=True)
"""


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of process ``pid`` from /proc, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1])


def _children(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[1] == parent:
                found.append(int(entry))
    return found


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, sig)


@dataclass
class FrozenCluster(PrivateCluster):
    """A running private cluster on 127.0.0.1:``port``; :meth:`freeze` and :meth:`thaw` it."""

    guardian: subprocess.Popen[bytes] | None = None
    #: the processes the last freeze() stopped (postmaster first)
    stopped: list[int] = field(default_factory=list)

    def url(self, dbname: str) -> str:
        """The SQLAlchemy URL of database ``dbname`` of this cluster, over TCP."""
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str) -> str:
        """Create database ``name``; returns it. Not while frozen: it would wait for the thaw."""
        return super().create_database(name)

    # -- freezing ----------------------------------------------------------------------------

    def postmaster_pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().splitlines()[0])

    def processes(self) -> list[int]:
        """The postmaster and its children (every server process), postmaster first."""
        postmaster = self.postmaster_pid()
        return [postmaster, *_children(postmaster)]

    @property
    def frozen(self) -> bool:
        return bool(self.stopped)

    def freeze(self) -> None:
        """SIGSTOP every server process; returns once each is stopped. The postmaster goes
        first, so that it forks no new backend meanwhile (the connections that arrive queue in
        its listening socket)."""
        postmaster = self.postmaster_pid()
        os.kill(postmaster, signal.SIGSTOP)
        stopped = [postmaster]
        deadline = time.monotonic() + STOP_WAIT
        while True:
            new = [pid for pid in _children(postmaster) if pid not in stopped]
            _signal(new, signal.SIGSTOP)
            stopped += new
            states = {pid: _stat(pid) for pid in stopped}
            running = [pid for pid, st in states.items() if st is not None and st[0] not in HELD]
            if not new and not running:
                break
            if time.monotonic() > deadline:
                self.stopped = stopped
                self.thaw()
                pytest.fail(f"server processes {running} did not stop within {STOP_WAIT} s")
            time.sleep(0.005)
        self.stopped = stopped

    def thaw(self) -> None:
        """SIGCONT every server process (those the freeze stopped and any child there is now).
        Harmless when not frozen."""
        pids = list(self.stopped)
        with suppress(OSError, ValueError, IndexError):  # no postmaster.pid: stopped already
            pids += [pid for pid in self.processes() if pid not in pids]
        _signal(pids, signal.SIGCONT)
        self.stopped = []

    def all_stopped(self) -> bool:
        """Whether every server process is in the stopped state now."""
        states = [_stat(pid) for pid in self.processes()]
        return all(st is None or st[0] in HELD for st in states)

    # -- the end -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Thaw, stop the server (immediate) and remove its directory; then the guardian ends."""
        self.thaw()
        _run_as_server(
            [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"],
            check=False,
        )
        shutil.rmtree(self.root, ignore_errors=True)
        if self.guardian is not None:
            if self.guardian.stdin is not None:
                self.guardian.stdin.close()
            try:
                self.guardian.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.guardian.kill()
            self.guardian = None


def _bindir() -> Path:
    """:func:`support.tls_cluster.server_bindir`, failing with this module's words."""
    try:
        return server_bindir()
    except pytest.fail.Exception as exc:
        pytest.fail(
            "the hung-peer tests freeze a PostgreSQL cluster of their own and need the server "
            f"binaries: {exc.msg}",
            pytrace=False,
        )


def start_frozen_cluster() -> FrozenCluster:
    """initdb a cluster in a new temporary directory, allow ``trust`` connections on 127.0.0.1,
    start it (running, not frozen) with its guardian. Stop it with :meth:`FrozenCluster.stop`."""
    bindir = _bindir()
    owner = server_owner("the hung-peer test cluster")
    root = private_root("broker-frozen-", owner)
    cluster = FrozenCluster(root=root, bindir=bindir, port=free_port())
    # The guardian first: from here on, whatever happens to this process, the cluster goes.
    cluster.guardian = subprocess.Popen(
        [sys.executable, "-c", _GUARDIAN, str(root), str(bindir / "pg_ctl"),
         SERVER_OS_USER if owner is not None else ""],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the test run's process group does not end it
    )  # fmt: skip
    try:
        _set_up(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _set_up(cluster: FrozenCluster) -> None:
    initdb(
        cluster,
        "# airflow-broker hung-peer test cluster\n"
        "max_connections = 40\n"
        "shared_buffers = 16MB\n"
        "fsync = off\n"
        "synchronous_commit = off\n"
        "full_page_writes = off\n",
        "local all all trust\nhost all all 127.0.0.1/32 trust\n",
    )
    started = start_server(cluster)
    if started.returncode != 0:
        pytest.fail(
            f"the hung-peer test cluster did not start ({started.stdout}{started.stderr}):\n"
            + cluster.server_log(),
            pytrace=False,
        )


@contextmanager
def frozen_cluster() -> Iterator[FrozenCluster]:
    """A running cluster for the ``with`` block; stopped (thawed first) at its end."""
    cluster = start_frozen_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()
