"""The lock that ties a message to its endpoint, taken in memory where the hot path allows.

No message may exist without its conversation endpoint (the lock order in
:mod:`airflow_broker.messaging`): a writer into an endpoint's queue holds a lock on that
endpoint that every remover of the endpoint (END CONVERSATION of every kind, DROP, a reset) and
every mover of its messages (MOVE CONVERSATION, ALTER SERVICE ... ON QUEUE) must wait for.

On PostgreSQL that lock comes in two forms, and removers take both:

- **A transaction-scoped advisory lock** keyed by the endpoint's handle
  (``uuid_hash_extended(handle, ENDPOINT_LOCK_SEED)``): SEND's fast path takes it *shared*,
  removers and movers take it *exclusive*. It lives in the server's lock table only: no tuple is
  written and nothing goes to the WAL, so a batched SEND into 100 far endpoints costs what its
  inserts cost. (A ``FOR KEY SHARE`` row lock marks each tuple and WAL-logs the mark: 100 of
  them add about 14% to a batched SEND statement and its commit, the advisory locks about 3%,
  measured statement by statement; ``bench.lock_cost`` measures the engine's rounds.)
- **The row lock** ``FOR KEY SHARE`` on the endpoint's row, for every other writer (SEND's
  general path, system messages, timers, the inbound accept of delivery, which update the row
  anyway), and for a fast-path SEND past :data:`ADVISORY_BUDGET` endpoints in one transaction:
  the lock table is shared by the whole server and sized for about 64 locks per connection,
  while tuple locks are unbounded. Removers take ``FOR UPDATE``, which waits for it.

A SEND reads the far endpoint (its queue, group and state) only *after* it holds the lock, in a
statement of its own with a fresh snapshot: the server-side functions ``broker_send_one`` and
``broker_send_many`` below (PL/pgSQL takes a new snapshot for each statement). In one statement
the snapshot would be older than the lock, and could still show an endpoint that a remover
deleted and committed in between. A single round trip all the same.

SQLite needs none of this: a broker transaction there holds the database's only write lock from
its first statement.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.engine import Connection

#: The seed of the advisory lock keys: ``uuid_hash_extended(handle, seed)``, a 64-bit key in
#: PostgreSQL's one-key space (Airflow's own advisory locks use small numbers there).
ENDPOINT_LOCK_SEED = 727170001

#: Far endpoints a transaction locks in memory (advisory locks) before SEND falls back to row
#: locks: PostgreSQL's lock table holds ``max_locks_per_transaction`` (64 by default) times the
#: connections, for all sessions together. One batched SEND to 100 dialogs fits.
ADVISORY_BUDGET = 128

_EXCLUDE_WRITERS = text(
    f"""
