"""Make sure the Redis the CeleryExecutor tests need is installed: Debian's redis-server,
/usr/bin/redis-server.

tests/support/airflow_stack.py starts a redis-server of its own for each deployment under
CeleryExecutor (a free loopback port, nothing written to disk) as the Celery broker, and never
lets those tests skip. Like ensure_browser.py, this runs before the tests: it installs the
``redis-server`` package with apt-get when the server is missing, and exits non-zero saying why
when it cannot. The service the package may start on 6379 is not what the tests use.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import apt_packages  # this folder: the scripts run from here

REDIS_SERVER = Path("/usr/bin/redis-server")


def version() -> str | None:
    """The server's version line, or None when it does not run."""
    if not REDIS_SERVER.exists():
        return None
    try:
        done = subprocess.run(
            [str(REDIS_SERVER), "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = done.stdout.strip()
    return line if done.returncode == 0 and line.startswith("Redis server") else None


def main() -> None:
    found = apt_packages.ensure("redis-server", str(REDIS_SERVER), version)
    print(f"redis: {found} at {REDIS_SERVER}")


if __name__ == "__main__":
    main()
