"""A hung far broker stops nothing but itself (issue 45): PostgreSQL, with a frozen server.

Broker A (a database on the shared test server) delivers to B, a database on a private cluster
of this module (``support.frozen_cluster``), and to C, another database on the shared server.
*Freezing* B's cluster stops every process of it with SIGSTOP: its connections are neither
refused nor answered, as in a network partition. The tests prove that:

- while B hangs, every message A sends to C is in C's queue within a few seconds of its SEND,
  for a whole minute of hang: no delivery pass waits for B longer than its patience
  (``deadlines.PATIENCE``); B's messages wait in A's transmission queue saying
  ``no answer from broker://b``, and the pass's report names B among the ``hung``;
- once B thaws, everything sent during the hang reaches B and C exactly once, in order, and
  A's transmission queue empties (every message acknowledged);
- exactly once holds across the cut (``deadlines.ANSWER_TIMEOUT``): B frozen in the middle of a
  batch's accept, after its messages are inserted and before the acknowledgment reaches A,
  whether the far commit never happens (B frozen before the statement after the insert, which
  is never answered) or happens after A gave up (B frozen just before the COMMIT, which waits
  in B's socket and is executed at the thaw), or B froze after a far commit, between batches;
- and, what the others rely on, that a frozen cluster really neither refuses nor answers, and
  that a COMMIT sent to it is executed when it thaws, though its client is gone.

The deadlines are shortened (answer timeout 6 s, patience 1 s) so that one minute of hang spans
ten answer timeouts.
"""

from __future__ import annotations

import importlib
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import psycopg
import pytest
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from support.frozen_cluster import FrozenCluster, frozen_cluster
from transport_procs import (
    INITIATOR,
    TARGET_QUEUE,
    Net,
    assert_exactly_once_in_order,
    collect,
    connect_all,
    conversation_ids,
    host,
    host_initiator,
    message_count,
    send_dialogs,
    send_more,
)

from airflow_broker import Broker, Message
from airflow_broker.storage import bulk
from airflow_broker.storage import direct as storage_direct
from airflow_broker.storage.accept_function import ACCEPT_PLAIN
from airflow_broker.transport import DeliveryReport, Transport
from airflow_broker.transport import direct as direct_delivery

pytestmark = [pytest.mark.postgres, pytest.mark.xdist_group("hung_peer")]

#: far broker -> the service it hosts (A routes each to its broker://NAME)
SERVICES = {"b": "TargetB", "c": "TargetC"}
#: deadlines.ANSWER_TIMEOUT and deadlines.PATIENCE in these tests
ANSWER = 6.0
PATIENCE = 1.0
#: how long after its SEND a message to C must be in C's queue, while B hangs
LATE = PATIENCE + 3.0
#: the probe's hang, and how often it sends to B and C meanwhile
HANG = 60.0
SEND_EVERY = 3.0
HUNG_TEXT = "no answer from broker://b"


@pytest.fixture(scope="module")
def cluster() -> Iterator[FrozenCluster]:
    with frozen_cluster() as c:
        yield c


@pytest.fixture
def deadlines(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The engine's deadlines module, its answer timeout and patience shortened. Imported here,
    not at the top: the cluster's own test runs without it."""
    module = importlib.import_module("airflow_broker.transport.deadlines")
    monkeypatch.setattr(module, "ANSWER_TIMEOUT", ANSWER)
    monkeypatch.setattr(module, "PATIENCE", PATIENCE)
    return module


@pytest.fixture
def net(cluster: FrozenCluster, make_pg_database: Callable[..., str]) -> Iterator[Net]:
    """A and C on the shared server, B on the frozen cluster (thawed at the end, whatever
    happened); A routes TargetB to broker://b and TargetC to broker://c, each far broker routes
    back to A."""
    name = f"broker_b_{uuid.uuid4().hex[:12]}"
    cluster.create_database(name)
    b_url = cluster.url(name)
    migrating = Broker.connect(b_url)
    migrating.migrate()
    migrating.dispose()
    network = connect_all({"a": make_pg_database(), "b": b_url, "c": make_pg_database()})
    try:
        host_initiator(network["a"])
        for far, service in SERVICES.items():
            host(network[far], service, TARGET_QUEUE)
            network["a"].create_route(f"To{far.upper()}", service, None, f"broker://{far}")
            network[far].create_route("ReturnRoute", INITIATOR, network.id("a"), "broker://a")
        yield network
    finally:
        cluster.thaw()
        network.close()


def rows_for(a: Broker, far: str) -> list[Any]:
    return [r for r in a.transmission_queue() if r.to_service_name == SERVICES[far]]


def statuses(rows: list[Any]) -> Counter[str]:
    return Counter(r.transmission_status for r in rows)


def settle(a: Broker, within: float) -> list[DeliveryReport]:
    """``deliver(retry_now=True)`` until A's transmission queue is empty; fails after
    ``within`` seconds saying what still waits."""
    reports: list[DeliveryReport] = []
    deadline = time.monotonic() + within
    while True:
        reports.append(a.deliver(retry_now=True))
        left = a.transmission_queue()
        if not left:
            return reports
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{len(left)} messages still in A's transmission queue {within:.0f} s after "
                f"the thaw: {statuses(left).most_common(3)}"
            )
        time.sleep(0.5)


