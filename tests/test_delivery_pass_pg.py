"""A delivery pass that moves a few messages between two PostgreSQL brokers is a few round trips.

Request and reply between broker databases moves one message at a time, so what a pass costs
beyond its messages decides that pattern's speed. Counted here, per database, at the level of
the wire: every query sent through :mod:`airflow_broker.storage.direct`, every statement
through SQLAlchemy (with the BEGIN and COMMIT psycopg sends for it) and the pool's pings.

- the far broker takes known dialogs in clear with one statement that commits on its own
  (``broker_accept_plain``), after the ping of the pooled connection; what it cannot take that
  way goes the general way, in the same pass;
- a pass with nothing to do is one statement; one that delivers a message, three at the
  sender;
- a peer's pooled connection broken while idle is replaced before use.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import transport_procs as tp
from sqlalchemy import event, text
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import Engine

from airflow_broker import Broker
from airflow_broker.constants import END_DIALOG
from airflow_broker.storage import direct
from airflow_broker.storage.accept_function import ACCEPT_PLAIN, DROP_ACCEPT_PLAIN_FUNCTION
from airflow_broker.storage.clock import utcnow
from airflow_broker.transport import direct as direct_delivery

#: libpq's PQTRANS_IDLE
_IDLE = 0

pytestmark = [pytest.mark.postgres, pytest.mark.parametrize("new_db", ["postgres"], indirect=True)]


class Wire:
    """What each database is sent while counting: (database, query) pairs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[str, str]] = []
        self.on = False
        sent = direct._sent

        def counting(conn: Any, raw: Any, query: bytes, send: Callable[[Any], None]) -> Any:
            if self.on:
                self.seen.append((raw.info.dbname, query.decode(errors="replace")))
            return sent(conn, raw, query, send)

        monkeypatch.setattr(direct, "_sent", counting)
        ping = PGDialect_psycopg.do_ping

        def pinging(dialect: Any, dbapi_conn: Any) -> bool:
            if self.on:
                self.seen.append((dbapi_conn.info.dbname, "ping"))
            return bool(ping(dialect, dbapi_conn))

        monkeypatch.setattr(PGDialect_psycopg, "do_ping", pinging)
        self._listeners = [
            ("before_cursor_execute", self._statement),
            ("commit", self._commit),
        ]
        for name, fn in self._listeners:
            event.listen(Engine, name, fn)

    @staticmethod
    def _in_transaction(conn: Any) -> bool:
        return bool(conn.connection.driver_connection.pgconn.transaction_status != _IDLE)

    def _statement(self, conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if not self._in_transaction(conn):
            self._mark(conn, "BEGIN")  # psycopg sends it on its own first, and waits for it
        self._mark(conn, statement)

    def _commit(self, conn: Any) -> None:
        if self._in_transaction(conn):  # (after storage.direct's COMMIT, psycopg sends none)
            self._mark(conn, "COMMIT")

    def _mark(self, conn: Any, what: str) -> None:
        if self.on:
            self.seen.append((conn.engine.url.database, what))

    def remove(self) -> None:
        for name, fn in self._listeners:
            event.remove(Engine, name, fn)

    def at(self, broker: Broker) -> list[str]:
        name = broker.engine.url.database
        return [q for db, q in self.seen if db == name]

    def __enter__(self) -> Wire:
        self.seen.clear()
        self.on = True
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.on = False


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Iterator[Wire]:
    w = Wire(monkeypatch)
    try:
        yield w
    finally:
        w.remove()


@pytest.fixture
def pair(network: Callable[..., tp.Net], monkeypatch: pytest.MonkeyPatch) -> Iterator[tp.Net]:
    """``a`` (initiator) and ``b`` (target), routes both ways; definitions and the identity
    status read once (not once a second), so that the counts are the pass's own."""
    from airflow_broker.storage import context

    monkeypatch.setattr(context, "DEFINITION_CACHE_SECONDS", 3600.0)
    net = network("a", "b")
    tp.two_way(net)
    yield net


def known_dialogs(net: tp.Net, n: int) -> list[uuid.UUID]:
    """``n`` dialogs a -> b whose first message b has (each side knows the other's instance)."""
    handles = tp.send_dialogs(net["a"], [1] * n)
    tp.deliver_until_empty(net["a"])
    assert len(tp.drain_all(net["b"], tp.TARGET_QUEUE)) == n
    net["a"].deliver()  # warm: the statements of a pass prepared on the pool's connections
    return handles


def test_known_dialogs_cost_the_far_broker_one_statement(pair: tp.Net, wire: Wire) -> None:
    a, b = pair["a"], pair["b"]
    handles = known_dialogs(pair, 3)
    tp.send_more(a, handles, 1, 2)
    with wire:
        report = a.deliver()
    assert report.delivered == 6
    far = wire.at(b)
    assert len(far) == 2 and far[0] == "ping", far
    assert ACCEPT_PLAIN.name in far[1]  # prepared on that connection already, or with it
    # The survey; the batch's rows, with BEGIN; their DELETE, with the COMMIT.
    near = wire.at(a)
    assert len(near) == 3, near
    assert near[-1].endswith("COMMIT") and "DELETE FROM broker_transmission_queue" in near[-1]
    assert not a.transmission_queue()
    got = tp.drain_all(b, tp.TARGET_QUEUE)
    by_conversation = tp.by_conversation(b, got)
    assert sorted(len(ms) for ms in by_conversation.values()) == [2, 2, 2]
    for ms in by_conversation.values():
        assert [m.json()["n"] for m in ms] == [1, 2]


def test_a_pass_with_nothing_to_do_is_one_statement(pair: tp.Net, wire: Wire) -> None:
    a = pair["a"]
    known_dialogs(pair, 1)
    with wire:
        report = a.deliver()
    assert report.delivered == 0
    assert len(wire.seen) == 1, wire.seen


def test_the_one_statement_accept_takes_a_message_once(pair: tp.Net) -> None:
    """The same messages offered twice (a sender that died before it recorded the answer):
    the second call answers the same number and queues nothing."""
    a, b = pair["a"], pair["b"]
    [handle] = known_dialogs(pair, 1)
    conversation_id = tp.conversation_ids(a, [handle])[handle]
    args = [
        a.instance_id,
        b.instance_id,
        [conversation_id],
        [True],
        ["DEFAULT"],
        [1],
        [2],
        [1, 1],
        [1, 2],
        ["DEFAULT", "DEFAULT"],
        [b"one", b"two"],
        utcnow(),
    ]
    answers = []
    for _ in range(2):
        fairy = b.engine.raw_connection()
        try:
            answers.append(direct.execute_committed(fairy, b.engine, ACCEPT_PLAIN, args))
        finally:
            fairy.close()
    assert answers[0] == [(conversation_id, True, 3, 2)]
    assert answers[1] == [(conversation_id, True, 3, 0)]
    got = tp.drain_all(b, tp.TARGET_QUEUE)
    assert [m.message_body for m in got] == [b"one", b"two"]


def test_what_one_statement_cannot_take_goes_the_general_way_in_the_same_pass(
    pair: tp.Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three dialogs in one pass: a known one with a plain message (the one statement), a known
    one ended (EndDialog is a system message: the general accept), and a new one (no endpoint at
    b yet: the general accept). All arrive, once each, in order."""
    a, b = pair["a"], pair["b"]
    plain, ended = known_dialogs(pair, 2)
    taken: list[set[uuid.UUID]] = []
    accept_known = direct_delivery._accept_known

    def watching(*args: Any) -> Any:
        result = accept_known(*args)
        taken.append(set() if result is None else set(result.upto))
        return result

    monkeypatch.setattr(direct_delivery, "_accept_known", watching)
    tp.send_more(a, [plain, ended], 1, 1)
    with a.transaction() as tx:
        tx.end_conversation(ended)
    [new] = tp.send_dialogs(a, [2])
    report = a.deliver()
    assert report.delivered == 5, report
    assert taken == [{plain}]
    got = tp.by_conversation(b, tp.drain_all(b, tp.TARGET_QUEUE))
    kinds = sorted(
        [m.message_type_name if m.message_type_name == END_DIALOG else m.json()["n"] for m in ms]
        for ms in got.values()
    )
    assert kinds == sorted([[1], [1, END_DIALOG], [0, 1]]), kinds
    assert got[tp.conversation_ids(a, [new])[new]] and len(got) == 3


def test_a_far_broker_without_the_function_takes_deliveries_the_general_way(
    pair: tp.Net, wire: Wire
) -> None:
    """A far broker not yet upgraded (no broker_accept_plain): the pass delivers the general
    way, and the next passes do not ask again."""
    a, b = pair["a"], pair["b"]
    handles = known_dialogs(pair, 2)
    with b.engine.begin() as conn:
        conn.execute(text(DROP_ACCEPT_PLAIN_FUNCTION))
    for k in (1, 2):
        tp.send_more(a, handles, k, 1)
        with wire:
            report = a.deliver()
        assert report.delivered == 2, report
        asked = [q for q in wire.at(b) if ACCEPT_PLAIN.name in q]
        assert len(asked) == (1 if k == 1 else 0), wire.at(b)
    got = tp.by_conversation(b, tp.drain_all(b, tp.TARGET_QUEUE))
    assert [[m.json()["n"] for m in ms] for ms in got.values()] == [[1, 2], [1, 2]]


def test_a_peer_connection_broken_while_idle_is_replaced_before_use(
    pair: tp.Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's server ends every connection to it while A's pool holds them idle: the next pass
    finds that out before it uses one (the pool's ping), connects again, and B takes the
    messages in one statement, each once."""
    a, b = pair["a"], pair["b"]
    handles = known_dialogs(pair, 2)
    outcomes: list[str] = []
    accept_known = direct_delivery._accept_known

    def watching(*args: Any) -> Any:
        try:
            result = accept_known(*args)
        except Exception as exc:
            outcomes.append(type(exc).__name__)
            raise
        outcomes.append("taken" if result is not None and len(result.upto) == 2 else "not")
        return result

    monkeypatch.setattr(direct_delivery, "_accept_known", watching)
    with b.engine.connect() as conn:
        ended = conn.execute(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        ).scalar()
    assert ended, "A's pool held no connection to B (test premise)"
    b.engine.dispose()  # B's own pool: its connections ended too
    tp.send_more(a, handles, 1, 1)
    report = a.deliver()
    assert report.delivered == 2, report
    assert not a.transmission_queue()
    assert outcomes == ["taken"], outcomes
    got = tp.by_conversation(b, tp.drain_all(b, tp.TARGET_QUEUE))
    assert [[m.json()["n"] for m in ms] for ms in got.values()] == [[1], [1]]


def test_messages_through_a_forwarder_are_taken_in_one_statement_both_ways(
    network: Callable[..., tp.Net], wire: Wire
) -> None:
    """A reaches B only through the forwarder G. Packets on known dialogs, which G passes on,
    are taken by B (and the replies by A) with the one-statement accept; each arrives once, in
    order, and is acknowledged back through G."""
    net = network("a", "g", "b")
    a, g, b = net["a"], net["g"], net["b"]
    aid, bid = net.id("a"), net.id("b")
    tp.host_initiator(a)
    tp.host_target(b)
    a.create_route("ViaG", tp.TARGET, bid, "broker://g")
    b.create_route("BackViaG", tp.INITIATOR, aid, "broker://g")
    with g.definitions() as d:
        d.create_route("ToB", tp.TARGET, bid, "broker://b")
        d.create_route("ToA", tp.INITIATOR, aid, "broker://a")
        d.configure(forwarding=True)
    handles = tp.send_dialogs(a, [1] * 3)
    tp.deliver_until_empty(a)
    first = tp.drain_all(b, tp.TARGET_QUEUE)
    assert len(first) == 3
    tp.send_more(a, handles, 1, 2)
    with wire:
        report = a.deliver()
    assert report.delivered == 6, report
    assert not a.transmission_queue() and not g.in_transit()
    assert sum(ACCEPT_PLAIN.name in q for q in wire.at(b)) == 1, wire.at(b)
    got = tp.by_conversation(b, tp.drain_all(b, tp.TARGET_QUEUE))
    assert [[m.json()["n"] for m in ms] for ms in got.values()] == [[1, 2]] * 3
    # The replies, back through G.
    tp.reply_to_all(b, first, {"reply": 1})
    with wire:
        b.deliver()
    assert sum(ACCEPT_PLAIN.name in q for q in wire.at(a)) == 1, wire.at(a)
    assert not b.transmission_queue()
    replies = tp.drain_all(a, tp.INIT_QUEUE)
    assert sorted(m.conversation_handle for m in replies) == sorted(handles)
