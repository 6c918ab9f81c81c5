"""Echo probes: send a probe through the echo example's prober service and collect its answer."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, inspect, select, update
from sqlalchemy.engine import Connection

from airflow_broker.constants import STATUS_READY
from airflow_broker.errors import (
    ConversationEnded,
    InvalidDefinition,
    QueueDisabled,
    UnknownObject,
)
from airflow_broker.messaging.arguments import as_name
from airflow_broker.messaging.duework import run_due
from airflow_broker.messaging.transaction import Transaction
from airflow_broker.operations import echo
from airflow_broker.operations.monitoring.actions import _record
from airflow_broker.operations.monitoring.models import (
    MAX_PROBE_TIMEOUT,
    PROBE_ID,
    NotReady,
    ProbeInfo,
    _e,
    _m,
    _ts,
)
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext


def _check_probe_id(probe_id: str) -> str:
    if not isinstance(probe_id, str) or not PROBE_ID.match(probe_id):
        raise InvalidDefinition(
            f"probe id {probe_id!r} is malformed: probe ids are 'probe-' and 12 hex digits"
        )
    return probe_id


def _probe_info(conn: Connection, row: Any, service: str | None = None) -> ProbeInfo:
    if service is None:
        service = conn.execute(
            select(_e.c.far_service).where(_e.c.conversation_handle == row["conversation_handle"])
        ).scalar()
    return ProbeInfo(
        probe_id=row["probe_id"],
        conversation_handle=row["conversation_handle"],
        service=service,
        status=row["status"],
        sent_at=aware(row["sent_at"]),  # type: ignore[arg-type]
        answered_at=aware(row["answered_at"]),
        round_trip_ms=row["round_trip_ms"],
        timeout_seconds=float(row["timeout_seconds"]),
        detail=row["detail"],
    )


def start_probe(
    broker: BrokerContext,
    service: str,
    *,
    timeout_seconds: float = echo.DEFAULT_TIMEOUT_SECONDS,
    body: str | None = None,
    actor: str | None = None,
) -> ProbeInfo:
    """Send an echo probe to ``service`` (:func:`airflow_broker.operations.echo.send_probe`): a
    dialog from the echo example's prober service, a Ping, and a timer of
    ``timeout_seconds``. Poll :func:`probe` for the outcome.

    The target must accept the echo contract and answer a Ping with the same body (the echo
    example's echo service does). Raises :class:`NotReady` when the echo example is not set up
    in this broker (``echo_setup`` DAG, or ``echo.setup(broker)``)."""
    as_name(service, "service")
    if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, int | float):
        raise InvalidDefinition(f"timeout_seconds must be a number, not {timeout_seconds!r}")
    if not 0 < timeout_seconds <= MAX_PROBE_TIMEOUT:
        raise InvalidDefinition(
            f"timeout_seconds must be more than 0 and at most {MAX_PROBE_TIMEOUT:g}, "
            f"not {timeout_seconds}"
        )
    if body is not None and (not isinstance(body, str) or len(body) > 1000):
        raise InvalidDefinition("a probe body must be a string of at most 1000 characters")
    with broker.read_connection() as conn:
        prober = conn.execute(
            select(s.service.c.name).where(s.service.c.name == echo.PROBER_SERVICE)
        ).first()
        has_table = inspect(conn).has_table(echo.echo_probe.name)
        accepts = set(
            conn.execute(
                select(s.service_contract.c.contract_name).where(
                    s.service_contract.c.service_name == service
                )
            ).scalars()
        )
        hosted = (
            conn.execute(select(s.service.c.name).where(s.service.c.name == service)).first()
            is not None
        )
    if prober is None or not has_table:
        raise NotReady(
            f"the echo example is not set up in this broker (service {echo.PROBER_SERVICE!r} "
            "and table 'echo_probe'): run the echo_setup DAG, or "
            "airflow_broker.operations.echo.setup(broker)"
        )
    if hosted and echo.CONTRACT not in accepts:
        raise InvalidDefinition(
            f"service {service!r} does not accept the echo contract {echo.CONTRACT!r}: it "
            "cannot be probed (add the contract to the service, and an echo to its reader)"
        )
    try:
        with Transaction(broker) as tx:
            sent = echo.send_probe(
                tx, body=body, timeout_seconds=timeout_seconds, to_service=service
            )
            _record(tx.connection, service, f"echo probe {sent.probe_id} sent", actor)
    except ConversationEnded as exc:
        raise InvalidDefinition(f"the probe of service {service!r} failed at once: {exc}") from exc
    with broker.read_connection() as conn:
        row = echo.probe_status(conn, sent.probe_id)
        assert row is not None
        return _probe_info(conn, row, service)


def probe(broker: BrokerContext, probe_id: str) -> ProbeInfo:
    """An echo probe's outcome. While it waits, this collects its answer itself (the prober's
    reader DAG may not run): it RECEIVEs the probe's own conversation from the prober's queue
    and records the outcome as the reader would, after firing the probe's timer when its
    timeout has passed. ``round_trip_ms`` runs to the echo's arrival in the prober's queue."""
    _check_probe_id(probe_id)
    with broker.read_connection() as conn:
        if not inspect(conn).has_table(echo.echo_probe.name):
            raise UnknownObject(f"probe {probe_id} does not exist (no probe was ever sent)")
        row = echo.probe_status(conn, probe_id)
    if row is None:
        raise UnknownObject(f"probe {probe_id} does not exist in this broker")
    if row["status"] == "waiting":
        _collect(broker, row)
        with broker.read_connection() as conn:
            row = echo.probe_status(conn, probe_id)
            assert row is not None
    with broker.read_connection() as conn:
        return _probe_info(conn, row)


def _collect(broker: BrokerContext, row: dict[str, Any]) -> None:
    sent_at = aware(row["sent_at"])
    assert sent_at is not None
    if utcnow() >= sent_at + timedelta(seconds=float(row["timeout_seconds"])):
        run_due(broker)  # fires the probe's DialogTimer: the outcome becomes no_answer
    h = row["conversation_handle"]
    try:
        with Transaction(broker) as tx:
            arrived = tx.connection.execute(
                select(func.min(_m.c.enqueued_at)).where(
                    _m.c.conversation_handle == h,
                    _m.c.message_type_name == echo.PING,
                    _m.c.status == STATUS_READY,
                )
            ).scalar()
            messages = tx.receive(echo.PROBER_QUEUE, conversation_handle=h)
            if not messages:
                return
            echo.probe_reply_handler(tx, messages)
            arrived_at = _ts(arrived)
            if arrived_at is not None:
                # The reply handler timed the round trip to now; the echo came back earlier.
                p = echo.echo_probe
                tx.connection.execute(
                    update(p)
                    .where(p.c.conversation_handle == h, p.c.status == "alive")
                    .values(
                        answered_at=arrived_at,
                        round_trip_ms=max(0.0, (arrived_at - sent_at).total_seconds() * 1000),
                    )
                )
    except QueueDisabled:
        return  # the prober's queue is disabled: the probe stays waiting, the queue shows why
