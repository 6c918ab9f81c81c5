"""Build or refresh ``.venv-oldest``: the package and its dev extra on the oldest supported Airflow.

``make test`` runs the Airflow-facing end-to-end tests a second time in this environment (the
first run is on the newest 3.x, in ``.venv``). What it holds is pinned, every distribution, by
``tests/support/oldest-airflow.txt``, so the oldest environment does not drift as new releases of
Airflow's dependencies appear (a structlog or pydantic from after Airflow's release breaks it).

Run it with any Python 3.11 (``make`` uses ``.venv/bin/python``)::

    python tests/support/ensure_oldest_airflow.py            # build or refresh; fast when current
    python tests/support/ensure_oldest_airflow.py --compile  # regenerate the pins, then build

Up to date means: the stamp file in the environment holds the hash of ``pyproject.toml``, the
pins and this script. Otherwise the environment is created if missing and synced to the pins:
``uv pip sync`` of the pinned set (which removes anything else), then the package itself, editable,
with its dev extra constrained by the same pins. A dependency that the pins do not name (one added
to ``pyproject.toml`` since they were compiled) still installs, at its newest release, and is
reported: run ``--compile`` and commit the new pins. Any failure exits non-zero and says why.

The pins (``--compile``): ``pyproject.toml``'s dev extra with ``apache-airflow`` at its lower
bound, resolved with ``uv pip compile --exclude-newer CUTOFF``: what an install of that Airflow
resolved in the week it was released, except for the packages in ``NEWER`` whose lower bounds in
``pyproject.toml`` (or theirs) are later releases.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-oldest"
PINS = ROOT / "tests" / "support" / "oldest-airflow.txt"
STAMP = VENV / ".oldest-airflow-stamp"
PYTHON_VERSION = "3.11"

#: Airflow 3.1.0 was released on 2025-09-25: resolve as of a few days after.
CUTOFF = "2025-10-01"
#: Released after CUTOFF but required: pyproject.toml pins PySpark 4.2 (and pyspark-client needs
#: the newer grpc and protos), and the benchmark peers' lower bounds are later releases. The
#: engine's schema needs SQLAlchemy 2.1 (``postgresql_with=`` on a Table: migration 0019), and
#: SQLAlchemy-Utils before 0.43 does not import under 2.1.
NEWER = (
    "sqlalchemy",
    "sqlalchemy-utils",
    "psycopg",
    "psycopg-binary",
    "psycopg-pool",
    "pyspark",
    "pyspark-client",
    "grpcio",
    "grpcio-status",
    "googleapis-common-protos",
    "pgmq",
    "pgqueuer",
    "uvloop",
)
NEWER_CUTOFF = "2100-01-01"


class Failed(Exception):
    """Why the environment could not be built: printed, exit status 1."""


def run(*cmd: str | Path, quiet: bool = False) -> str:
    args = [str(c) for c in cmd]
    print("+", " ".join(args), flush=True)
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise Failed(f"`{' '.join(args)}` failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    if not quiet and done.stderr.strip():
        print(done.stderr.strip(), flush=True)
    return done.stdout


def oldest_airflow() -> str:
    """The lower bound of ``apache-airflow`` in pyproject.toml's ``airflow`` extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["optional-dependencies"]["airflow"]:
        found = re.fullmatch(r"apache-airflow\s*>=\s*([0-9][0-9a-z.]*)", requirement.strip())
        if found:
            return found.group(1)
    raise Failed("pyproject.toml: no `apache-airflow>=X` in the airflow extra")


def pinned(path: Path = PINS) -> dict[str, str]:
    """name (normalized) -> version, from a ``name==version`` file."""
    pins = {}
    for line in path.read_text().splitlines():
        found = re.match(r"([A-Za-z0-9._-]+)==([^\s;#]+)", line)
        if found:
            pins[normalize(found.group(1))] = found.group(2)
    return pins


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def digest() -> str:
    h = hashlib.sha256()
    for path in (ROOT / "pyproject.toml", PINS, Path(__file__)):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def uv() -> Path:
    """uv inside the environment (created, with pip's help, when missing)."""
    python = VENV / "bin" / "python"
    if not python.exists():
        interpreter = shutil.which(f"python{PYTHON_VERSION}")
        if interpreter is None:
            raise Failed(f"python{PYTHON_VERSION} is not on PATH: it builds {VENV.name}")
        run(interpreter, "-m", "venv", VENV)
    tool = VENV / "bin" / "uv"
    if not tool.exists():
        run(python, "-m", "pip", "install", "--quiet", "uv")
    return tool


