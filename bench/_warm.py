"""The processes of bench/warm_latency.py: the broker's setup, the sender and the two readers.

Every entry point here runs in a process of its own (multiprocessing, spawn), so that the
SEND is committed by another process than the one whose handler receives it, as in real use.
Times are ``time.monotonic()``: CLOCK_MONOTONIC on Linux, one clock for every process of the
machine (and, unlike ``time.time()``, never stepped by NTP in the middle of a run).

The handler records ``(seq, monotonic())`` in the reader process when it is called: the moment
"the handler has it", inside the RECEIVE's transaction. A shared counter tells the parent how
many messages the handlers have seen; the records travel to the parent once the reader stops.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_broker import Broker, Message, Transaction

QUEUE = "warm_target_q"
SENDER_QUEUE = "warm_sender_q"
TARGET = "//bench/WarmTarget"
SENDER = "//bench/WarmSender"
#: The Airflow connection DrainQueueOperator reads the broker's URL from.
CONN_ID = "broker_warm_bench"
#: The sequence number of the warm-up message (sent before the clock starts).
WARMUP_SEQ = -1

Reply = tuple[str, Any]


def _connect(url: str) -> Broker:
    from airflow_broker import Broker

    return Broker.connect(url)


# ---------------------------------------------------------------------------------------------
# Setup (untimed, once, in the template database)
# ---------------------------------------------------------------------------------------------


def install(url: str, dialogs: int) -> list[uuid.UUID]:
    """Migrate, declare the queues and services (contract DEFAULT), and begin ``dialogs``
    dialogs from the sender's service, one message each, received at once: every target
    endpoint exists (each in a conversation group of its own) before the first measured SEND,
    so that the bench measures messaging on conversing dialogs, not dialog creation."""
    from airflow_broker import DEFAULT, Activation

    broker = _connect(url)
    try:
        broker.migrate()
        with broker.definitions() as d:
            d.create_queue(QUEUE, activation=Activation(max_readers=2))
            d.create_queue(SENDER_QUEUE)
            d.create_service(TARGET, queue=QUEUE, contracts=[DEFAULT])
            d.create_service(SENDER, queue=SENDER_QUEUE, contracts=[DEFAULT])
        with broker.transaction() as tx:
            handles = [tx.begin_dialog(SENDER, TARGET) for _ in range(dialogs)]
            tx.send(handles, body={"seq": WARMUP_SEQ})
        targets: set[uuid.UUID] = set()
        while True:
            with broker.transaction() as tx:
                msgs = tx.receive(QUEUE)
            if not msgs:
                break
            targets.update(m.conversation_handle for m in msgs)
        if len(targets) != dialogs:
            raise RuntimeError(f"setup: {len(targets)} target endpoints, not {dialogs}")
    finally:
        broker.dispose()
    return handles


def depth(url: str) -> int:
    """Ready messages left on the target queue."""
    broker = _connect(url)
    try:
        return sum(s.depth for s in broker.queue_status() if s.name == QUEUE)
    finally:
        broker.dispose()


# ---------------------------------------------------------------------------------------------
# The sender
# ---------------------------------------------------------------------------------------------


def sender_main(
    url: str,
    handles: list[uuid.UUID],
    messages: int,
    rate: float,
    go: Event,
    results: Queue[Reply],
) -> None:
    """SEND the warm-up message (connecting on the way), answer ``("ready", None)``, wait for
    ``go``, then SEND ``messages`` messages, one per transaction, at ``rate`` per second on an
    absolute schedule (a late SEND does not push the later ones back), round robin over the
    dialogs. Answers ``("sent", [(commit issued, commit returned), ...])`` by sequence number."""
    try:
        broker = _connect(url)
        with broker.transaction() as tx:
            tx.send(handles[0], body={"seq": WARMUP_SEQ})
        results.put(("ready", None))
        go.wait()
        times: list[tuple[float, float]] = []
        start = time.monotonic() + 0.05
        for seq in range(messages):
            delay = start + seq / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            with broker.transaction() as tx:
                tx.send(handles[seq % len(handles)], body={"seq": seq})
                issued = time.monotonic()  # the block's end: COMMIT goes out now
            times.append((issued, time.monotonic()))  # COMMIT returned
        broker.dispose()
        results.put(("sent", times))
    except BaseException as exc:
        results.put(("error", f"sender: {type(exc).__name__}: {exc}"))
        raise


# ---------------------------------------------------------------------------------------------
# The readers' handler
# ---------------------------------------------------------------------------------------------

#: (seq, monotonic time the handler got it), in the order the handler saw them
RECORDS: list[tuple[int, float]] = []
_counter: Synchronized[int] | None = None
_lock = threading.Lock()


def record(tx: Transaction, messages: list[Message]) -> None:
    """The readers' handler (``bench._warm:record``): stamps each message's sequence number."""
    seen = time.monotonic()
    seqs = [int(m.json()["seq"]) for m in messages]
    with _lock:  # the runner's readers are threads of one process
        RECORDS.extend((seq, seen) for seq in seqs)
    assert _counter is not None
    with _counter.get_lock():
        _counter.value += len(seqs)


def _reset(counter: Synchronized[int]) -> None:
    global _counter
    RECORDS.clear()
    _counter = counter


# ---------------------------------------------------------------------------------------------
# Reader (a): DrainQueueOperator.execute(), as a worker runs it, without the scheduler
# ---------------------------------------------------------------------------------------------


def operator_main(
    url: str, wait_seconds: float, counter: Synchronized[int], results: Queue[Reply]
) -> None:
    """``DrainQueueOperator(queue=..., handler="bench._warm:record", wait_seconds=...)
    .execute(context)`` with the context a test gives it (no triggering asset event, so it
    takes the oldest reader row waiting, or registers a new one), the broker named by an
    Airflow connection in the environment, as in a worker. It registers as the queue's reader,
    drains, waits up to ``wait_seconds`` in each RECEIVE, and returns when a RECEIVE found
    nothing for that long. Answers ``("records", (records, execute's return value))``.

    Airflow warns that ``execute`` "cannot be called outside of the Task Runner": here it is,
    on purpose, to time the operator's loop without a scheduler."""
    import json
    from types import SimpleNamespace

    # Airflow logs the task to stdout: send it to stderr, so that stdout is the bench's table.
    os.dup2(2, 1)
    try:
        os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(
            {"conn_type": "broker", "extra": {"url": url}}
        )
        from airflow_broker.operators.reader import DrainQueueOperator

        _reset(counter)
        op = DrainQueueOperator(
            task_id="drain",
            queue=QUEUE,
            handler="bench._warm:record",
            wait_seconds=wait_seconds,
            broker_conn_id=CONN_ID,
        )
        ti = SimpleNamespace(dag_id="warm_latency", run_id="bench", task_id="drain")
        outcome = op.execute({"ti": ti, "triggering_asset_events": {}})
        results.put(("records", (list(RECORDS), outcome)))
    except BaseException as exc:
        results.put(("error", f"DrainQueueOperator: {type(exc).__name__}: {exc}"))
        raise


# ---------------------------------------------------------------------------------------------
# Reader (b): ActivationRunner, its monitor and thread readers in one process
# ---------------------------------------------------------------------------------------------


def runner_main(
    url: str,
    max_readers: int,
    wait_seconds: float,
    counter: Synchronized[int],
    stop: Event,
    results: Queue[Reply],
) -> None:
    """``ActivationRunner(broker, queue, "bench._warm:record", max_readers, wait_seconds=...)``
    started at once (answers ``("ready", None)``: its monitor LISTENs before the first SEND),
    stopped when ``stop`` is set. Answers ``("records", (records, the runner's report))``."""
    try:
        from dataclasses import asdict

        from airflow_broker import ActivationRunner

        _reset(counter)
        broker = _connect(url)
        runner = ActivationRunner(
            broker,
            QUEUE,
            "bench._warm:record",
            max_readers=max_readers,
            wait_seconds=wait_seconds,
        ).start()
        results.put(("ready", None))
        stop.wait()
        report = runner.stop(timeout=wait_seconds + 30)
        broker.dispose()
        results.put(("records", (list(RECORDS), asdict(report))))
    except BaseException as exc:
        results.put(("error", f"ActivationRunner: {type(exc).__name__}: {exc}"))
        raise
