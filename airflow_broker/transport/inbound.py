"""The inbound accept: the far broker's receiving transaction.

:class:`Inbound` takes a batch of packets in one transaction of the receiving database: it inserts
each message whose sequence number is new for its conversation and direction (holding early
arrivals until the gap fills), creates target endpoints, fails what it cannot take with an Error
back, forwards what it does not host, and answers every message with an acknowledgment
(:mod:`.taker` takes the packets addressed to it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

import airflow_broker.transport.known as known
from airflow_broker.errors import BrokerError
from airflow_broker.messaging.lookups import hosted_services
from airflow_broker.storage import schema as s
from airflow_broker.storage.context import BrokerContext
from airflow_broker.storage.identity import copy_refusal
from airflow_broker.transport.forwarding import Forwarder
from airflow_broker.transport.packets import (
    ACK,
    DROPPED,
    MESSAGE,
    Outcome,
    Packet,
    Push,
    Unreachable,
    _first_line,
    _Settings,
)
from airflow_broker.transport.taker import Taker

log = logging.getLogger("airflow_broker")


def far_settings(broker: BrokerContext, conn: Connection) -> _Settings:
    """The receiving broker's instance id, forwarding and whether it is the principal (not if
    configured so, or a server in recovery); :class:`Unreachable` if it is not migrated or is
    a restored copy (:mod:`airflow_broker.storage.identity`)."""
    bi = s.broker_instance
    cols: list[Any] = [bi.c.instance_id, bi.c.forwarding, bi.c.principal]
    if broker.dialect == "postgresql":
        cols.append(text("pg_is_in_recovery()"))
    row = conn.execute(select(*cols)).first()
    if row is None:
        raise Unreachable(f"{broker!r} is not migrated")
    refused = copy_refusal(broker, conn)
    if refused is not None:
        raise Unreachable(refused)
    principal = bool(row[2]) and not (len(row) > 3 and row[3])
    return _Settings(str(row[0]), bool(row[1]), principal)


class Inbound:
    """What a broker does with packets that arrive from another broker (or that it relays)."""

    def __init__(self, broker: BrokerContext, push: Push | None = None) -> None:
        self.b = broker
        #: how a forwarding broker passes on what it does not host (None: it cannot here)
        self.push = push

    def _settings(self, conn: Connection) -> _Settings:
        return far_settings(self.b, conn)

    def accept(self, packets: Sequence[Packet], *, depth: int = 0) -> Outcome:
        """Take a batch of packets: those for this broker in one transaction (messages into
        queues, acknowledgments and notices applied), the others forwarded or refused."""
        out = Outcome()
        try:
            with self.b.engine.connect() as conn:
                settings = self._settings(conn)
        except DBAPIError as exc:
            raise Unreachable(_first_line(exc)) from exc
        if not settings.principal:
            raise Unreachable(
                f"broker instance {settings.instance_id} at {self.b!r} is not the principal"
            )
        mine: list[int] = []
        others: list[int] = []
        with self.b.engine.connect() as conn:
            hosted = hosted_services(self.b, conn)
        for i, p in enumerate(packets):
            if p.to_broker_instance == settings.instance_id or (
                p.to_broker_instance is None and p.kind == MESSAGE and p.to_service in hosted
            ):
                mine.append(i)
            else:
                others.append(i)
        if mine:
            self._take(packets, mine, settings, out)
        if others and settings.forwarding and self.push is None:
            raise BrokerError(
                f"broker instance {settings.instance_id} forwards, but this Inbound was made "
                "without a way to pass packets on (give it the outbound pass's push_any)"
            )
        if others:
            if settings.forwarding and self.push is not None:
                Forwarder(self.b, settings, self.push).forward(packets, others, out, depth)
            else:
                for i in others:
                    p = packets[i]
                    if p.to_broker_instance is not None:
                        why = (
                            f"it is for broker instance {p.to_broker_instance}; broker instance "
                            f"{settings.instance_id} dropped it (forwarding is off there)"
                        )
                    else:
                        why = (
                            f"service {p.to_service!r} is not hosted by broker instance "
                            f"{settings.instance_id}, which does not forward"
                        )
                    out.notes[i] = (DROPPED, why)
        return out

    # -- packets for this broker ---------------------------------------------------------------
    def _take_known(
        self, packets: Sequence[Packet], indexes: list[int], settings: _Settings, out: Outcome
    ) -> list[int]:
        """PostgreSQL: the conversations of known endpoints in clear whose packets are only
        messages, in order, taken in one statement (:mod:`.known`) and acknowledged; returns
        the indexes left to the general accept."""
        if self.b.dialect != "postgresql" or not known.asks(self.b):
            return indexes
        me = settings.instance_id
        groups: dict[tuple[Any, bool], list[int]] = {}
        for i in indexes:
            p = packets[i]
            groups.setdefault((p.conversation_id, p.from_initiator), []).append(i)
        by_sender: dict[str, list[known.Known]] = {}
        offered: dict[tuple[Any, bool], list[int]] = {}
        for key, members in groups.items():
            members.sort(key=lambda i: packets[i].seq)
            first = packets[members[0]]
            ps = [packets[i] for i in members]
            if all(
                p.kind == MESSAGE
                and not p.sealed
                and p.to_broker_instance == me
                and p.from_broker_instance == first.from_broker_instance
                and p.contract == first.contract
                for p in ps
            ) and known.gapless([p.seq for p in ps]):
                by_sender.setdefault(first.from_broker_instance, []).append(
                    known.Known(
                        key[0],
                        key[1],
                        first.contract,
                        [(p.seq, p.message_type, p.body) for p in ps],
                    )
                )
                offered[key] = members
        taken: set[int] = set()
        for sender, conversations in by_sender.items():
            try:
                took = known.accept_known(self.b, sender, me, conversations)
            except (DBAPIError, Unreachable) as exc:
                log.info("taking known conversations the general way: %s", _first_line(exc))
                break
            for key in took or ():
                for i in offered[key]:
                    out.answers.append(packets[i].answer(ACK, me))
                    taken.add(i)
        return [i for i in indexes if i not in taken]

    def _take(
        self, packets: Sequence[Packet], indexes: list[int], settings: _Settings, out: Outcome
    ) -> None:
        indexes = self._take_known(packets, indexes, settings, out)
        if not indexes:
            return
        for attempt in (1, 2):
            answers: list[Packet] = []
            notes: dict[int, tuple[str, str]] = {}
            try:
                with self.b.engine.begin() as conn:
                    Taker(self.b, conn, settings.instance_id, answers, notes).run(packets, indexes)
            except IntegrityError:
                # Another delivery created the same far endpoint at the same moment: the second
                # try finds it and treats these messages as the duplicates they are.
                if attempt == 2:
                    raise
                continue
            except OperationalError as exc:
                raise Unreachable(_first_line(exc)) from exc
            out.answers.extend(answers)
            out.notes.update(notes)
            return
