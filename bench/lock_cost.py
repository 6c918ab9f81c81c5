"""What the lock order costs SEND: the fast path with no lock, with row locks, with advisory locks.

Run from the repository root::

    python -m bench.lock_cost                   # about two minutes
    python -m bench.lock_cost --alternations 20

Issue 18 tied every message to its endpoint: a SEND locks the far endpoint, a cleanup waits for
it. Its budget is 3% of ``bench.throughput`` (single and batched). ``bench.throughput``'s rounds
differ by more than that from one run to the next on this machine (the receive phase most), so
this bench measures the change alone, in one process, on one database, with everything else
equal: the throughput workloads' producer and consumer (``bench._broker_system``), with SEND's
fast path swapped between

- ``none``: the statements as they were before the lock order (one statement, no lock);
- ``row``: the same statements locking the far endpoint ``FOR KEY SHARE`` (the lock order as
  first built);
- ``advisory``: what the engine runs now (``storage.endpoint_locks``: a server-side function
  that takes a shared advisory lock, then reads and writes in a statement of its own).

Each alternation runs every variant once, in a rotating order, over the same dialogs: a single
round (``--messages`` SENDs of one message, then RECEIVE ``top=1`` until empty) and a batched
round (``--batched-messages`` as SENDs to 100 dialogs, RECEIVE ``top=100``). Messages are
drained and the tables vacuumed between rounds. It prints the median times and, per workload,
``target lock_cost_{workload}: RATIO (goal <= 1.03)``: the round time (send + receive, as
``bench.throughput`` counts it) with advisory locks over the round time with none; and ``info``
lines for the send phase alone and for row locks.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import text

from bench._broker_system import AirflowBrokerSystem, BrokerConsumer, BrokerProducer
from bench._scratch import ScratchServer, vacuum
from bench._systems import Workload

VARIANTS = ("none", "row", "advisory")

# SEND's fast path before the lock order (``-- lock`` marks where ``row`` locks the far side).
_SEND_ONE = """
WITH far AS (
    SELECT f.conversation_handle, f.queue_id, f.conversation_group_id, f.priority,
           f.service_name, f.state
    FROM broker_conversation_endpoint s
    JOIN broker_conversation_endpoint f ON f.conversation_handle = s.far_handle
    WHERE s.conversation_handle = :handle
    -- lock
), seen AS (
    SELECT send_sequence FROM broker_conversation_endpoint WHERE conversation_handle = :handle
), snd AS (
    UPDATE broker_conversation_endpoint e
    SET send_sequence = e.send_sequence + 1,
        state = CASE WHEN e.state = 'SO' THEN 'CO' ELSE e.state END
    FROM far f, broker_queue fq, broker_queue q, broker_contract_message cm
    WHERE e.conversation_handle = :handle
      AND e.state IN ('SO', 'SI', 'CO')
      AND e.send_sequence = (SELECT send_sequence FROM seen)
      AND (e.lifetime IS NULL OR e.lifetime > :now)
      AND f.conversation_handle = e.far_handle AND f.state NOT IN ('DO', 'CD')
      AND fq.queue_id = f.queue_id AND fq.status
      AND q.queue_id = e.queue_id AND NOT q.retention
      AND cm.contract_name = e.contract_name AND cm.message_type_name = :message_type
      AND cm.sent_by IN ('any', CASE WHEN e.is_initiator THEN 'initiator' ELSE 'target' END)
      AND NOT EXISTS (SELECT 1 FROM broker_transmission_queue t
                      WHERE t.conversation_handle = e.conversation_handle)
    RETURNING e.send_sequence - 1 AS seq, f.queue_id, f.conversation_group_id,
              f.conversation_handle, f.priority, f.service_name, e.contract_name
), ins AS (
    INSERT INTO broker_message (
        queue_id, conversation_group_id, conversation_handle, message_sequence_number, status,
        priority, precedence, service_name, service_contract_name, message_type_name,
        validation, message_body, enqueued_at)
    SELECT queue_id, conversation_group_id, conversation_handle, seq, 1, priority, :precedence,
           service_name, contract_name, :message_type, :validation, :body, :now
    FROM snd
)
SELECT seq FROM snd
"""

_SEND_MANY = """
WITH cand AS (
    SELECT e.conversation_handle, f.queue_id, f.conversation_group_id,
           f.conversation_handle AS far_handle, f.priority, f.service_name, e.contract_name,
           e.send_sequence AS seen_sequence, e.state AS seen_state
    FROM broker_conversation_endpoint e
    JOIN broker_conversation_endpoint f
      ON f.conversation_handle = e.far_handle AND f.state NOT IN ('DO', 'CD')
    JOIN broker_queue fq ON fq.queue_id = f.queue_id AND fq.status
    JOIN broker_queue q ON q.queue_id = e.queue_id AND NOT q.retention
    JOIN broker_contract_message cm
      ON cm.contract_name = e.contract_name AND cm.message_type_name = :message_type
     AND cm.sent_by IN ('any', CASE WHEN e.is_initiator THEN 'initiator' ELSE 'target' END)
    WHERE e.conversation_handle = ANY(CAST(:handles AS uuid[]))
      AND e.state IN ('SO', 'SI', 'CO')
      AND (e.lifetime IS NULL OR e.lifetime > :now)
      AND NOT EXISTS (SELECT 1 FROM broker_transmission_queue t
                      WHERE t.conversation_handle = e.conversation_handle)
    ORDER BY f.conversation_handle
    -- lock
), snd AS (
    UPDATE broker_conversation_endpoint e
    SET send_sequence = e.send_sequence + 1,
        state = CASE WHEN e.state = 'SO' THEN 'CO' ELSE e.state END
    FROM cand
    WHERE e.conversation_handle = cand.conversation_handle
      AND (SELECT count(*) FROM cand) = cardinality(CAST(:handles AS uuid[]))
      AND e.send_sequence = cand.seen_sequence AND e.state = cand.seen_state
    RETURNING e.conversation_handle, e.send_sequence - 1 AS seq
), ins AS (
    INSERT INTO broker_message (
        queue_id, conversation_group_id, conversation_handle, message_sequence_number, status,
        priority, precedence, service_name, service_contract_name, message_type_name,
        validation, message_body, enqueued_at)
    SELECT cand.queue_id, cand.conversation_group_id, cand.far_handle, snd.seq, 1,
           cand.priority, :precedence, cand.service_name, cand.contract_name, :message_type,
           :validation, :body, :now
    FROM snd JOIN cand ON cand.conversation_handle = snd.conversation_handle
)
SELECT conversation_handle FROM snd
"""


def _statements(variant: str) -> tuple[Any, Any] | None:
    """SEND's (one, many) statements for ``variant``; None: the engine's own."""
    if variant == "advisory":
        return None
    lock = "FOR KEY SHARE OF f" if variant == "row" else ""
    from sqlalchemy import Uuid, bindparam

    one = text(_SEND_ONE.replace("-- lock", lock)).bindparams(bindparam("handle", type_=Uuid()))
    return one, text(_SEND_MANY.replace("-- lock", lock))


@contextmanager
def fast_path(variant: str) -> Iterator[None]:
    """The engine's SEND with ``variant``'s fast-path statements."""
    from airflow_broker.messaging import transaction

    swapped = _statements(variant)
    saved = transaction.SEND_ONE_PG, transaction.SEND_MANY_PG
    if swapped is not None:
        transaction.SEND_ONE_PG, transaction.SEND_MANY_PG = swapped  # type: ignore[misc]
    try:
        yield
    finally:
        transaction.SEND_ONE_PG, transaction.SEND_MANY_PG = saved  # type: ignore[misc]


def one_round(
    producer: BrokerProducer, consumer: BrokerConsumer, messages: int, batch: int
) -> tuple[float, float]:
    """Send ``messages`` (``batch`` per transaction), then receive them all; the two times."""
    start = time.perf_counter()
    sent = 0
    while sent < messages:
        producer.send(sent, batch)
        sent += batch
    middle = time.perf_counter()
    got = 0
    while got < messages:
        n = consumer.receive()
        if n == 0:
            raise RuntimeError(f"the queue ran dry after {got} of {messages} messages")
        got += n
    return middle - start, time.perf_counter() - middle


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--alternations", type=int, default=10)
    p.add_argument("--messages", type=int, default=1000, help="messages per single round")
    p.add_argument("--batched-messages", type=int, default=10000)
    p.add_argument("--batch", type=int, default=100)
    args = p.parse_args(argv)

    server = ScratchServer()
    server.check()
    system = AirflowBrokerSystem()
    workloads = {
        "single": Workload("single", 1, args.messages, 0, 100, 0),
        "batched": Workload("batched", args.batch, args.batched_messages, 0, args.batch, 4),
    }
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        template = server.template(system.name, system.install)
        for name, workload in workloads.items():
            db = server.create(template, "lock_cost", name)
            state = system.prepare(db, workload)
            producer = system.producer(db, workload, state)
            consumer = system.consumer(db, workload, state)
            try:
                with fast_path("none"):  # warm-up: connections, caches, prepared statements
                    one_round(producer, consumer, workload.messages // 10, workload.batch)
                for i in range(args.alternations):
                    order = VARIANTS[i % 3 :] + VARIANTS[: i % 3]
                    for variant in order:
                        vacuum(db)
                        with fast_path(variant):
                            times.setdefault((name, variant), []).append(
                                one_round(producer, consumer, workload.messages, workload.batch)
                            )
            finally:
                producer.close()
                consumer.close()
                server.drop(db)
    finally:
        server.drop_all()

    print(f"{'workload':<9} {'variant':<9} {'send s':>8} {'receive s':>10} {'round s':>8}")
    for (name, variant), rounds in times.items():
        send = statistics.median(r[0] for r in rounds)
        receive = statistics.median(r[1] for r in rounds)
        total = statistics.median(r[0] + r[1] for r in rounds)
        print(f"{name:<9} {variant:<9} {send:>8.3f} {receive:>10.3f} {total:>8.3f}")
    for name in workloads:
        ratio = _median(times, name, "advisory") / _median(times, name, "none")
        print(f"target lock_cost_{name}: {ratio:.3f} (goal <= 1.03)")
        send = _median(times, name, "advisory", 0) / _median(times, name, "none", 0)
        print(f"info lock_cost_{name}_send: {send:.3f}")
        row = _median(times, name, "row") / _median(times, name, "none")
        print(f"info lock_cost_{name}_row_locks: {row:.3f}")
        row_send = _median(times, name, "row", 0) / _median(times, name, "none", 0)
        print(f"info lock_cost_{name}_row_locks_send: {row_send:.3f}")


def _median(
    times: dict[tuple[str, str], list[tuple[float, float]]],
    name: str,
    variant: str,
    part: int | None = None,
) -> float:
    """The median round time (``part`` None), send time (0) or receive time (1)."""
    rounds = times[(name, variant)]
    if part is None:
        return statistics.median(r[0] + r[1] for r in rounds)
    return statistics.median(r[part] for r in rounds)


if __name__ == "__main__":
    main()
