"""Broker events and poison-message handling's rollback count."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

from sqlalchemy import (
    insert,
    update,
)
from sqlalchemy.engine import Connection

from airflow_broker import metrics
from airflow_broker.constants import (
    POISON_THRESHOLD,
)
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow

log = logging.getLogger("airflow_broker")

#: In the detail of a ``queue_disabled`` event that poison handling (not ALTER QUEUE) recorded.
POISON_DISABLED = "disabled by poison message handling"


def record_event(conn: Connection, event: str, object_name: str, detail: str) -> None:
    """Record something the broker did on its own (shown by ``Broker.events()``)."""
    conn.execute(
        insert(s.event).values(
            occurred_at=utcnow(), event=event, object_name=object_name, detail=detail
        )
    )


def record_rollbacks(conn: Connection, queue_ids: Iterable[int]) -> tuple[int, int]:
    """Count rolled-back receiving transactions; disable queues that reach the threshold.

    Returns (rollbacks counted, queues disabled)."""
    counted = disabled = 0
    for queue_id, n in sorted(Counter(queue_ids).items()):
        row = conn.execute(
            update(s.queue)
            .where(
                s.queue.c.queue_id == queue_id,
                s.queue.c.poison_message_handling.is_(True),
                s.queue.c.status.is_(True),
            )
            .values(rollback_count=s.queue.c.rollback_count + n)
            .returning(s.queue.c.name, s.queue.c.rollback_count)
        ).first()
        if row is None:
            continue
        counted += n
        if row.rollback_count >= POISON_THRESHOLD:
            conn.execute(
                update(s.queue)
                .where(s.queue.c.queue_id == queue_id)
                .values(status=False, rollback_count=0, modified_at=utcnow())
            )
            detail = (
                f"queue {row.name!r} {POISON_DISABLED} after "
                f"{row.rollback_count} consecutive rolled-back receiving transactions; "
                "fix the reader, then alter_queue(status=True)"
            )
            record_event(conn, "queue_disabled", row.name, detail)
            log.error(detail)
            metrics.incr(metrics.QUEUES_DISABLED, 1, {"queue": row.name})
            disabled += 1
        else:
            log.warning(
                "a transaction that received from queue %r rolled back (%d of %d before the "
                "queue is disabled)",
                row.name,
                row.rollback_count,
                POISON_THRESHOLD,
            )
    return counted, disabled