# -- the cluster itself --


def test_a_frozen_cluster_neither_refuses_nor_answers_until_thawed(
    cluster: FrozenCluster,
) -> None:
    """What the tests below rely on: frozen, every server process is stopped; a new connection
    is not refused but times out; a COMMIT sent meanwhile, its connection cut by the client
    before the thaw, is executed when the cluster thaws; thawed, it answers again."""
    name = cluster.create_database(f"frozen_{uuid.uuid4().hex[:12]}")
    dsn = f"host=127.0.0.1 port={cluster.port} user=postgres dbname={name}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (i int)")
    held = psycopg.connect(dsn)
    try:
        held.execute("INSERT INTO t VALUES (1)")
        cluster.freeze()
        try:
            assert cluster.all_stopped()
            t0 = time.monotonic()
            with pytest.raises(psycopg.OperationalError, match="timeout"):
                psycopg.connect(dsn + " connect_timeout=2")
            waited = time.monotonic() - t0
            assert 1.5 <= waited < 10, f"a connection attempt ended after {waited:.1f} s"

            # As the engine's deadline does: shut the socket down under a waiting call.
            cut = threading.Timer(
                1.0, lambda: socket.socket(fileno=held.fileno()).shutdown(socket.SHUT_RDWR)
            )
            cut.start()
            t0 = time.monotonic()
            with pytest.raises(psycopg.OperationalError):
                held.commit()
            assert time.monotonic() - t0 < 5, "the COMMIT was answered while frozen"
            cut.join()
        finally:
            cluster.thaw()
    finally:
        held.close()
    assert not cluster.all_stopped()
    with psycopg.connect(dsn + " connect_timeout=5") as conn:
        deadline = time.monotonic() + 5
        while conn.execute("SELECT count(*) FROM t").fetchone() != (1,):
            assert time.monotonic() < deadline, "the COMMIT sent while frozen never happened"
            time.sleep(0.1)


# -- the probe --


