"""Make sure what the Spark tests need is installed: a Java runtime and Debian's JDBC drivers.

PySpark (from the dev extra) brings Spark itself; it needs Java 17 and, for the routing job's
JDBC reads and writes, the PostgreSQL and SQLite drivers, which Debian packages as
``libpostgresql-jdbc-java`` and ``libxerial-sqlite-jdbc-java``
(:data:`airflow_broker.spark.jdbc.DEBIAN_JARS`). Like ensure_postgres.py this runs before the
tests (``make test``) and never lets them skip: it apt-get installs what is missing and exits
non-zero saying why when it cannot.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

JARS = {
    "/usr/share/java/postgresql.jar": "libpostgresql-jdbc-java",
    "/usr/share/java/sqlite-jdbc.jar": "libxerial-sqlite-jdbc-java",
}
JAVA_PACKAGE = "openjdk-17-jre-headless"


def missing() -> list[str]:
    packages = [pkg for jar, pkg in JARS.items() if not Path(jar).exists()]
    if shutil.which("java") is None:
        packages.append(JAVA_PACKAGE)
    return packages


def install(packages: list[str]) -> None:
    if shutil.which("apt-get") is None:
        sys.exit(f"{', '.join(packages)} missing and there is no apt-get to install them with")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"+ apt-get install {' '.join(packages)}", flush=True)
    try:
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
            check=True,
            env=env,
        )
    except subprocess.CalledProcessError as exc:
        sys.exit(f"installing {' '.join(packages)} failed: {exc}")


def main() -> None:
    packages = missing()
    if packages:
        install(packages)
    still = missing()
    if still:
        sys.exit(f"still missing after apt-get: {', '.join(still)}")
    java = subprocess.run(["java", "-version"], capture_output=True, text=True)
    first = (java.stderr or java.stdout).splitlines()[:1]
    print(f"Spark prerequisites: {first[0] if first else 'java'}; JDBC drivers {', '.join(JARS)}")


if __name__ == "__main__":
    main()
