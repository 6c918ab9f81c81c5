"""The stress run's worker: random operations on shared conversations, logged for the checks.

A worker (:func:`run_worker`) runs in its own process with its own :class:`Broker`. Until its
deadline it picks an operation at random: BEGIN DIALOG and SEND, SEND on one or several existing
dialogs, RECEIVE by queue, by conversation group or by handle (replying, ending, or rolling back
what it took), END CONVERSATION plain, WITH ERROR and WITH CLEANUP, and MOVE CONVERSATION between
groups. Every dialog, message, receipt and end is logged in a ``stress_*`` table **through the
transaction that did it**, so the log holds exactly what committed; ``test_stress_pg.py`` checks
the invariants on it afterwards.

What a worker may meet and carry on from, because another worker got there first: a conversation
that has ended (:class:`ConversationEnded`) or was removed (:class:`UnknownObject`). Anything else
is logged in ``stress_error`` and fails the run.
"""

from __future__ import annotations

import logging
import random
import time
import traceback
import uuid
from typing import Any

from sqlalchemy import func, select, text

from airflow_broker import (
    END_DIALOG,
    ERROR,
    Broker,
    ConversationEnded,
    Message,
    Transaction,
    UnknownObject,
)
from airflow_broker.storage import schema

INITIATOR = "//stress/Initiator"
TARGET = "//stress/Target"
INITIATOR_QUEUE = "stress_initiator_q"
TARGET_QUEUE = "stress_target_q"
CONTRACT = "//stress/Contract"
REQUEST = "//stress/Request"
REPLY = "//stress/Reply"

TABLES_DDL = (
    """
    CREATE TABLE IF NOT EXISTS stress_dialog (
        conversation_id uuid PRIMARY KEY,
        initiator_handle uuid NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS stress_sent (
        n bigserial PRIMARY KEY,
        worker integer NOT NULL,
        conversation_id uuid NOT NULL,
        to_target boolean NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS stress_received (
        id bigserial PRIMARY KEY,
        worker integer NOT NULL,
        conversation_handle uuid NOT NULL,
        conversation_group_id uuid NOT NULL,
        message_sequence_number bigint NOT NULL,
        message_type text NOT NULL,
        n bigint,
        conversation_id uuid,
        error_code integer
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS stress_hold (
        id bigserial PRIMARY KEY,
        worker integer NOT NULL,
        conversation_group_id uuid NOT NULL,
        started double precision NOT NULL,
        ended double precision NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS stress_closed (
        conversation_handle uuid NOT NULL,
        conversation_id uuid NOT NULL,
        is_initiator boolean NOT NULL,
        kind text NOT NULL,
        worker integer NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS stress_op (
        worker integer NOT NULL,
        op text NOT NULL,
        done integer NOT NULL,
        refused integer NOT NULL,
        PRIMARY KEY (worker, op)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS stress_error (
        id bigserial PRIMARY KEY,
        worker integer NOT NULL,
        op text NOT NULL,
        detail text NOT NULL
    )
    """,
)

#: The operations and their weights: receiving is the commonest, as in a real deployment.
OPERATIONS = {
    "begin": 3,
    "send": 5,
    "send_many": 1,
    "receive_queue": 6,
    "receive_group": 2,
    "receive_handle": 2,
    "end_initiator": 1,
    "end_with_error": 1,
    "cleanup": 1,
    "move": 1,
}


def declare(broker: Broker) -> None:
    """The two services of the run, in one broker database, and the log tables."""
    with broker.definitions() as d:
        d.create_message_type(REQUEST, validation="json")
        d.create_message_type(REPLY, validation="json")
        d.create_contract(CONTRACT, {REQUEST: "initiator", REPLY: "target"})
        # Rollbacks are one of the operations: the run is about races, not poison handling.
        d.create_queue(INITIATOR_QUEUE, poison_message_handling=False)
        d.create_queue(TARGET_QUEUE, poison_message_handling=False)
        d.create_service(INITIATOR, queue=INITIATOR_QUEUE, contracts=[CONTRACT])
        d.create_service(TARGET, queue=TARGET_QUEUE, contracts=[CONTRACT])
    with broker.engine.begin() as conn:
        for ddl in TABLES_DDL:
            conn.execute(text(ddl))


class _Rollback(Exception):
    """Raised inside a transaction to roll it back on purpose."""