@pytest.mark.timeout(150)
@pytest.mark.usefixtures("deadlines")
def test_while_b_hangs_for_a_minute_c_gets_every_message_within_seconds(
    net: Net, cluster: FrozenCluster
) -> None:
    """The issue's probe. B freezes for a minute; meanwhile a message goes to B and one to C
    every 3 s while A delivers in a loop: each message to C is in C's queue within LATE of its
    SEND, no pass lasts longer than LATE, B's rows say ``no answer from broker://b``, a report
    names B as hung. After the thaw every message reaches B and C exactly once, in order, and
    A's transmission queue empties."""
    a, b, c = net["a"], net["b"], net["c"]
    handles = {far: send_dialogs(a, [1, 1], to_service=SERVICES[far]) for far in SERVICES}
    got: dict[str, dict[uuid.UUID, list[Message]]] = {far: {} for far in SERVICES}
    settle(a, 10)
    for far in SERVICES:
        assert collect(net[far], TARGET_QUEUE, got[far]) == 2, f"{far} before the hang"

    cluster.freeze()
    # If a pass blocks for the whole hang (the bug), the test still ends, and says so.
    safety = threading.Timer(HANG + 5, cluster.thaw)
    safety.daemon = True
    safety.start()
    try:
        t0 = time.monotonic()
        sent: dict[int, float] = {}  # n -> when sent (to B and C)
        arrived: dict[int, float] = {}  # n -> when seen in C's queue
        passes: list[tuple[float, float, DeliveryReport]] = []  # (start, seconds, report)
        b_rows: list[tuple[float, Counter[str]]] = []  # (when, B's rows' statuses) after a pass
        n, next_send = 1, t0
        while (now := time.monotonic()) < t0 + HANG:
            # Nothing is sent in the last seconds: every message has its LATE within the hang.
            if now >= next_send and now < t0 + HANG - LATE - 1:
                for far in SERVICES:
                    send_more(a, handles[far], n, 1)
                sent[n] = time.monotonic()
                n += 1
                next_send += SEND_EVERY
            start = time.monotonic()
            report = a.deliver()
            passes.append((start - t0, time.monotonic() - start, report))
            in_c = message_count(c, TARGET_QUEUE) // len(handles["c"])
            for k in range(1, in_c + 1):
                arrived.setdefault(k, time.monotonic())
            b_rows.append((time.monotonic() - t0, statuses(rows_for(a, "b"))))
            time.sleep(0.2)
        hang_end = time.monotonic()
        frozen_at_end = cluster.frozen and cluster.all_stopped()
    finally:
        safety.cancel()
        cluster.thaw()

    late = {k: round(arrived.get(k, hang_end) - t, 1) for k, t in sent.items()}
    assert all(s <= LATE for s in late.values()), (
        f"messages to C arrived later than {LATE} s after their SEND while B hung "
        f"(n: seconds, at the end of the hang if never): {late}"
    )
    slow = [(round(at, 1), round(took, 1)) for at, took, _ in passes if took > LATE]
    assert not slow, f"passes that waited for the hung B (start, seconds): {slow}"
    assert frozen_at_end, "B thawed before the end of the hang (a pass blocked until the safety)"
    assert len(sent) >= 15, f"only {len(sent)} rounds sent during the hang"
    hung = [(round(at, 1), r.hung) for at, _, r in passes if "broker://b" in r.hung]
    assert hung, "no DeliveryReport named broker://b among the hung"
    assert not [r.hung for _, _, r in passes if "broker://c" in r.hung], "C reported hung"
    said = [at for at, st in b_rows if st and all(HUNG_TEXT in status for status in st)]
    assert said, (
        f"B's waiting rows never all said {HUNG_TEXT!r}; their statuses: "
        f"{sorted({s for _, st in b_rows for s in st})[:6]}"
    )

    settle(a, 2 * ANSWER + 20)
    conv = {far: conversation_ids(a, handles[far]) for far in SERVICES}
    for far in SERVICES:
        collect(net[far], TARGET_QUEUE, got[far])
        expected = {conv[far][h]: list(range(n)) for h in handles[far]}
        assert_exactly_once_in_order(got[far], expected, far)
    assert not a.transmission_queue()
    # Nothing straggles in after: B's queue keeps exactly what it received.
    a.deliver(retry_now=True)
    assert message_count(b, TARGET_QUEUE) == 0 and not a.transmission_queue()


# -- a hang in the middle of a batch's accept --


class Cut:
    """Freezes B's cluster once, at one point of a delivery to it (``point``), after
    :meth:`arm`: right after a COPY into broker_message on a connection to B ("insert"), at
    the commit of a transaction that did one or as the one statement that takes known
    conversations (``broker_accept_plain``, which commits on its own) goes to B ("commit"), or
    in ``Transport.after_push`` of a push to broker://b ("after push")."""

    def __init__(self, cluster: FrozenCluster, point: str) -> None:
        self.cluster = cluster
        self.point = point
        self.armed = False
        self.frozen_at: float | None = None
        #: thaws B if the test's own thaw is not reached in time (a pass blocked by the hang)
        self.safety = threading.Timer(1.5 * ANSWER + 10, cluster.thaw)
        self.safety.daemon = True
        self._lock = threading.Lock()

    def arm(self) -> None:
        self.armed = True

    def _to_b(self, conn: Connection) -> bool:
        return conn.engine.url.port == self.cluster.port

    def fire(self, point: str) -> None:
        with self._lock:
            if self.armed and point == self.point and self.frozen_at is None:
                self.cluster.freeze()
                self.frozen_at = time.monotonic()
                self.safety.start()

    def after_copy(self, conn: Connection, table: Any) -> None:
        if table.name == "broker_message" and self._to_b(conn):
            conn.info["hung_peer_test_copied"] = True
            self.fire("insert")

    def on_commit(self, conn: Connection) -> None:
        if conn.info.pop("hung_peer_test_copied", False) and self._to_b(conn):
            self.fire("commit")

    def accepting(self, engine: Engine) -> None:
        if engine.url.port == self.cluster.port:
            self.fire("commit")

    def after_push(self, address: str) -> None:
        if address == "broker://b":
            self.fire("after push")


