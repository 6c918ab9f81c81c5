"""Reader processes for tests/test_exact_accounting_pg.py: readers that die at random points of
their receiving transactions. Started with the fork context (cheap: hundreds per test); each
opens its own Broker and never touches the parent's connections."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from multiprocessing.connection import Connection as PipeEnd

import psycopg

from airflow_broker import Broker


class Failed(Exception):
    """The handler failed: its transaction rolls back."""


def die_at_random(url: str, queue: str, seed: int, window: float, ready: PipeEnd) -> None:
    """RECEIVE one message at a time, record each hand-out (outside the transaction, committed
    at once: body and the receive_count RECEIVE reported) and roll back after a moment's
    "work", in a loop. Once connected it tells the parent, and a timer SIGKILLs this process
    within ``window`` seconds: in the claim, while the lease row is written, between RECEIVE's
    return and the record, during the work, in the rollback or its accounting."""
    rng = random.Random(seed)
    broker = Broker.connect(url)
    record = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True)
    with broker.transaction() as tx:  # connected, statements prepared: only then the clock
        tx.receive(queue, top=1, wait_seconds=0)
        tx.rollback()
    ready.send(os.getpid())
    timer = threading.Timer(rng.uniform(0.0, window), os.kill, (os.getpid(), signal.SIGKILL))
    timer.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with broker.transaction() as tx:
                messages = tx.receive(queue, top=1, wait_seconds=0.2)
                for m in messages:
                    record.execute(
                        "INSERT INTO handouts (body, receive_count, pid) VALUES (%s, %s, %s)",
                        (m.message_body, m.receive_count, os.getpid()),
                    )
                time.sleep(rng.uniform(0.0, 0.002))
                raise Failed
        except Failed:
            pass
    os._exit(5)  # the timer never fired: the parent reports it
