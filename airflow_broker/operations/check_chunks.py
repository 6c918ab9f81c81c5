"""The consistency check's streaming (:mod:`airflow_broker.operations.check`): the
conversation-handle space cut into chunks the checks read one at a time, and the progress
reported while they do."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from airflow_broker.storage import schema as s

_e = s.conversation_endpoint

#: A chunk of the conversation-handle space: (after this handle, up to and including this one);
#: None at either end is open.
Chunk = tuple[Any, Any]


def within(column: Any, chunk: Chunk) -> list[Any]:
    """``column`` (a conversation handle) inside ``chunk``."""
    lo, hi = chunk
    conds = []
    if lo is not None:
        conds.append(column > lo)
    if hi is not None:
        conds.append(column <= hi)
    return conds


@dataclass(frozen=True, slots=True)
class Progress:
    """How far a check has come: ``endpoints`` conversation endpoints checked of ``total``
    (PostgreSQL's estimate past 10,000: ``estimated``), after ``seconds``, with ``problems``
    found so far; ``done`` on the last report."""

    endpoints: int
    total: int
    estimated: bool
    seconds: float
    problems: int
    done: bool = False

    def __str__(self) -> str:
        about = "about " if self.estimated else ""
        share = min(100, round(100 * self.endpoints / self.total)) if self.total else 100
        found = f"{self.problems} problem{'s' if self.problems != 1 else ''} so far"
        return (
            f"{self.endpoints:,} of {about}{self.total:,} conversation endpoints checked "
            f"({share}%) in {self.seconds:.1f} s, {found}"
        )


def chunks(conn: Connection, size: int) -> Iterator[tuple[Chunk, int]]:
    """The handle space in chunks of ``size`` endpoints (the last one open-ended), each with
    how many endpoints it holds: one index read per chunk finds where it ends."""
    handle = _e.c.conversation_handle
    last = None
    while True:
        stmt = select(handle).order_by(handle).offset(size - 1).limit(1)
        if last is not None:
            stmt = stmt.where(handle > last)
        hi = conn.execute(stmt).scalar()
        if hi is None:
            rest = select(func.count()).select_from(_e).where(*within(handle, (last, None)))
            yield (last, None), int(conn.execute(rest).scalar_one())
            return
        yield (last, hi), size
        last = hi


__all__ = ["Chunk", "Progress", "chunks", "within"]