def compile_pins() -> None:
    airflow = oldest_airflow()
    with tempfile.TemporaryDirectory() as tmp:
        extra = Path(tmp) / "oldest-airflow.in"
        extra.write_text(f"apache-airflow=={airflow}\n")
        out = _compile(extra)
    header = (
        f"# The oldest supported Airflow ({airflow}) and all that the dev extra installs with\n"
        "# it, as resolved in the week it was released. Generated: do not edit; regenerate with\n"
        "#   python tests/support/ensure_oldest_airflow.py --compile\n"
        f"# (uv pip compile --extra dev pyproject.toml, apache-airflow=={airflow},\n"
        f"#  --exclude-newer {CUTOFF}, except {', '.join(NEWER[:4])},\n"
        f"#  {', '.join(NEWER[4:])}).\n"
        "# Also a pip constraints file:\n"
        "#   pip install -c tests/support/oldest-airflow.txt -e '.[dev]'\n"
    )
    PINS.write_text(header + out)
    print(f"wrote {PINS.relative_to(ROOT)}: {len(pinned())} pins", flush=True)


def _compile(extra: Path) -> str:
    newer = [f"--exclude-newer-package={name}={NEWER_CUTOFF}" for name in NEWER]
    return run(
        uv(), "pip", "compile", "--quiet", "--python-version", PYTHON_VERSION,
        "--no-header", "--no-annotate", "--extra", "dev", "pyproject.toml", extra,
        "--exclude-newer", CUTOFF, *newer,
        quiet=True,
    )  # fmt: skip


def build() -> None:
    tool, python = uv(), VENV / "bin" / "python"
    env = ["--python", str(python)]
    run(tool, "pip", "sync", "--quiet", *env, PINS)
    run(tool, "pip", "install", "--quiet", *env, "-c", PINS, "-e", ".[dev]")
    installed = {
        normalize(name): version
        for name, version in (
            line.split("==", 1)
            for line in run(tool, "pip", "freeze", "--quiet", *env, quiet=True).splitlines()
            if "==" in line
        )
    }
    pins = pinned()
    airflow = oldest_airflow()
    if installed.get("apache-airflow") != airflow:
        raise Failed(
            f"{VENV.name} has apache-airflow {installed.get('apache-airflow')}, not {airflow} "
            f"(pyproject.toml's lower bound): regenerate the pins with --compile"
        )
    if pins.get("apache-airflow") != airflow:
        raise Failed(
            f"{PINS.name} pins apache-airflow {pins.get('apache-airflow')}, but pyproject.toml's "
            f"lower bound is {airflow}: regenerate the pins with --compile"
        )
    unpinned = sorted(set(installed) - set(pins) - {"airflow-broker", "pip", "setuptools", "uv"})
    if unpinned:
        print(
            f"warning: not pinned by {PINS.name}, installed at their newest: "
            f"{', '.join(unpinned)}; run {Path(__file__).name} --compile and commit the pins",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", action="store_true", help="regenerate the pins first")
    args = parser.parse_args()
    try:
        if args.compile:
            compile_pins()
        want = digest()
        if STAMP.exists() and STAMP.read_text().strip() == want:
            print(f"{VENV.name}: up to date (Airflow {oldest_airflow()})", flush=True)
            return 0
        STAMP.unlink(missing_ok=True)
        build()
        STAMP.write_text(want + "\n")
        print(f"{VENV.name}: Airflow {oldest_airflow()}, synced to {PINS.name}", flush=True)
        return 0
    except (Failed, OSError, KeyError) as exc:
        print(f"ensure_oldest_airflow: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
