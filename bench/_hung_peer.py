"""``bench.delivery``'s hung-peer rounds: delivery to a healthy broker while another one hangs.

Broker A holds, in its transmission queue, messages for broker C (healthy, a database on the
same server) and for broker B, which A reaches through :class:`StallProxy`, a TCP proxy in front
of the server that can stop answering: frozen, it still takes connections and bytes but passes
nothing on either way, which is how a partition or a stopped server looks to A. Each round has
fresh clones of the three databases (A loaded untimed), and runs twice, in alternating order:

- healthy: ``A.deliver()`` in a loop until C has every message (B gets its share meanwhile, in
  its own lane); C's messages over the time;
- hung: the proxy frozen, one untimed pass meets the hang (it waits the delivery's patience for
  B once, then goes on without it); then the same loop, timed, until C has every message; C's
  messages delivered in the timed loop over its time.

``target delivery_with_hung_peer_vs_healthy: RATIO (goal >= 0.8)``: the hung rounds' median
rate to C over the healthy rounds' median. The first pass's wait (the price of telling a slow
broker from a hung one, paid once per hang) is printed apart. The answer timeout and the
patience are set short for the run (``deadlines.ANSWER_TIMEOUT`` 3 s, ``PATIENCE`` 1 s) so the
hung rounds see the whole cycle: a push left to its lane, cut at the answer timeout, the broker
passed over while hung, tried again in the background.
"""

from __future__ import annotations

import contextlib
import select
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy import make_url

from bench._scratch import Database, ScratchServer, quiesce

