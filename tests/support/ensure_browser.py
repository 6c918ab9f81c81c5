"""Make sure the browser the UI test drives is installed: Debian's chromium, /usr/bin/chromium.

tests/test_ui_browser.py drives the broker page with Playwright, launched on this executable:
Playwright's own browser download needs a host this project's machines do not reach. Like
ensure_postgres.py, this runs before the tests (``make test``) and never lets them skip: it
installs the ``chromium`` package with apt-get when the browser is missing, and exits non-zero
saying why when it cannot.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import apt_packages  # this folder: the scripts run from here

CHROMIUM = Path("/usr/bin/chromium")


def version() -> str | None:
    """The browser's version line, or None when it does not run."""
    if not CHROMIUM.exists():
        return None
    try:
        done = subprocess.run(
            [str(CHROMIUM), "--headless", "--no-sandbox", "--version"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line for line in done.stdout.splitlines() if "chrom" in line.lower()]
    return lines[-1].strip() if done.returncode == 0 and lines else None


def main() -> None:
    found = apt_packages.ensure("chromium", str(CHROMIUM), version)
    print(f"browser: {found} at {CHROMIUM}")


if __name__ == "__main__":
    main()
