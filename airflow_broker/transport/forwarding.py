"""Forwarding (seed 002): passing messages on to the next hop, and holding what cannot go yet.

A forwarder never acknowledges anything itself; what it cannot pass on is held in non-durable
storage (an UNLOGGED table on PostgreSQL, process memory on SQLite) for its own delivery pass.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import insert, select

from airflow_broker import routing
from airflow_broker.constants import (
    ERR_HOPS_EXCEEDED,
    ERR_LIFETIME_EXPIRED,
)
from airflow_broker.messaging.delivery import RETRY_BASE
from airflow_broker.messaging.objects import TransitRow
from airflow_broker.routing.routes import routes_of
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow
from airflow_broker.storage.context import BrokerContext
from airflow_broker.transport.packets import (
    DROPPED,
    HELD,
    MESSAGE,
    NOTICE,
    Outcome,
    Packet,
    Push,
    _Settings,
)

log = logging.getLogger("airflow_broker")


_memory_transit: dict[str, list[dict[str, Any]]] = defaultdict(list)


_memory_lock = threading.Lock()


_memory_ids = itertools.count(1)


class Forwarder:
    """A forwarding broker passing on packets it is not the destination of."""

    def __init__(self, broker: BrokerContext, settings: _Settings, push: Push) -> None:
        self.b = broker
        self.settings = settings
        #: passes a batch on to the first reachable of some addresses (the outbound pass's
        #: :meth:`~airflow_broker.transport.outbound.Transport.push_any`)
        self.push = push

    def forward(
        self, packets: Sequence[Packet], indexes: list[int], out: Outcome, depth: int
    ) -> None:
        now = utcnow()
        with self.b.engine.connect() as conn:
            routes = routes_of(self.b, conn)
        groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
        onward: dict[int, Packet] = {}
        held_as: dict[int, Packet] = {}
        for i in indexes:
            p = packets[i]
            reason = self._discard_reason(p, now)
            if reason is not None:
                out.discarded += 1
                out.notes[i] = (DROPPED, reason)
                log.warning(
                    "forwarder %s discarded %s: %s", self.settings.instance_id, p.describe(), reason
                )
                if p.kind == MESSAGE:
                    code = ERR_HOPS_EXCEEDED if "hops" in reason else ERR_LIFETIME_EXPIRED
                    out.answers.append(p.answer(NOTICE, self.settings.instance_id, code, reason))
                continue
            decision = routing.route_conversation(
                routes,
                p.to_service,
                p.to_broker_instance,
                dialog_id=p.conversation_id,
                now=now,
                local_services=[],
            )
            if decision.kind != "remote":
                out.discarded += 1
                out.notes[i] = (
                    DROPPED,
                    f"forwarder {self.settings.instance_id} has no route for {p.to_service!r}: "
                    f"{decision.reason}",
                )
                continue
            held_as[i] = p
            onward[i] = p._replace(
                hops=p.hops + 1,
                to_broker_instance=p.to_broker_instance or decision.broker_instance,
            )
            groups[decision.addresses].append(i)
        for addresses, idx in groups.items():
            batch = [onward[i] for i in idx]
            result, failures = self.push(addresses, batch, depth + 1)
            if result is None:
                reason = "; ".join(failures)
                # Held as it arrived: the hop is counted again when it is passed on.
                hold(self.b, [held_as[i] for i in idx], now, f"next hop unreachable: {reason}")
                for i in idx:
                    out.notes[i] = (HELD, f"held in transit by a forwarder: {reason}")
                continue
            out.forwarded += sum(1 for p in batch if p.kind == MESSAGE)
            out.discarded += result.discarded
            out.answers.extend(result.answers)
            out.late_notes.extend(result.late_notes)
            for j, note in result.notes.items():
                out.notes[idx[j]] = note

    def _discard_reason(self, p: Packet, now: datetime) -> str | None:
        if routing.hops_exceeded(p.hops):
            return (
                f"{p.describe()} was forwarded {p.hops} times (more than {routing.MAX_HOPS} hops): "
                "a routing loop?"
            )
        if routing.lifetime_over(aware(p.lifetime), now):
            return f"{p.describe()} outlived its conversation's lifetime in transit"
        return None


def hold(broker: BrokerContext, packets: Sequence[Packet], now: datetime, reason: str) -> None:
    """Keep packets a forwarder cannot pass on yet (non-durable)."""
    rows = [
        {
            "kind": p.kind,
            "conversation_id": p.conversation_id,
            "from_initiator": p.from_initiator,
            "from_service_name": p.from_service,
            "from_broker_instance": p.from_broker_instance,
            "to_service_name": p.to_service,
            "to_broker_instance": p.to_broker_instance,
            "service_contract_name": p.contract,
            "message_type_name": p.message_type,
            "message_sequence_number": p.seq,
            "validation": p.validation,
            "message_body": p.body,
            "lifetime": p.lifetime,
            "hops": p.hops,
            "error_code": p.error_code,
            "error_description": p.error_description,
            "sealed": p.sealed or None,
            "handshake": p.handshake,
            "enqueued_at": now,
            "transmission_status": reason,
            "attempts": 1,
            "next_attempt_at": now + RETRY_BASE,
        }
        for p in packets
    ]
    if broker.dialect == "postgresql":
        with broker.engine.begin() as conn:
            conn.execute(insert(s.transit), rows)
    else:
        with _memory_lock:
            store = _memory_transit[_key(broker)]
            for row in rows:
                row["id"] = next(_memory_ids)
                store.append(row)
    broker.note_due(now + RETRY_BASE)


def _key(broker: BrokerContext) -> str:
    return broker.engine.url.render_as_string(hide_password=False)


def _packet_of_transit(r: Any) -> Packet:
    return Packet(
        r["kind"],
        r["conversation_id"],
        r["from_initiator"],
        r["from_service_name"],
        r["from_broker_instance"],
        r["to_service_name"],
        r["to_broker_instance"],
        r["message_sequence_number"],
        contract=r["service_contract_name"],
        message_type=r["message_type_name"],
        validation=r["validation"],
        body=r["message_body"],
        lifetime=aware(r["lifetime"]),
        hops=r["hops"],
        error_code=r["error_code"],
        error_description=r["error_description"],
        sealed=bool(r.get("sealed")),
        handshake=r.get("handshake"),
    )


def in_transit(broker: BrokerContext) -> list[TransitRow]:
    """What a forwarding broker holds (see :meth:`Broker.in_transit`)."""
    if broker.dialect == "postgresql":
        with broker.engine.connect() as conn:
            rows = [
                dict(r._mapping) for r in conn.execute(select(s.transit).order_by(s.transit.c.id))
            ]
    else:
        with _memory_lock:
            rows = [dict(r) for r in _memory_transit.get(_key(broker), [])]
    return [
        TransitRow(
            id=r["id"],
            kind=r["kind"],
            conversation_id=r["conversation_id"],
            from_service_name=r["from_service_name"],
            to_service_name=r["to_service_name"],
            to_broker_instance=r["to_broker_instance"],
            message_type_name=r["message_type_name"],
            message_sequence_number=r["message_sequence_number"],
            hops=r["hops"],
            enqueued_at=aware(r["enqueued_at"]),  # type: ignore[arg-type]
            transmission_status=r["transmission_status"],
            attempts=r["attempts"],
            next_attempt_at=aware(r["next_attempt_at"]),  # type: ignore[arg-type]
        )
        for r in rows
    ]
