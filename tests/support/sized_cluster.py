"""A private PostgreSQL cluster with a given ``max_connections``, for tests that count
connections (the breadth test: a triggerer holding 500 activated queues on a server whose
``max_connections`` is 100, PostgreSQL's default).

The shared test server's connections are shared with whatever else runs (the other half of
``make test -n 2``, other people's runs): a test that measures how many connections a component
holds, and that would take all of them if the component misbehaved, gets a server of its own.
It is :mod:`support.frozen_cluster`'s cluster (``initdb`` in a temporary directory, a free port
on 127.0.0.1, ``trust``, ``fsync`` off, the guardian that stops it if the test process dies)
with other settings; it is never frozen.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from support.frozen_cluster import _GUARDIAN, FrozenCluster, _bindir
from support.tls_cluster import (
    SERVER_OS_USER,
    free_port,
    initdb,
    private_root,
    server_owner,
    start_server,
)


def start_sized_cluster(max_connections: int = 100) -> FrozenCluster:
    """initdb and start a cluster allowing ``max_connections`` (3 of them kept for superusers,
    as PostgreSQL's default ``superuser_reserved_connections``). Stop it with
    :meth:`FrozenCluster.stop`."""
    bindir = _bindir()
    owner = server_owner("the test's PostgreSQL cluster")
    root = private_root("broker-sized-", owner)
    cluster = FrozenCluster(root=root, bindir=bindir, port=free_port())
    cluster.guardian = subprocess.Popen(
        [sys.executable, "-c", _GUARDIAN, str(root), str(bindir / "pg_ctl"),
         SERVER_OS_USER if owner is not None else ""],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        initdb(
            cluster,
            "# airflow-broker test cluster of a given size\n"
            f"max_connections = {max_connections}\n"
            "superuser_reserved_connections = 3\n"
            "shared_buffers = 64MB\n"
            "fsync = off\n"
            "synchronous_commit = off\n"
            "full_page_writes = off\n",
            "local all all trust\nhost all all 127.0.0.1/32 trust\n",
        )
        started = start_server(cluster)
        if started.returncode != 0:
            pytest.fail(
                f"the test's PostgreSQL cluster did not start ({started.stdout}"
                f"{started.stderr}):\n{cluster.server_log()}",
                pytrace=False,
            )
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextmanager
def sized_cluster(max_connections: int = 100) -> Iterator[FrozenCluster]:
    """A running cluster allowing ``max_connections`` for the ``with`` block."""
    cluster = start_sized_cluster(max_connections)
    try:
        yield cluster
    finally:
        cluster.stop()
