"""Seed 000 at volume on one machine: the example DAG ``sales_by_region`` and the Spark job.

``python -m airflow_broker.examples.sales_demo --dags-folder dags`` (``make demo-spark``) runs
the DAG with ``airflow dags test`` in a new ``AIRFLOW_HOME`` (a temporary directory unless
``--home`` names one), with nothing to set up beforehand:

- headquarters is the embedded store, ``$AIRFLOW_HOME/broker.db`` (no ``broker_default``
  connection: the hook uses the file and migrates it);
- each region is a SQLite file behind the Airflow connection ``sales_<region>``, migrated here;
- ``spark_default`` is a Spark connection whose host is ``local[*]``: ``SparkRoutingOperator``
  runs the job with ``spark-submit`` on this machine, with Debian's JDBC drivers.

It files ``--requests`` sales requests, the Spark job classifies each by the region in its
first message and delivers it to that region's database exactly once, and the demo prints how
many requests each region received. Exit status 0 when every request arrived.

It needs the ``airflow`` extra (Airflow, the Spark provider with PySpark), Java 17 and the JDBC
drivers (``apt-get install openjdk-17-jre-headless libxerial-sqlite-jdbc-java``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from airflow_broker import Broker
from airflow_broker.examples import sales

DAG_ID = "sales_by_region"
#: The Spark job's phases, in the order a run passes them (RunReport.phases): ``written`` at
#: a PostgreSQL far broker, ``staged`` at a SQLite one.
PHASES = ("planned", "written", "staged", "committed", "acknowledged")


def environment(home: Path, dags_folder: Path, regions: dict[str, str]) -> dict[str, str]:
    """Airflow's settings and connections for the demo, in the environment of its commands."""
    bin_dir = str(Path(sys.executable).parent)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_BROKER_ADDRESS_"))
    }
    env.update(
        {
            "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[*]"}),
            # The job's Python: this interpreter, where airflow_broker is installed.
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
        }
    )
    for region, url in regions.items():
        env[f"AIRFLOW_CONN_SALES_{region.upper()}"] = json.dumps(
            {"conn_type": "broker", "extra": {"url": url}}
        )
    return env


def run(requests: int, home: Path, dags_folder: Path) -> dict[str, int]:
    """The demo in ``home``; returns the requests each region's queue holds."""
    if not (dags_folder / f"{DAG_ID}.py").exists():
        raise SystemExit(f"{dags_folder} has no {DAG_ID}.py: pass the repository's dags folder")
    regions = {r: f"sqlite:///{home / f'sales_{r}.db'}" for r in sales.REGIONS}
    for url in regions.values():
        region = Broker.connect(url)
        region.migrate()
        region.dispose()
    env = environment(home, dags_folder.resolve(), regions)
    print(f"AIRFLOW_HOME={home}: migrating Airflow's metadata database", flush=True)
    subprocess.run(["airflow", "db", "migrate"], env=env, check=True, stdout=subprocess.DEVNULL)
    print(f"airflow dags test {DAG_ID}: {requests:,} sales requests", flush=True)
    test = subprocess.run(
        ["airflow", "dags", "test", DAG_ID, "--conf", json.dumps({"requests": requests})],
        env=env,
        capture_output=True,
        text=True,
    )
    report = [line for line in test.stdout.splitlines() if "AIRFLOW_BROKER_SPARK_REPORT" in line]
    if test.returncode != 0 or not report:
        sys.stdout.write(test.stdout[-8000:])
        sys.stderr.write(test.stderr[-8000:])
        raise SystemExit(f"airflow dags test {DAG_ID} failed (exit {test.returncode})")
    # The job's last line, as the task log carries it (fields may follow the JSON).
    text = report[-1].split("AIRFLOW_BROKER_SPARK_REPORT", 1)[1].strip()
    job, _ = json.JSONDecoder().raw_decode(text)
    phases = ", ".join(f"{k} {job['phases'][k]:.1f} s" for k in PHASES if k in job["phases"])
    print(
        f"the Spark job read {job['read']:,} messages, delivered {job['delivered']:,} and "
        f"acknowledged {job['acknowledged']:,} in {job['seconds']:.1f} s (phases: {phases})"
    )
    brokers = {r: Broker.connect(url) for r, url in regions.items()}
    try:
        return sales.depths(brokers)
    finally:
        for b in brokers.values():
            b.dispose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m airflow_broker.examples.sales_demo", description=__doc__.splitlines()[0]
    )
    p.add_argument("--requests", type=int, default=5000, help="sales requests to file")
    p.add_argument("--dags-folder", type=Path, default=Path("dags"), help="where the DAG is")
    p.add_argument("--home", type=Path, help="AIRFLOW_HOME (default: a new temporary folder)")
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error("--requests must be 1 or more")
    home = args.home or Path(tempfile.mkdtemp(prefix="airflow-broker-sales-"))
    home.mkdir(parents=True, exist_ok=True)
    depths = run(args.requests, home, args.dags_folder)
    for region, n in sorted(depths.items()):
        print(f"  {sales.service_of(region):<16} {n:>8,} requests")
    arrived = sum(depths.values())
    print(f"{arrived:,} of {args.requests:,} requests arrived in their region's database")
    return 0 if arrived == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
