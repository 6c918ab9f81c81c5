"""The consistency check's streaming (:mod:`airflow_broker.operations.check`): what a check
reads (a range of the conversation-handle space, the whole of it by default) and the progress
reported while the checks run.

Each check is one statement over the whole snapshot whose rows (only the problems it finds)
come from a server-side cursor a batch at a time; a first version cut the handle space into
chunks of 50,000 endpoints, one statement per check and chunk, but reading a chunk through the
primary key visits the heap in random order: with 10^6 endpoints it took three times as long
as one pass (hash joins over sequential scans), so the checks read the whole space once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: A range of the conversation-handle space: (after this handle, up to and including this one);
#: None at either end is open.
Chunk = tuple[Any, Any]

#: The whole handle space.
WHOLE: Chunk = (None, None)


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
    """How far a check has come: ``step`` of ``steps`` checks done (``name`` the last one), on
    a broker of ``endpoints`` conversation endpoints (PostgreSQL's estimate past 10,000:
    ``estimated``), after ``seconds``, with ``problems`` found so far; ``done`` on the last
    report."""

    step: int
    steps: int
    name: str
    endpoints: int
    estimated: bool
    seconds: float
    problems: int
    done: bool = False

    def __str__(self) -> str:
        about = "about " if self.estimated else ""
        found = f"{self.problems} problem{'s' if self.problems != 1 else ''} so far"
        return (
            f"{self.step} of {self.steps} checks done ({self.name}) in {self.seconds:.1f} s, "
            f"{found}; {about}{self.endpoints:,} conversation endpoints"
        )


__all__ = ["WHOLE", "Chunk", "Progress", "within"]
