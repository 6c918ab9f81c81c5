"""Where an outgoing message goes inside one broker database: the far endpoint's queue, or the
transmission queue with the reason it waits."""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import (
    Uuid,
    bindparam,
    delete,
    exists,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection

from airflow_broker import bulk, routing
from airflow_broker import schema as s
from airflow_broker.constants import (
    DIALOG_TIMER,
    END_DIALOG,
    ERR_CONTRACT_NOT_SUPPORTED,
    ERR_SERVICE_NOT_FOUND,
    ERROR,
    PRECEDENCE_ERROR,
    PRECEDENCE_NORMAL,
    PRECEDENCE_TIMER,
    SENDABLE_STATES,
    STATUS_READY,
)
from airflow_broker.engines import aware
from airflow_broker.errors import (
    ContractViolation,
    UnknownObject,
)
from airflow_broker.objects import (
    error_body,
)

if TYPE_CHECKING:
    from airflow_broker.broker import Broker

log = logging.getLogger("airflow_broker")

#: First retry delay of a transmission that could not go; doubles per attempt up to the cap.
RETRY_BASE = timedelta(seconds=1)
RETRY_CAP = timedelta(seconds=60)


def precedence(message_type: str) -> int:
    if message_type == DIALOG_TIMER:
        return PRECEDENCE_TIMER
    if message_type == ERROR:
        return PRECEDENCE_ERROR
    return PRECEDENCE_NORMAL


# ---------------------------------------------------------------------------------------------
# Delivery inside one broker database
# ---------------------------------------------------------------------------------------------


@cache
def endpoint_statement(dialect: str) -> Any:
    """Endpoints by handle (bind ``handles``, a list), with what SEND needs of the far side.

    On PostgreSQL the local endpoint rows are locked: sequence numbers are handed out under
    that lock, so concurrent SENDs on one conversation queue up instead of colliding.
    """
    e = s.conversation_endpoint.alias("e")
    f = s.conversation_endpoint.alias("f")
    fq = s.queue.alias("fq")
    q = s.queue.alias("q")
    t = s.transmission_queue
    stmt = (
        select(
            e,
            q.c.retention.label("own_retention"),
            f.c.queue_id.label("far_queue_id"),
            f.c.conversation_group_id.label("far_group_id"),
            f.c.state.label("far_state"),
            f.c.priority.label("far_priority"),
            f.c.service_name.label("far_service_name"),
            fq.c.status.label("far_queue_status"),
            fq.c.name.label("far_queue_name"),
            exists().where(t.c.conversation_handle == e.c.conversation_handle).label("has_pending"),
        )
        .join(q, q.c.queue_id == e.c.queue_id)
        .outerjoin(f, f.c.conversation_handle == e.c.far_handle)
        .outerjoin(fq, fq.c.queue_id == f.c.queue_id)
        .where(e.c.conversation_handle.in_(bindparam("handles", expanding=True)))
    )
    if dialect == "postgresql":
        stmt = stmt.with_for_update(of=e)
    return stmt


def on_fast_path(sender: Any) -> bool:
    """Whether a message on this endpoint goes straight into a far queue in this database:
    the far endpoint exists here, its queue is enabled, nothing of the dialog is waiting in the
    transmission queue and this side keeps no retained copies."""
    return (
        sender.far_queue_id is not None
        and bool(sender.far_queue_status)
        and not sender.has_pending
        and not sender.own_retention
    )


# The fast path writes only the sender's endpoint, never the far one: two readers sending on one
# dialog in opposite directions would otherwise lock the two endpoint rows in opposite orders and
# deadlock. The far side's receive_sequence is derived where it is shown (Transaction.conversation).

#: PostgreSQL: SEND of one message on many conversations in one statement: next sequence numbers
#: on the senders (locked by the caller's SELECT ... FOR UPDATE), the messages in the far queues.
_FAST_SEND_PG = text(
    """
WITH snd AS (
    UPDATE broker_conversation_endpoint e
    SET send_sequence = v.seq + 1,
        state = CASE WHEN e.state = 'SO' THEN 'CO' ELSE e.state END
    FROM unnest(CAST(:handles AS uuid[]), CAST(:seqs AS bigint[])) AS v(handle, seq)
    WHERE e.conversation_handle = v.handle
)
INSERT INTO broker_message (
    queue_id, conversation_group_id, conversation_handle, message_sequence_number, status,
    priority, precedence, service_name, service_contract_name, message_type_name, validation,
    message_body, enqueued_at)
SELECT v.queue_id, v.group_id, v.handle, v.seq, 1, v.priority, :precedence, v.service_name,
       v.contract, :message_type, :validation, :body, :now
FROM unnest(CAST(:far_queue_ids AS integer[]), CAST(:far_groups AS uuid[]),
            CAST(:far_handles AS uuid[]), CAST(:seqs AS bigint[]),
            CAST(:far_priorities AS smallint[]), CAST(:far_services AS text[]),
            CAST(:contracts AS text[]))
     AS v(queue_id, group_id, handle, seq, priority, service_name, contract)
"""
)

_e = s.conversation_endpoint
_SENDER_NEXT = (
    update(_e)
    .where(_e.c.conversation_handle == bindparam("b_handle"))
    .values(send_sequence=bindparam("b_next"), state=bindparam("b_state"))
)

#: PostgreSQL: SEND of one message on one conversation, checks included, in one statement. It
#: writes only when the conversation is on the fast path (see on_fast_path) and may send this
#: message type under its contract; otherwise it returns no row, writes nothing, and the caller
#: takes the general path, which says precisely what is wrong.
SEND_ONE_PG = text(
    """
WITH snd AS (
    UPDATE broker_conversation_endpoint e
    SET send_sequence = e.send_sequence + 1,
        state = CASE WHEN e.state = 'SO' THEN 'CO' ELSE e.state END
    FROM broker_conversation_endpoint f, broker_queue fq, broker_queue q,
         broker_contract_message cm
    WHERE e.conversation_handle = :handle
      AND e.state IN ('SO', 'SI', 'CO')
      AND (e.lifetime IS NULL OR e.lifetime > :now)
      AND f.conversation_handle = e.far_handle
      AND fq.queue_id = f.queue_id AND fq.status
      AND q.queue_id = e.queue_id AND NOT q.retention
      AND cm.contract_name = e.contract_name AND cm.message_type_name = :message_type
      AND cm.sent_by IN ('any', CASE WHEN e.is_initiator THEN 'initiator' ELSE 'target' END)
      AND NOT EXISTS (SELECT 1 FROM broker_transmission_queue t
                      WHERE t.conversation_handle = e.conversation_handle)
    RETURNING e.send_sequence - 1 AS seq, f.queue_id, f.conversation_group_id,
              f.conversation_handle, f.priority, f.service_name, e.contract_name
), ins AS (
    INSERT INTO broker_message (
        queue_id, conversation_group_id, conversation_handle, message_sequence_number, status,
        priority, precedence, service_name, service_contract_name, message_type_name,
        validation, message_body, enqueued_at)
    SELECT queue_id, conversation_group_id, conversation_handle, seq, 1, priority, :precedence,
           service_name, contract_name, :message_type, :validation, :body, :now
    FROM snd
)
SELECT seq FROM snd
"""
).bindparams(bindparam("handle", type_=Uuid()))


def send_fast(
    conn: Connection,
    dialect: str,
    senders: list[Any],
    message_type: str,
    body: bytes | None,
    validation: str,
    now: datetime,
) -> None:
    """SEND on conversations that are all :func:`on_fast_path`, set-based: one statement on
    PostgreSQL, two executemany batches on SQLite."""
    if dialect == "postgresql":
        conn.execute(
            _FAST_SEND_PG,
            {
                "handles": [r.conversation_handle for r in senders],
                "seqs": [r.send_sequence for r in senders],
                "far_handles": [r.far_handle for r in senders],
                "far_queue_ids": [r.far_queue_id for r in senders],
                "far_groups": [r.far_group_id for r in senders],
                "far_priorities": [r.far_priority for r in senders],
                "far_services": [r.far_service_name for r in senders],
                "contracts": [r.contract_name for r in senders],
                "precedence": precedence(message_type),
                "message_type": message_type,
                "validation": validation,
                "body": body,
                "now": now,
            },
        )
        return
    conn.execute(
        _SENDER_NEXT,
        [
            {
                "b_handle": r.conversation_handle,
                "b_next": r.send_sequence + 1,
                "b_state": "CO" if r.state == "SO" else r.state,
            }
            for r in senders
        ],
    )
    conn.execute(
        insert(s.message),
        [
            {
                "queue_id": r.far_queue_id,
                "conversation_group_id": r.far_group_id,
                "conversation_handle": r.far_handle,
                "message_sequence_number": r.send_sequence,
                "status": STATUS_READY,
                "priority": r.far_priority,
                "precedence": precedence(message_type),
                "service_name": r.far_service_name,
                "service_contract_name": r.contract_name,
                "message_type_name": message_type,
                "validation": validation,
                "message_body": body,
                "enqueued_at": now,
            }
            for r in senders
        ],
    )


def insert_message(
    *,
    queue_id: int,
    group_id: uuid.UUID,
    handle: uuid.UUID,
    seq: int,
    priority: int,
    service_name: str,
    contract: str,
    message_type: str,
    validation: str,
    body: bytes | None,
    now: datetime,
    status: int = STATUS_READY,
) -> Any:
    """The INSERT of one message into a queue."""
    return insert(s.message).values(
        queue_id=queue_id,
        conversation_group_id=group_id,
        conversation_handle=handle,
        message_sequence_number=seq,
        status=status,
        priority=priority,
        precedence=precedence(message_type),
        service_name=service_name,
        service_contract_name=contract,
        message_type_name=message_type,
        validation=validation,
        message_body=body,
        enqueued_at=now,
    )


def to_endpoint(
    endpoint: Any,
    message_type: str,
    seq: int,
    body: bytes | None,
    validation: str,
    now: datetime,
    status: int = STATUS_READY,
) -> Any:
    """The INSERT of a message into an endpoint's own queue: an Error or DialogTimer for this
    side, or (status 3) the retained copy of a message it sent."""
    return insert_message(
        queue_id=endpoint.queue_id,
        group_id=endpoint.conversation_group_id,
        handle=endpoint.conversation_handle,
        seq=seq,
        priority=endpoint.priority,
        service_name=endpoint.service_name,
        contract=endpoint.contract_name,
        message_type=message_type,
        validation=validation,
        body=body,
        now=now,
        status=status,
    )


@dataclass(frozen=True, slots=True)
class Hosted:
    """A service this broker hosts, as delivery sees it."""

    queue_id: int
    queue_name: str
    queue_status: bool
    contracts: frozenset[str]
    #: a data-dependent routing service: open to every contract
    router: bool

    def accepts(self, contract: str) -> bool:
        return self.router or contract in self.contracts


def hosted_services(broker: Broker, conn: Connection) -> dict[str, Hosted]:
    """The services this broker hosts, by name (cached briefly; queue status included, so a
    re-enabled queue is noticed within the cache's second)."""

    def load() -> dict[str, Hosted]:
        rows = conn.execute(
            select(
                s.service.c.name,
                s.service.c.queue_id,
                s.queue.c.name.label("queue_name"),
                s.queue.c.status,
                s.routing_service.c.name.label("router"),
            )
            .join(s.queue, s.queue.c.queue_id == s.service.c.queue_id)
            .outerjoin(s.routing_service, s.routing_service.c.name == s.service.c.name)
        ).all()
        contracts: dict[str, set[str]] = defaultdict(set)
        for r in conn.execute(select(s.service_contract)):
            contracts[r.service_name].add(r.contract_name)
        return {
            r.name: Hosted(
                r.queue_id,
                r.queue_name,
                bool(r.status),
                frozenset(contracts[r.name]),
                r.router is not None,
            )
            for r in rows
        }

    return broker.cached_definition("hosted_services", load)


def routes_of(broker: Broker, conn: Connection) -> list[routing.Route]:
    """This broker's routing table, as the pure rules see it (cached briefly)."""

    def load() -> list[routing.Route]:
        return [
            routing.Route(
                r.name,
                r.service_name,
                r.broker_instance,
                r.address,
                r.mirror_address,
                aware(r.expires_at),
            )
            for r in conn.execute(select(s.route).order_by(s.route.c.name))
        ]

    return broker.cached_definition("routes", load)


class Outgoing(NamedTuple):
    """One message on its way out of a SEND (or END CONVERSATION)."""

    message_type: str
    seq: int
    body: bytes | None
    validation: str
    now: datetime


class Delivery:
    """Puts one outgoing message where it goes: the far endpoint's queue when that is in this
    database and can take it, else the transmission queue with the reason it waits."""

    def __init__(self, broker: Broker, conn: Connection, *, batch: bool = False) -> None:
        self.b = broker
        self.conn = conn
        self.instance_id = broker.instance_id_on(conn)
        #: batch mode: transmission-queue rows are collected and written by :meth:`flush`
        #: (SEND on many conversations, each routed once)
        self._queued: list[dict[str, Any]] | None = [] if batch else None

    def flush(self) -> None:
        """Write the transmission-queue rows collected in batch mode, in one statement."""
        if self._queued:
            bulk.insert_rows(self.conn, s.transmission_queue, self._queued)
            self._queued.clear()

    def route(
        self,
        sender: Any,
        message_type: str,
        seq: int,
        body: bytes | None,
        validation: str,
        now: datetime,
    ) -> bool:
        """Deliver one message; False when it went to the transmission queue instead."""
        msg = Outgoing(message_type, seq, body, validation, now)
        if sender.has_pending:
            # Behind a message for another broker: the next delivery pass takes both in order.
            self._to_transmission(
                sender,
                msg,
                "waiting behind earlier messages of this conversation",
                retry_in=timedelta(0) if sender.far_handle is None else RETRY_BASE,
            )
            return False
        if sender.far_handle is not None:
            if sender.far_queue_id is None:
                if sender.far_broker_instance not in (None, self.instance_id):
                    self._to_transmission(
                        sender,
                        msg,
                        "waiting for delivery to another broker",
                    )
                    return False
                # The far endpoint was removed WITH CLEANUP: the conversation is gone there.
                self._error_back(
                    sender,
                    ERR_SERVICE_NOT_FOUND,
                    f"the far endpoint of this conversation (service "
                    f"{sender.far_service!r}) no longer exists",
                    now,
                )
                return True
            if not sender.far_queue_status:
                self._to_transmission(
                    sender,
                    msg,
                    f"the target queue {sender.far_queue_name!r} is disabled",
                )
                return False
            self._enqueue_far(
                sender.far_queue_id,
                sender.far_group_id,
                sender.far_handle,
                sender.far_priority,
                sender.far_service_name,
                sender.contract_name,
                msg,
            )
            self._far_received(sender.far_handle, seq, message_type, sender.far_state)
            return True
        # The far endpoint is not in this database (yet): the routes say where it is.
        if sender.far_broker_instance not in (None, self.instance_id):
            self._to_transmission(
                sender,
                msg,
                f"waiting for delivery to broker instance {sender.far_broker_instance}",
                retry_in=timedelta(0),
            )
            return False
        decision = self._decide(sender, now)
        if decision.kind == "remote":
            self._to_transmission(
                sender,
                msg,
                f"waiting for delivery to {decision.addresses[0]} ({decision.reason})",
                retry_in=timedelta(0),
            )
            return False
        target = self._local_target(sender) if decision.kind == "local" else None
        if target is None:
            self._to_transmission(
                sender,
                msg,
                f"{decision.reason}: it is not hosted by this broker and no route reaches it "
                "yet (the conversation is delayed and retried)"
                if decision.kind == "delayed"
                else f"no route to service {sender.far_service!r} (delayed and retried)",
                # the delivery pass routes it again (and asks a dynamic routing service)
                retry_in=timedelta(0),
            )
            return False
        if not target["router"] and sender.contract_name not in target["contracts"]:
            self._error_back(
                sender,
                ERR_CONTRACT_NOT_SUPPORTED,
                f"service {sender.far_service!r} does not accept contract {sender.contract_name!r}",
                now,
            )
            return True
        if not target["queue_status"]:
            self._to_transmission(
                sender,
                msg,
                f"the target queue {target['queue_name']!r} is disabled",
            )
            return False
        far = self._create_target_endpoint(sender, target, now)
        self._enqueue_far(
            target["queue_id"],
            far["group"],
            far["handle"],
            far["priority"],
            sender.far_service,
            sender.contract_name,
            msg,
        )
        self._far_received(far["handle"], seq, message_type, "CO")
        return True

    def _decide(self, sender: Any, now: datetime) -> routing.Decision:
        """Seed 001's routing of a conversation begun here, by this broker's routes."""
        from airflow_broker import dynamic

        hosted = hosted_services(self.b, self.conn)
        routes = routes_of(self.b, self.conn)
        service = sender.far_service
        # Step 4 delays the conversation; the delivery pass sends the route request.
        return routing.route_conversation(
            routes,
            service,
            sender.far_broker_instance,
            dialog_id=sender.conversation_id,
            now=now,
            local_services=list(hosted),
            dynamic_routing=dynamic.present(routes, service, now)
            and not dynamic.pending(self.conn, service, now),
        )

    def _local_target(self, sender: Any) -> dict[str, Any] | None:
        if sender.far_broker_instance not in (None, self.instance_id):
            return None
        row = self.conn.execute(
            select(
                s.service.c.queue_id,
                s.queue.c.status,
                s.queue.c.name,
                s.routing_service.c.name.label("router"),
            )
            .join(s.queue, s.queue.c.queue_id == s.service.c.queue_id)
            .outerjoin(s.routing_service, s.routing_service.c.name == s.service.c.name)
            .where(s.service.c.name == sender.far_service)
        ).first()
        if row is None:
            return None
        contracts = set(
            self.conn.execute(
                select(s.service_contract.c.contract_name).where(
                    s.service_contract.c.service_name == sender.far_service
                )
            ).scalars()
        )
        return {
            "queue_id": row.queue_id,
            "queue_status": row.status,
            "queue_name": row.name,
            "contracts": contracts,
            "router": row.router is not None,
        }

    def _create_target_endpoint(
        self, sender: Any, target: dict[str, Any], now: datetime
    ) -> dict[str, Any]:
        handle, group = uuid.uuid4(), uuid.uuid4()
        prio = priority_for(
            self.b, self.conn, sender.contract_name, sender.far_service, sender.service_name
        )
        self.conn.execute(
            insert(s.conversation_group).values(
                conversation_group_id=group, queue_id=target["queue_id"]
            )
        )
        self.conn.execute(
            insert(s.conversation_endpoint).values(
                conversation_handle=handle,
                conversation_id=sender.conversation_id,
                is_initiator=not sender.is_initiator,
                conversation_group_id=group,
                queue_id=target["queue_id"],
                service_name=sender.far_service,
                far_service=sender.service_name,
                far_broker_instance=self.instance_id,
                far_handle=sender.conversation_handle,
                contract_name=sender.contract_name,
                state="CO",
                priority=prio,
                lifetime=sender.lifetime,
                send_sequence=0,
                receive_sequence=0,
                created_at=now,
            )
        )
        self.conn.execute(
            update(s.conversation_endpoint)
            .where(s.conversation_endpoint.c.conversation_handle == sender.conversation_handle)
            .values(far_handle=handle, far_broker_instance=self.instance_id)
        )
        return {"handle": handle, "group": group, "priority": prio}

    def _enqueue_far(
        self,
        queue_id: int,
        group: uuid.UUID,
        handle: uuid.UUID,
        priority: int,
        service_name: str,
        contract: str,
        msg: Outgoing,
    ) -> None:
        self.conn.execute(
            insert_message(
                queue_id=queue_id,
                group_id=group,
                handle=handle,
                seq=msg.seq,
                priority=priority,
                service_name=service_name,
                contract=contract,
                message_type=msg.message_type,
                validation=msg.validation,
                body=msg.body,
                now=msg.now,
            )
        )

    def _far_received(
        self, far_handle: uuid.UUID, seq: int, message_type: str, far_state: str | None
    ) -> None:
        values: dict[str, Any] = {"receive_sequence": seq + 1}
        if message_type == END_DIALOG and far_state in SENDABLE_STATES:
            values["state"] = "DI"
        elif message_type == ERROR:
            values["state"] = "CD" if far_state == "DO" else "ER"
            values["timer_due_at"] = None
        self.conn.execute(
            update(s.conversation_endpoint)
            .where(s.conversation_endpoint.c.conversation_handle == far_handle)
            .values(**values)
        )

    def _to_transmission(
        self, sender: Any, msg: Outgoing, reason: str, *, retry_in: timedelta = RETRY_BASE
    ) -> None:
        """Into the transmission queue: ``retry_in`` 0 for messages for another broker (the
        next delivery pass takes them), later for a local target that cannot take it yet."""
        message_type, seq, body, validation, now = msg
        row = {
            "conversation_handle": sender.conversation_handle,
            "conversation_id": sender.conversation_id,
            "is_initiator": sender.is_initiator,
            "from_service_name": sender.service_name,
            "from_broker_instance": self.instance_id,
            "to_service_name": sender.far_service,
            "to_broker_instance": sender.far_broker_instance,
            "service_contract_name": sender.contract_name,
            "message_type_name": message_type,
            "message_sequence_number": seq,
            "priority": sender.priority,
            "validation": validation,
            "message_body": body,
            "lifetime": sender.lifetime,
            "enqueued_at": now,
            "transmission_status": reason,
            "attempts": 0,
            "next_attempt_at": now + retry_in,
        }
        if self._queued is not None:
            self._queued.append(row)
        else:
            self.conn.execute(insert(s.transmission_queue).values(**row))
        self.b.note_due(now + retry_in)
        # Waiting for a delivery pass is the normal way to another broker; anything else is news.
        log.log(
            logging.DEBUG if not retry_in else logging.INFO,
            "message %d of conversation %s waits in the transmission queue: %s",
            seq,
            sender.conversation_handle,
            reason,
        )

    def _error_back(self, sender: Any, code: int, description: str, now: datetime) -> None:
        """The dialog failed at the far side: the sender gets an Error and goes to ER."""
        self.conn.execute(
            to_endpoint(
                sender, ERROR, sender.receive_sequence, error_body(code, description), "X", now
            )
        )
        self.conn.execute(
            update(s.conversation_endpoint)
            .where(s.conversation_endpoint.c.conversation_handle == sender.conversation_handle)
            .values(state="ER", timer_due_at=None)
        )
        self.conn.execute(
            delete(s.transmission_queue).where(
                s.transmission_queue.c.conversation_handle == sender.conversation_handle
            )
        )
        log.warning("conversation %s failed: %s", sender.conversation_handle, description)


def priority_for(broker: Broker, conn: Connection, contract: str, local: str, remote: str) -> int:
    """The priority of a conversation endpoint: the most specific matching broker priority."""

    def load() -> list[Any]:
        return list(conn.execute(select(s.priority)))

    best: tuple[tuple[bool, bool, bool], int] | None = None
    for p in broker.cached_definition("priorities", load):
        if p.contract_name not in (None, contract):
            continue
        if p.local_service not in (None, local):
            continue
        if p.remote_service not in (None, remote):
            continue
        rank = (
            p.contract_name is not None,
            p.local_service is not None,
            p.remote_service is not None,
        )
        if best is None or rank > best[0]:
            best = (rank, p.priority)
    return best[1] if best else 5


#: PostgreSQL: SEND of one message on many conversations in one statement, all or nothing: it
#: writes only if every conversation is on the fast path and may send this message type (the
#: ``cand`` rows, read without locks); it returns how many it wrote. 0 sends the caller down the
#: general path. The UPDATE re-checks each sender's state on its latest version, so a
#: conversation ended concurrently is skipped, and the count tells the caller (who then fails the
#: transaction: a partial SEND must not commit).
SEND_MANY_PG = text(
    """
WITH cand AS (
    SELECT e.conversation_handle, f.queue_id, f.conversation_group_id,
           f.conversation_handle AS far_handle, f.priority, f.service_name, e.contract_name
    FROM broker_conversation_endpoint e
    JOIN broker_conversation_endpoint f ON f.conversation_handle = e.far_handle
    JOIN broker_queue fq ON fq.queue_id = f.queue_id AND fq.status
    JOIN broker_queue q ON q.queue_id = e.queue_id AND NOT q.retention
    JOIN broker_contract_message cm
      ON cm.contract_name = e.contract_name AND cm.message_type_name = :message_type
     AND cm.sent_by IN ('any', CASE WHEN e.is_initiator THEN 'initiator' ELSE 'target' END)
    WHERE e.conversation_handle = ANY(CAST(:handles AS uuid[]))
      AND e.state IN ('SO', 'SI', 'CO')
      AND (e.lifetime IS NULL OR e.lifetime > :now)
      AND NOT EXISTS (SELECT 1 FROM broker_transmission_queue t
                      WHERE t.conversation_handle = e.conversation_handle)
), snd AS (
    UPDATE broker_conversation_endpoint e
    SET send_sequence = e.send_sequence + 1,
        state = CASE WHEN e.state = 'SO' THEN 'CO' ELSE e.state END
    FROM cand
    WHERE e.conversation_handle = cand.conversation_handle
      AND (SELECT count(*) FROM cand) = :n
      AND e.state IN ('SO', 'SI', 'CO')
    RETURNING e.conversation_handle, e.send_sequence - 1 AS seq
), ins AS (
    INSERT INTO broker_message (
        queue_id, conversation_group_id, conversation_handle, message_sequence_number, status,
        priority, precedence, service_name, service_contract_name, message_type_name,
        validation, message_body, enqueued_at)
    SELECT cand.queue_id, cand.conversation_group_id, cand.far_handle, snd.seq, 1,
           cand.priority, :precedence, cand.service_name, cand.contract_name, :message_type,
           :validation, :body, :now
    FROM snd JOIN cand ON cand.conversation_handle = snd.conversation_handle
)
SELECT count(*) AS sent FROM snd
"""
)


def message_type_def(broker: Broker, conn: Connection, message_type: str) -> tuple[str, Any] | None:
    """(validation, json_schema) of a message type, or None if there is no such type."""

    def load() -> tuple[str, Any] | None:
        row = conn.execute(
            select(s.message_type.c.validation, s.message_type.c.json_schema).where(
                s.message_type.c.name == message_type
            )
        ).first()
        return None if row is None else (row.validation, row.json_schema)

    return broker.cached_definition(("message_type", message_type), load)


def contract_rule(
    broker: Broker, conn: Connection, contract: str, message_type: str
) -> tuple[str, str, Any]:
    """(sent_by, validation, json_schema) of ``message_type`` in ``contract``."""

    def load() -> tuple[str, str, Any] | None:
        row = conn.execute(
            select(
                s.contract_message.c.sent_by,
                s.message_type.c.validation,
                s.message_type.c.json_schema,
            )
            .join(s.message_type, s.message_type.c.name == s.contract_message.c.message_type_name)
            .where(
                s.contract_message.c.contract_name == contract,
                s.contract_message.c.message_type_name == message_type,
            )
        ).first()
        return None if row is None else (row.sent_by, row.validation, row.json_schema)

    rule = broker.cached_definition(("rule", contract, message_type), load)
    if rule is None:
        known = conn.execute(
            select(s.message_type.c.name).where(s.message_type.c.name == message_type)
        ).first()
        if known is None:
            raise UnknownObject(f"message type {message_type!r} does not exist in this broker")
        raise ContractViolation(
            f"message type {message_type!r} is not part of contract {contract!r}"
        )
    return rule
