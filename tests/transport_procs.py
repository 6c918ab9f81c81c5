"""Shared pieces of the routing and delivery tests (``test_transport.py`` on SQLite and
PostgreSQL, ``test_transport_pg.py`` on PostgreSQL only), and the worker process of the kill test.

A test builds a small network of broker databases, each known by a logical name (``a``, ``b``,
``g1``...). Every :class:`~airflow_broker.Broker` of the network gets the same resolver, which
maps each logical name to its URL: a route address ``broker://b`` reaches the database ``b``,
whichever broker delivers or forwards.

What a database received is read back with RECEIVE and checked per dialog: every message once,
in the order it was sent. Bodies are ``{"n": k}`` with ``k`` counting the messages of a dialog
from 0, so a lost, duplicated or reordered message shows in the list of ``n``.

:func:`deliver_and_hang` runs in a child process (the ``forkserver`` context, as in
``tests/procs.py``): it delivers with a :class:`~airflow_broker.transport.Transport` whose
``after_push`` writes a marker file and then sleeps, so the parent can SIGKILL it exactly after a
far broker committed a batch and before the acknowledgments were recorded.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from airflow_broker import Broker, Message
from airflow_broker.storage import schema as s

INITIATOR = "InitiatorService"
TARGET = "TargetService"
INIT_QUEUE = "initiator_q"
TARGET_QUEUE = "target_q"

#: A PostgreSQL server that is not there (nothing listens on port 1): connecting fails at once.
UNREACHABLE_URL = "postgresql+psycopg://postgres@127.0.0.1:1/nowhere"


# -- the network --


@dataclass
class Net:
    """Broker databases by logical name, all connected with one resolver."""

    urls: dict[str, str]
    resolver: dict[str, str]
    brokers: dict[str, Broker] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Broker:
        return self.brokers[name]

    def id(self, name: str) -> str:
        """The broker instance id of database ``name``."""
        return self.brokers[name].instance_id

    def close(self) -> None:
        for broker in self.brokers.values():
            broker.dispose()


def connect_all(urls: Mapping[str, str], unreachable: Iterable[str] = ()) -> Net:
    """Connect to every database of ``urls``; the names in ``unreachable`` resolve to a server
    that does not answer (they have no database of their own)."""
    resolver = {**urls, **{name: UNREACHABLE_URL for name in unreachable}}
    net = Net(dict(urls), resolver)
    for name, url in urls.items():
        net.brokers[name] = Broker.connect(url, resolver=dict(resolver))
    return net


def host(broker: Broker, service: str, queue: str, contracts: Sequence[str] = ("DEFAULT",)) -> None:
    """A queue and a service on it, in one block."""
    with broker.definitions() as d:
        d.create_queue(queue)
        d.create_service(service, queue=queue, contracts=list(contracts))


def host_initiator(broker: Broker, service: str = INITIATOR) -> None:
    host(broker, service, INIT_QUEUE)


def host_target(broker: Broker, service: str = TARGET) -> None:
    host(broker, service, TARGET_QUEUE)


def two_way(net: Net, initiator: str = "a", target: str = "b") -> None:
    """Initiator service in ``a``, target service in ``b``, a route each way."""
    a, b = net[initiator], net[target]
    host_initiator(a)
    host_target(b)
    a.create_route("ToTarget", TARGET, None, f"broker://{target}")
    b.create_route("ReturnRoute", INITIATOR, net.id(initiator), f"broker://{initiator}")


def ha_network(net: Net, g1: str = "g1", g2: str = "g2") -> None:
    """Seed 003's high availability example: A and B reach each other only through the
    forwarding gateways G1 and G2 (any that exist as databases get their routes)."""
    a, b = net["a"], net["b"]
    aid, bid = net.id("a"), net.id("b")
    host_initiator(a)
    host_target(b)
    with a.definitions() as d:
        d.create_route("HighAvailabilityRoute1", TARGET, bid, f"broker://{g1}")
        d.create_route("HighAvailabilityRoute2", TARGET, bid, f"broker://{g2}")
    with b.definitions() as d:
        d.create_route("ReturnRoute1", INITIATOR, aid, f"broker://{g1}")
        d.create_route("ReturnRoute2", INITIATOR, aid, f"broker://{g2}")
    for gateway in (g1, g2):
        if gateway in net.brokers:
            with net[gateway].definitions() as d:
                d.create_route("ForwardingRoute", TARGET, bid, "broker://b")
                d.create_route("ForwardingReturnRoute", INITIATOR, aid, "broker://a")
                d.configure(forwarding=True)


# -- sending --


def send_dialogs(
    broker: Broker,
    counts: Sequence[int],
    *,
    from_service: str = INITIATOR,
    to_service: str = TARGET,
    per_transaction: int = 250,
    **begin: Any,
) -> list[uuid.UUID]:
    """Begin ``len(counts)`` dialogs and send dialog ``i`` ``counts[i]`` messages ``{"n": k}``.

    One transaction per ``per_transaction`` dialogs; message ``k`` goes to every dialog of the
    transaction that has one in a single batched SEND."""
    handles: list[uuid.UUID] = []
    for start in range(0, len(counts), per_transaction):
        chunk = counts[start : start + per_transaction]
        with broker.transaction() as tx:
            # Between databases without dialog security (tests of it say encryption=True).
            begin.setdefault("encryption", False)
            hs = [tx.begin_dialog(from_service, to_service, **begin) for _ in chunk]
            for k in range(max(chunk, default=0)):
                tx.send([h for h, c in zip(hs, chunk, strict=True) if c > k], body={"n": k})
        handles += hs
    return handles


def send_more(broker: Broker, handles: Sequence[uuid.UUID], first: int, count: int) -> None:
    """Messages ``{"n": first}`` .. ``{"n": first + count - 1}`` on every dialog of ``handles``."""
    with broker.transaction() as tx:
        for k in range(first, first + count):
            tx.send(list(handles), body={"n": k})


def reply_to_all(broker: Broker, messages: Iterable[Message], body: Any) -> list[uuid.UUID]:
    """One reply on every conversation the messages came on; returns those handles."""
    handles = sorted({m.conversation_handle for m in messages})
    if handles:
        with broker.transaction() as tx:
            tx.send(handles, body=body)
    return handles


# -- receiving --


def drain_all(broker: Broker, queue: str, per_transaction: int = 200) -> list[Message]:
    """RECEIVE until the queue has nothing ready, several RECEIVEs (each one group) per
    committed transaction."""
    out: list[Message] = []
    for _ in range(10_000):
        ran_dry = False
        with broker.transaction() as tx:
            for _ in range(per_transaction):
                got = tx.receive(queue)
                if not got:
                    ran_dry = True
                    break
                out += got
        if ran_dry:
            return out
    raise AssertionError(f"queue {queue} never ran dry")


@dataclass(frozen=True)
class Endpoint:
    conversation_handle: uuid.UUID
    conversation_id: uuid.UUID
    is_initiator: bool
    service_name: str
    far_service: str
    far_broker_instance: str | None
    state: str


def endpoints(broker: Broker) -> dict[uuid.UUID, Endpoint]:
    """Every conversation endpoint of a database, by handle (one query, for thousands)."""
    e = s.conversation_endpoint
    with broker.engine.connect() as conn:
        rows = conn.execute(
            select(
                e.c.conversation_handle,
                e.c.conversation_id,
                e.c.is_initiator,
                e.c.service_name,
                e.c.far_service,
                e.c.far_broker_instance,
                e.c.state,
            )
        ).all()
    return {
        r.conversation_handle: Endpoint(
            r.conversation_handle,
            r.conversation_id,
            bool(r.is_initiator),
            r.service_name,
            r.far_service,
            None if r.far_broker_instance is None else str(r.far_broker_instance),
            r.state,
        )
        for r in rows
    }


def message_count(broker: Broker, queue: str) -> int:
    """Rows in ``queue`` whatever their status (ready, waiting for a gap, retained)."""
    m, q = s.message, s.queue
    with broker.engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(m.join(q, q.c.queue_id == m.c.queue_id))
                .where(q.c.name == queue)
            ).scalar_one()
        )


def by_conversation(broker: Broker, messages: Iterable[Message]) -> dict[uuid.UUID, list[Message]]:
    """Received messages grouped by conversation id (the id both sides share), in the order
    RECEIVE returned them."""
    eps = endpoints(broker)
    out: dict[uuid.UUID, list[Message]] = defaultdict(list)
    for m in messages:
        out[eps[m.conversation_handle].conversation_id].append(m)
    return dict(out)


def collect(broker: Broker, queue: str, into: dict[uuid.UUID, list[Message]]) -> int:
    """Drain ``queue`` and add what arrived to ``into`` (by conversation id), after what earlier
    drains put there; returns how many messages arrived."""
    got = by_conversation(broker, drain_all(broker, queue))
    for conv, msgs in got.items():
        into.setdefault(conv, []).extend(msgs)
    return sum(len(msgs) for msgs in got.values())


def conversation_ids(broker: Broker, handles: Iterable[uuid.UUID]) -> dict[uuid.UUID, uuid.UUID]:
    """handle -> conversation id, for the given local handles."""
    eps = endpoints(broker)
    return {h: eps[h].conversation_id for h in handles}


def assert_exactly_once_in_order(
    got: Mapping[uuid.UUID, list[Message]], expected: Mapping[uuid.UUID, Sequence[int]], where: str
) -> None:
    """``got[conversation]`` holds exactly the bodies ``{"n": k}`` for ``k`` in
    ``expected[conversation]``, in that order, with rising sequence numbers."""
    unexpected = set(got) - set(expected)
    assert not unexpected, f"{where}: messages on conversations nobody sent: {len(unexpected)}"
    missing = [c for c in expected if expected[c] and c not in got]
    assert not missing, f"{where}: {len(missing)} of {len(expected)} dialogs got nothing"
    for conv, msgs in got.items():
        ns = [m.json()["n"] for m in msgs]
        assert ns == list(expected[conv]), (
            f"{where}: dialog {conv} received n={ns}, sent n={list(expected[conv])} "
            "(a duplicate, a loss or a reordering)"
        )
        seqs = [m.message_sequence_number for m in msgs]
        assert all(a < b for a, b in itertools.pairwise(seqs)), (
            f"{where}: dialog {conv} received sequence numbers {seqs}"
        )


# -- delivering --


@dataclass
class Totals:
    """Sums of the DeliveryReports of several passes."""

    delivered: int = 0
    acknowledged: int = 0
    delayed: int = 0
    failed: int = 0
    discarded: int = 0
    forwarded: int = 0
    passes: int = 0

    def add(self, report: Any) -> None:
        self.passes += 1
        for name in ("delivered", "acknowledged", "delayed", "failed", "discarded", "forwarded"):
            setattr(self, name, getattr(self, name) + int(getattr(report, name)))


def moved(report: Any) -> int:
    return int(report.delivered + report.acknowledged + report.forwarded + report.discarded)


def pump(
    brokers: Sequence[Broker], *, rounds: int = 40, retry_now: bool = True
) -> dict[Broker, Totals]:
    """``deliver()`` on every broker in turn until nothing is left to move: all transmission
    queues and transit tables empty, or two rounds in a row in which no pass moved anything.

    ``retry_now`` (default) ignores backoff: multi-hop traffic settles in a few rounds instead
    of waiting seconds between them. Fails if traffic still moves after ``rounds`` rounds."""
    totals = {b: Totals() for b in brokers}
    idle = 0
    for _ in range(rounds):
        moved_now = 0
        for b in brokers:
            report = b.deliver(retry_now=retry_now)
            totals[b].add(report)
            moved_now += moved(report)
        if all(not b.transmission_queue() and not b.in_transit() for b in brokers):
            return totals
        idle = idle + 1 if moved_now == 0 else 0
        if idle >= 2:
            return totals
    raise AssertionError(f"traffic still moving after {rounds} delivery rounds: {totals}")


def deliver_until_empty(broker: Broker, passes: int = 5, retry_now: bool = False) -> Totals:
    """``deliver()`` until the transmission queue is empty (at most ``passes`` passes)."""
    totals = Totals()
    for _ in range(passes):
        totals.add(broker.deliver(retry_now=retry_now))
        if not broker.transmission_queue():
            return totals
    rows = broker.transmission_queue()
    raise AssertionError(
        f"{len(rows)} messages still in the transmission queue after {passes} deliver() passes; "
        f"first: {rows[0].transmission_status!r} (attempts {rows[0].attempts})"
    )


# -- the kill test --


def deliver_and_hang(url: str, resolver: dict[str, str], marker: str, batch: int) -> None:
    """Deliver from the broker at ``url`` with batches of ``batch`` messages; after the first
    batch a far broker committed, write ``{"address": ..., "sent": ...}`` to ``marker`` and
    sleep until killed."""
    from airflow_broker.transport import Transport

    class HangAfterPush(Transport):
        BATCH = batch

        def after_push(self, address: str, sent: int) -> None:
            tmp = Path(marker + ".tmp")
            tmp.write_text(json.dumps({"address": address, "sent": sent}))
            tmp.rename(marker)  # the parent never reads half a file
            time.sleep(300)

    broker = Broker.connect(url, resolver=resolver)
    HangAfterPush(broker).deliver()
    # Reaching this line means after_push was never called: the parent sees the exit.
    broker.dispose()
