"""Make sure the PostgreSQL server the tests need answers; start or install it if it does not.

The tests never skip for a missing database: this runs before them (``make test``). With
``BROKER_TEST_POSTGRES_URL`` pointing elsewhere it only checks that server. For the default local
server (127.0.0.1:5432, user postgres, trust auth) it starts an installed Debian cluster, or
installs Debian's ``postgresql`` package, opens trust auth on the loopback and starts it. Any
failure ends with a non-zero exit and says why.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from pathlib import Path

import apt_packages  # this folder: the scripts run from here
import psycopg
from sqlalchemy import make_url

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def answers(url: str) -> str | None:
    u = make_url(url)
    try:
        with psycopg.connect(
            host=u.host or "127.0.0.1",
            port=u.port or 5432,
            user=u.username or "postgres",
            password=u.password,
            dbname=u.database or "postgres",
            connect_timeout=3,
        ) as conn:
            conn.execute("SELECT 1")
        return None
    except Exception as exc:
        return str(exc).strip()


def run(*cmd: str) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def clusters() -> list[str]:
    root = Path("/etc/postgresql")
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def install() -> None:
    apt_packages.install(["postgresql"], recommends=True)


def trust_loopback(version: str) -> None:
    hba = Path(f"/etc/postgresql/{version}/main/pg_hba.conf")
    text = hba.read_text()
    line = "host all all 127.0.0.1/32 trust\n"
    if line not in text:
        hba.write_text(line + text)


def start(version: str) -> None:
    run("pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "start")


def server_binaries() -> None:
    """The TLS tests start a private cluster of their own (tests/support/tls_cluster.py): they
    need initdb and pg_ctl here even when the test server answers from elsewhere."""
    if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        print("PostgreSQL server binaries missing (initdb): installing them", flush=True)
        install()


def main() -> None:
    url = os.environ.get("BROKER_TEST_POSTGRES_URL", DEFAULT_URL)
    problem = answers(url)
    if problem is None:
        print(f"PostgreSQL answers at {make_url(url).render_as_string(hide_password=True)}")
        server_binaries()
        return
    local = make_url(url).host in ("127.0.0.1", "localhost") and url == DEFAULT_URL
    if not local:
        sys.exit(f"PostgreSQL at BROKER_TEST_POSTGRES_URL does not answer: {problem}")
    print(f"PostgreSQL does not answer ({problem}); starting the local server", flush=True)
    if not clusters():
        install()
    version = clusters()[-1]
    trust_loopback(version)
    try:
        start(version)
    except subprocess.CalledProcessError:
        # Already running with the old pg_hba.conf: reload it.
        run("pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "reload")
    for _ in range(60):
        problem = answers(url)
        if problem is None:
            print("PostgreSQL is up")
            return
        time.sleep(0.5)
    sys.exit(f"PostgreSQL did not come up at {url}: {problem}")


if __name__ == "__main__":
    main()
