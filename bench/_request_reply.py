"""Request and reply between two broker databases, against the same exchange inside one.

Part of ``python -m bench.delivery`` (also runs alone: ``python -m bench._request_reply``).
Service Broker's everyday pattern: a service asks another, one message per transaction, and
waits for the answer. Each exchange, timed from the request's SEND to the reply's RECEIVE:

1. the requester SENDs the request (a transaction of its own: ``Broker.send``);
2. two brokers only: a delivery pass of the requester's broker (``deliver()``);
3. the responder RECEIVEs it and SENDs the reply, in one transaction;
4. two brokers only: a delivery pass of the responder's broker;
5. the requester RECEIVEs the reply.

The dialogs are begun and answered once before the clock starts, so every exchange is on a
known dialog (each side knows the other's broker instance); the exchanges go round robin over
them. The delivery passes are the ones a transmitter run makes; the time a transmitter takes to
be woken is not in it (``bench.transmit`` measures that). ``target
request_reply_two_brokers_vs_one: RATIO (goal >= 0.5)`` is exchanges a second between two
broker databases over exchanges a second inside one database, medians of alternating rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bench._scratch import Database, ScratchServer, run_part

if TYPE_CHECKING:
    from airflow_broker import Broker

ASKER, ASKER_QUEUE = "//bench/Asker", "bench_asker_q"
ANSWERER, ANSWERER_QUEUE = "//bench/Answerer", "bench_answerer_q"
BODY = {"order": 1, "lines": ["x" * 40] * 3}


class Pair:
    """The requester's and the responder's brokers: one database, or two with routes."""

    def __init__(self, server: ScratchServer, two: bool, dialogs: int) -> None:
        from airflow_broker import DEFAULT, Broker

        self.server = server
        self.two = two
        tpl = server.template("request-reply", lambda db: _migrate(db))
        first = server.create(tpl, "rr", "two" if two else "one", "a")
        self.dbs: list[Database] = [first]
        if two:
            second = server.create(tpl, "rr", "two", "b")
            self.dbs.append(second)
        resolver = {"a": self.dbs[0].sqlalchemy_url, "b": self.dbs[-1].sqlalchemy_url}
        self.asker = Broker.connect(self.dbs[0].sqlalchemy_url, resolver=resolver)
        self.answerer = (
            Broker.connect(self.dbs[1].sqlalchemy_url, resolver=resolver) if two else self.asker
        )
        if two:  # clones of one template: each becomes a broker of its own
            self.asker.reset_identity("new_broker")
            self.answerer.reset_identity("new_broker")
        with self.answerer.definitions() as d:
            d.create_queue(ANSWERER_QUEUE)
            d.create_service(ANSWERER, queue=ANSWERER_QUEUE, contracts=[DEFAULT])
            if two:
                d.create_route("to_asker", service_name=ASKER, address="broker://a")
        with self.asker.definitions() as d:
            d.create_queue(ASKER_QUEUE)
            d.create_service(ASKER, queue=ASKER_QUEUE, contracts=[DEFAULT])
            if two:
                d.create_route("to_answerer", service_name=ANSWERER, address="broker://b")
        with self.asker.transaction() as tx:
            self.handles = [
                tx.begin_dialog(ASKER, ANSWERER, encryption=False) for _ in range(dialogs)
            ]
        for h in self.handles:  # one exchange each, untimed: both sides know each other
            self.exchange(h)

    def _pass(self, broker: Broker) -> None:
        if self.two:
            broker.deliver()

    def exchange(self, handle: Any) -> None:
        """One request and its reply on ``handle``."""
        self.asker.send(handle, body=BODY)
        self._pass(self.asker)
        for _ in range(50):
            with self.answerer.transaction() as tx:
                got = tx.receive(ANSWERER_QUEUE, top=1)
                for m in got:
                    tx.send(m.conversation_handle, body={"ok": True})
            if got:
                break
            self._pass(self.asker)
        else:
            raise RuntimeError("the request never reached the responder")
        self._pass(self.answerer)
        for _ in range(50):
            with self.asker.transaction() as tx:
                if tx.receive(ASKER_QUEUE, top=1):
                    return
            self._pass(self.answerer)
        raise RuntimeError("the reply never came back")

    def round(self, exchanges: int) -> float:
        """Exchanges a second over ``exchanges`` exchanges, round robin over the dialogs."""
        started = time.perf_counter()
        for i in range(exchanges):
            self.exchange(self.handles[i % len(self.handles)])
        return exchanges / (time.perf_counter() - started)

    def close(self) -> None:
        self.asker.dispose()
        if self.two:
            self.answerer.dispose()
        for db in self.dbs:
            self.server.drop(db)


def _migrate(db: Database) -> None:
    from airflow_broker import Broker

    b = Broker.connect(db.sqlalchemy_url)
    try:
        b.migrate()
    finally:
        b.dispose()


def measure(server: ScratchServer, exchanges: int = 300, rounds: int = 3) -> list[str]:
    """The lines ``bench.delivery`` prints for this part."""
    rates: dict[bool, list[float]] = {False: [], True: []}
    pairs = {two: Pair(server, two, dialogs=20) for two in (False, True)}
    try:
        for r in range(rounds):
            for two in (False, True) if r % 2 == 0 else (True, False):
                rates[two].append(pairs[two].round(exchanges))
    finally:
        for pair in pairs.values():
            pair.close()
    one, two = statistics.median(rates[False]), statistics.median(rates[True])
    return [
        f"info request_reply: {one:,.0f} exchanges/s inside one broker database, {two:,.0f} "
        f"between two (a request and its reply, one message per transaction, delivery passes "
        f"included; {exchanges} exchanges a round, {rounds} rounds)",
        f"target request_reply_two_brokers_vs_one: {two / one:.2f} (goal >= 0.5)",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench._request_reply", description=__doc__)
    p.add_argument("--exchanges", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--url", default=None)
    args = p.parse_args(argv)
    return run_part(args.url, lambda server: measure(server, args.exchanges, args.rounds))


if __name__ == "__main__":
    raise SystemExit(main())
