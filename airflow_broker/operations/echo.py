"""An echo service that answers liveness probes.

"Including an 'echo' message in every contract that just returns a message to the service that
sent it can be a useful tool for determining that the service is alive and processing messages"
(Architecting Service Broker Applications). Three pieces, as in seed 004's description of a
dialog:

- the **initiator**, :func:`send_probe`: begins a dialog from the prober service to the echo
  service, sends a Ping, records the probe and arms a conversation timer (how long it waits);
- the **target**, :func:`echo_handler`: any message gets the same body back, with the same
  message type, then the echo service ENDs the dialog;
- the **response service**, :func:`probe_reply_handler`: reads the prober's queue; the echo
  marks the probe ``alive`` with its round trip, a DialogTimer first marks it ``no_answer``;
  either way the prober ENDs its side.

The probes are kept in ``echo_probe`` in the broker database, keyed by conversation group id.
Nothing here imports Airflow.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import yaml
from sqlalchemy import (
    Column,
    DateTime,
    Float,
    MetaData,
    String,
    Table,
    Uuid,
    insert,
    select,
    update,
)
from sqlalchemy.engine import Connection

from airflow_broker.constants import DEFAULT, DIALOG_TIMER, END_DIALOG, ERROR
from airflow_broker.errors import ContractViolation, ConversationEnded
from airflow_broker.messaging.objects import Message
from airflow_broker.operations.declarations import apply_declarations
from airflow_broker.storage.schema import NAMING_CONVENTION

if TYPE_CHECKING:
    from airflow_broker.messaging.transaction import Transaction
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker.operations.echo")

PREFIX = "//airflow-broker/examples/echo"
ECHO_SERVICE = f"{PREFIX}/Echo"
PROBER_SERVICE = f"{PREFIX}/Prober"
CONTRACT = f"{PREFIX}/Contract"
PING = f"{PREFIX}/Ping"
ECHO_QUEUE = "echo_queue"
PROBER_QUEUE = "echo_prober_queue"
ECHO_READER_DAG = "echo_reader"
PROBER_READER_DAG = "echo_probe_reader"
#: How long a probe waits for its echo by default.
DEFAULT_TIMEOUT_SECONDS = 60.0

DECLARATIONS = "# The echo example (airflow_broker.operations.echo).\n" + yaml.safe_dump(
    {
        "version": 1,
        "message_types": [{"name": PING, "validation": "none"}],
        # Ping may come from either side, so the echo service may send it back.
        "contracts": [{"name": CONTRACT, "message_types": {PING: "any"}}],
        "queues": [
            {"name": ECHO_QUEUE, "activation": {"max_readers": 1, "reader": ECHO_READER_DAG}},
            {"name": PROBER_QUEUE, "activation": {"max_readers": 1, "reader": PROBER_READER_DAG}},
        ],
        "services": [
            # DEFAULT too: any service may probe it with the DEFAULT contract and message type.
            {"name": ECHO_SERVICE, "queue": ECHO_QUEUE, "contracts": [CONTRACT, DEFAULT]},
            {"name": PROBER_SERVICE, "queue": PROBER_QUEUE},
        ],
    },
    sort_keys=False,
    width=100,
)

metadata = MetaData(naming_convention=NAMING_CONVENTION)

echo_probe = Table(
    "echo_probe",
    metadata,
    Column("conversation_group_id", Uuid, primary_key=True),
    Column("conversation_handle", Uuid, nullable=False, unique=True),
    Column("probe_id", String(64), nullable=False, unique=True),
    Column("body", String(1000)),
    Column("sent_at", DateTime(timezone=True), nullable=False),
    Column("answered_at", DateTime(timezone=True)),
    Column("round_trip_ms", Float),
    Column("timeout_seconds", Float, nullable=False),
    Column("status", String(16), nullable=False, comment="waiting | alive | no_answer | failed"),
    Column("detail", String(500)),
    comment="Liveness probes of the echo service, one per conversation group of the prober.",
)


def setup(broker: BrokerContext) -> None:
    """The broker objects and the ``echo_probe`` table; safe to run again."""
    apply_declarations(broker, DECLARATIONS, "echo.DECLARATIONS")
    metadata.create_all(broker.engine, checkfirst=True)


def _now() -> datetime:
    return datetime.now(UTC)


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Probe:
    """A probe on its way."""

    probe_id: str
    conversation_handle: uuid.UUID
    conversation_group_id: uuid.UUID


def send_probe(
    tx: Transaction,
    body: str | None = None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    to_service: str = ECHO_SERVICE,
) -> Probe:
    """Begin a dialog to the echo service, send a Ping (``body``, default the probe id) and
    arm the timer that gives up after ``timeout_seconds``; all in ``tx``."""
    probe_id = f"probe-{uuid.uuid4().hex[:12]}"
    text = probe_id if body is None else body
    # A probe measures the way there and back: secured where dialog security is configured.
    handle = tx.begin_dialog(PROBER_SERVICE, to_service, CONTRACT, encryption=False)
    group = tx.conversation(handle).conversation_group_id
    tx.connection.execute(
        insert(echo_probe).values(
            conversation_group_id=group,
            conversation_handle=handle,
            probe_id=probe_id,
            body=text[:1000],
            sent_at=_now(),
            timeout_seconds=timeout_seconds,
            status="waiting",
        )
    )
    tx.send(handle, PING, text)
    tx.begin_conversation_timer(handle, timeout_seconds)
    return Probe(probe_id, handle, group)


def _end(tx: Transaction, handle: uuid.UUID) -> None:
    if tx.conversation(handle).state not in ("CD", "DO"):
        tx.end_conversation(handle)


def echo_handler(tx: Transaction, messages: Sequence[Message]) -> None:
    """The echo service: each message comes back with the same type and body, then the echo
    ENDs the dialog. EndDialog and Error messages are answered with END only."""
    ended: set[uuid.UUID] = set()
    for m in messages:
        h = m.conversation_handle
        if h in ended or m.message_type_name == DIALOG_TIMER:
            continue
        if m.message_type_name not in (END_DIALOG, ERROR):
            try:
                tx.send(h, m.message_type_name, m.message_body)
            except (ConversationEnded, ContractViolation) as exc:
                # A prober that has gone, or a contract that does not let the target answer
                # with this type: there is nothing to echo to.
                log.info("echo of %s on %s not sent: %s", m.message_type_name, h, exc)
        _end(tx, h)
        ended.add(h)


def probe_reply_handler(tx: Transaction, messages: Sequence[Message]) -> None:
    """The prober's reader: record each probe's outcome and END its dialog."""
    conn = tx.connection
    for m in messages:
        row = (
            conn.execute(
                select(echo_probe)
                .where(echo_probe.c.conversation_handle == m.conversation_handle)
                .with_for_update()
            )
            .mappings()
            .first()
        )
        if row is None or row["status"] != "waiting":
            _end(tx, m.conversation_handle)
            continue
        now = _now()
        values: dict[str, Any]
        if m.message_type_name == DIALOG_TIMER:
            values = {"status": "no_answer", "detail": f"no echo within {row['timeout_seconds']} s"}
        elif m.message_type_name == ERROR:
            code, text = m.error or (0, "")
            values = {"status": "failed", "detail": f"error {code}: {text}"}
        elif m.message_type_name == END_DIALOG:
            values = {"status": "failed", "detail": "the echo service ended without an echo"}
        elif m.text() == row["body"]:
            rtt = (now - _aware(row["sent_at"])).total_seconds() * 1000
            values = {"status": "alive", "round_trip_ms": rtt, "detail": "echoed"}
        else:
            values = {"status": "failed", "detail": f"echoed another body: {m.text()!r:.200}"}
        conn.execute(
            update(echo_probe)
            .where(echo_probe.c.conversation_group_id == row["conversation_group_id"])
            .values(answered_at=now, **values)
        )
        _end(tx, m.conversation_handle)


def probe_status(conn: Connection, probe_id: str) -> dict[str, Any] | None:
    """A probe's row: ``status`` is waiting, alive, no_answer or failed."""
    row = conn.execute(select(echo_probe).where(echo_probe.c.probe_id == probe_id)).mappings()
    first = row.first()
    return dict(first) if first is not None else None


__all__ = [
    "CONTRACT",
    "DECLARATIONS",
    "ECHO_QUEUE",
    "ECHO_SERVICE",
    "PING",
    "PROBER_QUEUE",
    "PROBER_SERVICE",
    "Probe",
    "echo_handler",
    "probe_reply_handler",
    "probe_status",
    "send_probe",
    "setup",
]