SELECT pg_advisory_xact_lock(uuid_hash_extended(h, {ENDPOINT_LOCK_SEED}))
FROM (SELECT DISTINCT h FROM unnest(CAST(:handles AS uuid[])) AS u(h) ORDER BY h OFFSET 0) AS s
"""
)


def exclude_writers(conn: Connection, handles: Sequence[uuid.UUID]) -> None:
    """PostgreSQL: wait for every fast-path SEND into these endpoints' queues to end, and keep
    new ones out until this transaction ends (the advisory half of a remover's lock; take
    ``FOR UPDATE`` on the rows too). Keys are taken in handle order, as the rows are."""
    if handles:
        conn.execute(_EXCLUDE_WRITERS, {"handles": sorted(set(handles), key=str)})


# The SEND functions. Parameters follow the columns they fill; p_row_lock chooses the lock kind.
# Their statements keep one generic plan each (SET plan_cache_mode, migration 0014): left to
# choose, the server planned the write anew on every call, because plans made for the actual
# values look cheaper (measured: a single SEND into a queue of 300,000 messages 0.91 ms with the
# per-call plans, 0.73 ms with the generic one; no change on an empty queue).
# That plan is made with sequential scans off (SET enable_seqscan, migration 0022): a session
# keeps it until the statistics of a table it reads change, and planned while the transmission
# queue was small it read that whole queue on every SEND once a far broker fell behind (1.6 ms a
# SEND against 0.6 with 20,000 messages waiting to leave, until the next ANALYZE).
# JIT is off in them (SET jit): under enable_seqscan = off the read of the one-row
# broker_instance is costed at 10^10, past jit_above_cost, and the server compiled the remote
# branch's statements on every call (measured: 0.3 s a SEND).
# The statements are SEND's one-statement fast path (messaging.fast_send) with the far endpoint
# read after it is locked. They return what the fast path sent on (nothing: the caller takes the
# general path, which says precisely what is wrong).
# The remote branch of both SEND functions (migration 0029). A client role that may not read
# the keys and bindings takes the general path, which leaves the sealing to the owner.
_MAY_READ_SECURITY = """has_table_privilege('broker_dialog_key', 'SELECT')
       AND has_table_privilege('broker_remote_service_binding', 'SELECT')"""
# Sender ``e``'s dialog is in clear: no session key, and for an initiator neither ENCRYPTION
# nor a remote service binding for its far service (what the general path would decide).
_IN_CLEAR = """NOT EXISTS (SELECT 1 FROM broker_dialog_key k
                              WHERE k.conversation_handle = e.conversation_handle)
              AND (NOT e.is_initiator
                   OR (NOT coalesce(e.encryption, false)
                       AND NOT EXISTS (SELECT 1 FROM broker_remote_service_binding b
                                       WHERE b.service = e.far_service)))"""


def _to_transmission(instance: str) -> str:
    """The INSERT of the transmission-queue rows of what CTE ``snd`` (the senders' endpoint
    rows and ``seq``) sent, from broker instance ``instance`` (an SQL expression)."""
    return f"""INSERT INTO broker_transmission_queue (
                conversation_handle, conversation_id, is_initiator, from_service_name,
                from_broker_instance, to_service_name, to_broker_instance,
                service_contract_name, message_type_name, message_sequence_number, priority,
                validation, message_body, lifetime, enqueued_at, transmission_status,
                attempts, next_attempt_at)
            SELECT snd.conversation_handle, snd.conversation_id, snd.is_initiator,
                   snd.service_name, {instance}, snd.far_service, snd.far_broker_instance,
                   snd.contract_name, p_message_type, snd.seq, snd.priority, p_validation,
                   p_body, snd.lifetime, p_now,
                   'waiting for delivery to broker instance ' || snd.far_broker_instance, 0,
                   p_now
            FROM snd"""


SEND_ONE_FUNCTION = f"""
CREATE OR REPLACE FUNCTION broker_send_one(
    p_handle uuid, p_message_type varchar, p_precedence smallint, p_validation varchar,
    p_body bytea, p_now timestamptz, p_row_lock boolean
) RETURNS bigint LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    v_far uuid;
    v_far_instance varchar;
    v_seq bigint;
BEGIN
    SELECT far_handle, far_broker_instance INTO v_far, v_far_instance
    FROM broker_conversation_endpoint WHERE conversation_handle = p_handle;
    IF v_far_instance IS NOT NULL AND v_far_instance <> (SELECT instance_id FROM broker_instance)
       AND (v_far IS NULL OR NOT EXISTS (SELECT 1 FROM broker_conversation_endpoint
                                         WHERE conversation_handle = v_far))
       AND {_MAY_READ_SECURITY} THEN
        -- The far side lives in another broker, known since its first answer: the message
        -- waits in the transmission queue for a delivery pass, in clear. Not when the dialog is
        -- secure (a session key, or one due: an initiator with ENCRYPTION or a remote service
        -- binding for its far service): the general path seals it. (A local dialog's
        -- far_broker_instance is NULL or this broker's.)
        WITH seen AS (
            SELECT send_sequence FROM broker_conversation_endpoint
            WHERE conversation_handle = p_handle
        ), snd AS (
            UPDATE broker_conversation_endpoint e
            SET send_sequence = e.send_sequence + 1,
                state = CASE WHEN e.state = 'SO' THEN 'CO' ELSE e.state END
            FROM broker_queue q, broker_contract_message cm
            WHERE e.conversation_handle = p_handle
              AND e.state IN ('SO', 'SI', 'CO')
              AND e.send_sequence = (SELECT send_sequence FROM seen)
              AND (e.lifetime IS NULL OR e.lifetime > p_now)
              AND q.queue_id = e.queue_id AND NOT q.retention
              AND cm.contract_name = e.contract_name AND cm.message_type_name = p_message_type
              AND cm.sent_by IN ('any',
                                 CASE WHEN e.is_initiator THEN 'initiator' ELSE 'target' END)
              AND {_IN_CLEAR}
            RETURNING e.send_sequence - 1 AS seq, e.*
        ), ins AS (
            {_to_transmission("(SELECT instance_id FROM broker_instance)")}
        )
        SELECT seq INTO v_seq FROM snd;
        RETURN v_seq;
    END IF;
    IF v_far IS NULL THEN
        RETURN NULL;
    END IF;
    IF p_row_lock THEN
        PERFORM 1 FROM broker_conversation_endpoint
        WHERE conversation_handle = v_far FOR KEY SHARE;
    ELSE
        PERFORM pg_advisory_xact_lock_shared(uuid_hash_extended(v_far, {ENDPOINT_LOCK_SEED}));
    END IF;
    -- A new snapshot: the far endpoint as it is now that no remover can change it. ``seen``
    -- guards the sender's own row: when another SEND on it committed after this snapshot (one
    -- whose message had to wait in the transmission queue, say), the UPDATE re-checks the new
    -- row version but NOT EXISTS still sees the old snapshot; the send sequence then differs
    -- and the general path takes over rather than overtake that message.
    WITH seen AS (
        SELECT send_sequence FROM broker_conversation_endpoint
        WHERE conversation_handle = p_handle
    ), snd AS (
        UPDATE broker_conversation_endpoint e
        SET send_sequence = e.send_sequence + 1,
            state = CASE WHEN e.state = 'SO' THEN 'CO' ELSE e.state END
        FROM broker_conversation_endpoint f, broker_queue fq, broker_queue q,
             broker_contract_message cm
        WHERE e.conversation_handle = p_handle
          AND e.state IN ('SO', 'SI', 'CO')
          AND e.send_sequence = (SELECT send_sequence FROM seen)
          AND (e.lifetime IS NULL OR e.lifetime > p_now)
          AND f.conversation_handle = v_far AND f.state NOT IN ('DO', 'CD')
          AND fq.queue_id = f.queue_id AND fq.status
          AND q.queue_id = e.queue_id AND NOT q.retention
          AND cm.contract_name = e.contract_name AND cm.message_type_name = p_message_type
          AND cm.sent_by IN ('any', CASE WHEN e.is_initiator THEN 'initiator' ELSE 'target' END)
          AND NOT EXISTS (SELECT 1 FROM broker_transmission_queue t
                          WHERE t.conversation_handle = e.conversation_handle)
        RETURNING e.send_sequence - 1 AS seq, f.queue_id, f.conversation_group_id,
                  f.conversation_handle, f.priority, f.service_name, e.contract_name
    ), ins AS (
        INSERT INTO broker_message (
            queue_id, conversation_group_id, conversation_handle, message_sequence_number,
            status, priority, precedence, service_name, service_contract_name,
            message_type_name, validation, message_body, enqueued_at)
        SELECT queue_id, conversation_group_id, conversation_handle, seq, 1, priority,
               p_precedence, service_name, contract_name, p_message_type, p_validation, p_body,
               p_now
        FROM snd
    )
    SELECT seq INTO v_seq FROM snd;
    RETURN v_seq;
