"""Delivery between broker databases when a database goes away: PostgreSQL only.

A database is taken down as a server would lose it: ``ALTER DATABASE ... ALLOW_CONNECTIONS
false`` and every session of it terminated (connections pooled by anyone, the delivering broker
included, die with them); ``ALLOW_CONNECTIONS true`` brings it back.

- seed 003 high availability: either of two forwarding gateways may be down; traffic flows
  through the other, both ways, exactly once;
- the target database is down: messages wait in the sender's transmission queue with a reason
  naming the address, attempts grow and back off (1 s doubling, 60 s cap); once it is back
  one ``deliver(retry_now=True)`` delivers everything exactly once and in order;
- mirrors (seed 001): the route's mirror address is used when the principal is down or says it
  is not the principal, and only when the mirror says it is.

The cases that run on SQLite too are in ``test_transport.py``.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING

import pytest
from sqlalchemy import make_url, text
from transport_procs import (
    INIT_QUEUE,
    INITIATOR,
    TARGET,
    TARGET_QUEUE,
    Net,
    assert_exactly_once_in_order,
    by_conversation,
    collect,
    connect_all,
    conversation_ids,
    drain_all,
    endpoints,
    ha_network,
    host_initiator,
    host_target,
    message_count,
    reply_to_all,
    send_dialogs,
    send_more,
    two_way,
)

from airflow_broker import Broker, Message
from airflow_broker.messaging.objects import TransmissionRow
from airflow_broker.storage.clock import utcnow

if TYPE_CHECKING:
    from conftest import PostgresServer

pytestmark = [pytest.mark.postgres, pytest.mark.xdist_group("transport")]

Network = Callable[..., Net]


class Outage:
    """Takes broker databases down and brings them back (all back at teardown)."""

    def __init__(self, server: PostgresServer) -> None:
        self.server = server
        self.down_now: set[str] = set()

    def _alter(self, url: str, allow: bool) -> str:
        db = make_url(url).database
        assert db is not None
        with self.server._admin.connect() as conn:
            conn.execute(
                text(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS {"true" if allow else "false"}')
            )
            if not allow:
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = :db AND pid <> pg_backend_pid()"
                    ),
                    {"db": db},
                )
        return db

    def down(self, net: Net, name: str) -> None:
        # The test's own broker for it must not hand out a dead pooled connection later.
        net[name].dispose()
        self.down_now.add(self._alter(net.urls[name], False))

    def up(self, net: Net, name: str) -> None:
        self.down_now.discard(self._alter(net.urls[name], True))

    def restore(self) -> None:
        for db in list(self.down_now):
            self._alter(self.server.url_for(db), True)
        self.down_now.clear()


@pytest.fixture
def outage(postgres_server: PostgresServer) -> Iterator[Outage]:
    o = Outage(postgres_server)
    yield o
    o.restore()


@pytest.fixture
def pg_network(make_pg_database: Callable[..., str]) -> Iterator[Network]:
    """``pg_network("a", "b")``: a fresh PostgreSQL broker database per name, one resolver."""
    nets: list[Net] = []

    def build(*names: str, unreachable: tuple[str, ...] = ()) -> Net:
        net = connect_all({name: make_pg_database() for name in names}, unreachable)
        nets.append(net)
        return net

    yield build
    for net in nets:
        net.close()


def assert_all_delivered(broker: Broker, what: str) -> None:
    left = broker.transmission_queue()
    assert not left, (
        f"{what}: {len(left)} messages still in the transmission queue; first: "
        f"{left[0].transmission_status!r} (attempts {left[0].attempts})"
    )


def says_unreachable(status: str, address: str) -> bool:
    """A transmission status that names ``address`` and says it could not be reached."""
    words = ("cannot", "could not", "unreachable", "connect", "refused", "not accepting", "down")
    return address in status and any(w in status.lower() for w in words)


# -- seed 003: high availability --


@pytest.mark.direct_connection  # a server refusing connections; a pooler answers instead
@pytest.mark.timeout(120)
def test_high_availability_survives_either_gateway_going_down(
    pg_network: Network, outage: Outage
) -> None:
    """Both gateways up, then G1 down, then G1 back and G2 down: after every change one
    deliver() pass of A gets every message to B, and B's replies reach A, exactly once."""
    net = pg_network("a", "g1", "g2", "b")
    ha_network(net)
    a, b = net["a"], net["b"]
    at_b: dict[uuid.UUID, list[Message]] = {}

    old = send_dialogs(a, [2] * 20)
    a.deliver()
    assert_all_delivered(a, "both gateways up")
    assert collect(b, TARGET_QUEUE, at_b) == 40

    outage.down(net, "g1")
    send_more(a, old, 2, 2)
    new = send_dialogs(a, [2] * 10)
    a.deliver()
    assert_all_delivered(a, "G1 down")
    assert not net["g2"].in_transit()
    assert collect(b, TARGET_QUEUE, at_b) == 60

    replies: Counter[uuid.UUID] = Counter()
    reply_to_all(b, [m for ms in at_b.values() for m in ms], {"reply": 1})
    b.deliver()
    assert_all_delivered(b, "B's replies with G1 down")
    replies.update(m.conversation_handle for m in drain_all(a, INIT_QUEUE))

    outage.up(net, "g1")
    outage.down(net, "g2")
    handles = old + new
    send_more(a, handles, 4, 1)
    a.deliver()
    assert_all_delivered(a, "G2 down")
    assert not net["g1"].in_transit()
    assert collect(b, TARGET_QUEUE, at_b) == 30
    reply_to_all(b, [m for ms in at_b.values() for m in ms], {"reply": 2})
    b.deliver()
    assert_all_delivered(b, "B's replies with G2 down")
    replies.update(m.conversation_handle for m in drain_all(a, INIT_QUEUE))

    conv_of = conversation_ids(a, handles)
    expected = {conv_of[h]: [0, 1, 2, 3, 4] for h in old}
    expected |= {conv_of[h]: [0, 1, 4] for h in new}
    assert_exactly_once_in_order(at_b, expected, "b")
    assert replies == Counter({h: 2 for h in handles})
    assert {endpoints(a)[h].far_broker_instance for h in handles} == {net.id("b")}


