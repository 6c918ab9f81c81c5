"""The supported Airflow range is stated once and agrees everywhere: pyproject.toml's lower bound,
``compat.OLDEST_SUPPORTED``, the Airflow that pins the oldest test environment
(tests/support/oldest-airflow.txt) and the supported range in docs/airflow.md. In that
environment (``make test`` runs this module there too), the Airflow installed is that one."""

from __future__ import annotations

import os
import re
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.version import Version

from airflow_broker.provider import compat

ROOT = Path(__file__).resolve().parent.parent
PINS = ROOT / "tests" / "support" / "oldest-airflow.txt"


def lower_bound() -> Version:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds = [
        found.group(1)
        for requirement in extra["optional-dependencies"]["airflow"]
        if (found := re.fullmatch(r"apache-airflow\s*>=\s*(\S+)", requirement.strip()))
    ]
    assert len(bounds) == 1, f"one `apache-airflow>=X` in the airflow extra, not {bounds}"
    return Version(bounds[0])


def test_pyproject_lower_bound_is_the_oldest_supported() -> None:
    assert lower_bound() == compat.OLDEST_SUPPORTED


def test_the_oldest_environment_pins_the_oldest_supported() -> None:
    [pinned] = re.findall(r"^apache-airflow==(\S+)$", PINS.read_text(), flags=re.M)
    assert Version(pinned) == compat.OLDEST_SUPPORTED


def test_the_docs_state_the_supported_range() -> None:
    oldest = compat.OLDEST_SUPPORTED
    docs = (ROOT / "docs" / "airflow.md").read_text()
    assert f"Airflow {oldest.major}.{oldest.minor} or newer" in docs
    assert f"| {oldest} |" in docs  # the table of what is tested on which version


def test_the_installed_airflow_is_supported() -> None:
    """And in .venv-oldest it is exactly the oldest: a run there cannot pass on another one."""
    installed = Version(version("apache-airflow"))
    assert installed == compat.AIRFLOW_VERSION
    assert installed >= compat.OLDEST_SUPPORTED
    if Path(sys.prefix).name == ".venv-oldest" or os.environ.get("BROKER_TEST_OLDEST_AIRFLOW"):
        assert installed == compat.OLDEST_SUPPORTED
