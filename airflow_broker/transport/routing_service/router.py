"""A routing service's record (:class:`RoutingService`) and the router: what
:func:`~.service.run_routing_service` does with each received message, in forward and redirect
mode, with the resolved-conversations mapping.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import delete, insert, or_, select

from airflow_broker.constants import (
    DIALOG_TIMER,
    END_DIALOG,
    ERR_NOT_CLASSIFIED,
    ERROR,
    REDIRECT,
    SENDABLE_STATES,
)
from airflow_broker.errors import (
    BrokerError,
    ConversationEnded,
    UnknownObject,
)
from airflow_broker.messaging.objects import ConversationEndpoint, Message
from airflow_broker.messaging.transaction import Transaction
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow
from airflow_broker.transport.routing_service.classifiers import Classify, NotClassified
from airflow_broker.transport.routing_service.paths import _error_code

if TYPE_CHECKING:
    from airflow_broker.messaging.transaction import Transaction

log = logging.getLogger("airflow_broker")


#: The two ways a routing service can route (seed 000).
MODES = ("forward", "redirect")


#: Endpoint states in which the router has ended its side: nothing more to do with it.
ENDED_STATES = frozenset({"DO", "CD"})


@dataclass(frozen=True, slots=True)
class RoutingService:
    """A routing service as stored: its service, queue, mode and classifier text."""

    name: str
    queue: str
    mode: str
    classifier: str


@dataclass(frozen=True, slots=True)
class _Pair:
    """The other half of a mapped conversation."""

    other: uuid.UUID
    #: whether the conversation the message came on is the inbound half
    inbound: bool
    target_service: str


class _Router:
    """Routes the messages of one RECEIVE, inside its transaction."""

    def __init__(self, tx: Transaction, svc: RoutingService, classify: Classify) -> None:
        self.tx = tx
        self.svc = svc
        self.classify = classify

    # -- lookups -------------------------------------------------------------------------------
    def _endpoint(self, handle: uuid.UUID) -> ConversationEndpoint | None:
        try:
            return self.tx.conversation(handle)
        except UnknownObject:
            return None

    def _pair(self, handle: uuid.UUID) -> _Pair | None:
        r = s.resolved_conversation
        row = self.tx.connection.execute(
            select(r.c.inbound_handle, r.c.outbound_handle, r.c.target_service).where(
                or_(r.c.inbound_handle == handle, r.c.outbound_handle == handle)
            )
        ).first()
        if row is None:
            return None
        if row.inbound_handle == handle:
            return _Pair(row.outbound_handle, True, row.target_service)
        return _Pair(row.inbound_handle, False, row.target_service)

    # -- dispatch ------------------------------------------------------------------------------
    def handle(self, m: Message) -> None:
        h = m.conversation_handle
        ep = self._endpoint(h)
        if ep is None:
            log.info("routing service %r: conversation %s is gone; message dropped", self.name, h)
            return
        mt = m.message_type_name
        if mt == DIALOG_TIMER:
            log.debug("routing service %r: DialogTimer on %s ignored", self.name, h)
            return
        pair = self._pair(h)
        if mt == END_DIALOG:
            self._end_dialog(ep, pair)
        elif mt == ERROR:
            self._error(m, ep, pair)
        elif ep.state in ENDED_STATES:
            log.info(
                "routing service %r: %s on conversation %s, which the router has ended; dropped",
                self.name,
                mt,
                h,
            )
        elif pair is not None:
            self._relay(m, ep, pair)
        elif ep.is_initiator:
            # Only the router begins dialogs from its service, and always with a mapping.
            self._end(
                h,
                (
                    ERR_NOT_CLASSIFIED,
                    f"routing service {self.name!r} began no conversation {h} that it knows of",
                ),
            )
            log.warning(
                "routing service %r: message on conversation %s, which it began but has no "
                "mapping for; ended with an error",
                self.name,
                h,
            )
        elif self.svc.mode == "redirect":
            self._redirect(m, ep)
        else:
            self._forward_first(m, ep)

    @property
    def name(self) -> str:
        return self.svc.name

    # -- first message of an inbound conversation -----------------------------------------------
    def _target(self, m: Message) -> str | None:
        """Classify; on failure end the inbound conversation WITH ERROR and return None."""
        try:
            target = self.classify(m.message_body)
            if target == self.name:
                raise NotClassified(
                    f"the classifier named the routing service {self.name!r} itself"
                )
        except NotClassified as exc:
            reason = str(exc)
            self._end(
                m.conversation_handle,
                (
                    ERR_NOT_CLASSIFIED,
                    f"routing service {self.name!r} could not classify message "
                    f"{m.message_sequence_number} ({m.message_type_name}) of this "
                    f"conversation: {reason}",
                ),
            )
            log.warning(
                "routing service %r: conversation %s not classified (%s); ended with error %d",
                self.name,
                m.conversation_handle,
                reason,
                ERR_NOT_CLASSIFIED,
            )
            return None
        return target

    def _forward_first(self, m: Message, ep: ConversationEndpoint) -> None:
        target = self._target(m)
        if target is None:
            return
        tx = self.tx
        inbound = m.conversation_handle
        lifetime: int | None = None
        if ep.lifetime is not None:
            # The outbound half lives no longer than the inbound one.
            lifetime = max(1, math.ceil((ep.lifetime - utcnow()).total_seconds()))
        savepoint = tx.connection.begin_nested()
        try:
            outbound = tx.begin_dialog(
                self.name,
                target,
                contract=ep.contract_name,
                lifetime_seconds=lifetime,
                related_conversation=inbound,
                # Forwarding on the initiator's behalf: sealed when dialog security is
                # configured for the target, in clear otherwise (seed 000: end-to-end
                # security needs the redirect mode).
                encryption=False,
            )
            tx.connection.execute(
                insert(s.resolved_conversation).values(
                    inbound_handle=inbound,
                    outbound_handle=outbound,
                    routing_service=self.name,
                    target_service=target,
                    created_at=utcnow(),
                )
            )
            tx.send(outbound, m.message_type_name, m.message_body)
        except BrokerError as exc:
            # The router's broker cannot carry this message on (a contract or message type it
            # lacks, a body its message type refuses): nothing of the pair remains.
            savepoint.rollback()
            code = _error_code(exc)
            self._end(
                inbound,
                (
                    code,
                    f"routing service {self.name!r} could not forward message "
                    f"{m.message_sequence_number} ({m.message_type_name}) to {target!r}: {exc}",
                ),
            )
            log.warning(
                "routing service %r: conversation %s classified to %r but not forwarded: %s",
                self.name,
                inbound,
                target,
                exc,
            )
            return
        savepoint.commit()
        log.info(
            "routing service %r: conversation %s (from %r, contract %r) routed to %r on %s",
            self.name,
            inbound,
            ep.far_service,
            ep.contract_name,
            target,
            outbound,
        )

    def _redirect(self, m: Message, ep: ConversationEndpoint) -> None:
        target = self._target(m)
        if target is None:
            return
        h = m.conversation_handle
        body = json.dumps({"to_service": target, "broker_instance": None}).encode("utf-8")
        tx = self.tx
        tx._system_send(tx._endpoint_row(h), REDIRECT, body, utcnow())
        self._end(h)
        log.info(
            "routing service %r: conversation %s (from %r) redirected to %r",
            self.name,
            h,
            ep.far_service,
            target,
        )

    # -- later messages --------------------------------------------------------------------------
    def _relay(self, m: Message, ep: ConversationEndpoint, pair: _Pair) -> None:
        other = self._endpoint(pair.other)
        if other is None or other.state not in SENDABLE_STATES:
            state = "gone" if other is None else other.state
            log.info(
                "routing service %r: %s on %s not relayed: the other half %s is %s",
                self.name,
                m.message_type_name,
                m.conversation_handle,
                pair.other,
                state,
            )
            return
        tx = self.tx
        if m.message_type_name == REDIRECT:
            # The target is itself a redirecting router: its answer is for the initiator.
            tx._system_send(tx._endpoint_row(pair.other), REDIRECT, m.message_body, utcnow())
            log.info(
                "routing service %r: Redirect from %r passed on to %s",
                self.name,
                ep.far_service,
                pair.other,
            )
            return
        try:
            tx.send(pair.other, m.message_type_name, m.message_body)
        except ConversationEnded as exc:
            log.info(
                "routing service %r: %s on %s not relayed: %s",
                self.name,
                m.message_type_name,
                m.conversation_handle,
                exc,
            )
            return
        except BrokerError as exc:
            # The message type or body is not acceptable here (the router's broker defines the
            # message types differently): the pair cannot go on.
            code = _error_code(exc)
            description = (
                f"routing service {self.name!r} could not pass on message "
                f"{m.message_sequence_number} ({m.message_type_name}): {exc}"
            )
            self._end(pair.other, (code, description))
            self._end(m.conversation_handle, (code, description))
            self._forget(m.conversation_handle, pair)
            log.warning("routing service %r: %s", self.name, description)
            return
        log.debug(
            "routing service %r: %s relayed %s -> %s",
            self.name,
            m.message_type_name,
            m.conversation_handle,
            pair.other,
        )

    def _end_dialog(self, ep: ConversationEndpoint, pair: _Pair | None) -> None:
        h = ep.conversation_handle
        if pair is not None:
            self._end(pair.other)
        self._end(h)
        if pair is not None:
            self._forget(h, pair)
        log.info(
            "routing service %r: EndDialog on %s%s",
            self.name,
            h,
            f"; ended it and {pair.other}" if pair is not None else "; ended it",
        )

    def _error(self, m: Message, ep: ConversationEndpoint, pair: _Pair | None) -> None:
        h = ep.conversation_handle
        code, description = m.error or (0, "")
        if pair is not None:
            where = (
                f"from service {ep.far_service!r}"
                + (
                    ""
                    if ep.far_broker_instance in (None, self.tx.broker.instance_id)
                    else f" at broker instance {ep.far_broker_instance}"
                )
                + f" via routing service {self.name!r}"
            )
            self._end(pair.other, (code, f"[{where}] {description}"))
        self._end(h)
        if pair is not None:
            self._forget(h, pair)
        log.info(
            "routing service %r: Error %d on %s (%s)%s",
            self.name,
            code,
            h,
            description,
            f"; passed on to {pair.other}" if pair is not None else "",
        )

    # -- ending ----------------------------------------------------------------------------------
    def _end(self, handle: uuid.UUID, error: tuple[int, str] | None = None) -> None:
        """END CONVERSATION (WITH ERROR if ``error``) unless the router has ended it already."""
        ep = self._endpoint(handle)
        if ep is None or ep.state in ENDED_STATES:
            return
        if error is None:
            self.tx.end_conversation(handle)
        else:
            self.tx.end_conversation(handle, error_code=error[0], error_description=error[1])

    def _forget(self, handle: uuid.UUID, pair: _Pair) -> None:
        """Delete the mapping once the router has ended both halves."""
        for h in (handle, pair.other):
            ep = self._endpoint(h)
            if ep is not None and ep.state not in ENDED_STATES:
                return
        r = s.resolved_conversation
        inbound = handle if pair.inbound else pair.other
        self.tx.connection.execute(delete(r).where(r.c.inbound_handle == inbound))
