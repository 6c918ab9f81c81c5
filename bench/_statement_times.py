"""Time spent in each SQL statement of a timed part, by statement text (``--statements``).

SQLAlchemy's cursor events on every engine: the wall time from just before a statement is sent
until its result is back (the round trip and the server's work), summed per statement text,
only while a part is being timed. COMMITs go through the DB-API, not a cursor, and are left
out; what the statements do not cover is the client's own time, and the commits.

The engine's COPYs (``airflow_broker.storage.bulk``) run on the driver's cursor, which
SQLAlchemy's events do not see: they are timed by wrapping the one function that runs them, the
rows' conversion included, as the events include the parameters'.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

from airflow_broker.storage import bulk

#: characters of a statement's text that name it in the table
NAME_LENGTH = 90


class StatementTimes:
    """Per statement text: how many ran and their summed seconds, over every :meth:`timing`."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.wall = 0.0
        self._on = False
        event.listen(Engine, "before_cursor_execute", self._before)
        event.listen(Engine, "after_cursor_execute", self._after)
        copy_rows = bulk._copy_rows

        def timed_copy(
            conn: Any, table: Any, columns: tuple[str, ...], rows: Any, **kwargs: Any
        ) -> None:
            started = time.perf_counter()
            try:
                copy_rows(conn, table, columns, rows, **kwargs)
            finally:
                if self._on:
                    self._add(
                        f"COPY {table.name} ({', '.join(columns)}) FROM STDIN",
                        time.perf_counter() - started,
                    )

        bulk._copy_rows = timed_copy  # bench-only instrumentation, for this process

    def _before(self, conn: Any, _cursor: Any, *_args: Any) -> None:
        conn.info["bench_statement_started"] = time.perf_counter()

    def _after(self, conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        started = conn.info.pop("bench_statement_started", None)
        if self._on and started is not None:
            self._add(statement, time.perf_counter() - started)

    def _add(self, statement: str, seconds: float) -> None:
        name = " ".join(statement.split())[:NAME_LENGTH]
        self.counts[name] += 1
        self.seconds[name] += seconds

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Record the statements run inside the block, and its wall time."""
        self._on = True
        started = time.perf_counter()
        try:
            yield
        finally:
            self.wall += time.perf_counter() - started
            self._on = False

    def report(self, top: int) -> str:
        """The ``top`` costliest statements, and how much of the wall time statements took."""
        total = sum(self.seconds.values())
        lines = [
            f"statements {total:.3f} s of {self.wall:.3f} s timed "
            f"({sum(self.counts.values())} statements, commits left out)",
            f"{'seconds':>8} {'count':>6}  statement",
        ]
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:top]
        lines += [f"{s:8.3f} {self.counts[name]:6d}  {name}" for name, s in ranked]
        return "\n".join(lines)
