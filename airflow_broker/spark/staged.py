"""What the commit reads of the staging tables and what it reports: the staged conversations of
a part, and the :class:`Committed` / :class:`Ack` results.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    and_,
    select,
)

from airflow_broker.storage import schema as s
from airflow_broker.transport import Packet

if TYPE_CHECKING:
    pass


@dataclass(frozen=True, slots=True)
class Ack:
    """A conversation the far broker has every message of below ``upto``."""

    source_handle: uuid.UUID
    upto: int
    far_instance: str
    far_service: str


@dataclass(slots=True)
class Committed:
    """What one :func:`commit` did at the far broker."""

    far_instance: str
    #: conversations taken the set-based way, for the source to acknowledge
    acks: list[Ack] = field(default_factory=list)
    #: answers of the general path (acknowledgments, Error notices) for the source
    answers: list[Packet] = field(default_factory=list)
    #: conversations (source handle) with general-path messages the far broker did not take
    #: for good, and why
    waiting: dict[uuid.UUID, str] = field(default_factory=dict)
    #: messages the set-based way put into queues (new ones, duplicates not counted)
    inserted: int = 0
    #: messages that took the general path
    general: int = 0


def _conversations(run_id: str, part: int | None) -> Any:
    """The staged conversations of a run (of one part of its commit), each once: a retried
    Spark task may have written some twice."""
    sc = s.spark_staged_conversation
    stmt = select(
        sc.c.conversation_id,
        sc.c.from_initiator,
        sc.c.source_handle,
        sc.c.from_service,
        sc.c.to_service,
        sc.c.to_broker_instance,
        sc.c.contract,
        sc.c.lifetime_epoch,
        sc.c.hops,
    ).where(sc.c.run_id == run_id)
    if part is not None:
        stmt = stmt.where(sc.c.part == part)
    return stmt.distinct().subquery("conv")


def _same_conversation(a: Any, b: Any) -> Any:
    """Rows of ``a`` and ``b`` (tables or subqueries) about one conversation and direction."""
    return and_(
        a.c.conversation_id == b.c.conversation_id, a.c.from_initiator == b.c.from_initiator
    )
