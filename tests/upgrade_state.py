"""A broker database at an old revision, holding live state written as the code of that time
wrote it, and the checks that all of it carries on after an upgrade to the newest schema
(``tests/test_upgrade_in_flight.py``).

:func:`build_at` creates the broker tables at an old revision with Alembic. :func:`fill` writes,
in plain SQL against the tables as they are at that revision, what a broker of that time held
in flight (the only code of today it calls is the identity's fingerprint, which migration 0009
calls too):

- definitions: message types (one validated as JSON), a contract, queues (one disabled), services,
  a route to another broker, a broker priority, the broker's identity;
- a local dialog in conversation, with ordered messages waiting in both queues, a timer that is
  due and one that is not;
- a dialog the initiator ended: its last message and the EndDialog wait for the target;
- a dialog whose lifetime has run out;
- two dialogs to a service of another broker (one addressed to its broker instance), their
  messages in the transmission queue;
- a dialog to a local service whose queue is disabled, its message in the transmission queue;
- a receive lease of a reader that died holding messages (PostgreSQL: a row of a backend that
  is gone; SQLite: an unlocked lease file, in the bare-queue-id form of that time); on PostgreSQL
  from 0003 on also the row of a committed one (its commit marker written).

:func:`check_carries_on` then uses today's API only: RECEIVE gets every message once and in
order, the due timer fires and the other waits, the lifetime expires, the dead reader counts as
one rolled-back receive (Service Broker's poison rule) and the committed lease as none, the
transmitter delivers to a second broker database and to the re-enabled local queue, and every
dialog can go on (SEND after the upgrade continues each sequence) and end.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

from airflow_broker import Broker, ConversationEndpoint, Message
from airflow_broker.constants import (
    AUTO_CREATED_LOCAL,
    DEFAULT,
    DIALOG_TIMER,
    END_DIALOG,
    ERR_LIFETIME_EXPIRED,
    ERROR,
)
from airflow_broker.errors import MessageValidationError
from airflow_broker.storage.clock import aware, utcnow
from airflow_broker.storage.identity import physical_fingerprint
from airflow_broker.storage.migrations import VERSION_TABLE, alembic_config

INITIATOR = "//upgrade/Initiator"
TARGET = "//upgrade/Target"
HELD = "//upgrade/Held"
FAR = "//upgrade/Far"
ORDER = "//upgrade/Order"
CONTRACT = "//upgrade/Contract"
INIT_Q, TARGET_Q, HELD_Q, FAR_Q = "initiator_q", "target_q", "held_q", "far_q"
#: The priority the broker priority row gives the initiator's side of CONTRACT.
URGENT = 8
#: No server has a backend with this pid (above Linux's largest pid_max, 2**22).
DEAD_PID = 99_999_999
#: The logical names of the two broker databases in each other's routes.
NEAR_NAME, FAR_NAME = "near", "far"

# Codes and values the code of revisions 0001-0010 wrote (airflow_broker/constants.py,
# validation.py of that time): message status, precedence, validation codes, endpoint states.
READY = 1
PRECEDENCE_TIMER, PRECEDENCE_ERROR, PRECEDENCE_NORMAL = 0, 1, 2


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def version_of(url: str) -> str | None:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
    finally:
        engine.dispose()


def build_at(url: str, revision: str) -> None:
    """The broker tables at ``revision`` (as that revision's migrations made them), no rows."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            command.upgrade(alembic_config(conn), revision)
    finally:
        engine.dispose()
    assert version_of(url) == revision


# --------------------------------------------------------------------------------------------
# the old state, in SQL of the old schema


@dataclass
class Dialog:
    """Both sides of a local dialog as :func:`fill` wrote them."""

    initiator: uuid.UUID
    target: uuid.UUID
    #: bodies of the messages waiting for the target side, in order (None: a system message)
    to_target: list[Any] = field(default_factory=list)
    #: bodies of the replies waiting for the initiator side, in order
    to_initiator: list[Any] = field(default_factory=list)


@dataclass
class Outbound:
    """A dialog whose target has no endpoint yet: its messages wait in the transmission queue."""

    initiator: uuid.UUID
    to_target: list[Any]


@dataclass
class OldState:
    """What :func:`fill` wrote, for :func:`check_carries_on` to look for."""

    revision: str
    dialect: str
    instance_id: str
    queue_ids: dict[str, int]
    #: a local dialog in conversation; the initiator's timer is due, the target's is not
    talking: Dialog
    #: the initiator ended it: its last message and the EndDialog wait for the target
    ending: Dialog
    #: its lifetime ran out before the upgrade
    expired: Dialog
    #: to FAR through the route (far_broker_instance unknown)
    remote: Outbound
    #: to FAR's broker instance, named at BEGIN DIALOG
    remote_by_instance: Outbound
    #: to HELD, whose queue is disabled
    held: Outbound
    future_timer: datetime
    committed_lease: bool


class OldWriter:
    """INSERTs into the tables as they are at an old revision, with values as that code wrote
    them (SQLite: UUIDs as 32 hex digits, timestamps as UTC text; PostgreSQL: native types)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.sqlite = conn.dialect.name == "sqlite"

    def value(self, v: Any) -> Any:
        if self.sqlite and isinstance(v, uuid.UUID):
            return v.hex
        if self.sqlite and isinstance(v, datetime):
            utc = v.astimezone(UTC) if v.tzinfo else v
            return utc.replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f")
        return v

    def insert(self, table: str, **values: Any) -> Any:
        columns = ", ".join(values)
        params = ", ".join(f":{name}" for name in values)
        return self.conn.execute(
            text(f"INSERT INTO {table} ({columns}) VALUES ({params})"),
            {k: self.value(v) for k, v in values.items()},
        )

    def update(self, table: str, where: dict[str, Any], **values: Any) -> None:
        sets = ", ".join(f"{k} = :set_{k}" for k in values)
        cond = " AND ".join(f"{k} = :where_{k}" for k in where)
        params = {f"set_{k}": self.value(v) for k, v in values.items()}
        params.update({f"where_{k}": self.value(v) for k, v in where.items()})
        self.conn.execute(text(f"UPDATE {table} SET {sets} WHERE {cond}"), params)

    def scalar(self, sql: str, **params: Any) -> Any:
        return self.conn.execute(
            text(sql), {k: self.value(v) for k, v in params.items()}
        ).scalar_one()


def body(value: Any) -> bytes:
    """A body as that code's encode_body made it from a JSON value."""
    return json.dumps(value, separators=(",", ":")).encode()


class OldBroker:
    """The verbs of the broker of revisions 0001-0010, as the rows they wrote."""

    def __init__(self, w: OldWriter, instance_id: str, now: datetime) -> None:
        self.w = w
        self.instance_id = instance_id
        self.now = now
        self.queue_ids: dict[str, int] = {}
        self.endpoints: dict[uuid.UUID, dict[str, Any]] = {}

    # -- definitions -------------------------------------------------------------------------
    def create_queue(self, name: str, *, status: bool = True) -> None:
        self.w.insert(
            "broker_queue",
            name=name,
            status=status,
            retention=False,
            poison_message_handling=True,
            activation=None,
            rollback_count=0,
            created_at=self.now,
            modified_at=self.now,
        )
        self.queue_ids[name] = self.w.scalar(
            "SELECT queue_id FROM broker_queue WHERE name = :n", n=name
        )

    def create_service(self, name: str, queue: str, contracts: list[str]) -> None:
        self.w.insert(
            "broker_service", name=name, queue_id=self.queue_ids[queue], created_at=self.now
        )
        for contract in contracts:
            self.w.insert("broker_service_contract", service_name=name, contract_name=contract)

    # -- dialogs -------------------------------------------------------------------------------
    def begin_dialog(
        self,
        from_service: str,
        queue: str,
        to_service: str,
        contract: str,
        *,
        priority: int = 5,
        broker_instance: str | None = None,
        lifetime: datetime | None = None,
    ) -> uuid.UUID:
        handle, group = uuid.uuid4(), uuid.uuid4()
        queue_id = self.queue_ids[queue]
        self.w.insert("broker_conversation_group", conversation_group_id=group, queue_id=queue_id)
        row = dict(
            conversation_handle=handle,
            conversation_id=uuid.uuid4(),
            is_initiator=True,
            conversation_group_id=group,
            queue_id=queue_id,
            service_name=from_service,
            far_service=to_service,
            far_broker_instance=broker_instance,
            far_handle=None,
            contract_name=contract,
            state="SO",
            priority=priority,
            lifetime=lifetime,
            timer_due_at=None,
            send_sequence=0,
            receive_sequence=0,
            created_at=self.now,
            closed_at=None,
        )
        self.w.insert("broker_conversation_endpoint", **row)
        self.endpoints[handle] = row
        return handle

    def _accept(self, initiator: uuid.UUID, queue: str, priority: int) -> uuid.UUID:
        """The first message of a local dialog created its target endpoint."""
        sender = self.endpoints[initiator]
        handle, group = uuid.uuid4(), uuid.uuid4()
        queue_id = self.queue_ids[queue]
        self.w.insert("broker_conversation_group", conversation_group_id=group, queue_id=queue_id)
        row = dict(
            sender,
            conversation_handle=handle,
            is_initiator=False,
            conversation_group_id=group,
            queue_id=queue_id,
            service_name=sender["far_service"],
            far_service=sender["service_name"],
            far_broker_instance=self.instance_id,
            far_handle=initiator,
            state="CO",
            priority=priority,
            timer_due_at=None,
            send_sequence=0,
            receive_sequence=0,
        )
        self.w.insert("broker_conversation_endpoint", **row)
        self.endpoints[handle] = row
        self._set(initiator, far_handle=handle, far_broker_instance=self.instance_id)
        return handle

    def _set(self, handle: uuid.UUID, **values: Any) -> None:
        self.w.update("broker_conversation_endpoint", {"conversation_handle": handle}, **values)
        self.endpoints[handle].update(values)

    def _take_seq(self, handle: uuid.UUID) -> int:
        row = self.endpoints[handle]
        seq: int = row["send_sequence"]
        state = "CO" if row["state"] == "SO" else row["state"]
        self._set(handle, send_sequence=seq + 1, state=state)
        return seq

    def _enqueue(
        self,
        to: uuid.UUID,
        message_type: str,
        seq: int,
        payload: bytes | None,
        validation: str,
        precedence: int = PRECEDENCE_NORMAL,
    ) -> None:
        far = self.endpoints[to]
        self.w.insert(
            "broker_message",
            queue_id=far["queue_id"],
            conversation_group_id=far["conversation_group_id"],
            conversation_handle=to,
            message_sequence_number=seq,
            status=READY,
            priority=far["priority"],
            precedence=precedence,
            service_name=far["service_name"],
            service_contract_name=far["contract_name"],
            message_type_name=message_type,
            validation=validation,
            message_body=payload,
            enqueued_at=self.now,
        )
        self._set(to, receive_sequence=seq + 1)

    def send_local(
        self,
        sender: uuid.UUID,
        message_type: str,
        value: Any,
        validation: str,
        *,
        target_queue: str | None = None,
        target_priority: int = 5,
    ) -> uuid.UUID:
        """SEND to a far side in this database (created by the first message); returns it."""
        seq = self._take_seq(sender)
        far = self.endpoints[sender]["far_handle"]
        if far is None:
            assert target_queue is not None
            far = self._accept(sender, target_queue, target_priority)
        self._enqueue(far, message_type, seq, body(value), validation)
        assert isinstance(far, uuid.UUID)
        return far

    def end_conversation(self, handle: uuid.UUID) -> None:
        """END CONVERSATION of a side whose far side still converses: DO here, DI there."""
        seq = self._take_seq(handle)
        self._set(handle, state="DO", timer_due_at=None)
        far = self.endpoints[handle]["far_handle"]
        self._enqueue(far, END_DIALOG, seq, None, "E")
        self._set(far, state="DI")

    def send_waiting(self, sender: uuid.UUID, value: Any, reason: str, *, due: datetime) -> None:
        """SEND whose message went to the transmission queue (``reason``), due at ``due``."""
        seq = self._take_seq(sender)
        e = self.endpoints[sender]
        values = dict(
            conversation_handle=sender,
            conversation_id=e["conversation_id"],
            is_initiator=True,
            from_service_name=e["service_name"],
            from_broker_instance=self.instance_id,
            to_service_name=e["far_service"],
            to_broker_instance=e["far_broker_instance"],
            service_contract_name=e["contract_name"],
            message_type_name=DEFAULT,
            message_sequence_number=seq,
            priority=e["priority"],
            validation="N",
            message_body=body(value),
            lifetime=e["lifetime"],
            enqueued_at=self.now,
            transmission_status=reason,
            attempts=0,
            next_attempt_at=due,
        )
        self.w.insert("broker_transmission_queue", **values)

    def set_timer(self, handle: uuid.UUID, due: datetime) -> None:
        self._set(handle, timer_due_at=due)


def fill(url: str, revision: str, far_instance: str) -> OldState:
    """Write the old state (see the module docstring) into ``url``, at ``revision``."""
    assert version_of(url) == revision
    has_commit_markers = revision >= "0003"
    engine = create_engine(url, poolclass=NullPool)
    now = utcnow() - timedelta(minutes=10)  # written ten minutes before the upgrade
    instance_id = str(uuid.uuid4())
    try:
        with engine.begin() as conn:
            w = OldWriter(conn)
            # migrate() of that time: the identity, DEFAULT, AutoCreatedLocal.
            identity: dict[str, Any] = dict(
                id=1, instance_id=instance_id, forwarding=False, created_at=now
            )
            if revision >= "0009":
                identity["fingerprint"] = physical_fingerprint(conn)
            w.insert("broker_instance", **identity)
            w.insert("broker_message_type", name=DEFAULT, validation="none", created_at=now)
            w.insert("broker_contract", name=DEFAULT, created_at=now)
            w.insert(
                "broker_contract_message",
                contract_name=DEFAULT,
                message_type_name=DEFAULT,
                sent_by="any",
            )
            w.insert("broker_route", name=AUTO_CREATED_LOCAL, address="LOCAL", created_at=now)
            # The application's definitions.
            w.insert("broker_message_type", name=ORDER, validation="json", created_at=now)
            w.insert("broker_contract", name=CONTRACT, created_at=now)
            w.insert(
                "broker_contract_message",
                contract_name=CONTRACT,
                message_type_name=ORDER,
                sent_by="initiator",
            )
            w.insert(
                "broker_contract_message",
                contract_name=CONTRACT,
                message_type_name=DEFAULT,
                sent_by="any",
            )
            old = OldBroker(w, instance_id, now)
            old.create_queue(INIT_Q)
            old.create_queue(TARGET_Q)
            old.create_queue(HELD_Q, status=False)
            old.create_service(INITIATOR, INIT_Q, [DEFAULT, CONTRACT])
            old.create_service(TARGET, TARGET_Q, [DEFAULT, CONTRACT])
            old.create_service(HELD, HELD_Q, [DEFAULT])
            w.insert(
                "broker_route",
                name="ToFar",
                service_name=FAR,
                broker_instance=None,
                address=f"broker://{FAR_NAME}",
                mirror_address=None,
                expires_at=None,
                created_at=now,
            )
            w.insert(
                "broker_priority",
                name="Urgent",
                contract_name=CONTRACT,
                local_service=INITIATOR,
                remote_service=None,
                priority=URGENT,
            )

            # A dialog in conversation: three orders wait for the target, two replies for the
            # initiator; the initiator's timer is due, the target's in an hour.
            a = old.begin_dialog(INITIATOR, INIT_Q, TARGET, CONTRACT, priority=URGENT)
            orders = [{"order": n, "item": f"widget-{n}"} for n in range(3)]
            a_target = old.send_local(a, ORDER, orders[0], "J", target_queue=TARGET_Q)
            for order in orders[1:]:
                old.send_local(a, ORDER, order, "J")
            replies = [{"ack": 0}, {"ack": 1}]
            for reply in replies:
                old.send_local(a_target, DEFAULT, reply, "N")
            old.set_timer(a, now)
            future_timer = now + timedelta(hours=2)
            old.set_timer(a_target, future_timer)
            talking = Dialog(a, a_target, orders, replies)

            # A dialog the initiator ended after its last message.
            b = old.begin_dialog(INITIATOR, INIT_Q, TARGET, DEFAULT)
            b_target = old.send_local(b, DEFAULT, {"last": True}, "N", target_queue=TARGET_Q)
            old.end_conversation(b)
            ending = Dialog(b, b_target, [{"last": True}, None])

            # A dialog whose lifetime ended (five minutes before the upgrade).
            c = old.begin_dialog(
                INITIATOR, INIT_Q, TARGET, DEFAULT, lifetime=now + timedelta(minutes=5)
            )
            c_target = old.send_local(c, DEFAULT, {"too": "late"}, "N", target_queue=TARGET_Q)
            expired = Dialog(c, c_target, [{"too": "late"}])

            # Two dialogs to FAR, in another broker; their messages wait for delivery.
            if revision >= "0004":
                # Delivery between brokers (0004 on): due at once, for the next delivery pass.
                reason, due = f"waiting for delivery to broker://{FAR_NAME} (route ToFar)", now
            else:
                reason = (
                    f"no route to service {FAR!r}: it is not hosted by this broker and no route "
                    "reaches it yet (the conversation is delayed and retried)"
                )
                due = now + timedelta(seconds=1)
            d = old.begin_dialog(INITIATOR, INIT_Q, FAR, DEFAULT)
            remote = Outbound(d, [{"far": n} for n in range(3)])
            for value in remote.to_target:
                old.send_waiting(d, value, reason, due=due)
            e = old.begin_dialog(INITIATOR, INIT_Q, FAR, DEFAULT, broker_instance=far_instance)
            remote_by_instance = Outbound(e, [{"far_instance": n} for n in range(2)])
            if revision >= "0004":
                reason = f"waiting for delivery to broker instance {far_instance}"
            for value in remote_by_instance.to_target:
                old.send_waiting(e, value, reason, due=due)

            # A dialog to a local service whose queue is disabled.
            f = old.begin_dialog(INITIATOR, INIT_Q, HELD, DEFAULT)
            held = Outbound(f, [{"held": 0}])
            old.send_waiting(
                f,
                held.to_target[0],
                f"the target queue {HELD_Q!r} is disabled",
                due=now + timedelta(seconds=1),
            )

            # Receive leases: a reader that died holding messages of the target queue, and (with
            # commit markers) one whose transaction committed.
            target_q = old.queue_ids[TARGET_Q]
            if w.sqlite:
                database = make_url(url).database
                assert database
                leases = Path(database).resolve().with_name(Path(database).name + "-leases")
                leases.mkdir(exist_ok=True)
                # That code's lease file: the queue id, under an flock its dead reader released.
                (leases / f"{DEAD_PID}-{uuid.uuid4().hex}.lease").write_text(str(target_q))
            else:
                lease = dict(queue_id=target_q, pid=DEAD_PID, started_at=now)
                w.insert("broker_receive_lease", lease_key=1_000_001, backend_start=now, **lease)
                if has_commit_markers:
                    w.insert(
                        "broker_receive_lease", lease_key=1_000_002, backend_start=None, **lease
                    )
                    w.insert("broker_receive_commit", lease_key=1_000_002)
        return OldState(
            revision=revision,
            dialect=engine.dialect.name,
            instance_id=instance_id,
            queue_ids=dict(old.queue_ids),
            talking=talking,
            ending=ending,
            expired=expired,
            remote=remote,
            remote_by_instance=remote_by_instance,
            held=held,
            future_timer=future_timer,
            committed_lease=has_commit_markers and engine.dialect.name == "postgresql",
        )
    finally:
        engine.dispose()


# --------------------------------------------------------------------------------------------
# today's API on the upgraded database


def far_broker(far_url: str, near_url: str, near_instance: str) -> Broker:
    """The second broker database (today's schema): FAR on FAR_Q, a route back to INITIATOR."""
    far = Broker.connect(far_url, resolver={NEAR_NAME: near_url, FAR_NAME: far_url})
    far.migrate()
    far.create_queue(FAR_Q)
    far.create_service(FAR, queue=FAR_Q, contracts=[DEFAULT])
    far.create_route("Back", INITIATOR, near_instance, f"broker://{NEAR_NAME}")
    return far


def receive_all(broker: Broker, queue: str) -> dict[uuid.UUID, list[Message]]:
    """RECEIVE until the queue is empty, one transaction per group; messages by conversation."""
    got: dict[uuid.UUID, list[Message]] = defaultdict(list)
    for _ in range(100):
        with broker.transaction() as tx:
            messages = tx.receive(queue)
        if not messages:
            return dict(got)
        for m in messages:
            got[m.conversation_handle].append(m)
    raise AssertionError(f"{queue} never drained")


def payloads(messages: list[Message]) -> list[Any]:
    return [m.json() if m.message_type_name not in (END_DIALOG, ERROR) else None for m in messages]


@contextmanager
def connected(url: str, far_url: str) -> Iterator[Broker]:
    broker = Broker.connect(url, resolver={NEAR_NAME: url, FAR_NAME: far_url})
    try:
        yield broker
    finally:
        broker.dispose()


def check_carries_on(url: str, far_url: str, old: OldState, *, migrate: bool = True) -> None:
    """Upgrade ``url`` with ``Broker.migrate()`` (unless the caller did, e.g. through
    ``airflow db migrate``), then check that everything :func:`fill` wrote carries on."""
    with connected(url, far_url) as near:
        if migrate:
            assert version_of(url) == old.revision
            near.migrate()
        assert version_of(url) == head_revision()
        _check(near, url, far_url, old)


def _check(near: Broker, url: str, far_url: str, old: OldState) -> None:
    # -- definitions and identity --
    assert near.instance_id == old.instance_id
    assert not near.identity_status().copied
    catalog = near.catalog()
    assert {INIT_Q, TARGET_Q, HELD_Q} <= set(catalog.queues)
    assert {INITIATOR, TARGET, HELD} <= set(catalog.services)
    assert {DEFAULT, CONTRACT} <= set(catalog.contracts)
    assert {DEFAULT, ORDER} <= set(catalog.message_types)
    assert {AUTO_CREATED_LOCAL, "ToFar"} <= set(catalog.routes)
    status = {q.name: q for q in near.queue_status()}
    assert status[TARGET_Q].depth == 3 + 2 + 1  # talking's orders, ending's two, expired's one
    assert status[INIT_Q].depth == 2
    assert not status[HELD_Q].status
    waiting = near.transmission_queue()
    assert sorted((r.to_service_name, r.message_sequence_number) for r in waiting) == sorted(
        [(HELD, 0), (FAR, 0), (FAR, 0), (FAR, 1), (FAR, 1), (FAR, 2)]
    )
    t = old.talking
    timer = aware(endpoint(near, t.target).timer_due_at)
    assert timer is not None and abs((timer - old.future_timer).total_seconds()) < 1

    # The receive leases came through the upgrade (the dead reader's, and a committed one's).
    assert _receive_leases(near, url) == (2 if old.committed_lease else 1)

    # -- due work: the due timer fires, the lifetime expires, the dead reader counts --
    report = near.run_due()
    assert report.timers_fired == 1
    assert report.lifetimes_expired == 2  # both sides of the expired dialog
    assert report.rollbacks_counted == 1  # the dead reader; not the committed lease
    assert report.queues_disabled == 0
    status = {q.name: q for q in near.queue_status()}
    assert status[TARGET_Q].rollback_count == 1
    assert status[TARGET_Q].status
    assert _receive_leases(near, url) == 0
    assert endpoint(near, t.target).timer_due_at is not None  # not due: still set

    # -- RECEIVE: every message once, in order --
    to_target = receive_all(near, TARGET_Q)
    assert set(to_target) == {t.target, old.ending.target, old.expired.target}
    assert payloads(to_target[t.target]) == t.to_target
    assert [m.message_sequence_number for m in to_target[t.target]] == [0, 1, 2]
    assert {m.message_type_name for m in to_target[t.target]} == {ORDER}
    assert {m.priority for m in to_target[t.target]} == {5}
    assert {m.receive_count for m in to_target[t.target]} == {1}  # the dead reader held none
    assert [m.message_type_name for m in to_target[old.ending.target]] == [DEFAULT, END_DIALOG]
    assert payloads(to_target[old.ending.target]) == old.ending.to_target
    # The Error first (its precedence), then what had arrived before the lifetime ended.
    expired_error, late = to_target[old.expired.target]
    assert expired_error.error is not None and expired_error.error[0] == ERR_LIFETIME_EXPIRED
    assert [late.json()] == old.expired.to_target
    assert {q.name: q.rollback_count for q in near.queue_status()}[TARGET_Q] == 0  # a commit

    to_initiator = receive_all(near, INIT_Q)
    assert set(to_initiator) == {t.initiator, old.expired.initiator}
    # The DialogTimer comes before the dialog's other messages (its precedence).
    assert [m.message_type_name for m in to_initiator[t.initiator]] == [
        DIALOG_TIMER,
        DEFAULT,
        DEFAULT,
    ]
    assert payloads(to_initiator[t.initiator])[1:] == t.to_initiator
    assert [m.message_sequence_number for m in to_initiator[t.initiator]][1:] == [0, 1]
    (initiator_error,) = to_initiator[old.expired.initiator]
    assert initiator_error.error is not None and initiator_error.error[0] == ERR_LIFETIME_EXPIRED

    # -- the dialogs go on: SEND continues each sequence --
    with near.transaction() as tx:
        tx.send(t.initiator, ORDER, {"order": 3})
        with pytest.raises(MessageValidationError):
            tx.send(t.initiator, ORDER, b"not json")
        tx.send(t.target, DEFAULT, {"ack": 2})
        tx.end_conversation(old.ending.target)
    with near.transaction() as tx:
        (order,) = tx.receive(TARGET_Q)
        assert (order.message_sequence_number, order.json()) == (3, {"order": 3})
    with near.transaction() as tx:
        (ack,) = tx.receive(INIT_Q)
        assert (ack.message_sequence_number, ack.json()) == (2, {"ack": 2})
        tx.end_conversation(t.initiator)
    with near.transaction() as tx:
        (end,) = tx.receive(TARGET_Q)
        assert (end.message_type_name, end.message_sequence_number) == (END_DIALOG, 4)
        tx.end_conversation(t.target)
    for handle in (t.initiator, t.target, old.ending.initiator, old.ending.target):
        assert endpoint(near, handle).state == "CD"
    # The broker priority still applies to new dialogs.
    with near.transaction() as tx:
        fresh = tx.begin_dialog(INITIATOR, TARGET, CONTRACT)
    assert endpoint(near, fresh).priority == URGENT

    # -- the transmission queue: the re-enabled local queue, and the other broker --
    near.alter_queue(HELD_Q, status=True)
    near.run_due()
    held = receive_all(near, HELD_Q)
    (held_msgs,) = held.values()
    assert payloads(held_msgs) == old.held.to_target

    far = far_broker(far_url, url, near.instance_id)
    try:
        for _ in range(5):
            near.deliver(retry_now=True)
            if not near.transmission_queue():
                break
        assert near.transmission_queue() == []
        arrived = receive_all(far, FAR_Q)
        dialogs = [json.dumps(payloads(msgs)) for msgs in arrived.values()]
        assert sorted(dialogs) == sorted(
            json.dumps(d.to_target) for d in (old.remote, old.remote_by_instance)
        )
        for msgs in arrived.values():
            assert [m.message_sequence_number for m in msgs] == list(range(len(msgs)))
        # The far side answers on each dialog; the answers come back to the initiator.
        with far.transaction() as tx:
            for handle in arrived:
                tx.send(handle, DEFAULT, {"from": "far"})
        for _ in range(5):
            far.deliver(retry_now=True)
            if not far.transmission_queue():
                break
        assert far.transmission_queue() == []
        answers = receive_all(near, INIT_Q)
        assert set(answers) == {old.remote.initiator, old.remote_by_instance.initiator}
        for msgs in answers.values():
            assert [(m.message_sequence_number, m.json()) for m in msgs] == [(0, {"from": "far"})]
        # And the initiators go on sending after the answers.
        with near.transaction() as tx:
            tx.send(old.remote.initiator, DEFAULT, {"far": 3})
        near.deliver(retry_now=True)
        with far.transaction() as tx:
            (more,) = tx.receive(FAR_Q)
        assert (more.message_sequence_number, more.json()) == (3, {"far": 3})
    finally:
        far.dispose()
    assert near.check() == []


def endpoint(broker: Broker, handle: uuid.UUID) -> ConversationEndpoint:
    with broker.transaction() as tx:
        return tx.conversation(handle)


def _receive_leases(near: Broker, url: str) -> int:
    """Receive leases on record: PostgreSQL's rows (and their commit markers), SQLite's files."""
    if near.engine.dialect.name == "postgresql":
        with near.engine.connect() as conn:
            rows = conn.execute(text("SELECT count(*) FROM broker_receive_lease")).scalar_one()
            marks = conn.execute(text("SELECT count(*) FROM broker_receive_commit")).scalar_one()
        assert marks <= rows
        return int(rows)
    database = make_url(url).database
    assert database
    leases = Path(database).resolve().with_name(Path(database).name + "-leases")
    return len(list(leases.glob("*.lease")))
