"""SEND's fast path: the steady state of a dialog inside one database, in one statement.

When both endpoints of a dialog live in this database, the far queue is enabled and nothing of
the dialog waits in the transmission queue (:func:`on_fast_path`), a SEND is one statement on
PostgreSQL whatever the number of conversations: it checks state, lifetime, contract and the far
queue, advances the senders' sequence numbers and inserts the messages, all or nothing. Anything
else takes the general path of :class:`~airflow_broker.messaging.delivery.Delivery`, which says
precisely what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from functools import cache
from typing import TYPE_CHECKING, Any

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
from sqlalchemy.exc import DBAPIError

from airflow_broker import metrics
from airflow_broker.constants import (
    STATUS_READY,
    SYSTEM_MESSAGE_TYPES,
)
from airflow_broker.errors import MessageValidationError
from airflow_broker.messaging.arguments import Handle, send_handles
from airflow_broker.messaging.lookups import known_message_type_def, message_type_def
from airflow_broker.messaging.rows import precedence
from airflow_broker.messaging.validation import VALIDATION_CODES, encode_body, validate_body
from airflow_broker.storage import direct
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow
from airflow_broker.storage.endpoint_locks import ADVISORY_BUDGET

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext


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

#: PostgreSQL: SEND of one message on one conversation, checks included, in one round trip: the
#: function ``broker_send_one`` (:mod:`airflow_broker.storage.endpoint_locks`) locks the far
#: endpoint (a shared advisory lock, or FOR KEY SHARE when ``row_lock``), then reads it afresh
#: and writes only when the conversation is on the fast path (see on_fast_path) and may send
#: this message type under its contract. Otherwise it returns NULL, writes nothing, and the
#: caller takes the general path, which says precisely what is wrong. A cleanup that removed the
#: far endpoint before the lock was granted leaves nothing to write into.
SEND_ONE_PG = text(
    "SELECT broker_send_one(:handle, CAST(:message_type AS varchar), "
    "CAST(:precedence AS smallint), CAST(:validation AS varchar), CAST(:body AS bytea), "
    "CAST(:now AS timestamptz), CAST(:row_lock AS boolean))"
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


#: PostgreSQL: SEND of one message on many conversations in one round trip (the function
#: ``broker_send_many``): it locks the far endpoints in handle order, then writes only if every
#: conversation is on the fast path and may send this message type. The UPDATE skips a sender
#: that another transaction changed after the function's snapshot (it waited for that one's
#: lock, then finds another send sequence or state than it read; see ``seen`` in
#: ``broker_send_one`` for why that matters): the statement returns the handles it sent on, and
#: the caller sends on the others by the general path, in the same transaction, which reads them
#: afresh.
SEND_MANY_PG = text(
    "SELECT * FROM broker_send_many(CAST(:handles AS uuid[]), CAST(:message_type AS varchar), "
    "CAST(:precedence AS smallint), CAST(:validation AS varchar), CAST(:body AS bytea), "
    "CAST(:now AS timestamptz), CAST(:row_lock AS boolean))"
)

#: The bound names of :data:`SEND_ONE_PG` and :data:`SEND_MANY_PG` after the handle(s), in the
#: order of the direct statements' arguments below.
SEND_PARAMS = ("message_type", "precedence", "validation", "body", "now", "row_lock")

#: :data:`SEND_ONE_PG` and :data:`SEND_MANY_PG` prepared for :mod:`airflow_broker.storage.direct`
#: (one round trip, BEGIN included): arguments handle(s), message type, precedence, validation,
#: body, now, row_lock.
_SEND_TYPES = ("varchar", "smallint", "varchar", "bytea", "timestamptz", "boolean")
SEND_ONE_DIRECT = direct.Prepared(
    "SELECT broker_send_one($1, $2, $3, $4, $5, $6, $7)", ("uuid", *_SEND_TYPES)
)
SEND_MANY_DIRECT = direct.Prepared(
    "SELECT * FROM broker_send_many($1, $2, $3, $4, $5, $6, $7)", ("uuid[]", *_SEND_TYPES)
)

#: SQLSTATE of :data:`SENT_ALL_FUNCTION`'s error: the fast path did not reach every conversation.
NOT_ALL_SENT = "BRS01"

#: PostgreSQL (migration 0020): raises :data:`NOT_ALL_SENT` unless ``sent`` equals ``wanted``,
#: so that a COMMIT sent in the same query as the SEND does not run (``Broker.send``).
SENT_ALL_FUNCTION = f"""
CREATE OR REPLACE FUNCTION broker_sent_all(sent bigint, wanted integer) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    IF sent IS DISTINCT FROM wanted THEN
        RAISE EXCEPTION 'SEND reached % of % conversations by the fast path', sent, wanted
            USING ERRCODE = '{NOT_ALL_SENT}';
    END IF;
    RETURN sent;
