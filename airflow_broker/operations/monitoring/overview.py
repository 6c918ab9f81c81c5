"""The broker as a whole (:func:`overview`), its event log (:func:`events`) and its certificates
(:func:`certificates`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select

from airflow_broker.errors import (
    BrokerError,
    InvalidDefinition,
)
from airflow_broker.messaging.objects import BrokerEvent
from airflow_broker.operations.check import EVENT as CHECK_EVENT
from airflow_broker.operations.monitoring.conversations import _state_counts
from airflow_broker.operations.monitoring.models import (
    DEFAULT_LIMIT,
    Overview,
    Page,
    _check_offset,
    _ev,
    _poison_filter,
    _t,
    _ts,
    check_page,
)
from airflow_broker.security import certificates as certificate_store
from airflow_broker.security.certificates import EXPIRY_WARNING
from airflow_broker.storage import readiness
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext


def events(
    broker: BrokerContext,
    *,
    event: str | None = None,
    object_name: str | None = None,
    limit: int = DEFAULT_LIMIT,
    offset: int = 0,
    kinds: Sequence[str] | None = None,
) -> Page[BrokerEvent]:
    """What the broker (and its operators) did, newest first: queues disabled by poison
    handling, re-enabled queues, dynamic routing requests, operator actions..."""
    check_page(limit, offset)
    conds: list[Any] = []
    if event is not None:
        conds.append(_ev.c.event == event)
    if object_name is not None:
        conds.append(_ev.c.object_name == object_name)
    if kinds is not None:
        conds.append(_ev.c.event.in_(kinds))
    with broker.read_connection() as conn:
        total = int(conn.execute(select(func.count()).select_from(_ev).where(*conds)).scalar_one())
        _check_offset(offset, total, "events")
        items = [
            BrokerEvent(r.id, aware(r.occurred_at), r.event, r.object_name, r.detail)  # type: ignore[arg-type]
            for r in conn.execute(
                select(_ev).where(*conds).order_by(_ev.c.id.desc()).limit(limit).offset(offset)
            )
        ]
    return Page(items, total, limit, offset)


def overview(broker: BrokerContext) -> Overview:
    """The broker as a whole: identity, settings and the counts an operator looks at first."""
    from airflow_broker.transport import in_transit

    bi = s.broker_instance
    with broker.read_connection() as conn:
        me = conn.execute(select(bi.c.instance_id, bi.c.forwarding, bi.c.principal)).first()
        if me is None:
            raise BrokerError(f"{broker!r} is not migrated: run Broker.migrate()")
        queue_counts = conn.execute(
            select(func.count(), func.count().filter(s.queue.c.status.is_(False))).select_from(
                s.queue
            )
        ).one()
        waiting = list(readiness.tally(conn).values())
        tq = conn.execute(
            select(
                func.count(), func.min(_t.c.enqueued_at), func.count().filter(_t.c.attempts > 0)
            ).select_from(_t)
        ).one()
        poison = conn.execute(
            select(func.count()).select_from(_ev).where(_poison_filter())
        ).scalar_one()
        states = _state_counts(conn)
        expiring = certificate_store.certificates(conn, expiring_within=EXPIRY_WARNING)
        last_check = conn.execute(
            select(_ev.c.occurred_at, _ev.c.detail)
            .where(_ev.c.event == CHECK_EVENT)
            .order_by(_ev.c.id.desc())
            .limit(1)
        ).first()
    # On SQLite a forwarding broker holds messages in transit in the delivering process's
    # memory: this process cannot count them.
    transit = len(in_transit(broker)) if broker.dialect == "postgresql" else None
    return Overview(
        instance_id=str(me.instance_id),
        engine=broker.dialect,
        database=broker.engine.url.render_as_string(hide_password=True),
        forwarding=bool(me.forwarding),
        principal=bool(me.principal),
        queues=int(queue_counts[0]),
        queues_disabled=int(queue_counts[1] or 0),
        messages_ready=sum(q.ready.messages for q in waiting),
        conversations=states,
        transmission_queue=int(tq[0]),
        transmission_oldest_enqueued_at=_ts(tq[1]),
        transmissions_failing=int(tq[2] or 0),
        in_transit=transit,
        poison_events=int(poison),
        last_check_at=_ts(last_check.occurred_at) if last_check else None,
        last_check=last_check.detail if last_check else None,
        certificates_expiring=expiring,
        messages_held=sum(q.held.messages for q in waiting),
        messages_leased=sum(q.leased.messages for q in waiting),
        conversations_estimated=any(c.estimated for c in states),
    )


def certificates(broker: BrokerContext, *, expiring_within_days: int | None = None) -> list[Any]:
    """Dialog security's certificates (never a private key), the one ending first first; with
    ``expiring_within_days``, only those ending within that many days (expired ones included)."""
    within = None
    if expiring_within_days is not None:
        if not isinstance(expiring_within_days, int) or not 0 <= expiring_within_days <= 36500:
            raise InvalidDefinition(
                f"expiring_within_days must be a whole number of days from 0 to 36500, not "
                f"{expiring_within_days!r}"
            )
        within = timedelta(days=expiring_within_days)
    with broker.read_connection() as conn:
        return list(certificate_store.certificates(conn, expiring_within=within))
