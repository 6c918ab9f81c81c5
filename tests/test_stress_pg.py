"""The stress run: several processes race random operations on shared conversations (issue 18).

Four workers (``stress_procs.py``) begin dialogs, SEND on one or several of them, RECEIVE by
queue, group and handle, reply, roll back, END plain, WITH ERROR and WITH CLEANUP, and MOVE
conversations between groups, all on the same few hundred live conversations of one PostgreSQL
broker database, for ``BROKER_STRESS_SECONDS`` (default 60). Afterwards the queues are drained and
the invariants are checked on what committed:

- nothing received twice, and nothing received that was not sent;
- each endpoint received its dialog's messages in sequence order with no gap: 0, 1, 2, ...;
- nothing sent is lost, unless the receiving side of its dialog was ended or cleaned up;
- no conversation group was held by two transactions at once;
- ``Broker.check()`` finds nothing (no message without its endpoint, no impossible state, ...).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections import defaultdict
from collections.abc import Iterator
from itertools import pairwise
from multiprocessing.process import BaseProcess
from typing import Any

import pytest
import stress_procs as sp
from sqlalchemy import create_engine, text

from airflow_broker import Broker

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.xdist_group("stress")]

MP = multiprocessing.get_context("forkserver")
MP.set_forkserver_preload(["stress_procs", "psycopg", "sqlalchemy.dialects.postgresql.psycopg"])
WORKERS = 4
SECONDS = float(os.environ.get("BROKER_STRESS_SECONDS", "60"))


@pytest.fixture
def workers() -> Iterator[list[BaseProcess]]:
    started: list[BaseProcess] = []
    yield started
    for proc in started:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)


def _rows(url: str, sql: str) -> list[Any]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(sql)))
    finally:
        engine.dispose()


def _cause(detail: str) -> str:
    """The exception line of a logged traceback (psycopg's, when SQLAlchemy wraps one)."""
    lines = [ln for ln in detail.splitlines() if ln and not ln.startswith(" ")]
    return next((ln for ln in lines if ln.startswith("sqlalchemy.exc.")), lines[-1])[:300]


def test_random_operations_on_shared_conversations_keep_every_invariant(
    pg_url: str, workers: list[BaseProcess]
) -> None:
    broker = Broker.connect(pg_url)
    try:
        sp.declare(broker)
    finally:
        broker.dispose()

    deadline = time.monotonic() + SECONDS
    for i in range(WORKERS):
        proc = MP.Process(target=sp.run_worker, args=(pg_url, i, 1000 + i, deadline), daemon=True)
        proc.start()
        workers.append(proc)
    for proc in workers:
        proc.join(max(deadline - time.monotonic(), 0) + 60)
        assert proc.exitcode == 0, f"worker {proc.name} ended with {proc.exitcode}"
    drained = sp.drain(pg_url)

    errors = _rows(pg_url, "SELECT worker, op, detail FROM stress_error ORDER BY id")
    if errors:
        first = {(e.op, _cause(e.detail)): e.detail for e in reversed(errors)}
        pytest.fail(
            f"{len(errors)} unexpected errors: {sorted(first)}\n\n"
            + "\n\n".join(f"in {op}:\n{detail}" for (op, _), detail in first.items())
        )

    # The run did what it says: every operation ran, and ran often.
    tallies: dict[str, int] = defaultdict(int)
    for r in _rows(pg_url, "SELECT op, done FROM stress_op"):
        tallies[r.op] += r.done
    assert len(_rows(pg_url, "SELECT DISTINCT worker FROM stress_op")) == WORKERS
    assert all(tallies[op] >= 3 for op in sp.OPERATIONS), dict(tallies)
    received = _rows(
        pg_url,
        "SELECT id, conversation_handle, conversation_group_id, message_sequence_number,"
        " message_type, n, conversation_id, error_code FROM stress_received ORDER BY id",
    )
    sent = {r.n: r for r in _rows(pg_url, "SELECT n, conversation_id, to_target FROM stress_sent")}
    closed_rows = _rows(
        pg_url, "SELECT conversation_handle, conversation_id, is_initiator, kind FROM stress_closed"
    )
    closed = closed_rows
    kinds = {r.kind for r in closed}
    assert {"end", "error", "cleanup"} <= kinds, kinds
    assert len(received) > 200 and len(sent) > 200, (len(received), len(sent))

    # Nothing received twice; nothing received that was not sent, on its own dialog.
    seen: set[int] = set()
    for r in received:
        if r.n is None:
            continue
        assert r.n not in seen, f"message {r.n} received twice"
        seen.add(r.n)
        assert r.n in sent, f"message {r.n} received but never sent"
        assert str(sent[r.n].conversation_id) == str(r.conversation_id)

    # Each endpoint received its dialog's messages 0, 1, 2, ... in order without a gap. An Error
    # comes ahead of the user messages of its dialog (DESIGN: "DialogTimer first, then Error,
    # then the rest in order"), and an END removes what is left: so the user messages are always
    # 0..k in order, and all messages together are 0..n unless this side ended.
    # (An Error the broker raised itself, e.g. because the far endpoint was removed WITH
    # CLEANUP, is not in the far side's sequence: it carries the number this side knows of.)
    closed_handles = {r.conversation_handle for r in closed_rows}
    numbered: dict[Any, list[int]] = defaultdict(list)
    users: dict[Any, list[int]] = defaultdict(list)
    for r in received:
        if r.error_code is None or r.error_code > 0:
            numbered[r.conversation_handle].append(r.message_sequence_number)
        if r.n is not None:
            users[r.conversation_handle].append(r.message_sequence_number)
    for handle, seqs in numbered.items():
        ok = users[handle] == list(range(len(users[handle])))
        if handle not in closed_handles:
            ok = ok and sorted(seqs) == list(range(len(seqs)))
        if not ok:
            story = [
                (r.id, r.message_sequence_number, r.message_type, r.n, r.error_code)
                for r in received
                if r.conversation_handle == handle
            ]
            pytest.fail(f"conversation {handle} received (id, seq, type, n, error) {story}")

    # Nothing lost but what an END or a cleanup of the receiving side removed.
    closed_sides = {(str(r.conversation_id), r.is_initiator) for r in closed}
    lost = [
        n
        for n, s in sent.items()
        if n not in seen and (str(s.conversation_id), not s.to_target) not in closed_sides
    ]
    assert not lost, f"{len(lost)} messages lost, e.g. {lost[:5]}"

    # No conversation group held by two transactions at once.
    holds: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for r in _rows(pg_url, "SELECT conversation_group_id, started, ended FROM stress_hold"):
        holds[r.conversation_group_id].append((r.started, r.ended))
    for group, spans in holds.items():
        spans.sort()
        for (_, ended), (started, _) in pairwise(spans):
            assert started >= ended, f"group {group} held twice at once"

    broker = Broker.connect(pg_url)
    try:
        problems = broker.check()
        assert problems == [], [f"{p.kind} {p.object}: {p.detail}" for p in problems]
        assert {q.name: q.depth for q in broker.queue_status()} == {
            sp.INITIATOR_QUEUE: 0,
            sp.TARGET_QUEUE: 0,
        }
        assert broker.transmission_queue() == []
    finally:
        broker.dispose()
    print(
        f"stress: {sum(tallies.values())} operations in {SECONDS:.0f} s, {len(sent)} sent, "
        f"{len(received)} received ({drained} in the final drain), {len(closed)} ends"
    )