class Worker:
    def __init__(self, broker: Broker, worker: int, rng: random.Random) -> None:
        self.broker = broker
        self.worker = worker
        self.rng = rng
        self.done: dict[str, int] = dict.fromkeys(OPERATIONS, 0)
        self.refused: dict[str, int] = dict.fromkeys(OPERATIONS, 0)

    # -- logging, always through the operation's own transaction --------------------------------
    def _send(self, tx: Transaction, handle: Any, cid: Any, to_target: bool) -> None:
        n = tx.connection.execute(
            text(
                "INSERT INTO stress_sent (worker, conversation_id, to_target) "
                "VALUES (:w, :cid, :t) RETURNING n"
            ),
            {"w": self.worker, "cid": cid, "t": to_target},
        ).scalar_one()
        tx.send(handle, REQUEST if to_target else REPLY, {"n": n, "cid": str(cid)})

    def _end(self, tx: Transaction, handle: uuid.UUID, kind: str, **how: Any) -> None:
        """END CONVERSATION and its log row (which side of which dialog, and how)."""
        ep = tx.conversation(handle)
        tx.end_conversation(handle, **how)
        tx.connection.execute(
            text("INSERT INTO stress_closed VALUES (:h, :cid, :i, :k, :w)"),
            {
                "h": handle,
                "cid": ep.conversation_id,
                "i": ep.is_initiator,
                "k": kind,
                "w": self.worker,
            },
        )

    def _log_receipts(self, tx: Transaction, messages: list[Message], started: float) -> None:
        rows = []
        cids: dict[uuid.UUID, str] = {}
        for m in messages:
            h = m.conversation_handle
            if h not in cids:
                cids[h] = str(tx.conversation(h).conversation_id)
            n = code = None
            if m.error is not None:
                code = m.error[0]
            if m.message_type_name in (REQUEST, REPLY):
                body = m.json()
                n = body["many"][cids[h]] if "many" in body else body["n"]
            rows.append(
                {
                    "w": self.worker,
                    "h": m.conversation_handle,
                    "g": m.conversation_group_id,
                    "seq": m.message_sequence_number,
                    "t": m.message_type_name,
                    "n": n,
                    "cid": cids[h],
                    "code": code,
                }
            )
        tx.connection.execute(
            text(
                "INSERT INTO stress_received (worker, conversation_handle, conversation_group_id,"
                " message_sequence_number, message_type, n, conversation_id, error_code)"
                " VALUES (:w, :h, :g, :seq, :t, :n, :cid, :code)"
            ),
            rows,
        )
        tx.connection.execute(
            text(
                "INSERT INTO stress_hold (worker, conversation_group_id, started, ended)"
                " VALUES (:w, :g, :s, :e)"
            ),
            {
                "w": self.worker,
                "g": messages[0].conversation_group_id,
                "s": started,
                "e": time.monotonic(),
            },
        )

    # -- picking live conversations (may be stale by the time they are used: that is the point) --
    def _dialogs(self, k: int) -> list[Any]:
        with self.broker.engine.connect() as conn:
            return list(
                conn.execute(
                    text(
                        "SELECT initiator_handle, conversation_id FROM stress_dialog"
                        " ORDER BY random() LIMIT :k"
                    ),
                    {"k": k},
                )
            )

    def _targets(self, k: int) -> list[Any]:
        with self.broker.engine.connect() as conn:
            e = schema.conversation_endpoint
            return list(
                conn.execute(
                    select(e.c.conversation_handle, e.c.conversation_group_id)
                    .where(e.c.service_name == TARGET)
                    .order_by(func.random())
                    .limit(k)
                )
            )

    # -- the operations -------------------------------------------------------------------------
    def begin(self) -> None:
        with self.broker.transaction() as tx:
            h = tx.begin_dialog(INITIATOR, TARGET, CONTRACT)
            cid = tx.conversation(h).conversation_id
            tx.connection.execute(
                text("INSERT INTO stress_dialog VALUES (:cid, :h)"), {"cid": cid, "h": h}
            )
            for _ in range(self.rng.randint(1, 3)):
                self._send(tx, h, cid, True)

    def send(self) -> None:
        picked = self._dialogs(1)
        if not picked:
            return self.begin()
        with self.broker.transaction() as tx:
            for _ in range(self.rng.randint(1, 3)):
                self._send(tx, picked[0].initiator_handle, picked[0].conversation_id, True)

    def send_many(self) -> None:
        """One SEND on several conversations at once: every one gets it, or none does."""
        picked = self._dialogs(3)
        if len(picked) < 2:
            return self.begin()
        with self.broker.transaction() as tx:
            ns = []
            for p in picked:
                ns.append(
                    tx.connection.execute(
                        text(
                            "INSERT INTO stress_sent (worker, conversation_id, to_target)"
                            " VALUES (:w, :cid, true) RETURNING n"
                        ),
                        {"w": self.worker, "cid": p.conversation_id},
                    ).scalar_one()
                )
            # One body for all: each receiver finds its own n by its conversation id.
            body = {str(p.conversation_id): n for p, n in zip(picked, ns, strict=True)}
            tx.send([p.initiator_handle for p in picked], REQUEST, {"n": None, "many": body})

    def _receive(self, queue: str, **how: Any) -> None:
        with self.broker.transaction() as tx:
            got = tx.receive(queue, top=self.rng.choice([1, 5, None]), **how)
            started = time.monotonic()  # the group is ours from here to the commit
            if not got:
                return
            rolled_back = self.rng.random() < 0.1
            self._log_receipts(tx, got, started)
            self._handle(tx, got)
            if rolled_back:
                raise _Rollback

    def _handle(self, tx: Transaction, got: list[Message]) -> None:
        """What an application does with what it received: reply, end, or end on an end."""
        ended: set[uuid.UUID] = set()
        for m in got:
            h = m.conversation_handle
            if h in ended:
                continue
            if m.message_type_name in (END_DIALOG, ERROR):
                self._end(tx, h, "end")
                ended.add(h)
            elif m.message_type_name == REQUEST:
                cid = tx.conversation(h).conversation_id
                roll = self.rng.random()
                if roll < 0.2:
                    self._send(tx, h, cid, False)
                elif roll < 0.27:
                    self._end(tx, h, "end")
                    ended.add(h)

    def receive_queue(self) -> None:
        queue = TARGET_QUEUE if self.rng.random() < 0.75 else INITIATOR_QUEUE
        self._receive(queue, wait_seconds=self.rng.choice([0, 0.2]))

    def receive_group(self) -> None:
        with self.broker.transaction() as tx:
            group = tx.get_conversation_group(TARGET_QUEUE)
            if group is None:
                return
            started = time.monotonic()
            got = tx.receive(TARGET_QUEUE, conversation_group=group)
            if got:
                self._log_receipts(tx, got, started)
                self._handle(tx, got)

    def receive_handle(self) -> None:
        picked = self._targets(1)
        if picked:
            self._receive(TARGET_QUEUE, conversation_handle=picked[0].conversation_handle)

    def end_initiator(self) -> None:
        picked = self._dialogs(1)
        if picked:
            with self.broker.transaction() as tx:
                self._end(tx, picked[0].initiator_handle, "end")

    def end_with_error(self) -> None:
        picked = self._targets(1)
        if picked:
            with self.broker.transaction() as tx:
                self._end(
                    tx,
                    picked[0].conversation_handle,
                    "error",
                    error_code=50001,
                    error_description="stress: refused",
                )

    def cleanup(self) -> None:
        """END WITH CLEANUP on a target that may be busy: the race issue 18 names."""
        picked = self._targets(1) if self.rng.random() < 0.7 else self._dialogs(1)
        if picked:
            handle = picked[0][0]
            with self.broker.transaction() as tx:
                self._end(tx, handle, "cleanup", cleanup=True)

    def move(self) -> None:
        picked = self._targets(2)
        if len(picked) == 2:
            with self.broker.transaction() as tx:
                tx.move_conversation(picked[0].conversation_handle, picked[1].conversation_group_id)

    def step(self) -> None:
        op = self.rng.choices(list(OPERATIONS), weights=list(OPERATIONS.values()))[0]
        try:
            getattr(self, op)()
            self.done[op] += 1
        except (ConversationEnded, UnknownObject, _Rollback):
            self.refused[op] += 1
        except Exception:
            self.refused[op] += 1
            with self.broker.engine.begin() as conn:
                conn.execute(
                    text("INSERT INTO stress_error (worker, op, detail) VALUES (:w, :op, :d)"),
                    {"w": self.worker, "op": op, "d": traceback.format_exc()},
                )

    def save(self) -> None:
        with self.broker.engine.begin() as conn:
            conn.execute(
                text("INSERT INTO stress_op VALUES (:w, :op, :d, :r)"),
                [
                    {"w": self.worker, "op": op, "d": self.done[op], "r": self.refused[op]}
                    for op in OPERATIONS
                ],
            )