# -- faults: the target database is down --


def delays(rows: list[TransmissionRow], before: datetime, after: datetime) -> tuple[float, float]:
    """The backoff of the rows just attempted, in seconds: (shortest possible, longest)."""
    nexts = {r.next_attempt_at for r in rows}
    assert None not in nexts, "a failed row has no next attempt time"
    lo = min(nexts) - after
    hi = max(nexts) - before
    return lo.total_seconds(), hi.total_seconds()


@pytest.mark.direct_connection  # a server refusing connections; a pooler answers instead
@pytest.mark.timeout(120)
def test_messages_wait_while_the_target_is_down_and_arrive_once_it_is_back(
    pg_network: Network, outage: Outage
) -> None:
    """B goes down after a first delivery (so pooled connections to it die too). Messages sent
    meanwhile wait in A's transmission queue with a reason naming broker://b; every retry
    counts an attempt and backs off 1 s doubling up to 60 s; a plain deliver() leaves them alone
    until due. Once B is back one deliver(retry_now=True) delivers them all, in order."""
    net = pg_network("a", "b")
    two_way(net)
    a, b = net["a"], net["b"]
    at_b: dict[uuid.UUID, list[Message]] = {}
    old = send_dialogs(a, [2] * 5)
    a.deliver()
    assert_all_delivered(a, "B up")
    assert collect(b, TARGET_QUEUE, at_b) == 10

    outage.down(net, "b")
    send_more(a, old, 2, 2)
    new = send_dialogs(a, [3] * 5)
    pending = 5 * 2 + 5 * 3

    fresh = {r.transmission_status for r in a.transmission_queue()}
    before = utcnow()
    report = a.deliver()
    after = utcnow()
    assert report.delivered == 0
    rows = a.transmission_queue()
    assert len(rows) == pending
    statuses = {r.transmission_status for r in rows}
    assert not statuses & fresh, f"the reasons did not change after a failed attempt: {statuses}"
    assert all(says_unreachable(st, "broker://b") for st in statuses), statuses
    assert {r.attempts for r in rows} == {1}
    backoff = [delays(rows, before, after)]
    assert backoff[0][1] >= 0.5 and backoff[0][0] <= 2.5, f"first backoff {backoff[0]} s, not ~1 s"
    summary = [x for x in a.transmission_summary() if x.to_service_name == TARGET]
    assert sum(x.count for x in summary) == pending
    assert all("broker://b" in x.transmission_status for x in summary)

    for attempt in range(2, 9):
        before = utcnow()
        a.deliver(retry_now=True)
        after = utcnow()
        rows = a.transmission_queue()
        assert len(rows) == pending
        assert {r.attempts for r in rows} == {attempt}, "retry_now did not attempt every row"
        backoff.append(delays(rows, before, after))
    for (lo_prev, _), (_, hi) in itertools.pairwise(backoff):
        assert hi >= min(1.5 * lo_prev, 59.0), f"backoff does not double: {backoff}"
    assert all(hi <= 61.0 for _, hi in backoff), f"backoff past the 60 s cap: {backoff}"
    assert backoff[-1][0] >= 55.0, f"backoff after 8 attempts is not at the cap: {backoff}"

    # Not due: a plain pass leaves them alone.
    a.deliver()
    assert {r.attempts for r in a.transmission_queue()} == {8}

    outage.up(net, "b")
    report = a.deliver(retry_now=True)
    assert_all_delivered(a, "B back")
    assert report.delivered == pending, f"A's deliver() reports {report}"
    assert collect(b, TARGET_QUEUE, at_b) == pending

    handles = old + new
    conv_of = conversation_ids(a, handles)
    expected = {conv_of[h]: [0, 1, 2, 3] for h in old} | {conv_of[h]: [0, 1, 2] for h in new}
    assert_exactly_once_in_order(at_b, expected, "b")
    # and the way back works after the restart too
    reply_to_all(b, [m for ms in at_b.values() for m in ms], {"reply": 1})
    b.deliver()
    assert_all_delivered(b, "replies")
    assert Counter(m.conversation_handle for m in drain_all(a, INIT_QUEUE)) == Counter(handles)


