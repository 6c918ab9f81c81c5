"""Where airflow-broker's time goes per message: statements, round trips, database vs Python time.

A diagnostic next to ``bench.throughput`` (it has no targets)::

    python -m bench.statements                  # single and batched, 500 / 5000 messages
    python -m bench.statements --system pgmq    # the same count for pgmq, to compare

It runs the throughput workloads' producer and consumer in this one process, on a scratch
database, with psycopg wrapped to count and time every statement. Per phase it prints
statements and round trips per message (counted at the driver, so the pool's pre-ping and raw
side connections are included; BEGIN and COMMIT are round trips of their own, except a BEGIN
that the engine sends in one query with the first statement, ``storage.direct``), the time
spent waiting on the database versus the whole phase, and the statements that cost the most
(the side connection's writes are sent without waiting, and listed with their send time).
"""

from __future__ import annotations

import argparse
import inspect
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from bench._registry import get_system
from bench._scratch import ScratchServer
from bench._systems import Consumer, Workload


@dataclass
class StatementLog:
    """Counts and timings of what psycopg sends while it is active (all connections)."""

    count: Counter[str] = field(default_factory=Counter)
    seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    #: BEGIN / COMMIT / ROLLBACK that psycopg sends on its own (each one round trip)
    commands: Counter[str] = field(default_factory=Counter)
    #: statements sent without waiting for their answer (no round trip of their own)
    sent: Counter[str] = field(default_factory=Counter)
    commit_seconds: float = 0.0
    active: bool = False

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.count.clear()
        self.seconds.clear()
        self.commands.clear()
        self.sent.clear()
        self.commit_seconds = 0.0

    @property
    def statements(self) -> int:
        """Statements executed (an executemany counts once: psycopg pipelines it)."""
        return sum(self.count.values())

    @property
    def round_trips(self) -> int:
        """Statements plus transaction-control commands that waited for their answer."""
        waited = sum(n for cmd, n in self.commands.items() if "same round trip" not in cmd)
        return self.statements + waited

    @property
    def db_seconds(self) -> float:
        """Time inside execute and commit (network + server)."""
        return sum(self.seconds.values()) + self.commit_seconds


LOG = StatementLog()
_SPACES = re.compile(r"\s+")


def _key(statement: Any) -> str:
    if isinstance(statement, bytes):
        statement = statement.decode()
    elif not isinstance(statement, str):
        statement = str(statement)
    return _SPACES.sub(" ", statement).strip()[:110]