TARGET_NAME = "delivery_with_hung_peer_vs_healthy"
GOAL = 0.8
INITIATOR = "//bench/HungInitiator"
SERVICE_B, SERVICE_C = "//bench/HungB", "//bench/HealthyC"
QUEUE_A, QUEUE_B, QUEUE_C = "bench_hung_a_q", "bench_hung_b_q", "bench_hung_c_q"
BODY = (b"bench-hung-peer:" + bytes(range(32, 127)) * 3)[:200]
ANSWER_TIMEOUT, PATIENCE = 3.0, 1.0


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class StallProxy:
    """A TCP proxy to ``host``:``port`` on a free local port; :meth:`freeze` stops it passing
    anything on (connections are still taken, bytes still read into its buffers)."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.passing = threading.Event()
        self.passing.set()
        self.closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="stall-proxy", daemon=True).start()

    def freeze(self) -> None:
        self.passing.clear()

    def thaw(self) -> None:
        self.passing.set()

    def close(self) -> None:
        self.closed.set()
        self.passing.set()
        for s in [self.listener, *self._sockets]:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self._sockets.append(client)
        self.passing.wait()  # frozen: the connection is taken, and never answered
        try:
            server = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        self._sockets.append(server)
        for src, dst in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self.closed.is_set():
                ready, _, _ = select.select([src], [], [], 0.5)
                if not ready:
                    continue
                data = src.recv(65536)
                self.passing.wait()  # read while frozen: held until a thaw
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


@dataclass
class HungResults:
    healthy: list[float] = field(default_factory=list)
    hung: list[float] = field(default_factory=list)
    onset: list[float] = field(default_factory=list)

    def lines(self) -> list[str]:
        if not self.healthy or not self.hung:
            return []
        healthy, hung = statistics.median(self.healthy), statistics.median(self.hung)
        return [
            f"info hung_peer: to the healthy broker {healthy:,.0f} msgs/s with every broker "
            f"healthy, {hung:,.0f} msgs/s while another hangs (medians of "
            f"{len(self.healthy)} rounds); the pass that met the hang took "
            f"{statistics.median(self.onset):.2f} s (patience {PATIENCE:g} s)",
            f"target {TARGET_NAME}: {hung / healthy:.2f} (goal >= {GOAL})",
        ]


def _host(broker: Any, service: str, queue: str) -> None:
    from airflow_broker import DEFAULT

    with broker.definitions() as d:
        d.create_queue(queue)
        d.create_service(service, queue=queue, contracts=[DEFAULT])


class HungPeerRounds:
    """Templates of A (loaded), B and C; :meth:`run_round` clones and measures them."""

    def __init__(self, server: ScratchServer, c_dialogs: int, b_dialogs: int, messages: int):
        from airflow_broker import Broker

        self.server = server
        self.messages = messages
        self.c_messages = c_dialogs * messages
        self.templates: dict[str, str] = {}

        def install(db: Database) -> None:
            broker = Broker.connect(db.sqlalchemy_url)
            try:
                broker.migrate()
            finally:
                broker.dispose()

        for name in ("a", "b", "c"):
            self.templates[name] = server.template(f"hung_{name}", install)
        brokers = {
            n: Broker.connect(server_db(server, self.templates[n]).sqlalchemy_url) for n in "abc"
        }
        try:
            _host(brokers["a"], INITIATOR, QUEUE_A)
            _host(brokers["b"], SERVICE_B, QUEUE_B)
            _host(brokers["c"], SERVICE_C, QUEUE_C)
            with brokers["a"].definitions() as d:
                d.create_route("bench_to_b", service_name=SERVICE_B, address="broker://b")
                d.create_route("bench_to_c", service_name=SERVICE_C, address="broker://c")
            a = brokers["a"]
            for service, dialogs in ((SERVICE_C, c_dialogs), (SERVICE_B, b_dialogs)):
                for first in range(0, dialogs, 250):
                    with a.transaction() as tx:
                        handles = [
                            tx.begin_dialog(INITIATOR, service, encryption=False)
                            for _ in range(min(250, dialogs - first))
                        ]
                        for _ in range(messages):
                            tx.send(handles, body=BODY)
        finally:
            for b in brokers.values():
                b.dispose()

    def run_round(self, index: int, hung: bool, results: HungResults) -> None:
        from airflow_broker import Broker
        from airflow_broker.transport import deadlines, lanes
        from airflow_broker.transport.resolve import close_peers

        kind = "hung" if hung else "healthy"
        dbs = {n: self.server.create(self.templates[n], "hung", n, kind, str(index)) for n in "abc"}
        quiesce(*dbs.values())
        url = make_url(dbs["b"].sqlalchemy_url)
        proxy = StallProxy(url.host or "127.0.0.1", url.port or 5432)
        resolver = {
            "b": url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False),
            "c": dbs["c"].sqlalchemy_url,
        }
        saved = deadlines.ANSWER_TIMEOUT, deadlines.PATIENCE
        deadlines.ANSWER_TIMEOUT, deadlines.PATIENCE = ANSWER_TIMEOUT, PATIENCE
        a = Broker.connect(dbs["a"].sqlalchemy_url, resolver=resolver)
        for db in dbs.values():
            # A clone carries its template's identity and would be refused as a copy
            # (airflow_broker.storage.identity): each round's clone is that broker, moved.
            clone = Broker.connect(db.sqlalchemy_url)
            try:
                clone.reset_identity("keep")
            finally:
                clone.dispose()
        try:
            if hung:
                proxy.freeze()
                started = time.perf_counter()
                a.deliver(max_messages=2_000)
                results.onset.append(time.perf_counter() - started)
            left = _for_c(dbs["a"])
            started = time.perf_counter()
            passes = 0
            while _for_c(dbs["a"]):
                report = a.deliver()
                passes += 1
                if time.perf_counter() - started > 300:
                    raise SystemExit(f"hung-peer round {kind}: C's messages did not all go "
                                     f"in 300 s (last pass: {report})")  # fmt: skip
            seconds = time.perf_counter() - started
            got = _count(dbs["c"], "SELECT count(*) FROM broker_message")
            if got != self.c_messages:
                raise SystemExit(f"C holds {got} messages, {self.c_messages} were sent")
            rate = left / seconds
            (results.hung if hung else results.healthy).append(rate)
            _say(f"  hung-peer round {index} {kind}: {left} to C in {seconds:.2f}s "
                 f"({rate:,.0f} msgs/s, {passes} passes)")  # fmt: skip
        finally:
            proxy.thaw()
            # B's lane finishes what it started (a push cut, recorded late) before A goes.
            lane = lanes.lane(a, "broker://b")
            until = time.monotonic() + ANSWER_TIMEOUT + 5
            while lane.busy() is not None and time.monotonic() < until:
                time.sleep(0.1)
            deadlines.ANSWER_TIMEOUT, deadlines.PATIENCE = saved
            a.dispose()
            close_peers()
            proxy.close()
            for db in dbs.values():
                self.server.drop(db)


def server_db(server: ScratchServer, name: str) -> Database:
    from bench._scratch import database

    return database(name, server.url)


def _count(db: Database, query: str) -> int:
    with psycopg.connect(db.conninfo) as conn:
        row = conn.execute(query).fetchone()
        return int(row[0]) if row else 0


def _for_c(db: Database) -> int:
    return _count(
        db,
        f"SELECT count(*) FROM broker_transmission_queue WHERE to_service_name = '{SERVICE_C}'",
    )


def run(
    server: ScratchServer, rounds: int, c_dialogs: int, b_dialogs: int, messages: int
) -> list[str]:
    """The hung-peer rounds; returns the lines to print (none for no rounds)."""
    if rounds < 1:
        return []
    started = time.perf_counter()
    setup = HungPeerRounds(server, c_dialogs, b_dialogs, messages)
    _say(f"  hung-peer: loaded A ({c_dialogs} dialogs to C, {b_dialogs} to B, x{messages}) in "
         f"{time.perf_counter() - started:.0f}s")  # fmt: skip
    results = HungResults()
    for index in range(rounds):
        order = (False, True) if index % 2 == 0 else (True, False)
        for hung in order:
            setup.run_round(index, hung, results)
    return results.lines()


__all__ = ["TARGET_NAME", "HungPeerRounds", "StallProxy", "run"]
