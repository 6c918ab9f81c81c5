"""CREATE / ALTER / DROP SERVICE, and what the last two do to the service's conversations.

ALTER SERVICE ... ON QUEUE moves the service's conversation endpoints, with the messages waiting
in them, to the new queue, as Service Broker does. DROP SERVICE first ends each conversation of
the service that is still open on this side, WITH ERROR where the far side still converses, so
that the far side (in this database or another) is told and does not wait for ever; then it
removes the service's messages and endpoints.

Both follow the lock order of :mod:`airflow_broker.messaging` on PostgreSQL: the service's
conversation groups first, in id order (rule 0, as END and MOVE take them), then its endpoints
``FOR UPDATE`` in handle order (rule 3), which waits for every writer into their queues.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Row, bindparam, delete, exists, insert, or_, select, update

from airflow_broker.constants import ERR_SERVICE_DROPPED, SENDABLE_STATES
from airflow_broker.errors import InvalidDefinition, UnknownObject
from airflow_broker.messaging.arguments import as_name
from airflow_broker.messaging.definitions_core import DefinitionsCore
from airflow_broker.messaging.ending import Ending
from airflow_broker.security import permissions
from airflow_broker.storage import schema as s
from airflow_broker.storage import waits
from airflow_broker.storage.clock import utcnow
from airflow_broker.storage.endpoint_locks import exclude_writers

log = logging.getLogger("airflow_broker")


class ServiceDefinitions(DefinitionsCore):
    """Services of a :class:`~airflow_broker.messaging.definitions.Definitions` transaction."""

    def create_service(self, name: str, queue: str, contracts: Sequence[str] = ()) -> None:
        """CREATE SERVICE on ``queue``; ``contracts`` are those it accepts as a target."""
        as_name(name, "service")
        wanted = _names(contracts, f"service {name!r}: contracts")
        self._refuse_existing(s.service, s.service.c.name, name, "service")
        qrow = self._queue_row(queue)
        missing = self._missing(s.contract, s.contract.c.name, wanted)
        if missing:
            raise UnknownObject(
                f"service {name!r} names contract(s) that do not exist: {', '.join(missing)}"
            )
        self._conn.execute(
            insert(s.service).values(name=name, queue_id=qrow.queue_id, created_at=utcnow())
        )
        if wanted:
            self._conn.execute(
                insert(s.service_contract),
                [{"service_name": name, "contract_name": c} for c in wanted],
            )
        # Messages that waited for a route to it: hosted here now, they go (one cause, one wait).
        waits.wake_for_route(self._conn, name, ())

    def alter_service(
        self,
        name: str,
        *,
        queue: str | None = None,
        add_contracts: Sequence[str] = (),
        drop_contracts: Sequence[str] = (),
    ) -> None:
        """ALTER SERVICE. Everything is checked before anything is written.

        :param queue: ON QUEUE: the service's conversation endpoints move to this queue with
            the messages waiting in them, in their conversation groups (an endpoint whose
            group also holds another service's conversations gets a group of its own there).
            Messages for the service waiting in the transmission queue are retried at once.
        :param add_contracts: contracts that dialogs begun with the service from now on may use.
        :param drop_contracts: contracts they may no longer use; dialogs already begun on one
            go on.
        """
        svc = self._conn.execute(select(s.service).where(s.service.c.name == name)).first()
        if svc is None:
            raise UnknownObject(f"service {name!r} does not exist in this broker")
        add = _names(add_contracts, f"service {name!r}: add_contracts")
        drop = _names(drop_contracts, f"service {name!r}: drop_contracts")
        both = [c for c in add if c in drop]
        if both:
            raise InvalidDefinition(
                f"service {name!r}: contract(s) {', '.join(both)} both added and dropped"
            )
        qrow = None if queue is None else self._queue_row(queue)
        missing = self._missing(s.contract, s.contract.c.name, add + drop)
        if missing:
            raise UnknownObject(
                f"service {name!r} names contract(s) that do not exist: {', '.join(missing)}"
            )
        sc = s.service_contract
        has = set(
            self._conn.execute(select(sc.c.contract_name).where(sc.c.service_name == name))
            .scalars()
            .all()
        )
        already = [c for c in add if c in has]
        if already:
            raise InvalidDefinition(
                f"service {name!r} already accepts contract(s) {', '.join(already)}"
            )
        lacking = [c for c in drop if c not in has]
        if lacking:
            raise InvalidDefinition(
                f"service {name!r} does not accept contract(s) {', '.join(lacking)}: "
                "nothing to drop"
            )
        if qrow is not None and qrow.queue_id != svc.queue_id:
            self._move_service(name, qrow)
        if add:
            self._conn.execute(
                insert(sc), [{"service_name": name, "contract_name": c} for c in add]
            )
        if drop:
            self._conn.execute(
                delete(sc).where(sc.c.service_name == name, sc.c.contract_name.in_(drop))
            )

    def drop_service(self, name: str) -> None:
        """DROP SERVICE, as Service Broker does it: the far side of each open conversation is
        told before the conversation goes.

        Each conversation of the service still open on this side ends first: WITH ERROR
        (:data:`~airflow_broker.constants.ERR_SERVICE_DROPPED`, naming the service) while the
        far side still converses, so that it gets an Error and goes to ER, in this database at
        once and in another by the next ``deliver()``; plainly where the far side ended first
        (DI) or the dialog has failed (ER). Then the service's messages go, and its endpoints,
        except those something still waits on: an endpoint with messages in the transmission
        queue (the Error on its way to another broker database) stays, closed, until delivery
        is done with it and the purge of closed endpoints removes it; one that ended before its
        far side did (DO) stays until the far side ends too. Dropping the queue takes those
        endpoints with it.
        """
        self._require(s.service, s.service.c.name, name, "service")
        if self._conn.dialect.name == "postgresql":
            self._lock_conversations(name)
        self._end_conversations(name)
        e, m, t = s.conversation_endpoint, s.message, s.transmission_queue
        endpoints = select(e.c.conversation_handle).where(e.c.service_name == name)
        self._conn.execute(delete(m).where(m.c.conversation_handle.in_(endpoints)))
        waited_on = or_(
            e.c.state == "DO",
            exists().where(t.c.conversation_handle == e.c.conversation_handle),
        )
        self._conn.execute(delete(e).where(e.c.service_name == name, ~waited_on))
        self._conn.execute(delete(s.service).where(s.service.c.name == name))
        permissions.forget_object(self._conn, permissions.SEND, name)

    # -- what ALTER and DROP do to the service's conversations ---------------------------------
    def _lock_conversations(self, name: str) -> None:
        """PostgreSQL: lock the conversation groups of the service's endpoints (in id order, as
        RECEIVE locks them), then the endpoints ``FOR UPDATE`` in handle order. The groups are
        read again under their locks: a MOVE CONVERSATION may have moved an endpoint into
        another group meanwhile (none can once its group is held)."""
        e, g = s.conversation_endpoint, s.conversation_group
        of_service = select(e.c.conversation_group_id).where(e.c.service_name == name).distinct()
        locked: set[uuid.UUID] = set()
        while True:
            groups = set(self._conn.execute(of_service).scalars().all())
            if groups <= locked:
                break
            locked |= groups
            self._conn.execute(
                select(g.c.conversation_group_id)
                .where(g.c.conversation_group_id.in_(sorted(locked, key=str)))
                .order_by(g.c.conversation_group_id)
                .with_for_update(key_share=True)  # FOR NO KEY UPDATE, as RECEIVE takes it
            )
        exclude_writers(
            self._conn,
            self._conn.execute(select(e.c.conversation_handle).where(e.c.service_name == name))
            .scalars()
            .all(),
        )
        self._conn.execute(
            select(e.c.conversation_handle)
            .where(e.c.service_name == name)
            .order_by(e.c.conversation_handle)
            .with_for_update()
        )

    def _end_conversations(self, name: str) -> None:
        """END CONVERSATION on each endpoint of the service still open on this side, through the
        transaction's own END (its Error reaches the far side however END's would)."""
        e = s.conversation_endpoint
        ending = Ending(self._broker, within=self._conn)
        description = f"service {name!r} has been dropped"
        handles = (
            self._conn.execute(
                select(e.c.conversation_handle)
                .where(e.c.service_name == name, e.c.state.not_in(("DO", "CD")))
                .order_by(e.c.conversation_handle)
            )
            .scalars()
            .all()
        )
        for handle in handles:
            # Read again: ending one side of a dialog the service holds with itself changes
            # the other side.
            state = self._conn.execute(
                select(e.c.state).where(e.c.conversation_handle == handle)
            ).scalar()
            if state in SENDABLE_STATES:
                ending.end_conversation(
                    handle, error_code=ERR_SERVICE_DROPPED, error_description=description
                )
            elif state in ("DI", "ER"):
                ending.end_conversation(handle)
        if handles:
            log.info("DROP SERVICE %r ended %d conversation(s)", name, len(handles))

    def _move_service(self, name: str, queue: Row[Any]) -> None:
        """ALTER SERVICE ... ON QUEUE: the service, its endpoints and their messages to
        ``queue``, set-based whatever the number of conversations."""
        if self._conn.dialect.name == "postgresql":
            self._lock_conversations(name)
        e, g, m, t = s.conversation_endpoint, s.conversation_group, s.message, s.transmission_queue
        to = queue.queue_id
        endpoints = select(e.c.conversation_handle).where(e.c.service_name == name)
        groups = select(e.c.conversation_group_id).where(e.c.service_name == name)
        other = e.alias("other")
        # Groups that also hold another service's endpoints stay where they are: this
        # service's endpoints in them get a new group of their own on the new queue.
        shared = (
            self._conn.execute(
                select(other.c.conversation_group_id)
                .where(other.c.conversation_group_id.in_(groups), other.c.service_name != name)
                .distinct()
            )
            .scalars()
            .all()
        )
        if shared:
            moves = [{"old_group": old, "new_group": uuid.uuid4()} for old in shared]
            self._conn.execute(
                insert(g),
                [{"conversation_group_id": mv["new_group"], "queue_id": to} for mv in moves],
            )
            self._conn.execute(
                update(e)
                .where(
                    e.c.conversation_group_id == bindparam("old_group"), e.c.service_name == name
                )
                .values(conversation_group_id=bindparam("new_group")),
                moves,
            )
            self._conn.execute(
                update(m)
                .where(
                    m.c.conversation_group_id == bindparam("old_group"),
                    m.c.conversation_handle.in_(endpoints),
                )
                .values(conversation_group_id=bindparam("new_group")),
                moves,
            )
        self._conn.execute(
            update(g).where(g.c.conversation_group_id.in_(groups)).values(queue_id=to)
        )
        self._conn.execute(update(e).where(e.c.service_name == name).values(queue_id=to))
        moved = self._conn.execute(
            update(m).where(m.c.conversation_handle.in_(endpoints)).values(queue_id=to)
        ).rowcount
        self._conn.execute(update(s.service).where(s.service.c.name == name).values(queue_id=to))
        if queue.status:
            # Messages that waited for the old queue (disabled, say) try the new one now.
            now = utcnow()
            here = self._broker.instance_id_on(self._conn)
            self._conn.execute(
                update(t)
                .where(
                    t.c.to_service_name == name,
                    or_(t.c.to_broker_instance.is_(None), t.c.to_broker_instance == here),
                )
                .values(next_attempt_at=now)
            )
            self._broker.note_due(now)
        log.info("service %r moved to queue %r with %d message(s)", name, queue.name, moved)


def _names(values: Sequence[str], what: str) -> list[str]:
    """A list of object names (one name alone is a list of one), each once, in order."""
    if isinstance(values, str):
        values = [values]
    for value in values:
        if not isinstance(value, str) or not value:
            raise InvalidDefinition(f"{what} must be names, not {value!r}")
    return list(dict.fromkeys(values))