# -- mirrors --


def mirrored(pg_network: Network, make_pg_database: Callable[..., str]) -> Net:
    """A, B and B2, a copy of B (same broker instance id, same services and return route); A's
    route to TargetService names B's id, address broker://b and mirror address broker://b2."""
    setup = pg_network("a", "b")
    host_initiator(setup["a"])
    host_target(setup["b"])
    setup["b"].create_route("ReturnRoute", INITIATOR, setup.id("a"), "broker://a")
    setup.close()
    urls = dict(setup.urls)
    urls["b2"] = make_pg_database(copy_of=urls["b"])
    net = connect_all(urls)
    assert net.id("b2") == net.id("b")
    net["a"].create_route(
        "MirroredRoute", TARGET, net.id("b"), "broker://b", mirror_address="broker://b2"
    )
    return net


@pytest.fixture
def mirror_net(pg_network: Network, make_pg_database: Callable[..., str]) -> Iterator[Net]:
    net = mirrored(pg_network, make_pg_database)
    yield net
    net.close()


@pytest.mark.direct_connection  # a server refusing connections; a pooler answers instead
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case", ["principal down, mirror is principal", "principal says it is not the principal"]
)
def test_the_mirror_takes_the_messages_when_the_principal_cannot(
    mirror_net: Net, outage: Outage, case: str
) -> None:
    net = mirror_net
    a, b2 = net["a"], net["b2"]
    if case == "principal down, mirror is principal":
        b2.configure(principal=True)
        outage.down(net, "b")
    else:
        net["b"].configure(principal=False)
        b2.configure(principal=True)
    handles = send_dialogs(a, [2] * 5)

    a.deliver()
    assert_all_delivered(a, case)
    conv_of = conversation_ids(a, handles)
    got = by_conversation(b2, drain_all(b2, TARGET_QUEUE))
    assert_exactly_once_in_order(got, {conv_of[h]: range(2) for h in handles}, "b2")
    assert {endpoints(a)[h].far_broker_instance for h in handles} == {net.id("b")}

    reply_to_all(b2, [m for ms in got.values() for m in ms], {"reply": 1})
    b2.deliver()
    assert_all_delivered(b2, "replies from the mirror")
    assert Counter(m.conversation_handle for m in drain_all(a, INIT_QUEUE)) == Counter(handles)
    outage.up(net, "b")
    assert message_count(net["b"], TARGET_QUEUE) == 0


@pytest.mark.direct_connection  # a server refusing connections; a pooler answers instead
@pytest.mark.timeout(120)
def test_no_delivery_while_the_principal_is_down_and_the_mirror_does_not_claim_to_be_it(
    mirror_net: Net, outage: Outage
) -> None:
    """B down and B2 says it is not the principal: nothing goes to B2, the messages wait with a
    reason; when B is back they go to B, exactly once."""
    net = mirror_net
    a, b2 = net["a"], net["b2"]
    b2.configure(principal=False)
    outage.down(net, "b")
    handles = send_dialogs(a, [2] * 5)

    fresh = {r.transmission_status for r in a.transmission_queue()}
    report = a.deliver()
    assert report.delivered == 0
    rows = a.transmission_queue()
    assert len(rows) == 10
    assert all(r.attempts >= 1 for r in rows)
    statuses = {r.transmission_status for r in rows}
    assert not statuses & fresh, f"the reasons did not change after a failed attempt: {statuses}"
    assert all(says_unreachable(st, "broker://b") for st in statuses), statuses
    assert message_count(b2, TARGET_QUEUE) == 0
    assert endpoints(b2) == {}, "the mirror that is not the principal created endpoints"

    outage.up(net, "b")
    a.deliver(retry_now=True)
    assert_all_delivered(a, "principal back")
    conv_of = conversation_ids(a, handles)
    got = by_conversation(net["b"], drain_all(net["b"], TARGET_QUEUE))
    assert_exactly_once_in_order(got, {conv_of[h]: range(2) for h in handles}, "b")
    assert message_count(b2, TARGET_QUEUE) == 0


@pytest.mark.direct_connection  # a server refusing connections; a pooler answers instead
def test_an_outage_refuses_connections_until_it_ends(pg_network: Network, outage: Outage) -> None:
    """What the tests above rely on: while "down" a database refuses new connections at once."""
    net = pg_network("a")
    a = net["a"]
    outage.down(net, "a")
    t0 = time.monotonic()
    with pytest.raises(Exception, match="not currently accepting connections"):
        a.engine.connect().close()
    assert time.monotonic() - t0 < 5
    outage.up(net, "a")
    with a.engine.connect() as conn:
        assert conn.execute(text("SELECT 1")).scalar() == 1
