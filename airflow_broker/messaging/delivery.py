"""Where an outgoing message goes inside one broker database: the far endpoint's queue, or the
transmission queue with the reason it waits.

The fast path of a dialog's steady state is :mod:`~airflow_broker.messaging.fast_send`; the
definitions read here are :mod:`~airflow_broker.messaging.lookups`; routing decisions are the pure
rules of :mod:`airflow_broker.routing`.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import (
    insert,
    select,
    update,
)
from sqlalchemy.engine import Connection

from airflow_broker import routing
from airflow_broker.constants import (
    END_DIALOG,
    ERR_CONTRACT_NOT_SUPPORTED,
    ERR_SERVICE_NOT_FOUND,
    ERROR,
    SENDABLE_STATES,
)
from airflow_broker.messaging.lookups import hosted_services, priority_for
from airflow_broker.messaging.objects import (
    error_body,
)
from airflow_broker.messaging.rows import drop_waiting, insert_message, to_endpoint
from airflow_broker.routing import dynamic
from airflow_broker.routing.routes import routes_of
from airflow_broker.security import dialogs
from airflow_broker.security.crypto import SecurityFailure
from airflow_broker.storage import bulk
from airflow_broker.storage import schema as s

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")

#: First retry delay of a transmission that could not go; doubles per attempt up to the cap.
RETRY_BASE = timedelta(seconds=1)
RETRY_CAP = timedelta(seconds=60)


def backoff(
    attempts: int, *, base: timedelta = RETRY_BASE, cap: timedelta = RETRY_CAP
) -> timedelta:
    """Delay before attempt number ``attempts + 1``: ``base`` (1 s) doubling up to ``cap``
    (:data:`RETRY_CAP`). The exponent stops growing once the cap is reached, so a message that
    waits for days (thousands of attempts) does not overflow the arithmetic."""
    return min(base * 2 ** min(max(attempts - 1, 0), 16), cap)


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

    def __init__(self, broker: BrokerContext, conn: Connection, *, batch: bool = False) -> None:
        self.b = broker
        self.conn = conn
        self.instance_id = broker.instance_id_on(conn)
        #: batch mode: transmission-queue rows are collected and written by :meth:`flush`
        #: (SEND on many conversations, each routed once)
        self._queued: list[dict[str, Any]] | None = [] if batch else None
        #: dialog security, per conversation: (sealing or None, why it waits or None)
        self._seals: dict[uuid.UUID, tuple[dialogs.Sealing | None, str | None]] = {}

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
                remote=sender.far_handle is None,
            )
            return False
        if sender.far_handle is not None:
            if sender.far_queue_id is None:
                if sender.far_broker_instance not in (None, self.instance_id):
                    self._to_transmission(
                        sender,
                        msg,
                        "waiting for delivery to another broker",
                        remote=True,
                        say_why=True,
                    )
                    return False
                self._far_removed(sender, now)
                return True
            if not sender.far_queue_status:
                self._to_transmission(
                    sender,
                    msg,
                    f"the target queue {sender.far_queue_name!r} is disabled",
                )
                return False
            far_state = sender.far_state
            if self.b.dialect == "postgresql":
                far_state = self._lock_far(sender.far_handle)
            if far_state == "busy":
                # Another transaction is writing the far endpoint (its side SENDs or ENDs, or a
                # cleanup removes it). Waiting for it here, with this side's endpoint locked,
                # deadlocks when that writer comes for this endpoint next (both sides ENDing at
                # once do). The message waits its turn in the transmission queue instead, ahead
                # of anything sent after it, and due work delivers it in a moment.
                self._to_transmission(
                    sender, msg, "waiting for the far endpoint to be free", retry_in=timedelta(0)
                )
                return False
            if far_state in ("DO", "CD"):
                self._far_ended(sender.far_handle, message_type, far_state, msg.now)
                return True
            # The far endpoint is updated (and so locked) before its message is written: a
            # cleanup that removed it since the sender row was read leaves nothing to update.
            far = self._far_received(sender.far_handle, seq, message_type, far_state, msg.now)
            if far is None:
                self._far_removed(sender, now)
                return True
            self._enqueue_far(
                far.queue_id,
                far.conversation_group_id,
                sender.far_handle,
                far.priority,
                far.service_name,
                sender.contract_name,
                msg,
            )
            return True
        # The far endpoint is not in this database (yet): the routes say where it is.
        if sender.far_broker_instance not in (None, self.instance_id):
            self._to_transmission(
                sender,
                msg,
                f"waiting for delivery to broker instance {sender.far_broker_instance}",
                retry_in=timedelta(0),
                remote=True,
                say_why=True,
            )
            return False
        decision = self._decide(sender, now)
        if decision.kind == "remote":
            self._to_transmission(
                sender,
                msg,
                f"waiting for delivery to {decision.addresses[0]} ({decision.reason})",
                retry_in=timedelta(0),
                remote=True,
                say_why=True,
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
                remote=True,
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
        self._far_received(far["handle"], seq, message_type, "CO", msg.now)
        return True

    def _decide(self, sender: Any, now: datetime) -> routing.Decision:
        """Seed 001's routing of a conversation begun here, by this broker's routes."""

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

    def close_far(self, sender: Any, seq: int, now: datetime) -> bool:
        """END on a side whose far side, in this database, ended first (``sender`` is in DI):
        close the far endpoint, which waits in DO for this END.

        Rule 4 of the lock order: this side's endpoint is held, so the far one is not waited
        for. When another transaction holds it (its owner SENDs or ENDs on it, a cleanup
        removes it), the EndDialog ``seq`` waits in the transmission queue and due work closes
        the far endpoint with it in a moment: then True (``seq`` is used). A far endpoint that
        is gone, or no longer DO, needs nothing."""
        far_state = sender.far_state
        if self.b.dialect == "postgresql":
            far_state = self._lock_far(sender.far_handle)
        if far_state == "busy":
            self._to_transmission(
                sender,
                Outgoing(END_DIALOG, seq, None, "E", now),
                "waiting for the far endpoint to be free",
                retry_in=timedelta(0),
            )
            return True
        if far_state == "DO":
            self._far_ended(sender.far_handle, END_DIALOG, far_state, now)
        return False

    def _far_removed(self, sender: Any, now: datetime) -> None:
        """The far endpoint was removed WITH CLEANUP: the conversation is gone there."""
        if sender.state == "CD":
            # A closed side's waiting EndDialog: there is no one left to tell, nor to tell it.
            log.debug("EndDialog of %s: the far endpoint is gone", sender.conversation_handle)
            return
        self._error_back(
            sender,
            ERR_SERVICE_NOT_FOUND,
            f"the far endpoint of this conversation (service {sender.far_service!r}) no longer "
            "exists",
            now,
        )

    def _lock_far(self, far_handle: uuid.UUID) -> str | None:
        """PostgreSQL: lock the far endpoint for its update and return its state, unless
        another transaction holds it: then ``"busy"``. None when it is gone (removed WITH
        CLEANUP; the update then finds nothing)."""
        f = s.conversation_endpoint
        state: str | None = self.conn.execute(
            select(f.c.state)
            .where(f.c.conversation_handle == far_handle)
            .with_for_update(key_share=True, skip_locked=True)
        ).scalar()
        if state is not None:
            return state
        gone = (
            self.conn.execute(
                select(f.c.conversation_handle).where(f.c.conversation_handle == far_handle)
            ).first()
            is None
        )
        return None if gone else "busy"

    def _far_ended(
        self, far_handle: uuid.UUID, message_type: str, far_state: str, now: datetime
    ) -> None:
        """The far side has ended (DO: it waits for this side's end; CD: closed). Like Service
        Broker, it takes no more messages; this side's own END or Error closes it."""
        if far_state == "DO" and message_type in (END_DIALOG, ERROR):
            self.conn.execute(
                update(s.conversation_endpoint)
                .where(s.conversation_endpoint.c.conversation_handle == far_handle)
                .values(state="CD", closed_at=now, timer_due_at=None)
            )
        log.debug("%s for ended conversation %s discarded", message_type, far_handle)

    def _far_received(
        self,
        far_handle: uuid.UUID,
        seq: int,
        message_type: str,
        far_state: str | None,
        now: datetime,
    ) -> Any:
        """Advance the far endpoint past ``seq`` (and its state for EndDialog and Error); the
        row where its messages go now (queue, group, priority, service), or None if it is gone.
        """
        values: dict[str, Any] = {"receive_sequence": seq + 1}
        if message_type == END_DIALOG and far_state in SENDABLE_STATES:
            values["state"] = "DI"
        elif message_type == ERROR:
            values["state"] = "CD" if far_state == "DO" else "ER"
            values["timer_due_at"] = None
            if far_state == "DO":
                # closed now: the purge of closed endpoints counts its retention from here
                values["closed_at"] = now
        f = s.conversation_endpoint
        row = self.conn.execute(
            update(f)
            .where(f.c.conversation_handle == far_handle)
            .values(**values)
            .returning(f.c.queue_id, f.c.conversation_group_id, f.c.priority, f.c.service_name)
        ).first()
        if values.get("state") == "ER":
            # A failed side can send nothing more: what waited to leave it goes, as when the
            # Error arrives from another broker (transport.inbound).
            self.conn.execute(drop_waiting(far_handle))
        return row

    def _to_transmission(
        self,
        sender: Any,
        msg: Outgoing,
        reason: str,
        *,
        retry_in: timedelta = RETRY_BASE,
        remote: bool = False,
        say_why: bool = False,
    ) -> None:
        """Into the transmission queue: ``retry_in`` 0 for messages for another broker (the
        next delivery pass takes them), later for a local target that cannot take it yet.
        ``remote``: bound for another broker (or maybe: no route yet), so sealed when its
        dialog is secure; ``say_why``: surely bound for another broker, so a dialog that waits
        for dialog security says so instead of ``reason``."""
        message_type, seq, body, validation, now = msg
        sealed = False
        if remote:
            sealing, waits = self._sealing(sender, now)
            if sealing is not None:
                body = dialogs.seal_body(
                    sealing.key,
                    sender.conversation_id,
                    sender.is_initiator,
                    seq,
                    message_type,
                    body,
                )
                sealed = True
            elif waits is not None and say_why:
                reason = waits
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
            "sealed": sealed or None,
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

    def prefetch_sealing(self, senders: list[Any], now: datetime) -> None:
        """Look up at once how many conversations bound for another broker seal what they send
        (:func:`dialogs.for_sending_many`: one query for their keys, one for the bindings),
        instead of two queries a conversation when each message is routed (measured: a SEND on
        1,000 conversations to another broker's service took 1.07 ms a message, 0.9 of it in
        those look-ups). ``senders`` are endpoint rows whose far side is not in this database."""
        if self.b.client_role is not None:
            return  # a restricted role seals nothing (see _sealing)
        todo = [r for r in senders if r.conversation_handle not in self._seals]
        if not todo:
            return
        for handle, got in dialogs.for_sending_many(self.conn, todo, now).items():
            if isinstance(got, dialogs.Wait | SecurityFailure):
                self._seals[handle] = (None, got.reason)
            else:
                self._seals[handle] = (got, None)

    def _sealing(self, sender: Any, now: datetime) -> tuple[dialogs.Sealing | None, str | None]:
        """The conversation's sealing (None: in clear), once per conversation and transaction,
        and why it waits when it must be secured and cannot be yet. A certificate that expired
        is left to the delivery pass, which stops the dialog."""
        handle = sender.conversation_handle
        if self.b.client_role is not None:
            # A restricted role (a reader replying to another broker) sees no keys: the owner's
            # delivery pass seals what it queued before anything leaves.
            return None, None
        if handle not in self._seals:
            try:
                self._seals[handle] = (dialogs.for_sending(self.conn, sender, now), None)
            except (dialogs.Wait, SecurityFailure) as exc:
                self._seals[handle] = (None, exc.reason)
        return self._seals[handle]

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
        self.conn.execute(drop_waiting(sender.conversation_handle))
        log.warning("conversation %s failed: %s", sender.conversation_handle, description)


__all__ = ["RETRY_BASE", "RETRY_CAP", "Delivery", "Outgoing", "backoff"]
