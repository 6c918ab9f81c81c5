"""Delivery on dialogs the far broker knows: the one-statement accept against the general one.

Part of ``python -m bench.delivery`` (also runs alone: ``python -m bench._known_dialogs``).
``bench.delivery``'s main rounds deliver new dialogs (the far broker creates their endpoints);
a long-lived deployment mostly delivers more messages on dialogs both sides know. Those the
far broker takes with ``broker_accept_plain``, one statement that commits on its own, where the
general accept (``transport/direct.py``'s ``_Accept``) takes them with a COPY among seven
round trips. Both are measured here on the same pair of broker databases, alternating:

- each round SENDs ``--messages`` messages on each of ``--dialogs`` known dialogs (untimed,
  one transaction per message number), then times ``deliver()`` passes until the sender's
  transmission queue is empty (the far queue is drained afterwards, untimed);
- ``general``: the same with the one-statement accept turned off
  (``transport.direct._accept_known`` answers None), so every conversation goes the general way;
- ``packets`` (an info line): every conversation pushed as packets, as a forwarder, an inbox or
  a SQLite sender delivers them, and taken by the one-statement accept at the far broker.

``target known_dialogs_one_statement_vs_general: RATIO (goal >= 1.0)`` is messages a second
delivered the one-statement way over the general way, medians of the rounds: the short path
for small passes must not cost the big ones.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench._request_reply import ANSWERER_QUEUE, Pair
from bench._scratch import ScratchServer, run_part

BODY = {"order": 7, "lines": ["y" * 40] * 4}


#: How a round delivers: the one-statement accept without packets, the general accept without
#: packets, or packets (as a forwarder, an inbox or a SQLite sender delivers) taken by the
#: one-statement accept at the far broker.
ONE_STATEMENT, GENERAL, PACKETS = "one-statement", "general", "packets"
MODES = (ONE_STATEMENT, GENERAL, PACKETS)


def _round(pair: Pair, messages: int, mode: str) -> float:
    """Messages a second of one round's delivery passes."""
    from airflow_broker.transport import Transport, direct

    for k in range(messages):
        with pair.asker.transaction() as tx:
            tx.send(list(pair.handles), body={**BODY, "k": k})
    total = messages * len(pair.handles)
    accept_known, send_direct = direct._accept_known, Transport._send_direct
    if mode == GENERAL:
        direct._accept_known = lambda *_args: None  # type: ignore[assignment]
    elif mode == PACKETS:
        Transport._send_direct = lambda _self, _address, conversations, _plan: conversations  # type: ignore[method-assign,assignment]
    try:
        started = time.perf_counter()
        moved = 0
        while pair.asker.transmission_queue(limit=1):
            moved += pair.asker.deliver().delivered
        took = time.perf_counter() - started
    finally:
        direct._accept_known = accept_known
        Transport._send_direct = send_direct  # type: ignore[method-assign]
    if moved != total:
        raise RuntimeError(f"delivered {moved} of {total} messages")
    got = 0
    while True:
        with pair.answerer.transaction() as tx:
            n = len(tx.receive(ANSWERER_QUEUE, top=1000))
        if not n:
            break
        got += n
    if got != total:
        raise RuntimeError(f"the far queue holds {got} of {total} messages")
    return total / took


def measure(
    server: ScratchServer, dialogs: int = 500, messages: int = 10, rounds: int = 5
) -> list[str]:
    """The lines ``bench.delivery`` prints for this part."""
    pair = Pair(server, True, dialogs=dialogs)
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                rates[mode].append(_round(pair, messages, mode))
    finally:
        pair.close()
    one, general, packets = (statistics.median(rates[mode]) for mode in MODES)
    return [
        f"info known_dialogs: {one:,.0f} msgs/s delivered the one-statement way, {general:,.0f} "
        f"the general way, {packets:,.0f} as packets taken the one-statement way ({dialogs} "
        f"known dialogs x {messages} messages a round, {rounds} rounds)",
        f"target known_dialogs_one_statement_vs_general: {one / general:.2f} (goal >= 1.0)",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench._known_dialogs", description=__doc__)
    p.add_argument("--dialogs", type=int, default=500)
    p.add_argument("--messages", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--url", default=None)
    args: Any = p.parse_args(argv)
    return run_part(
        args.url, lambda server: measure(server, args.dialogs, args.messages, args.rounds)
    )


if __name__ == "__main__":
    raise SystemExit(main())
