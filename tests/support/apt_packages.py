"""Installing Debian packages for the test set-up (the ensure_*.py scripts beside this one):
apt-get, non-interactive; exits saying what could not be installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence


def install(packages: Sequence[str], *, recommends: bool = False) -> None:
    """``apt-get update`` then ``apt-get install`` ``packages``; exit non-zero saying why when
    there is no apt-get or it fails (the tests never run without what they need)."""
    names = " ".join(packages)
    if shutil.which("apt-get") is None:
        sys.exit(f"{names}: not installed, and there is no apt-get to install them with")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"+ apt-get install {names}", flush=True)
    options = [] if recommends else ["--no-install-recommends"]
    try:
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", *options, *packages], check=True, env=env
        )
    except subprocess.CalledProcessError as exc:
        sys.exit(f"installing {names} failed: {exc}")


def ensure(package: str, binary: str, version: Callable[[], str | None]) -> str:
    """``version()`` of ``binary`` (None: missing or not running); when None, install
    ``package`` and ask again. Returns the version line; exits non-zero saying why when the
    package does not make it run."""
    found = version()
    if found is None:
        print(f"{binary} is missing or does not run; installing Debian's {package}", flush=True)
        install([package])
        found = version()
    if found is None:
        sys.exit(f"{binary} does not run after installing Debian's {package} package")
    return found
