"""Routing and delivery between broker databases, on SQLite files and on PostgreSQL databases.

Each test builds a small network of broker databases (``tests/transport_procs.py``), sends
dialogs, runs ``deliver()`` where the seeds say a broker would transmit, and reads back with
RECEIVE what every database got: each message exactly once, each dialog in order, nothing left
in a transmission queue or in transit.

- seed 003 load balancing: 1000 dialogs split between two target databases by the dialog id's
  hash, each dialog whole on one of them, the far broker id locked by the first
  acknowledgment, replies back by the targets' own ``deliver()``;
- seed 003 high availability: two forwarding gateways, one of them unreachable;
- seed 002: a routing loop between two forwarders ends with ERR_HOPS_EXCEEDED at the sender;
- a delivery process SIGKILLed after a far broker committed a batch, then run again;
- replies, EndDialog and Error both ways; invalid bodies and unsupported contracts;
- seed 001 in delivery: a named route beats AutoCreatedLocal, expired routes are ignored, no
  route delays, TRANSPORT routes, a message bearing another broker's id is dropped.

The faults that need PostgreSQL (a database refusing connections, mirrors) are in
``test_transport_pg.py``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import transport_procs as tp
from helpers import CONTRACT, INVOICE, NOTE, ORDER
from sqlalchemy import update
from transport_procs import (
    INIT_QUEUE,
    INITIATOR,
    TARGET,
    TARGET_QUEUE,
    Net,
    assert_exactly_once_in_order,
    by_conversation,
    conversation_ids,
    deliver_until_empty,
    drain_all,
    endpoints,
    ha_network,
    host,
    host_initiator,
    host_target,
    message_count,
    pump,
    reply_to_all,
    send_dialogs,
    send_more,
    two_way,
)

from airflow_broker import END_DIALOG, ERROR, Broker
from airflow_broker.constants import (
    ERR_CONTRACT_NOT_SUPPORTED,
    ERR_HOPS_EXCEEDED,
    ERR_MESSAGE_INVALID,
)
from airflow_broker.routing import pick_broker_instance
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow
from airflow_broker.transport import Transport

MP = multiprocessing.get_context("forkserver")
MP.set_forkserver_preload(
    ["__main__", "procs", "transport_procs", "psycopg", "sqlalchemy.dialects.postgresql.psycopg"]
)

Network = Callable[..., Net]


# -- fixtures --


# -- seed 003: load balancing --

#: (routes, dialogs, messages per dialog cycling 1..n). The duplicated route only needs to show
#: that it does not weight the split: with 600 one-message dialogs the 40%..60% band is almost 5
#: standard deviations wide either side, while weighting by route (B gets 1/3) would fall 3.5
#: standard deviations below it.
LOAD_BALANCING = [("two routes", 1000, 3), ("three routes to two broker ids", 600, 1)]


@pytest.mark.slow
@pytest.mark.xdist_group("transport")
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("routes", "dialogs", "most"), LOAD_BALANCING, ids=[c[0] for c in LOAD_BALANCING]
)
def test_load_balancing_splits_dialogs_by_hash_and_keeps_each_on_one_database(
    network: Network, routes: str, dialogs: int, most: int
) -> None:
    """Seed 003: A routes TargetService to B's and C's broker ids; dialogs begun without a
    broker id are spread by the dialog id's hash (a second route to C does not weight it), every
    message of a dialog reaches the same database exactly once and in order, the first
    acknowledgment locks the far broker id, and replies come back by B's and C's deliver()."""
    net = network("a", "b", "c")
    a = net["a"]
    host_initiator(a)
    with a.definitions() as d:
        d.create_route("LoadBalancingRoute1", TARGET, net.id("b"), "broker://b")
        d.create_route("LoadBalancingRoute2", TARGET, net.id("c"), "broker://c")
        if routes == "three routes to two broker ids":
            d.create_route("LoadBalancingRoute3", TARGET, net.id("c"), "broker://c")
    for name in "bc":
        host_target(net[name])
        net[name].create_route("ReturnRoute", INITIATOR, net.id("a"), "broker://a")

    counts = [1 + i % most for i in range(dialogs)]
    t0 = time.monotonic()
    handles = send_dialogs(a, counts, per_transaction=250)
    sent = time.monotonic()
    totals = deliver_until_empty(a)
    delivered = time.monotonic()
    assert totals.delivered == sum(counts), f"A's deliver() reports: {totals}"

    conv_of = conversation_ids(a, handles)
    expected = {conv_of[h]: range(c) for h, c in zip(handles, counts, strict=True)}
    got = {name: by_conversation(net[name], drain_all(net[name], TARGET_QUEUE)) for name in "bc"}
    received = time.monotonic()

    both = set(got["b"]) & set(got["c"])
    assert not both, f"{len(both)} dialogs reached both B and C (two target endpoints)"
    for name in "bc":
        assert_exactly_once_in_order(got[name], {c: expected[c] for c in got[name]}, name)
    assert set(got["b"]) | set(got["c"]) == set(expected), "dialogs that reached neither B nor C"
    share = {name: len(got[name]) / dialogs for name in "bc"}
    assert 0.4 <= share["b"] <= 0.6, f"load balancing split {share} (routes: {routes})"

    # Deterministic: the hash of the dialog id picks the broker id, as routing.py (and Spark)
    # compute it, so a rerun or another delivery process routes every dialog the same way.
    ids = [net.id("b"), net.id("c")]
    for name in "bc":
        off = [c for c in got[name] if pick_broker_instance(c, ids) != net.id(name)]
        assert not off, f"{len(off)} dialogs went to {name} although their hash picks the other"

    # The first acknowledgment locked the far broker id of every initiator endpoint.
    eps = endpoints(a)
    for name in "bc":
        wrong = {
            eps[h].far_broker_instance
            for h in handles
            if conv_of[h] in got[name] and eps[h].far_broker_instance != net.id(name)
        }
        assert not wrong, f"dialogs on {name} have far_broker_instance {wrong}"

    # Replies go back by the targets' own routes and deliver().
    for name in "bc":
        replied = reply_to_all(
            net[name], [m for ms in got[name].values() for m in ms], {"from": name}
        )
        assert len(replied) == len(got[name])
        back = deliver_until_empty(net[name])
        assert back.delivered == len(replied), f"{name}'s deliver() reports {back}"
    replies = drain_all(a, INIT_QUEUE)
    per_handle = Counter(m.conversation_handle for m in replies)
    assert per_handle == Counter(handles), (
        f"{len(replies)} replies for {len(handles)} dialogs; "
        f"duplicated: {sum(1 for n in per_handle.values() if n > 1)}"
    )
    misplaced = [m for m in replies if conv_of[m.conversation_handle] not in got[m.json()["from"]]]
    assert not misplaced, f"{len(misplaced)} replies came from a database that had no such dialog"
    assert not a.transmission_queue()
    print(
        f"\n{dialogs} dialogs, {sum(counts)} messages ({routes}): send {sent - t0:.1f} s, "
        f"deliver {delivered - sent:.1f} s, receive {received - delivered:.1f} s, "
        f"total {time.monotonic() - t0:.1f} s; split {share}"
    )


# -- seed 003: high availability --


@pytest.mark.timeout(120)
def test_high_availability_delivers_through_the_gateway_that_answers(network: Network) -> None:
    """G1 resolves to a server that does not answer: one deliver() pass of A gets every
    message to B through G2 exactly once, B's replies come back the same way, and neither end
    nor the gateway keeps anything."""
    net = network("a", "g2", "b", unreachable=("g1",))
    ha_network(net)
    a, b, g2 = net["a"], net["b"], net["g2"]
    counts = [1 + i % 3 for i in range(30)]
    handles = send_dialogs(a, counts)

    a.deliver()
    left = a.transmission_queue()
    assert not left, (
        f"{len(left)} messages left in A after one pass although G2 answers: "
        f"{left[0].transmission_status!r}"
    )
    assert not g2.in_transit()
    conv_of = conversation_ids(a, handles)
    expected = {conv_of[h]: range(c) for h, c in zip(handles, counts, strict=True)}
    got = by_conversation(b, drain_all(b, TARGET_QUEUE))
    assert_exactly_once_in_order(got, expected, "b")
    eps = endpoints(a)
    assert {eps[h].far_broker_instance for h in handles} == {net.id("b")}

    reply_to_all(b, [m for ms in got.values() for m in ms], {"reply": 1})
    b.deliver()
    left = b.transmission_queue()
    assert not left, f"{len(left)} replies left in B: {left[0].transmission_status!r}"
    assert not g2.in_transit()
    replies = drain_all(a, INIT_QUEUE)
    assert Counter(m.conversation_handle for m in replies) == Counter(handles)


# -- seed 002: routing loop --


@pytest.mark.timeout(120)
def test_a_routing_loop_between_forwarders_ends_with_hops_exceeded(network: Network) -> None:
    """F1 routes TargetService to F2 and F2 back to F1; both route InitiatorService to A. The hop
    count breaks the loop: each dialog's sender gets one Error (ERR_HOPS_EXCEEDED) and goes to
    ER, and nothing stays in A's transmission queue or in either forwarder's transit."""
    net = network("a", "f1", "f2")
    a = net["a"]
    host_initiator(a)
    a.create_route("ToF1", TARGET, None, "broker://f1")
    for me, other in (("f1", "f2"), ("f2", "f1")):
        with net[me].definitions() as d:
            d.create_route("Onward", TARGET, None, f"broker://{other}")
            d.create_route("Back", INITIATOR, net.id("a"), "broker://a")
            d.configure(forwarding=True)
    handles = send_dialogs(a, [2, 2, 2])

    pump([a, net["f1"], net["f2"]], rounds=60)

    assert not a.transmission_queue(), a.transmission_queue()[0].transmission_status
    for f in ("f1", "f2"):
        assert not net[f].in_transit(), f"{f} still holds {net[f].in_transit()}"
    got = drain_all(a, INIT_QUEUE)
    assert Counter(m.conversation_handle for m in got) == Counter(handles), (
        f"one Error per dialog expected, got {[(m.message_type_name, m.error) for m in got]}"
    )
    assert {m.message_type_name for m in got} == {ERROR}
    assert {m.error[0] for m in got if m.error} == {ERR_HOPS_EXCEEDED}
    eps = endpoints(a)
    assert {eps[h].state for h in handles} == {"ER"}
    # The sender can end the failed dialogs; nothing goes anywhere.
    with a.transaction() as tx:
        for h in handles:
            tx.end_conversation(h)
    pump([a, net["f1"], net["f2"]], rounds=5)
    assert not a.transmission_queue()
    assert {endpoints(a)[h].state for h in handles} == {"CD"}


# -- crash mid-batch --


@pytest.mark.slow
@pytest.mark.xdist_group("transport")
@pytest.mark.timeout(120)
def test_delivery_killed_after_the_far_commit_is_rerun_without_duplicates(
    network: Network, tmp_path: Path
) -> None:
    """A delivery process is SIGKILLed after B committed its first batch and before A recorded
    the acknowledgments. B has that batch, A still holds every row; the rerun delivers the
    rest, B drops the copies it already has, and A's transmission queue ends empty."""
    net = network("a", "b")
    two_way(net)
    a, b = net["a"], net["b"]
    counts = [10] * 20
    handles = send_dialogs(a, counts)
    batch = 50
    marker = tmp_path / "pushed.json"

    proc = MP.Process(
        target=tp.deliver_and_hang,
        args=(net.urls["a"], net.resolver, str(marker), batch),
        daemon=True,
    )
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.is_alive(), f"the delivery process exited ({proc.exitcode}) unpushed"
            assert time.monotonic() < deadline, "no batch pushed within 60 s"
            time.sleep(0.02)
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)

    pushed = json.loads(marker.read_text())
    assert pushed["address"] == "broker://b"
    assert 0 < pushed["sent"] <= batch
    # the far side has the batch, this side has not recorded the acknowledgment
    assert message_count(b, TARGET_QUEUE) == pushed["sent"]
    assert len(a.transmission_queue()) == sum(counts)

    deliver_until_empty(a, retry_now=True)
    conv_of = conversation_ids(a, handles)
    expected = {conv_of[h]: range(c) for h, c in zip(handles, counts, strict=True)}
    got = by_conversation(b, drain_all(b, TARGET_QUEUE))
    assert_exactly_once_in_order(got, expected, "b")
    assert message_count(b, TARGET_QUEUE) == 0
    assert {endpoints(a)[h].far_broker_instance for h in handles} == {net.id("b")}


