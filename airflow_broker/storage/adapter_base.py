"""What every engine's adapter (storage.adapters) answers to, and the records it hands back.

:class:`EngineAdapter` is the interface; :class:`ReceiveLease`, :class:`FailedHold` and
:class:`WaitState` are what a receiving transaction holds, counts and waits with; the NOTIFY
channels are named here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.engine import Connection


@dataclass(slots=True)
class ReceiveLease:
    """This transaction received from ``queue_id``: if it never commits, that is a rollback."""

    queue_id: int
    key: int = 0
    path: Path | None = None
    fd: int | None = None
    #: queuing_order of every message taken: a failed attempt counts them (receive_count)
    held: list[int] = field(default_factory=list)
    #: PostgreSQL: taken by the last RECEIVE, held once its row says so (lease_written)
    pending: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FailedHold:
    """Messages a receiving transaction took and did not keep (it rolled back, or its reader
    died): one failed attempt for each of them."""

    queue_id: int
    held: tuple[int, ...]


@dataclass(slots=True)
class WaitState:
    """What a waiting RECEIVE holds between two attempts."""

    queue_id: int
    listener: Any = None
    data_version: int | None = None
    released: bool = False


class EngineAdapter(Protocol):
    dialect: str

    def new_lease_key(self) -> int | None: ...

    def open_lease(
        self,
        conn: Connection,
        queue_id: int,
        key: int | None,
        held: list[int],
        *,
        check: bool = True,
    ) -> ReceiveLease: ...

    def hold_more(self, lease: ReceiveLease, held: list[int], *, check: bool = True) -> None: ...

    def lease_written(self, lease: ReceiveLease) -> bool: ...

    def rollback_keeping_lock(self, conn: Connection) -> bool: ...

    def lease_cleanup(self, leases: list[ReceiveLease]) -> bytes | None: ...

    def dead_lease_on(self, queue_id: int) -> bool: ...

    def forget_leases(self, conn: Connection, leases: list[ReceiveLease]) -> list[FailedHold]: ...

    def leases_committing(self, conn: Connection, leases: list[ReceiveLease]) -> None: ...

    def close_leases(self, leases: list[ReceiveLease]) -> None: ...

    def reap_dead_leases(
        self, conn: Connection, queue_id: int | None = None
    ) -> list[FailedHold]: ...

    def dead_leases(self, conn: Connection) -> list[tuple[str, int]]: ...

    def start_wait(self, conn: Connection, queue_id: int, *, can_release: bool) -> WaitState: ...

    def wait(self, conn: Connection, state: WaitState, timeout: float) -> None: ...

    def end_wait(self, state: WaitState) -> None: ...

    def dispose(self) -> None: ...


def channel(queue_id: int) -> str:
    """The NOTIFY channel of a queue's ready messages (migration 0002)."""
    return f"airflow_broker_q{queue_id}"


#: The NOTIFY channel of messages queued to leave the database (migration 0010).
TRANSMIT_CHANNEL = "airflow_broker_transmit"


__all__ = [
    "TRANSMIT_CHANNEL",
    "EngineAdapter",
    "FailedHold",
    "ReceiveLease",
    "WaitState",
    "channel",
]
