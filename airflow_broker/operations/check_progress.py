"""The progress the consistency check (:mod:`airflow_broker.operations.check`) reports while it
runs.

Each check is one statement over the whole snapshot whose rows (only the problems it finds)
come from a server-side cursor a batch at a time. The checks do not cut the conversation-handle
space into ranges read one statement each: reading a range through the primary key visits the
heap in random order: with 10^6 endpoints, ranges of 50,000 take three times as long as one
pass over the whole space (hash joins over sequential scans).
"""

from __future__ import annotations

from dataclasses import dataclass


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


__all__ = ["Progress"]
