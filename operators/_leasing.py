"""``ReceiveOperator(lease_seconds=...)``'s half of leases: its arguments and its work.

Kept apart from :mod:`.dialog` (whose ``ReceiveOperator`` calls it) and :mod:`.lease` (the
operators that complete and release a lease, built on :mod:`.dialog`), so that neither imports
the other in a cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_broker.provider.xcom import lease_to_dict

if TYPE_CHECKING:
    from airflow_broker.broker import Broker
    from airflow_broker.operators.dialog import ReceiveOperator


def check_lease_arguments(task_id: str, lease_seconds: Any, conversation_handle: Any) -> None:
    """``ReceiveOperator(lease_seconds=...)``'s arguments, checked when the DAG is parsed."""
    if conversation_handle is not None:
        raise ValueError(
            f"ReceiveOperator {task_id!r}: a lease holds a whole conversation group: give "
            "conversation_group, not conversation_handle, with lease_seconds"
        )
    number = not isinstance(lease_seconds, bool) and isinstance(lease_seconds, int | float)
    if not number or lease_seconds <= 0:
        raise ValueError(
            f"ReceiveOperator {task_id!r}: lease_seconds must be positive, not {lease_seconds!r}"
        )


def take_lease(
    op: ReceiveOperator, lease_seconds: float, conversation_group: str | None
) -> dict[str, Any] | None:
    """``ReceiveOperator(lease_seconds=...)``'s work: ``Broker.lease``, committed at once; the
    lease as :func:`~airflow_broker.provider.xcom.lease_to_dict` gives it, or None."""

    def lease(broker: Broker) -> dict[str, Any] | None:
        taken = broker.lease(
            op.queue_name,
            lease_seconds=lease_seconds,
            top=op.top,
            wait_seconds=op.wait_seconds,
            conversation_group_id=conversation_group,
        )
        return None if taken is None else lease_to_dict(taken)

    leased = op.run(lease)
    if leased is None:
        op.log.info("no message ready on queue %r: no lease", op.queue_name)
    else:
        op.log.info(
            "leased %d message(s) of queue %r, conversation group %s, until %s: lease %s",
            len(leased["messages"]),
            op.queue_name,
            leased["conversation_group_id"],
            leased["expires_at"],
            leased["token"],
        )
    return leased


__all__ = ["check_lease_arguments", "take_lease"]
