"""PostgreSQL: the SQL of receive leases, the rows that let failure handling count a reader
that ended without committing (:class:`~airflow_broker.storage.adapters.PostgresAdapter`).

A receiving transaction's claim takes a transaction-level advisory lock on its lease's key
(:mod:`~airflow_broker.storage.queries`), released with its row locks however the transaction
ends, a killed client's included and through a pooler. Its lease row (queue, messages held)
is written outside the transaction, on the side connection
(:mod:`~airflow_broker.storage.side_writer`), before RECEIVE hands the messages out, and a
committing transaction deletes it in its COMMIT's query. So a lease row whose lock is free
belongs to a transaction that did not commit: its attempt is a failed one, counted once by
whoever deletes the row (the rollback itself, the due-work pass's reaper, or a RECEIVE of the
queue, below). Rows written by versions that marked
commits instead (``broker_receive_commit``) count as committed when they have a marker.

A RECEIVE counts a dead reader of its queue before it hands out what it took, so no hand-out
escapes a count and a group held back by the failure is seen as held:
:data:`WRITE_FUNCTION` (migration 0025) writes the lease row unless it finds such a reader.
Every call for a queue takes that queue's advisory lock first, so they run one at a time and
each reads with a snapshot taken after the one before committed. A reader's row is written only
while its transaction still holds its key, so a row that lands after its reader died is never
written (that reader handed nothing out: RECEIVE returns only once its row is written). Hence:
a reader that died after handing messages out has its row visible to every later call for the
queue, and the RECEIVE that took its messages next is told to count it first.
"""

from __future__ import annotations

#: The advisory lock class of a queue's lease rows (pg_advisory_xact_lock(class, queue_id); the
#: broker's other classes: migrate 727170000, activation 727170001, depth sampling 727170002,
#: transmitter 727170003).
QUEUE_LEASES_CLASS = 727170004

#: A lease row ``l`` whose server process is gone (rows written before migration 0023).
BACKEND_GONE = (
    "NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = l.pid"
    " AND (a.backend_start IS NULL OR l.backend_start IS NULL"
    "      OR a.backend_start = l.backend_start))"
)
#: A lease row ``l`` whose transaction has ended: its lock is free (taken and given back at
#: once, so that the caller, counting it, never makes it look alive to a RECEIVE that looks
#: for dead readers meanwhile).
LEASE_ENDED = (
    "CASE WHEN NOT l.xact_lock THEN "
    f"{BACKEND_GONE} "
    "WHEN pg_try_advisory_lock(l.lease_key) THEN pg_advisory_unlock(l.lease_key) "
    "ELSE false END"
)
#: The same, read from pg_locks without taking anything (a bigint key is classid, objid).
LEASE_UNLOCKED = (
    "CASE WHEN l.xact_lock THEN NOT EXISTS (SELECT 1 FROM pg_locks k"
    " WHERE k.locktype = 'advisory' AND k.objsubid = 1 AND k.granted"
    " AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND k.classid = CAST(l.lease_key >> 32 AS oid)"
    " AND k.objid = CAST(l.lease_key & 4294967295 AS oid))"
    f" ELSE {BACKEND_GONE} END"
)
#: No commit marker vouches for the lease row ``l`` (markers: rows of earlier versions).
NO_MARKER = "NOT EXISTS (SELECT 1 FROM broker_receive_commit c WHERE c.lease_key = l.lease_key)"

#: What broker_write_receive_lease answers.
WRITTEN, DEAD_READER, TRANSACTION_GONE, KEY_TAKEN = 0, 1, 2, 3

#: broker_write_receive_lease(key, queue_id, pid, backend_start, started_at, held, look, first):
#: write (``first``: insert, else update ``held`` of) the lease row of ``key``, unless
#: ``look`` and a dead reader of the queue is uncounted (answers 1, nothing written), or the
#: transaction holding ``key`` has ended (2); ``key`` NULL: only look. 0: written; 3: the key
#: is taken (63 random bits: never seen).
WRITE_FUNCTION = f"""
CREATE OR REPLACE FUNCTION broker_write_receive_lease(
    p_key bigint, p_queue integer, p_pid integer, p_backend_start timestamptz,
    p_started_at timestamptz, p_held text, p_look boolean, p_first boolean)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- The queue's calls, one at a time: each statement below reads with a snapshot taken
    -- after every earlier call for the queue committed.
    PERFORM pg_advisory_xact_lock({QUEUE_LEASES_CLASS}, p_queue);
    IF p_key IS NOT NULL AND pg_try_advisory_xact_lock(p_key) THEN
        RETURN {TRANSACTION_GONE};
    END IF;
    IF p_look AND EXISTS (
        SELECT 1 FROM broker_receive_lease l
        WHERE l.queue_id = p_queue AND l.lease_key IS DISTINCT FROM p_key
          AND {NO_MARKER} AND {LEASE_ENDED}
    ) THEN
        RETURN {DEAD_READER};
    END IF;
    IF p_key IS NULL THEN
        RETURN {WRITTEN};
    END IF;
    IF p_first THEN
        INSERT INTO broker_receive_lease
            (lease_key, queue_id, pid, backend_start, started_at, held, xact_lock)
        VALUES (p_key, p_queue, p_pid, p_backend_start, p_started_at, p_held, true)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            RETURN {KEY_TAKEN};
        END IF;
    ELSE
        UPDATE broker_receive_lease SET held = p_held WHERE lease_key = p_key;
    END IF;
    RETURN {WRITTEN};
END
$$
"""
DROP_WRITE_FUNCTION = (
    "DROP FUNCTION IF EXISTS broker_write_receive_lease("
    "bigint, integer, integer, timestamptz, timestamptz, text, boolean, boolean)"
)

#: The side connection's call (values in text format, in the function's order).
WRITE = (
    "SELECT broker_write_receive_lease(CAST($1 AS bigint), CAST($2 AS integer), "
    "CAST($3 AS integer), CAST($4 AS timestamptz), CAST($5 AS timestamptz), CAST($6 AS text), "
    "CAST($7 AS boolean), CAST($8 AS boolean))"
)

__all__ = [
    "DEAD_READER",
    "DROP_WRITE_FUNCTION",
    "KEY_TAKEN",
    "LEASE_ENDED",
    "LEASE_UNLOCKED",
    "NO_MARKER",
    "QUEUE_LEASES_CLASS",
    "TRANSACTION_GONE",
    "WRITE",
    "WRITE_FUNCTION",
    "WRITTEN",
]