@pytest.fixture
def cut_at(
    request: pytest.FixtureRequest, cluster: FrozenCluster, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Cut]:
    cut = Cut(cluster, request.param)
    copy_rows = bulk._copy_rows

    def copying(conn: Connection, table: Any, *args: Any, **kwargs: Any) -> None:
        copy_rows(conn, table, *args, **kwargs)
        cut.after_copy(conn, table)

    after_push = Transport.after_push

    def pushed(self: Transport, address: str, sent: int) -> None:
        after_push(self, address, sent)
        cut.after_push(address)

    # Every insert into a queue goes through bulk._copy_rows (COPY: no SQLAlchemy event sees it),
    # but for known conversations, which broker_accept_plain takes in one statement that commits
    # on its own: it has no moment between its insert and its commit, so the "insert" case
    # delivers by the general accept, and the "commit" case freezes B as the statement goes.
    monkeypatch.setattr(bulk, "_copy_rows", copying)
    if cut.point == "insert":
        monkeypatch.setattr(direct_delivery, "_accept_known", lambda *_args: None)
    execute_committed = storage_direct.execute_committed

    def committed(fairy: Any, engine: Engine, statement: Any, args: Any) -> Any:
        if statement is ACCEPT_PLAIN:
            cut.accepting(engine)
        return execute_committed(fairy, engine, statement, args)

    monkeypatch.setattr(storage_direct, "execute_committed", committed)
    monkeypatch.setattr(Transport, "after_push", pushed)
    # Small batches: a pass pushes to B several times (the "after push" case cuts a later one).
    monkeypatch.setattr(Transport, "BATCH", 4)
    event.listen(Engine, "commit", cut.on_commit)
    try:
        yield cut
    finally:
        event.remove(Engine, "commit", cut.on_commit)
        cut.safety.cancel()
        cluster.thaw()


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("deadlines")
@pytest.mark.parametrize(
    ("cut_at", "far_commit"),
    [
        pytest.param("insert", "never", id="after-the-far-insert"),
        pytest.param("commit", "after-the-cut", id="before-the-far-commit"),
        pytest.param("after push", "before-the-cut", id="after-the-far-commit"),
    ],
    indirect=["cut_at"],
)
def test_a_hang_inside_a_batch_loses_nothing_and_duplicates_nothing(
    net: Net, cluster: FrozenCluster, cut_at: Cut, far_commit: str
) -> None:
    """Ten dialogs get two messages each to B, then three more each; B freezes during the
    delivery of those three (at ``cut_at``): after the far insert (the next statement is never
    answered and the COMMIT never sent: B rolls back at the thaw), just before the far COMMIT
    (it waits in B's socket; B executes it at the thaw, after A's deadline cut the connection:
    A cannot know), or after a far commit, before the pass's next push to B. The pass returns
    within its patience; after the answer timeout B's rows say ``no answer from broker://b``.
    B thaws 1.5 answer timeouts after it froze (before its session's idle-in-transaction
    timeout, twice the answer timeout, could end the transaction). Then everything is at B
    exactly once, in order, and A's transmission queue is empty."""
    a, b = net["a"], net["b"]
    handles = send_dialogs(a, [2] * 10, to_service=SERVICES["b"])
    got: dict[uuid.UUID, list[Message]] = {}
    settle(a, 10)
    assert collect(b, TARGET_QUEUE, got) == 20

    cut_at.arm()
    send_more(a, handles, 2, 3)
    t0 = time.monotonic()
    a.deliver()
    took = time.monotonic() - t0
    assert cut_at.frozen_at is not None, f"B was not frozen at {cut_at.point!r} (test premise)"
    frozen_at = cut_at.frozen_at
    assert took <= LATE, f"the pass waited {took:.1f} s for the hung B (patience {PATIENCE} s)"
    waiting = rows_for(a, "b")
    assert waiting, "nothing waited for B after the cut (test premise: a push to B hung)"

    time.sleep(max(0.0, frozen_at + ANSWER + 1 - time.monotonic()))
    a.deliver()
    left = rows_for(a, "b")
    assert left and all(HUNG_TEXT in r.transmission_status for r in left), (
        f"B's waiting rows after the answer timeout: {statuses(left).most_common(3)}"
    )
    assert cluster.all_stopped()

    time.sleep(max(0.0, frozen_at + 1.5 * ANSWER - time.monotonic()))
    cluster.thaw()
    # What B has, before A sends anything again: the premise of the case.
    time.sleep(1.0)
    at_b = message_count(b, TARGET_QUEUE)
    if far_commit == "never":
        assert at_b == 0, f"B committed {at_b} messages of the cut batch (premise: none)"
    elif far_commit == "after-the-cut":
        assert at_b > 0, "B did not commit the batch whose COMMIT it got frozen (premise)"
    else:
        assert 0 < at_b < 30, f"B has {at_b} of the 30 (premise: a batch committed before)"

    settle(a, 2 * ANSWER + 20)
    collect(b, TARGET_QUEUE, got)
    conv_of = conversation_ids(a, handles)
    assert_exactly_once_in_order(got, {conv_of[h]: range(5) for h in handles}, "b")
    assert not a.transmission_queue()