def _install_listeners() -> None:
    """Wrap psycopg's execute, executemany, commit and transaction-control commands.

    At the driver, not in SQLAlchemy's events, so that statements sent around SQLAlchemy (the
    pool's pre-ping, raw side connections) are counted too.
    """
    import psycopg
    from psycopg._connection_base import BaseConnection

    def timed(original: Any) -> Any:
        def wrapper(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            if not LOG.active:
                return original(self, query, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(self, query, *args, **kwargs)
            finally:
                key = _key(query)
                LOG.count[key] += 1
                LOG.seconds[key] += time.perf_counter() - t0

        return wrapper

    psycopg.Cursor.execute = timed(psycopg.Cursor.execute)  # type: ignore[method-assign]
    psycopg.Cursor.executemany = timed(psycopg.Cursor.executemany)  # type: ignore[method-assign]

    exec_command = BaseConnection._exec_command

    def counted(self: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        gen = exec_command(self, command, *args, **kwargs)
        if not LOG.active:
            return gen
        verb = _key(command).split()[0].upper()
        LOG.commands[verb] += 1
        if verb not in ("COMMIT", "ROLLBACK"):
            return gen  # BEGIN runs inside an execute, which is timed already

        def timed_gen() -> Any:
            t0 = time.perf_counter()
            try:
                return (yield from gen)
            finally:
                LOG.commit_seconds += time.perf_counter() - t0

        return timed_gen()

    BaseConnection._exec_command = counted  # type: ignore[method-assign]

    # The hot statements the engine sends through libpq itself (storage.direct): one round trip
    # each, BEGIN included; and the side connection's writes, sent without waiting.
    from airflow_broker.storage import direct
    from airflow_broker.storage.side_writer import SideWriter

    def observed(query: bytes, seconds: float) -> None:
        if not LOG.active:
            return
        if query == b"COMMIT" or (
            query.startswith(b"DELETE FROM broker_receive_lease") and query.endswith(b";COMMIT")
        ):  # a COMMIT, with its transaction's lease rows deleted in the same query
            LOG.commands["COMMIT"] += 1
            LOG.commit_seconds += seconds
            return
        statements = query.split(b";")
        if b"BEGIN" in statements:
            LOG.commands["BEGIN (in the same round trip)"] += 1
        last = statements[-1]
        # EXECUTE name(literals...): counted by the statement, not by its values.
        name = last.split(b"(", 1)[0] if last.startswith(b"EXECUTE") else last
        key = _key(name) + " [direct: one round trip]"
        LOG.count[key] += 1
        LOG.seconds[key] += seconds

    direct.observer = observed
    side_send = SideWriter.send

    def side_counted(self: Any, sql: str, values: Any) -> None:
        if not LOG.active:
            side_send(self, sql, values)
            return
        t0 = time.perf_counter()
        try:
            side_send(self, sql, values)
        finally:
            key = _key(sql) + " [side, not waited for]"
            LOG.sent[key] += 1
            LOG.seconds[key] += time.perf_counter() - t0

    SideWriter.send = side_counted  # type: ignore[method-assign]


@contextmanager
def phase(name: str, messages: int, top: int) -> Iterator[None]:
    """Count what runs inside the block and print it per message."""
    LOG.reset()
    LOG.active = True
    start = time.perf_counter()
    try:
        yield
    finally:
        LOG.active = False
    wall = time.perf_counter() - start
    commits = LOG.commands["COMMIT"]
    control = ", ".join(f"{n / messages:.2f} {cmd}" for cmd, n in sorted(LOG.commands.items()))
    print(
        f"\n== {name}: {messages} messages, {commits} commits, {wall:.2f}s "
        f"({messages / wall:,.0f} msgs/s)"
    )
    print(
        f"   per message: {LOG.statements / messages:.2f} statements + {control} = "
        f"{LOG.round_trips / messages:.2f} round trips; {wall / messages * 1e3:.3f} ms "
        f"(waiting on the database {LOG.db_seconds / messages * 1e3:.3f} ms, of which "
        f"commit {LOG.commit_seconds / messages * 1e3:.3f} ms; Python "
        f"{(wall - LOG.db_seconds) / messages * 1e3:.3f} ms)"
    )
    shown = {**LOG.count, **LOG.sent}
    for key, n in sorted(shown.items(), key=lambda kv: -LOG.seconds[kv[0]])[:top]:
        print(f"   {n / messages:7.2f}/msg {LOG.seconds[key] / messages * 1e3:7.3f} ms/msg  {key}")


def run(system_name: str, workload: Workload, top: int) -> None:
    """Produce then consume ``workload.messages`` messages in this process, counting."""
    system = get_system(system_name)
    server = ScratchServer()
    server.check()
    try:
        db = server.create(server.template(system.name, system.install), "stmts", workload.name)
        state = system.prepare(db, workload)
        producer = system.producer(db, workload, state)
        built = system.consumer(db, workload, state)
        if inspect.iscoroutinefunction(built.receive):
            raise SystemExit(f"{system_name}: asyncio consumers are not instrumented")
        consumer = cast(Consumer, built)
        try:
            for k in range(0, workload.warmup, workload.batch):  # warm caches, compile
                producer.send(k, workload.batch)
            while consumer.receive():
                pass
            with phase(f"{system_name} {workload.name} SEND", workload.messages, top):
                for k in range(0, workload.messages, workload.batch):
                    producer.send(k, workload.batch)
            got = 0
            with phase(f"{system_name} {workload.name} RECEIVE", workload.messages, top):
                while n := consumer.receive():
                    got += n
            assert got == workload.messages, (got, workload.messages)
        finally:
            producer.close()
            consumer.close()
    finally:
        server.drop_all()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the diagnostic."""
    p = argparse.ArgumentParser(
        prog="python -m bench.statements",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--system", default="airflow-broker", help="airflow-broker or pgmq")
    p.add_argument("--messages", type=int, default=500)
    p.add_argument("--batched-messages", type=int, default=5000)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--top", type=int, default=8, help="costliest statements shown per phase")
    args = p.parse_args(argv)
    _install_listeners()
    run(args.system, Workload("single", 1, args.messages, 100, 100, 0), args.top)
    batched = -(-args.batched_messages // args.batch) * args.batch
    run(
        args.system,
        Workload("batched", args.batch, batched, args.batch * 5, args.batch, args.groups),
        args.top,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
