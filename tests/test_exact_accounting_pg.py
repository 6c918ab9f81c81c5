"""Exact failure accounting on PostgreSQL: a reader killed at any point of its receiving
transaction is counted once, before anyone else can take what it held.

A RECEIVE that took messages writes its lease row before handing them out, and the write
refuses while a reader of the queue that ended without committing is uncounted: the RECEIVE
gives its claim back, counts that reader and claims again (storage/receive_leases.py)."""

from __future__ import annotations

import multiprocessing
import random
import signal
import time
from collections import defaultdict
from typing import Any

import pytest
from accounting_procs import die_at_random
from helpers import NOTE, SUPPLIER_QUEUE, begin, declare_pair, send
from sqlalchemy import text

from airflow_broker import Broker

pytestmark = pytest.mark.postgres

DLQ = "supplier_dead_letters"
FORK = multiprocessing.get_context("fork")
KILLS = 200
MAX_RECEIVES = 3


def _dialogs(broker: Broker, n: int, start: int) -> None:
    """``n`` dialogs of one message each (each dialog is a conversation group of its own)."""
    for i in range(start, start + n):
        send(broker, begin(broker), NOTE, f"m{i}".encode())


def _ready(broker: Broker) -> int:
    with broker.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM broker_message m JOIN broker_queue q USING (queue_id) "
                    "WHERE q.name = :q AND m.status = 1"
                ),
                {"q": SUPPLIER_QUEUE},
            ).scalar_one()
        )


@pytest.mark.timeout(600)
def test_a_reader_killed_at_random_points_200_times_is_counted_once_each_time(
    pg_url: str,
) -> None:
    """Readers SIGKILLed at random points of their transactions, two at a time, 200 times,
    against a queue with max_receives=3: every hand-out reports a receive count one above the
    last (none missed, none repeated), none reports 4, and every dead-lettered message's record
    says 3, as its count did."""
    broker = Broker.connect(pg_url)
    try:
        declare_pair(broker)
        broker.create_queue(DLQ)
        broker.alter_queue(SUPPLIER_QUEUE, max_receives=MAX_RECEIVES, dead_letter_queue=DLQ)
        with broker.engine.begin() as conn:
            conn.execute(text("CREATE TABLE handouts (body BYTEA, receive_count INT, pid INT)"))
        sent = 0
        _dialogs(broker, 100, sent)
        sent += 100
        kills = others = 0
        seed = random.Random(20261129)
        running: list[Any] = []
        # A reader is killed within this many seconds of connecting: long enough for most to
        # take a message first. Through PgBouncer a RECEIVE takes about twice as long.
        window = 0.08 if broker.adapter.pooled else 0.045  # type: ignore[union-attr]
        started = time.monotonic()
        while kills < KILLS:
            assert time.monotonic() - started < 480, f"only {kills} kills in 8 minutes"
            if _ready(broker) < 10:
                _dialogs(broker, 50, sent)
                sent += 50
            while len(running) < 2:
                _parent_end, child_end = FORK.Pipe()
                proc = FORK.Process(
                    target=die_at_random,
                    args=(pg_url, SUPPLIER_QUEUE, seed.getrandbits(32), window, child_end),
                )
                proc.start()
                running.append(proc)
            for proc in list(running):
                proc.join(0.05)
                if proc.exitcode is None:
                    continue
                running.remove(proc)
                if proc.exitcode == -signal.SIGKILL:
                    kills += 1
                else:
                    others += 1
        for proc in running:
            proc.join(10)
            kills += proc.exitcode == -signal.SIGKILL
        assert others == 0, f"{others} reader(s) ended otherwise than killed"
        broker.run_due()  # the last killed readers' attempts

        with broker.engine.connect() as conn:
            handouts = conn.execute(text("SELECT body, receive_count FROM handouts")).all()
            waiting = conn.execute(
                text(
                    "SELECT m.message_body, m.receive_count FROM broker_message m "
                    "JOIN broker_queue q USING (queue_id) WHERE q.name = :q"
                ),
                {"q": SUPPLIER_QUEUE},
            ).all()
        reported: dict[bytes, list[int]] = defaultdict(list)
        for body, count in handouts:
            reported[bytes(body)].append(count)
        assert len(handouts) >= KILLS // 2, f"only {len(handouts)} hand-outs recorded"
        for body, counts in reported.items():
            # Each hand-out saw every earlier attempt counted: no count twice, none past 3.
            assert len(counts) == len(set(counts)), f"{body!r}: counts {sorted(counts)}"
            assert max(counts) <= MAX_RECEIVES, f"{body!r} handed out {max(counts)} times"
        dead = {m.message_body: m for m in _drain_dead_letters(broker)}
        counted = {bytes(b): c for b, c in waiting}
        assert len(dead) >= 20, f"only {len(dead)} message(s) dead-lettered"
        for body, m in dead.items():
            assert m.dead_letter is not None
            # Dead-lettered on the attempt that made 3, and its record agrees.
            assert m.dead_letter.receive_count == MAX_RECEIVES, (body, m.dead_letter)
            assert max(reported.get(body, [0])) <= MAX_RECEIVES
        for body, count in counted.items():
            assert count < MAX_RECEIVES, (body, count)
            assert max(reported.get(body, [0])) <= count, (body, count, reported.get(body))
        print(
            f"{kills} kills, {len(handouts)} hand-outs recorded, {len(dead)} dead-lettered, "
            f"{len(counted)} waiting, {sent} sent"
        )
    finally:
        broker.dispose()


def _drain_dead_letters(broker: Broker) -> list[Any]:
    out: list[Any] = []
    while True:
        with broker.transaction() as tx:
            got = tx.receive(DLQ)
        if not got:
            return out
        out.extend(got)