def run_worker(url: str, worker: int, seed: int, deadline: float) -> None:
    """Random operations until ``deadline`` (``time.monotonic()``), then save the tallies."""
    # A failed dialog (its far side cleaned up) is a warning the run makes by the hundred.
    logging.getLogger("airflow_broker").setLevel(logging.ERROR)
    broker = Broker.connect(url)
    w = Worker(broker, worker, random.Random(seed))
    try:
        while time.monotonic() < deadline:
            w.step()
        w.save()
    finally:
        broker.dispose()


def drain(url: str) -> int:
    """After the run: RECEIVE both queues dry, logged like any receipt, ending on an end."""
    broker = Broker.connect(url)
    w = Worker(broker, -1, random.Random(0))
    taken = 0
    try:
        for _ in range(10_000):
            broker.run_due()  # what waits in the transmission queue for a busy far endpoint
            got: list[Message] = []
            for queue in (TARGET_QUEUE, INITIATOR_QUEUE):
                with broker.transaction() as tx:
                    batch = tx.receive(queue)
                    if batch:
                        w._log_receipts(tx, batch, time.monotonic())
                        for m in batch:
                            if m.message_type_name in (END_DIALOG, ERROR):
                                w._end(tx, m.conversation_handle, "end")
                got.extend(batch)
            if not got and not broker.in_transit() and not _waiting(broker):
                return taken
            taken += len(got)
        raise AssertionError("the queues never ran dry")
    finally:
        broker.dispose()


def _waiting(broker: Broker) -> bool:
    with broker.engine.connect() as conn:
        return conn.execute(select(schema.transmission_queue.c.id).limit(1)).first() is not None
