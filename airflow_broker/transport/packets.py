"""What travels between broker databases: packets (a message, an acknowledgment, a notice), a
batch's outcome, and the delivery report.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple

from airflow_broker.errors import BrokerError

MESSAGE, ACK, NOTICE = "M", "A", "E"


#: A delivery pass's count of messages no far broker took (not a DeliveryReport field).
_UNREACHABLE = "unreachable"


class Packet(NamedTuple):
    """One unit between brokers: a message (``M``), an acknowledgment (``A``) or an Error notice
    from a broker on the way (``E``). Acknowledgments and notices are addressed back to the
    sender of the message they answer and carry its sequence number.

    A named tuple, immutable like the frozen dataclass it was and made four times as fast:
    a delivery pass makes two a message (the message and its acknowledgment), and a frozen
    dataclass's ``__init__`` sets each of its 18 fields through ``object.__setattr__`` (6.2
    against 1.7 µs measured; ``_replace`` instead of ``dataclasses.replace``)."""

    kind: str
    conversation_id: uuid.UUID
    #: the side that sent this packet is the dialog's initiator
    from_initiator: bool
    from_service: str
    from_broker_instance: str
    to_service: str
    to_broker_instance: str | None
    seq: int
    contract: str = ""
    message_type: str = ""
    validation: str = "N"
    body: bytes | None = None
    lifetime: datetime | None = None
    hops: int = 0
    error_code: int | None = None
    error_description: str | None = None
    #: dialog security: ``body`` is sealed under the dialog's session key
    sealed: bool = False
    #: dialog security: the initiator's signed key exchange, until the target has the key
    handshake: bytes | None = None

    def answer(
        self,
        kind: str,
        by_broker_instance: str,
        code: int | None = None,
        description: str | None = None,
    ) -> Packet:
        """An acknowledgment or an Error notice for this message, addressed to its sender."""
        return Packet(
            kind,
            self.conversation_id,
            not self.from_initiator,
            self.to_service,
            by_broker_instance,
            self.from_service,
            self.from_broker_instance,
            self.seq,
            self.contract,
            self.message_type,
            "N",
            None,
            self.lifetime,
            0,
            code,
            description,
        )

    def describe(self) -> str:
        what = {MESSAGE: "message", ACK: "acknowledgment of message", NOTICE: "error notice on"}
        return f"{what[self.kind]} {self.seq} of conversation {self.conversation_id}"


#: Outcome of one packet at a broker that did not take it for good.
HELD, DROPPED = "held", "dropped"


@dataclass(slots=True)
class Outcome:
    """What a broker did with a batch of packets: the answers (acknowledgments and Error
    notices, for this broker's caller to apply or pass back), and for packets it did not take
    for good, why (by index in the batch)."""

    answers: list[Packet] = field(default_factory=list)
    #: index -> (HELD or DROPPED, reason)
    notes: dict[int, tuple[str, str]] = field(default_factory=dict)
    discarded: int = 0
    forwarded: int = 0
    #: the batch went into the far broker's inbox (:mod:`.inbox`): held until answered
    inbox: bool = False
    #: notes on packets of earlier batches, collected with this answer:
    #: (conversation_id, from_initiator, seq, HELD or DROPPED, reason)
    late_notes: list[tuple[uuid.UUID, bool, int, str, str]] = field(default_factory=list)


class Unreachable(BrokerError):
    """The broker at an address could not be reached (or refused: not the principal)."""


@dataclass(frozen=True, slots=True)
class DeliveryReport:
    """What one :meth:`Broker.deliver` pass did.

    :ivar delivered: messages that reached their destination: a local queue, or a far broker
        that acknowledged them.
    :ivar acknowledged: messages removed from the transmission queue by an acknowledgment.
    :ivar delayed: messages still waiting (no route, destination unreachable, held by a
        forwarder, queue disabled); each has a ``transmission_status`` saying why.
    :ivar failed: messages whose conversation failed with an Error instead (contract not
        supported, invalid body, too many hops...).
    :ivar discarded: messages this broker, forwarding, threw away (hop count, lifetime, no route).
    :ivar forwarded: messages this broker, forwarding, passed on to their next hop.
    :ivar hung: far brokers that did not answer in time during the pass (their messages wait,
        the others went on: :mod:`~airflow_broker.transport.lanes`), by address, with why.
    """

    delivered: int = 0
    acknowledged: int = 0
    delayed: int = 0
    failed: int = 0
    discarded: int = 0
    forwarded: int = 0
    hung: dict[str, str] = field(default_factory=dict)


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0]


@dataclass(slots=True)
class _Settings:
    instance_id: str
    forwarding: bool
    principal: bool


#: Passes a batch of packets on to the first reachable of some addresses, one forwarding hop
#: deeper: ``push(addresses, packets, depth) -> (outcome or None, failures)``.
Push = Callable[[Sequence[str], Sequence[Packet], int], tuple[Outcome | None, list[str]]]
