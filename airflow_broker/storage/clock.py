"""Time as the broker stores it: timezone-aware UTC, whatever the database hands back.

Every timestamp the engine writes or compares (lifetimes, conversation timers, retries, closed
endpoints' retention) comes from :func:`utcnow`, never from the database server's clock, so one
process sees one time line. :func:`advance` moves that time line forward for this process only:
tests (the reference model's state machine) use it to reach timers and lifetimes without
sleeping. Waits (``wait_seconds``, leases, heartbeats) use the monotonic clock and are not moved.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

_skew = timedelta(0)
_skew_lock = threading.Lock()


def utcnow() -> datetime:
    """Now, in UTC (plus whatever :func:`advance` added in this process)."""
    return datetime.now(UTC) + _skew


def advance(seconds: float) -> None:
    """Move this process's broker time forward by ``seconds`` (for tests; never backwards)."""
    global _skew
    if seconds < 0:
        raise ValueError(f"broker time only moves forward, not by {seconds} seconds")
    with _skew_lock:
        _skew += timedelta(seconds=seconds)


def reset() -> None:
    """Back to the wall clock (for tests)."""
    global _skew
    with _skew_lock:
        _skew = timedelta(0)


def aware(value: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes for timezone-aware columns: they are UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


__all__ = ["advance", "aware", "reset", "utcnow"]