END
$$
"""

SEND_MANY_FUNCTION = f"""
CREATE OR REPLACE FUNCTION broker_send_many(
    p_handles uuid[], p_message_type varchar, p_precedence smallint, p_validation varchar,
    p_body bytea, p_now timestamptz, p_row_lock boolean
) RETURNS SETOF uuid LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    v_instance varchar := (SELECT instance_id FROM broker_instance);
BEGIN
    -- Every conversation's far side in another broker, known since its first answer (see
    -- broker_send_one): the messages wait in the transmission queue, in clear, written here
    -- when every dialog may send this message type and none is secure; else nothing.
    IF {_MAY_READ_SECURITY}
       AND NOT EXISTS (
           SELECT 1 FROM broker_conversation_endpoint e
           WHERE e.conversation_handle = ANY(p_handles)
             AND (e.far_broker_instance IS NULL OR e.far_broker_instance = v_instance
                  OR EXISTS (SELECT 1 FROM broker_conversation_endpoint f
                             WHERE f.conversation_handle = e.far_handle))) THEN
        RETURN QUERY
        WITH cand AS (
            SELECT e.conversation_handle, e.send_sequence AS seen_sequence,
                   e.state AS seen_state
            FROM broker_conversation_endpoint e
            JOIN broker_queue q ON q.queue_id = e.queue_id AND NOT q.retention
            JOIN broker_contract_message cm
              ON cm.contract_name = e.contract_name AND cm.message_type_name = p_message_type
             AND cm.sent_by IN ('any',
                                CASE WHEN e.is_initiator THEN 'initiator' ELSE 'target' END)
            WHERE e.conversation_handle = ANY(p_handles)
              AND e.state IN ('SO', 'SI', 'CO')
              AND (e.lifetime IS NULL OR e.lifetime > p_now)
              AND {_IN_CLEAR}
        ), snd AS (
            UPDATE broker_conversation_endpoint e
            SET send_sequence = e.send_sequence + 1,
                state = CASE WHEN e.state = 'SO' THEN 'CO' ELSE e.state END
            FROM cand
            WHERE e.conversation_handle = cand.conversation_handle
              AND (SELECT count(*) FROM cand) = cardinality(p_handles)
              AND e.send_sequence = cand.seen_sequence AND e.state = cand.seen_state
            RETURNING e.send_sequence - 1 AS seq, e.*
        ), ins AS (
            {_to_transmission("v_instance")}
        )
        SELECT snd.conversation_handle FROM snd;
        RETURN;
    END IF;
    -- The far endpoints, locked in handle order (as removers lock them).
    IF p_row_lock THEN
        PERFORM 1 FROM broker_conversation_endpoint f
        WHERE f.conversation_handle IN (
            SELECT far_handle FROM broker_conversation_endpoint
            WHERE conversation_handle = ANY(p_handles))
        ORDER BY f.conversation_handle
        FOR KEY SHARE;
    ELSE
        -- PostgreSQL evaluates a volatile function of the select list after the sort.
        PERFORM pg_advisory_xact_lock_shared(uuid_hash_extended(far_handle, {ENDPOINT_LOCK_SEED}))
        FROM broker_conversation_endpoint
        WHERE conversation_handle = ANY(p_handles) AND far_handle IS NOT NULL
        ORDER BY far_handle;
    END IF;
    -- A new snapshot. It writes only if every conversation is on the fast path and may send
    -- this message type; the UPDATE skips a sender that another transaction changed after
    -- this snapshot (see ``seen`` in broker_send_one), and the caller sends on those by the
    -- general path, in the same transaction.
    RETURN QUERY
    WITH cand AS (
        SELECT e.conversation_handle, f.queue_id, f.conversation_group_id,
               f.conversation_handle AS far_handle, f.priority, f.service_name,
               e.contract_name, e.send_sequence AS seen_sequence, e.state AS seen_state
        FROM broker_conversation_endpoint e
        JOIN broker_conversation_endpoint f
          ON f.conversation_handle = e.far_handle AND f.state NOT IN ('DO', 'CD')
        JOIN broker_queue fq ON fq.queue_id = f.queue_id AND fq.status
        JOIN broker_queue q ON q.queue_id = e.queue_id AND NOT q.retention
        JOIN broker_contract_message cm
          ON cm.contract_name = e.contract_name AND cm.message_type_name = p_message_type
         AND cm.sent_by IN ('any', CASE WHEN e.is_initiator THEN 'initiator' ELSE 'target' END)
        WHERE e.conversation_handle = ANY(p_handles)
          AND e.state IN ('SO', 'SI', 'CO')
          AND (e.lifetime IS NULL OR e.lifetime > p_now)
          AND NOT EXISTS (SELECT 1 FROM broker_transmission_queue t
                          WHERE t.conversation_handle = e.conversation_handle)
    ), snd AS (
        UPDATE broker_conversation_endpoint e
        SET send_sequence = e.send_sequence + 1,
            state = CASE WHEN e.state = 'SO' THEN 'CO' ELSE e.state END
        FROM cand
        WHERE e.conversation_handle = cand.conversation_handle
          AND (SELECT count(*) FROM cand) = cardinality(p_handles)
          AND e.send_sequence = cand.seen_sequence AND e.state = cand.seen_state
        -- What the INSERT needs comes back with the UPDATE: joining snd to cand again was a
        -- nested loop over both (the planner takes a CTE for one row), a third of the
        -- statement's time for 100 conversations and quadratic beyond.
        RETURNING e.conversation_handle, e.send_sequence - 1 AS seq, cand.queue_id,
                  cand.conversation_group_id, cand.far_handle, cand.priority,
                  cand.service_name, cand.contract_name
    ), ins AS (
        INSERT INTO broker_message (
            queue_id, conversation_group_id, conversation_handle, message_sequence_number,
            status, priority, precedence, service_name, service_contract_name,
            message_type_name, validation, message_body, enqueued_at)
        SELECT snd.queue_id, snd.conversation_group_id, snd.far_handle, snd.seq, 1,
               snd.priority, p_precedence, snd.service_name, snd.contract_name,
               p_message_type, p_validation, p_body, p_now
        FROM snd
        -- In the far handles' order, the order of the group index RECEIVE reads them by:
        -- a group's messages then lie together in the table (measured: RECEIVE TOP (100)
        -- of 100 dialogs in 4 groups takes a twentieth longer in another order).
        ORDER BY snd.far_handle
    )
    SELECT snd.conversation_handle FROM snd;
END
$$
"""

#: What migrations 0013, 0014 and 0016 create (and a downgrade of 0013 drops), in this order.
FUNCTIONS = (SEND_ONE_FUNCTION, SEND_MANY_FUNCTION)
DROP_FUNCTIONS = (
    "DROP FUNCTION IF EXISTS broker_send_one(uuid, varchar, smallint, varchar, bytea, "
    "timestamptz, boolean)",
    "DROP FUNCTION IF EXISTS broker_send_many(uuid[], varchar, smallint, varchar, bytea, "
    "timestamptz, boolean)",
)


__all__ = [
    "ADVISORY_BUDGET",
    "DROP_FUNCTIONS",
    "ENDPOINT_LOCK_SEED",
    "FUNCTIONS",
    "exclude_writers",
]
