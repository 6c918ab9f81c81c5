"""What the pushes of a delivery batch brought back, read for recording (the batch's own
transaction, or a late one for a destination that answered after the pass went on)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import airflow_broker.transport.direct as direct
import airflow_broker.transport.inbox as inbox
from airflow_broker.transport.packets import _UNREACHABLE, HELD, Outcome, Packet

#: why a row a push left waiting waits: no far broker took it (else HELD or DROPPED, its note)
UNREACHABLE = "unreachable"


@dataclass(slots=True)
class Sent:
    """What one destination's share of a batch brought back (:meth:`.Transport._send_to`)."""

    #: what the far broker took without packets
    taken: list[direct.Taken]
    #: bodies sealed for the packets (kept sealed in the transmission queue)
    seal_now: list[dict[str, Any]]
    #: each push of packets: the packets, the outcome (None: no broker took them), failures
    results: list[tuple[list[Packet], Outcome | None, str]]


def outcomes(
    results: list[tuple[list[Packet], Outcome | None, str]],
    plan: dict[str, Any],
    counts: dict[str, int],
) -> tuple[list[Packet], list[inbox.Note], list[tuple[Any, str, str]], set[int]]:
    """The pushes' outcomes: the answers for this broker and its relays, notes on earlier
    batches, the rows that wait (with why, and :data:`UNREACHABLE`, HELD or DROPPED), and which
    of those went through an inbox."""
    me = plan["me"]
    answers: list[Packet] = []
    late: list[inbox.Note] = []
    waiting: list[tuple[Any, str, str]] = []
    inboxed: set[int] = set()
    for batch, outcome, failure in results:
        if outcome is None:
            counts[_UNREACHABLE] += len(batch)  # the broker.transport_failed metric
            rows = plan["packet_rows"]
            waiting += [(rows[(p.conversation_id, p.seq)], failure, UNREACHABLE) for p in batch]
            continue
        answered = {
            (a.conversation_id, a.seq) for a in outcome.answers if a.to_broker_instance == me
        }
        for j, p in enumerate(batch):
            if (p.conversation_id, p.seq) in answered:
                continue
            kind, reason = outcome.notes.get(
                j, (HELD, "sent; waiting for the final destination's acknowledgment")
            )
            row = plan["packet_rows"][(p.conversation_id, p.seq)]
            if outcome.inbox:
                inboxed.add(row.id)
            waiting.append((row, reason, kind))
        answers += outcome.answers
        late += outcome.late_notes
    return answers, late, waiting, inboxed


__all__ = ["UNREACHABLE", "Sent", "outcomes"]
