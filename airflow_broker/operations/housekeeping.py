"""Housekeeping: what the broker keeps only for a while, and the purge that removes the rest.

Three things grow without bound unless something removes them:

- ``broker_event``: what the broker did on its own (queues disabled, dead readers, delivery
  failures). Kept :attr:`Retention.events` (default 30 days): long enough to explain an outage
  after a holiday weekend.
- ``broker_queue_sample``: the queue depth history behind the UI's charts. Kept
  :attr:`Retention.samples` (default 7 days, the longest history the UI asks for).
- Closed conversation endpoints (state CD): kept :attr:`Retention.closed_endpoints` (default 30
  minutes) so that a late duplicate of their last message is recognised and dropped, as Service
  Broker keeps them; then removed with their conversation groups once those are empty.
- ``broker_dedupe``: the keys of idempotent SEND, BEGIN DIALOG and END CONVERSATION. A key goes
  once its conversation's endpoint is gone (purged, or removed WITH CLEANUP) and it is older
  than the closed endpoints' retention (a retried END WITH CLEANUP still finds it meanwhile).

:func:`purge` removes what is older than the retention, in bounded batches, each DELETE its own
short transaction (events and samples) or under the lock order (endpoints: ``FOR UPDATE SKIP
LOCKED``, so a writer into such an endpoint's queue is never waited for; the next pass takes it).
:func:`housekeeping_step` is the throttled, never-raising form that periodic loops call (the
transmitter, due work in Airflow); ``airflow-broker purge`` runs :func:`purge` from the shell.

Everything here runs without Airflow, against either engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy import delete, select

from airflow_broker.errors import InvalidDefinition
from airflow_broker.messaging import dedupe
from airflow_broker.messaging.duework import CLOSED_ENDPOINT_RETENTION, DueWork
from airflow_broker.operations.sampling import DEFAULT_RETENTION as SAMPLE_RETENTION
from airflow_broker.operations.sampling import delete_old_samples
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")

#: Events are kept this long by default.
EVENT_RETENTION = timedelta(days=30)
#: Rows one DELETE removes at most; a pass runs at most :data:`MAX_BATCHES` per table.
BATCH = 5000
MAX_BATCHES = 20
#: How often :func:`housekeeping_step` purges, per process (seconds).
DEFAULT_EVERY = 300.0


@dataclass(frozen=True, slots=True)
class Retention:
    """How long the broker keeps what it may forget."""

    events: timedelta = EVENT_RETENTION
    samples: timedelta = SAMPLE_RETENTION
    closed_endpoints: timedelta = CLOSED_ENDPOINT_RETENTION

    def __post_init__(self) -> None:
        for name in ("events", "samples", "closed_endpoints"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value < timedelta(0):
                raise InvalidDefinition(
                    f"retention of {name} must be a timedelta >= 0, not {value!r}"
                )


@dataclass(frozen=True, slots=True)
class PurgeReport:
    """What one purge removed."""

    events: int = 0
    samples: int = 0
    endpoints: int = 0
    dedupe_keys: int = 0

    @property
    def total(self) -> int:
        return self.events + self.samples + self.endpoints + self.dedupe_keys


def _delete_old_events(
    broker: BrokerContext, before: datetime, *, batch: int, max_batches: int
) -> int:
    e = s.event
    deleted = 0
    for _ in range(max_batches):
        oldest = select(e.c.id).where(e.c.occurred_at < before).order_by(e.c.id).limit(batch)
        with broker.engine.begin() as conn:
            ids = conn.execute(oldest).scalars().all()
            if ids:
                conn.execute(delete(e).where(e.c.id.in_(ids)))
        deleted += len(ids)
        if len(ids) < batch:
            break
    return deleted


def _purge_closed_endpoints(
    broker: BrokerContext, now: datetime, retention: timedelta, *, max_batches: int
) -> int:
    purged = 0
    for _ in range(max_batches):
        with broker.engine.begin() as conn:
            n = DueWork(broker, conn).purge_closed(now, retention)
        purged += n
        if n < DueWork.BATCH:
            break
    return purged


def _purge_dedupe_keys(broker: BrokerContext, created_before: datetime) -> int:
    with broker.engine.begin() as conn:
        return dedupe.delete_orphans(conn, created_before)


def purge(
    broker: BrokerContext,
    retention: Retention | None = None,
    *,
    now: datetime | None = None,
    batch: int = BATCH,
    max_batches: int = MAX_BATCHES,
) -> PurgeReport:
    """Remove events, depth samples and closed endpoints older than ``retention``.

    At most ``max_batches`` DELETEs of ``batch`` rows per table: a large backlog is worked off
    over several passes rather than in one long transaction."""
    if batch < 1 or max_batches < 1:
        raise InvalidDefinition(f"batch and max_batches must be >= 1, not {batch}, {max_batches}")
    retention = retention or Retention()
    now = utcnow() if now is None else aware(now)
    assert now is not None
    report = PurgeReport(
        events=_delete_old_events(
            broker, now - retention.events, batch=batch, max_batches=max_batches
        ),
        samples=delete_old_samples(
            broker, now - retention.samples, batch=batch, max_batches=max_batches
        ),
        endpoints=_purge_closed_endpoints(
            broker, now, retention.closed_endpoints, max_batches=max_batches
        ),
        # After the endpoints: the keys of those just purged go in the same pass.
        dedupe_keys=_purge_dedupe_keys(broker, now - retention.closed_endpoints),
    )
    if report.total:
        log.info(
            "purged %d events, %d depth samples, %d closed endpoints and %d dedupe keys",
            report.events,
            report.samples,
            report.endpoints,
            report.dedupe_keys,
        )
    return report


def housekeeping_step(
    broker: BrokerContext, retention: Retention | None = None, every: float = DEFAULT_EVERY
) -> PurgeReport | None:
    """A purge if this process has not run one within ``every`` seconds (per broker); never
    raises (a failure is logged and tried again ``every`` seconds later)."""
    now = time.monotonic()
    if now < broker.next_housekeeping:
        return None
    broker.next_housekeeping = now + every
    try:
        return purge(broker, retention)
    except Exception as exc:  # housekeeping is never worth failing the caller's loop
        log.warning("housekeeping failed: %s: %s", type(exc).__name__, exc)
        return None


__all__ = [
    "DEFAULT_EVERY",
    "EVENT_RETENTION",
    "PurgeReport",
    "Retention",
    "housekeeping_step",
    "purge",
]