class LosesItsAnswers(Transport):
    """Pushes each batch and fails before applying the far broker's answers: the far broker
    has the messages, this side still holds every row (as after a crash between the two
    commits)."""

    def _finish(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("lost before this side's commit")


@pytest.mark.xdist_group("transport")
def test_a_batch_of_messages_the_far_broker_has_and_new_ones_after_them(
    network: Network,
) -> None:
    """The far broker takes each conversation's repeats as duplicates (acknowledged again,
    queued once) and the new messages that follow them, in order, in the same batch."""
    net = network("a", "b")
    two_way(net)
    a, b = net["a"], net["b"]
    handles = send_dialogs(a, [4] * 6)
    with pytest.raises(RuntimeError, match="lost before"):
        LosesItsAnswers(a).deliver()
    assert message_count(b, TARGET_QUEUE) == 24
    assert len(a.transmission_queue()) == 24
    send_more(a, handles, 4, 3)
    report = a.deliver()
    assert report.acknowledged == 6 * 7
    assert a.transmission_queue() == []
    conv_of = conversation_ids(a, handles)
    got = by_conversation(b, drain_all(b, TARGET_QUEUE))
    assert_exactly_once_in_order(got, {conv_of[h]: range(7) for h in handles}, "b")


# -- dialogs across databases --


def po_network(net: Net) -> tuple[Broker, Broker]:
    """The purchase-order contract of ``tests/helpers.py`` split over two databases: buyer
    service in A, supplier service in B."""
    a, b = net["a"], net["b"]
    for x in (a, b):
        with x.definitions() as d:
            d.create_message_type(ORDER, validation="json")
            d.create_message_type(INVOICE, validation="json")
            d.create_message_type(NOTE, validation="none")
            d.create_contract(CONTRACT, {ORDER: "initiator", INVOICE: "target", NOTE: "any"})
    host(a, INITIATOR, INIT_QUEUE, [CONTRACT])
    host(b, TARGET, TARGET_QUEUE, [CONTRACT])
    a.create_route("ToTarget", TARGET, None, "broker://b")
    b.create_route("ReturnRoute", INITIATOR, net.id("a"), "broker://a")
    return a, b


def state(broker: Broker, handle: uuid.UUID) -> str:
    with broker.transaction() as tx:
        return tx.conversation(handle).state


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ender", ["initiator", "target"])
@pytest.mark.parametrize("with_error", [False, True], ids=["end", "end-with-error"])
def test_replies_end_dialog_and_error_travel_both_ways(
    network: Network, ender: str, with_error: bool
) -> None:
    """Orders to B, an invoice back to A; then one side ENDs (plainly or WITH ERROR): the other
    gets exactly one EndDialog (state DI) or Error (state ER), ENDs in turn, and both
    endpoints close with nothing left to transmit."""
    net = network("a", "b")
    a, b = po_network(net)
    with a.transaction() as tx:
        h = tx.begin_dialog(INITIATOR, TARGET, contract=CONTRACT, encryption=False)
        tx.send(h, ORDER, {"n": 0})
        tx.send(h, ORDER, {"n": 1})
    a.deliver()
    got = drain_all(b, TARGET_QUEUE)
    assert [(m.message_type_name, m.json()) for m in got] == [
        (ORDER, {"n": 0}),
        (ORDER, {"n": 1}),
    ]
    t = got[0].conversation_handle
    with b.transaction() as tx:
        tx.send(t, INVOICE, {"total": 42})
    b.deliver()
    back = drain_all(a, INIT_QUEUE)
    assert [(m.message_type_name, m.json(), m.conversation_handle) for m in back] == [
        (INVOICE, {"total": 42}, h)
    ]
    with a.transaction() as tx:
        ep = tx.conversation(h)
    assert (ep.far_broker_instance, ep.state) == (net.id("b"), "CO")

    first, first_h, first_q = (a, h, INIT_QUEUE) if ender == "initiator" else (b, t, TARGET_QUEUE)
    other, other_h, other_q = (b, t, TARGET_QUEUE) if ender == "initiator" else (a, h, INIT_QUEUE)
    with first.transaction() as tx:
        if with_error:
            tx.end_conversation(first_h, error_code=50001, error_description="out of stock")
        else:
            tx.end_conversation(first_h)
    assert state(first, first_h) == ("CD" if with_error else "DO")
    first.deliver()
    assert not first.transmission_queue()
    told = drain_all(other, other_q)
    if with_error:
        assert [(m.message_type_name, m.error) for m in told] == [(ERROR, (50001, "out of stock"))]
        assert state(other, other_h) == "ER"
    else:
        assert [(m.message_type_name, m.message_body) for m in told] == [(END_DIALOG, None)]
        assert state(other, other_h) == "DI"
    assert told[0].conversation_handle == other_h

    with other.transaction() as tx:
        tx.end_conversation(other_h)
    assert state(other, other_h) == "CD"
    pump([a, b])
    assert state(first, first_h) == "CD"
    assert drain_all(first, first_q) == [], "the side that ended first got a message after END"
    assert drain_all(other, other_q) == []
    assert not a.transmission_queue() and not b.transmission_queue()


@pytest.mark.timeout(120)
def test_a_body_invalid_at_the_target_is_discarded_and_the_sender_gets_an_error(
    network: Network,
) -> None:
    """The sender's message type has no validation, the target's says JSON: the valid first
    message arrives, the invalid second one is discarded at B and A gets ERR_MESSAGE_INVALID."""
    net = network("a", "b")
    a, b = net["a"], net["b"]
    data, contract = "//t/Data", "//t/DataContract"
    for x, validation in ((a, "none"), (b, "json")):
        with x.definitions() as d:
            d.create_message_type(data, validation=validation)
            d.create_contract(contract, {data: "initiator"})
    host(a, INITIATOR, INIT_QUEUE, [contract])
    host(b, TARGET, TARGET_QUEUE, [contract])
    a.create_route("ToTarget", TARGET, None, "broker://b")
    b.create_route("ReturnRoute", INITIATOR, net.id("a"), "broker://a")
    with a.transaction() as tx:
        h = tx.begin_dialog(INITIATOR, TARGET, contract=contract, encryption=False)
        tx.send(h, data, {"ok": 1})
        tx.send(h, data, b"{this is not json")

    pump([a, b])

    at_b = drain_all(b, TARGET_QUEUE)
    # B may also be told that the dialog failed (an Error of its own); the invalid body itself
    # never reaches its queue.
    assert [
        (m.message_type_name, m.message_body) for m in at_b if m.message_type_name != ERROR
    ] == [(data, b'{"ok":1}')], [(m.message_type_name, m.message_body) for m in at_b]
    at_a = drain_all(a, INIT_QUEUE)
    assert [(m.message_type_name, m.error and m.error[0]) for m in at_a] == [
        (ERROR, ERR_MESSAGE_INVALID)
    ], [(m.message_type_name, m.message_body) for m in at_a]
    assert at_a[0].conversation_handle == h
    assert state(a, h) == "ER"
    assert not a.transmission_queue() and not b.transmission_queue()


@pytest.mark.timeout(120)
def test_a_contract_the_far_service_does_not_support_errors_at_the_sender(
    network: Network,
) -> None:
    net = network("a", "b")
    a, b = po_network(net)
    other = "//t/OtherContract"
    for x in (a, b):
        x.create_contract(other, {NOTE: "any"})
    with a.transaction() as tx:
        h = tx.begin_dialog(INITIATOR, TARGET, contract=other, encryption=False)
        tx.send(h, NOTE, "hello")

    pump([a, b])

    assert drain_all(b, TARGET_QUEUE) == []
    assert not [e for e in endpoints(b).values() if not e.is_initiator], "B made an endpoint"
    at_a = drain_all(a, INIT_QUEUE)
    assert [(m.message_type_name, m.error and m.error[0]) for m in at_a] == [
        (ERROR, ERR_CONTRACT_NOT_SUPPORTED)
    ], [(m.message_type_name, m.message_body) for m in at_a]
    assert state(a, h) == "ER"
    assert not a.transmission_queue() and not b.transmission_queue()


# -- seed 001 in delivery --


@pytest.mark.timeout(120)
def test_a_named_route_beats_auto_created_local_even_for_a_local_service(
    network: Network,
) -> None:
    """A hosts TargetService too. Without a route of its own the dialog stays local
    (AutoCreatedLocal); with route ``ToB`` naming the service (matching step 2, before the
    wildcard at step 5) the next dialog goes to B."""
    net = network("a", "b")
    a, b = net["a"], net["b"]
    host_initiator(a)
    host(a, TARGET, "local_target_q")
    host_target(b)
    b.create_route("ReturnRoute", INITIATOR, net.id("a"), "broker://a")

    [local] = send_dialogs(a, [1])
    a.deliver()
    assert [m.json() for m in drain_all(a, "local_target_q")] == [{"n": 0}]

    a.create_route("ToB", TARGET, None, "broker://b")
    [remote] = send_dialogs(a, [3])
    deliver_until_empty(a)
    assert drain_all(a, "local_target_q") == [], "the named route lost to AutoCreatedLocal"
    got = by_conversation(b, drain_all(b, TARGET_QUEUE))
    conv = conversation_ids(a, [remote])[remote]
    assert_exactly_once_in_order(got, {conv: range(3)}, "b")
    eps = endpoints(a)
    assert eps[remote].far_broker_instance == net.id("b")
    assert eps[local].far_broker_instance == net.id("a")


@pytest.mark.timeout(120)
def test_an_expired_route_is_ignored(network: Network) -> None:
    """Route ``Old`` (TargetService to C, no broker id) would win at matching step 2, but it has
    expired; route ``ToB`` (with B's id, a lifetime of an hour) is used at step 3."""
    net = network("a", "b", "c")
    a = net["a"]
    host_initiator(a)
    for name in "bc":
        host_target(net[name])
        net[name].create_route("ReturnRoute", INITIATOR, net.id("a"), "broker://a")
    with a.definitions() as d:
        d.create_route("Old", TARGET, None, "broker://c", lifetime_seconds=1)
        d.create_route("ToB", TARGET, net.id("b"), "broker://b", lifetime_seconds=3600)
    # Expire ``Old`` without sleeping through its lifetime.
    with a.engine.begin() as conn:
        conn.execute(
            update(s.route)
            .where(s.route.c.name == "Old")
            .values(expires_at=utcnow() - timedelta(hours=1))
        )
    a.invalidate_definitions()
    routes = a.catalog().routes
    assert routes["Old"].expires_at is not None and routes["Old"].expires_at < utcnow()
    assert routes["ToB"].expires_at is not None and routes["ToB"].expires_at > utcnow()

    handles = send_dialogs(a, [2, 2])
    deliver_until_empty(a)
    assert message_count(net["c"], TARGET_QUEUE) == 0, "the expired route was used"
    conv_of = conversation_ids(a, handles)
    got = by_conversation(net["b"], drain_all(net["b"], TARGET_QUEUE))
    assert_exactly_once_in_order(got, {conv_of[h]: range(2) for h in handles}, "b")


@pytest.mark.timeout(120)
def test_no_route_delays_the_message_until_a_route_exists(network: Network) -> None:
    """No route to TargetService is not an error: the messages wait in A's transmission queue
    with a reason naming the service, the dialogs stay open, and once a route exists they are
    delivered exactly once."""
    net = network("a", "b")
    a, b = net["a"], net["b"]
    host_initiator(a)
    host_target(b)
    b.create_route("ReturnRoute", INITIATOR, net.id("a"), "broker://a")
    handles = send_dialogs(a, [2, 2])

    report = a.deliver(retry_now=True)
    assert report.delivered == 0
    rows = a.transmission_queue()
    assert len(rows) == 4
    assert all(TARGET in r.transmission_status for r in rows), [r.transmission_status for r in rows]
    assert {e.state for h, e in endpoints(a).items() if h in handles} <= {"SO", "CO"}
    assert drain_all(a, INIT_QUEUE) == [], "a missing route sent an Error"
    summary = a.transmission_summary()
    assert sum(x.count for x in summary if x.to_service_name == TARGET) == 4

    a.create_route("ToB", TARGET, None, "broker://b")
    a.deliver(retry_now=True)
    assert not a.transmission_queue()
    conv_of = conversation_ids(a, handles)
    got = by_conversation(b, drain_all(b, TARGET_QUEUE))
    assert_exactly_once_in_order(got, {conv_of[h]: range(2) for h in handles}, "b")


@pytest.mark.timeout(120)
def test_a_transport_route_takes_the_address_from_the_initiator_service_name(
    network: Network,
) -> None:
    """The initiator service is named ``broker://a/po/Initiator``; B has no route to it but a
    TRANSPORT route, and B's replies reach A."""
    net = network("a", "b")
    a, b = net["a"], net["b"]
    initiator = "broker://a/po/Initiator"
    host_initiator(a, initiator)
    host_target(b)
    a.create_route("ToB", TARGET, None, "broker://b")
    b.create_route("Transport", None, None, "TRANSPORT")
    assert all(r.address in ("LOCAL", "TRANSPORT") for r in b.catalog().routes.values())

    handles = send_dialogs(a, [1, 1], from_service=initiator)
    deliver_until_empty(a)
    got = drain_all(b, TARGET_QUEUE)
    assert len(got) == 2
    reply_to_all(b, got, {"reply": 1})
    deliver_until_empty(b)
    replies = drain_all(a, INIT_QUEUE)
    assert Counter(m.conversation_handle for m in replies) == Counter(handles)
    assert {m.json()["reply"] for m in replies} == {1}


@pytest.mark.timeout(120)
def test_a_message_bearing_another_brokers_id_is_dropped_by_the_receiver(
    network: Network,
) -> None:
    """A dialog begun for C's broker id, with a route that wrongly sends it to B: B drops the
    message (no endpoint, nothing queued) and it stays in A's transmission queue with a reason.
    Once the route points at C it arrives there exactly once."""
    net = network("a", "b", "c")
    a, b, c = net["a"], net["b"], net["c"]
    host_initiator(a)
    for x in (b, c):
        host_target(x)
        x.create_route("ReturnRoute", INITIATOR, net.id("a"), "broker://a")
    cid = net.id("c")
    a.create_route("Wrong", TARGET, cid, "broker://b")
    [h] = send_dialogs(a, [2], broker_instance=cid)

    a.deliver()
    rows = a.transmission_queue()
    assert len(rows) == 2, "the message left A although only a broker with another id took it"
    assert all(r.attempts >= 1 for r in rows), [(r.attempts, r.transmission_status) for r in rows]
    assert all(
        cid in r.transmission_status or "instance" in r.transmission_status.lower() for r in rows
    ), [r.transmission_status for r in rows]
    assert message_count(b, TARGET_QUEUE) == 0
    assert endpoints(b) == {}, "B created an endpoint for a dialog meant for another broker"
    assert state(a, h) != "ER"
    assert drain_all(a, INIT_QUEUE) == []

    a.drop_route("Wrong")
    a.create_route("Right", TARGET, cid, "broker://c")
    a.deliver(retry_now=True)
    assert not a.transmission_queue()
    conv = conversation_ids(a, [h])[h]
    assert_exactly_once_in_order(
        by_conversation(c, drain_all(c, TARGET_QUEUE)), {conv: range(2)}, "c"
    )
    assert endpoints(a)[h].far_broker_instance == cid
