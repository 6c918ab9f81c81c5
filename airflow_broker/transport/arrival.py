"""What an arriving message does to its endpoint here: whether it is accepted, the state it
leads to, a secure dialog's body opened, a conversation failed by what arrived (or by dialog
security)."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.engine import Connection

from airflow_broker.constants import (
    END_DIALOG,
    ERR_MESSAGE_INVALID,
    ERROR,
    SENDABLE_STATES,
    SYSTEM_MESSAGE_TYPES,
)
from airflow_broker.errors import BrokerError, ContractViolation, MessageValidationError
from airflow_broker.messaging.lookups import Hosted, contract_rule, hosted_services, priority_for
from airflow_broker.messaging.objects import error_body
from airflow_broker.messaging.rows import drop_waiting, insert_message
from airflow_broker.messaging.validation import VALIDATION_CODES, validate_body
from airflow_broker.security import dialogs
from airflow_broker.security.crypto import SecurityFailure
from airflow_broker.storage import schema as s
from airflow_broker.storage.context import BrokerContext
from airflow_broker.transport.packets import Packet

log = logging.getLogger("airflow_broker")


class Definitions:
    """The definitions arriving messages are taken by, read once a transaction of the accept:
    a batch's messages share a few types and services, and the broker's cache of definitions
    takes a lock and reads the clock on every look-up (it was once a message)."""

    def __init__(self, broker: BrokerContext, conn: Connection, me: str) -> None:
        self.b = broker
        self.conn = conn
        self.me = me
        #: (contract, message type) -> its rule here, or why there is none
        self._rules: dict[tuple[str, str], tuple[str, str, Any] | BrokerError] = {}
        self._hosted: dict[str, Hosted] | None = None
        #: (contract, this service, far service) -> the priority of a new endpoint
        self._priorities: dict[tuple[str, str, str], int] = {}
        #: (contract, from initiator, message type) -> :meth:`plain`
        self._plain: dict[tuple[str, bool, str], bool] = {}

    def hosted(self) -> dict[str, Hosted]:
        if self._hosted is None:
            self._hosted = hosted_services(self.b, self.conn)
        return self._hosted

    def priority(self, contract: str, local: str, remote: str) -> int:
        key = (contract, local, remote)
        prio = self._priorities.get(key)
        if prio is None:
            prio = self._priorities[key] = priority_for(self.b, self.conn, *key)
        return prio

    def check(self, contract: str, p: Packet) -> tuple[tuple[int, str] | None, str | None]:
        """Whether this broker accepts the message: its type in the contract, sent by the right
        side, and a body that its type here validates. Returns (why not: an Error's code and
        description, or None; the validation code the body passed, None for system types)."""
        if p.message_type in SYSTEM_MESSAGE_TYPES:
            return None, None
        rule = self._rule(contract, p.message_type)
        if isinstance(rule, BrokerError):
            return (ERR_MESSAGE_INVALID, f"at broker instance {self.me}: {rule}"), None
        sent_by, validation, schema_ = rule
        side = "initiator" if p.from_initiator else "target"
        if sent_by not in (side, "any"):
            why = (
                f"contract {contract!r} lets only the {sent_by} send message type "
                f"{p.message_type!r}"
            )
            return (ERR_MESSAGE_INVALID, why), None
        try:
            validate_body(p.message_type, validation, schema_, p.body)
        except (MessageValidationError, ContractViolation) as exc:
            return (ERR_MESSAGE_INVALID, f"discarded at broker instance {self.me}: {exc}"), None
        return None, VALIDATION_CODES[validation]

    def _rule(self, contract: str, message_type: str) -> tuple[str, str, Any] | BrokerError:
        key = (contract, message_type)
        rule = self._rules.get(key)
        if rule is None:
            try:
                rule = contract_rule(self.b, self.conn, contract, message_type)
            except BrokerError as exc:
                rule = exc
            self._rules[key] = rule
        return rule

    def plain(self, contract: str, from_initiator: bool, message_type: str) -> bool:
        """Whether :meth:`check` accepts every message of this type from that side whatever
        its body, with validation code ``N``: a type of the contract that side may send, not a
        system type, with no validation here."""
        key = (contract, from_initiator, message_type)
        known = self._plain.get(key)
        if known is None:
            rule = (
                None if message_type in SYSTEM_MESSAGE_TYPES else self._rule(contract, message_type)
            )
            side = "initiator" if from_initiator else "target"
            known = self._plain[key] = (
                isinstance(rule, tuple) and rule[0] in (side, "any") and rule[1] == "none"
            )
        return known


def opened(key: bytes, p: Packet) -> Packet:
    """A message of a secure dialog with its body opened; :class:`SecurityFailure` when it came
    in clear or was altered on the way."""
    if not p.sealed:
        raise SecurityFailure(
            f"message {p.seq} of conversation {p.conversation_id} arrived in clear on a dialog "
            "secured by dialog security"
        )
    body = dialogs.open_body(
        key, p.conversation_id, p.from_initiator, p.seq, p.message_type, p.body
    )
    # Not dataclasses.replace: this runs once per message, and replace() costs 3x a call.
    return Packet(
        p.kind,
        p.conversation_id,
        p.from_initiator,
        p.from_service,
        p.from_broker_instance,
        p.to_service,
        p.to_broker_instance,
        p.seq,
        p.contract,
        p.message_type,
        p.validation,
        body,
        p.lifetime,
        p.hops,
        p.error_code,
        p.error_description,
    )


def next_state(state: str, message_type: str) -> str:
    """The state an endpoint goes to when an EndDialog or Error arrives in order."""
    if message_type == END_DIALOG:
        if state == "DO":
            return "CD"
        if state in SENDABLE_STATES:
            return "DI"
    elif message_type == ERROR:
        return "CD" if state in ("DO", "CD") else "ER"
    return state


def fail_endpoint(
    conn: Connection, ep: dict[str, Any], code: int, description: str, now: datetime
) -> None:
    """The conversation failed: this side gets an Error message and goes to ER; whatever it
    still had to send is dropped."""
    if ep["state"] in ("ER", "CD"):
        return
    e = s.conversation_endpoint
    handle = ep["conversation_handle"]
    conn.execute(
        insert_message(
            queue_id=ep["queue_id"],
            group_id=ep["conversation_group_id"],
            handle=handle,
            seq=ep["receive_sequence"],
            priority=ep["priority"],
            service_name=ep["service_name"],
            contract=ep["contract_name"],
            message_type=ERROR,
            validation="X",
            body=error_body(code, description),
            now=now,
        )
    )
    conn.execute(
        update(e).where(e.c.conversation_handle == handle).values(state="ER", timer_due_at=None)
    )
    conn.execute(drop_waiting(handle))
    ep["state"] = "ER"
    log.warning("conversation %s failed: %s", handle, description)
