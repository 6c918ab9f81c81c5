"""Make sure what the Spark tests need is installed: a Java runtime and Debian's JDBC drivers.

PySpark (from the dev extra) brings Spark itself; it needs Java 17 and, for the routing job's
JDBC reads and writes, the PostgreSQL and SQLite drivers, which Debian packages as
``libpostgresql-jdbc-java`` and ``libxerial-sqlite-jdbc-java``
(:data:`airflow_broker.spark.jdbc.DEBIAN_JARS`). Like ensure_postgres.py this runs before the
tests (``make test``) and never lets them skip: it apt-get installs what is missing and exits
non-zero saying why when it cannot.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import apt_packages  # this folder: the scripts run from here

JARS = {
    "/usr/share/java/postgresql.jar": "libpostgresql-jdbc-java",
    "/usr/share/java/sqlite-jdbc.jar": "libxerial-sqlite-jdbc-java",
}
JAVA_PACKAGE = "openjdk-17-jre-headless"
#: PySpark 4 runs on Java 17 and newer.
MIN_JAVA = 17


def java_version() -> tuple[int, str] | None:
    """The major version and first line of ``java -version``, or None without a Java."""
    if shutil.which("java") is None:
        return None
    done = subprocess.run(["java", "-version"], capture_output=True, text=True)
    first = ((done.stderr or done.stdout).splitlines() or [""])[0]
    found = re.search(r'version "(\d+)', first)
    return (int(found.group(1)) if found else 0), first


#: The Spark cluster test's worker runs Debian's Python, which lacks airflow_broker
#: (tests/support/spark_cluster.py): the executors must get it from the shipped archive.
WORKER_PYTHON = Path("/usr/bin/python3")


def missing() -> list[str]:
    packages = [pkg for jar, pkg in JARS.items() if not Path(jar).exists()]
    if not WORKER_PYTHON.exists():
        packages.append("python3")
    java = java_version()
    if java is None or java[0] < MIN_JAVA:
        packages.append(JAVA_PACKAGE)
    return packages


def main() -> None:
    packages = missing()
    if packages:
        apt_packages.install(packages)
    still = missing()
    if still:
        sys.exit(
            f"still missing after apt-get: {', '.join(still)} (PySpark 4 needs Java "
            f"{MIN_JAVA} or newer as `java` on PATH)"
        )
    java = java_version()
    print(f"Spark prerequisites: {java and java[1]}; JDBC drivers {', '.join(JARS)}")


if __name__ == "__main__":
    main()
