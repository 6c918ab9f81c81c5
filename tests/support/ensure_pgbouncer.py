"""Make sure Debian's PgBouncer is installed: the PostgreSQL subset of the tests runs through it.

``make test`` runs the PostgreSQL-facing tests of the engine, leases, failure handling, delivery,
activation and the transmitter a second time through a PgBouncer in transaction mode that each
test process starts (tests/support/pgbouncer.py), and tests/test_pgbouncer.py starts its own.
Like ensure_postgres.py this runs before the tests and never lets them skip: it installs the
``pgbouncer`` package with apt-get when /usr/sbin/pgbouncer is missing (the package's own
service stays stopped: the tests start theirs), and exits non-zero saying why when it cannot.
PgBouncer refuses to run as root: as root the tests run it as the ``postgres`` user, which
Debian's server package creates.
"""

from __future__ import annotations

import pwd
import subprocess
import sys

import apt_packages  # this folder: the scripts run from here
from pgbouncer import BINARY


def version() -> str | None:
    try:
        done = subprocess.run([BINARY, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.splitlines()[0].strip() if done.returncode == 0 and done.stdout else None


def main() -> None:
    found = apt_packages.ensure("pgbouncer", BINARY, version)
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        sys.exit("no 'postgres' user to run PgBouncer as (install Debian's postgresql package)")
    print(f"pgbouncer: {found}")


if __name__ == "__main__":
    main()
