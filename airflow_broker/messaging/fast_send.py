"""SEND's fast path: the steady state of a dialog inside one database, in one statement.

When both endpoints of a dialog live in this database, the far queue is enabled and nothing of
the dialog waits in the transmission queue (:func:`on_fast_path`), a SEND is one statement on
PostgreSQL whatever the number of conversations: it checks state, lifetime, contract and the far
queue, advances the senders' sequence numbers and inserts the messages, all or nothing. Anything
else takes the general path of :class:`~airflow_broker.messaging.delivery.Delivery`, which says
precisely what is wrong.
"""

from __future__ import annotations

from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import (
    Uuid,
    bindparam,
    exists,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection

from airflow_broker.constants import (
    STATUS_READY,
)
from airflow_broker.messaging.rows import precedence
from airflow_broker.storage import schema as s


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
        # NO KEY UPDATE, not UPDATE: the far side's SENDs hold KEY SHARE on this row while they
        # write into its queue (see the lock order), and must not wait for this side's SEND.
        stmt = stmt.with_for_update(of=e, key_share=True)
    return stmt


#: PostgreSQL: lock the far endpoints of local dialogs (``handles``) ``FOR KEY SHARE`` before
#: writing into their queues, and read where their messages go now. An endpoint removed
#: meanwhile is missing from the answer; one moved to another group shows its new group.
LOCK_FAR_PG = text(
    """
SELECT conversation_handle, queue_id, conversation_group_id
FROM broker_conversation_endpoint
WHERE conversation_handle = ANY(CAST(:handles AS uuid[]))
ORDER BY conversation_handle
FOR KEY SHARE
"""
)


def far_endpoints_unchanged(conn: Connection, senders: list[Any]) -> bool:
    """PostgreSQL: take the KEY SHARE locks of the lock order on the far endpoints of
    ``senders`` (rows of :func:`endpoint_statement`) that live in this database; True when
    each is still where the rows say (False: read the rows again, now that they are locked)."""
    far = {r.far_handle: r for r in senders if r.far_queue_id is not None}
    if not far:
        return True
    locked = {
        r.conversation_handle: r
        for r in conn.execute(LOCK_FAR_PG, {"handles": sorted(far, key=str)})
    }
    return locked.keys() == far.keys() and all(
        (locked[h].queue_id, locked[h].conversation_group_id) == (r.far_queue_id, r.far_group_id)
        for h, r in far.items()
    )


def on_fast_path(sender: Any) -> bool:
    """Whether a message on this endpoint goes straight into a far queue in this database:
    the far endpoint exists here and has not ended, its queue is enabled, nothing of the dialog
    is waiting in the transmission queue and this side keeps no retained copies."""
    return (
        sender.far_queue_id is not None
        and sender.far_state not in ("DO", "CD")
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
#: takes the general path, which says precisely what is wrong. The far endpoint is locked FOR KEY
#: SHARE first (``far``), and its queue and group are read from the locked row: a cleanup that
#: removed it meanwhile leaves ``far`` empty, and nothing is written.
#:
#: ``seen`` guards against a stale snapshot: when the sender's row was changed by a transaction
#: that committed after this statement began (another SEND on it, perhaps one whose message had
#: to wait in the transmission queue), the UPDATE re-checks its conditions on the new row version
#: but the NOT EXISTS still sees the old snapshot, and the message could overtake the waiting one.
#: The send sequence then differs from what ``seen`` read, and the general path takes over.
SEND_ONE_PG = text(
    """
WITH far AS (
    SELECT f.conversation_handle, f.queue_id, f.conversation_group_id, f.priority,
           f.service_name, f.state
    FROM broker_conversation_endpoint s
    JOIN broker_conversation_endpoint f ON f.conversation_handle = s.far_handle
    WHERE s.conversation_handle = :handle
    FOR KEY SHARE OF f
), seen AS (
    SELECT send_sequence FROM broker_conversation_endpoint WHERE conversation_handle = :handle
), snd AS (
    UPDATE broker_conversation_endpoint e
    SET send_sequence = e.send_sequence + 1,
        state = CASE WHEN e.state = 'SO' THEN 'CO' ELSE e.state END
    FROM far f, broker_queue fq, broker_queue q, broker_contract_message cm
    WHERE e.conversation_handle = :handle
      AND e.state IN ('SO', 'SI', 'CO')
      AND e.send_sequence = (SELECT send_sequence FROM seen)
      AND (e.lifetime IS NULL OR e.lifetime > :now)
      AND f.conversation_handle = e.far_handle AND f.state NOT IN ('DO', 'CD')
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


#: PostgreSQL: SEND of one message on many conversations in one statement: it writes only if
#: every conversation is on the fast path and may send this message type (the ``cand`` rows,
#: which lock their far endpoints FOR KEY SHARE, in handle order, as they are read). The UPDATE
#: skips a sender that another transaction changed after this statement's snapshot (it waited
#: for that one's lock, then finds another send sequence or state than ``cand`` read; see
#: ``seen`` in SEND_ONE_PG for why that matters): the statement returns the handles it sent on,
#: and the caller sends on the others by the general path, in the same transaction, which reads
#: them afresh.
SEND_MANY_PG = text(
    """
WITH cand AS (
    SELECT e.conversation_handle, f.queue_id, f.conversation_group_id,
           f.conversation_handle AS far_handle, f.priority, f.service_name, e.contract_name,
           e.send_sequence AS seen_sequence, e.state AS seen_state
    FROM broker_conversation_endpoint e
    JOIN broker_conversation_endpoint f
      ON f.conversation_handle = e.far_handle AND f.state NOT IN ('DO', 'CD')
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
    ORDER BY f.conversation_handle
    FOR KEY SHARE OF f
), snd AS (
    UPDATE broker_conversation_endpoint e
    SET send_sequence = e.send_sequence + 1,
        state = CASE WHEN e.state = 'SO' THEN 'CO' ELSE e.state END
    FROM cand
    WHERE e.conversation_handle = cand.conversation_handle
      AND (SELECT count(*) FROM cand) = :n
      AND e.send_sequence = cand.seen_sequence AND e.state = cand.seen_state
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
SELECT conversation_handle FROM snd
"""
)