END
$$
"""

#: :data:`SEND_ONE_DIRECT` and :data:`SEND_MANY_DIRECT` for a SEND whose COMMIT follows in the
#: same query: one row (how many were sent), or the error :data:`NOT_ALL_SENT`.
SEND_ONE_COMMITTING = direct.Prepared(
    "SELECT broker_sent_all(count(x.seq), 1) "
    "FROM (SELECT broker_send_one($1, $2, $3, $4, $5, $6, $7) AS seq) x",
    ("uuid", *_SEND_TYPES),
)
SEND_MANY_COMMITTING = direct.Prepared(
    "SELECT broker_sent_all(count(*), cardinality($1)) "
    "FROM broker_send_many($1, $2, $3, $4, $5, $6, $7)",
    ("uuid[]", *_SEND_TYPES),
)


def fast_args(
    broker: BrokerContext,
    conn: Connection | None,
    message_type: str,
    payload: bytes | None,
    now: datetime,
    *,
    row_lock: bool,
) -> list[Any] | None:
    """The fast path's arguments after the handle(s) (:data:`SEND_PARAMS`' order), or None
    when the message type is unknown or the body does not validate: the general path raises
    that, after the checks that come first. Without ``conn`` the message type is known only
    if this process read it lately (None otherwise)."""
    if conn is None:
        mtype = known_message_type_def(broker, message_type)
    else:
        mtype = message_type_def(broker, conn, message_type)
    if mtype is None:
        return None
    validation, schema = mtype
    try:
        validate_body(message_type, validation, schema, payload)
    except MessageValidationError:
        return None
    return [
        message_type,
        precedence(message_type),
        VALIDATION_CODES[validation],
        payload,
        now,
        row_lock,
    ]


def send_committed(
    broker: BrokerContext,
    handles: Handle | Sequence[Handle],
    message_type: str,
    body: Any,
) -> bool:
    """``Broker.send`` on PostgreSQL: the SEND by the fast path and its COMMIT in one query,
    on a pooled connection of its own (no Transaction, no SQLAlchemy Connection: they cost as
    much client time as the rest). True: sent and committed. False: nothing was sent; the
    caller SENDs the usual way, which says precisely what stands in the way (a dialog's first
    message, a far queue disabled, a far broker that has not answered yet or a secure dialog,
    retention, a type or body the fast path does not take, more conversations than the
    advisory locks cover). Bad handles and
    bodies raise here as they would there; other errors are raised, nothing committed."""
    if (
        broker.dialect != "postgresql"
        or broker.client_role is not None
        or message_type in SYSTEM_MESSAGE_TYPES
    ):
        return False
    handle_list = send_handles(handles)
    payload = encode_body(body)
    if payload is not None and len(payload) > direct.MAX_LITERAL_BODY:
        return False
    if len(handle_list) > ADVISORY_BUDGET:  # the far endpoints would be row-locked: usual way
        return False
    args = fast_args(broker, None, message_type, payload, utcnow(), row_lock=False)
    if args is None:
        return False
    single = len(handle_list) == 1
    args.insert(0, handle_list[0] if single else handle_list)
    statement = SEND_ONE_COMMITTING if single else SEND_MANY_COMMITTING
    fairy = broker.engine.raw_connection()
    try:
        direct.execute_committed(fairy, broker.engine, statement, args)
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) == NOT_ALL_SENT:
            return False  # rolled back: nothing was sent
        raise
    finally:
        fairy.close()
    metrics.incr(metrics.MESSAGES_SENT, len(handle_list))
    return True
