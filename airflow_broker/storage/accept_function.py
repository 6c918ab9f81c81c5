"""PostgreSQL: a far broker takes the known conversations of a delivery batch in one statement.

Delivery's common case (:mod:`airflow_broker.transport.direct`) is a batch of messages on
dialogs the far broker already has an endpoint for, in clear, of types it takes whatever the
body. The server-side function ``broker_accept_plain`` (migration 0030) does for those what the
direct accept does in Python, in one round trip that commits on its own:

1. the far endpoints of the conversations are locked ``FOR UPDATE`` in handle order, as every
   writer that takes a batch of arriving conversations locks them;
2. a new statement (PL/pgSQL takes a new snapshot for each) keeps the conversations it can take
   whole: this broker is the principal and the instance they are for; the endpoint is open
   (SO, SI, CO), bound to the sender or to nobody, not secure (no session key), with no message
   held for a gap, and its receive sequence number at or past the first message; every message
   is of a type the contract lets that side send, with no validation here, and not a system
   type;
3. their messages at or above the receive sequence number go into the queues, the numbers are
   raised past the last message, and endpoints bound to nobody are bound to the sender.

It returns one row per conversation taken: its id and side, the number it now has every message
below (the sender deletes its transmission rows below it), and how many messages went in. A
conversation it does not return is left to the general accept, which says why or takes it
another way (a new dialog, a secure one, a gap). The sender checks that each conversation's
messages follow one another without a gap before it asks.
"""

from __future__ import annotations

from airflow_broker.constants import (
    PRECEDENCE_NORMAL,
    STATUS_NOT_COMPLETE,
    STATUS_READY,
    SYSTEM_MESSAGE_TYPES,
)
from airflow_broker.storage.prepared import Prepared

_SYSTEM_TYPES = ", ".join(f"'{t}'" for t in sorted(SYSTEM_MESSAGE_TYPES))
#: The validation code of a body nothing validated (messaging.validation's VALIDATION_CODES
#: "none", stored in every queue row: it never changes).
_NO_VALIDATION = "N"

ACCEPT_PLAIN_FUNCTION = f"""
CREATE OR REPLACE FUNCTION broker_accept_plain(
    p_sender varchar, p_target varchar, p_conversations uuid[], p_from_initiator boolean[],
    p_contracts varchar[], p_first bigint[], p_last bigint[], p_of integer[], p_seqs bigint[],
    p_types varchar[], p_bodies bytea[], p_now timestamptz
) RETURNS TABLE (conversation_id uuid, from_initiator boolean, upto bigint, inserted bigint)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM broker_instance
                   WHERE instance_id = p_target AND principal AND NOT pg_is_in_recovery()) THEN
        RETURN;  -- not the instance they are for, a mirror, or a standby: the general accept
    END IF;
    PERFORM 1 FROM broker_conversation_endpoint e
    JOIN unnest(p_conversations, p_from_initiator) AS k(cid, ini)
      ON e.conversation_id = k.cid AND e.is_initiator = NOT k.ini
    ORDER BY e.conversation_handle
    FOR UPDATE OF e;
    -- A new snapshot: the endpoints as they are now that this transaction holds them.
    RETURN QUERY
    WITH k AS (
        SELECT * FROM unnest(p_conversations, p_from_initiator, p_contracts, p_first, p_last)
            WITH ORDINALITY AS k(cid, ini, contract, first_seq, last_seq, i)
    ), m AS (
        SELECT * FROM unnest(p_of, p_seqs, p_types, p_bodies) AS m(i, seq, message_type, body)
    ), c AS (
        SELECT k.i, k.cid, k.ini, k.contract, k.last_seq, e.conversation_handle,
               e.receive_sequence AS recv, e.far_broker_instance, e.queue_id,
               e.conversation_group_id, e.priority, e.service_name
        FROM k JOIN broker_conversation_endpoint e
          ON e.conversation_id = k.cid AND e.is_initiator = NOT k.ini
        WHERE e.state IN ('SO', 'SI', 'CO')
          AND (e.far_broker_instance IS NULL OR e.far_broker_instance = p_sender)
          AND k.first_seq <= e.receive_sequence
          AND NOT EXISTS (SELECT 1 FROM broker_message h
                          WHERE h.conversation_handle = e.conversation_handle
                            AND h.status = {STATUS_NOT_COMPLETE})
          AND NOT EXISTS (SELECT 1 FROM broker_dialog_key d
                          WHERE d.conversation_handle = e.conversation_handle)
          AND NOT EXISTS (
              SELECT 1 FROM m
              WHERE m.i = k.i
                AND (m.message_type IN ({_SYSTEM_TYPES}) OR NOT EXISTS (
                    SELECT 1 FROM broker_contract_message cm
                    JOIN broker_message_type mt ON mt.name = cm.message_type_name
                    WHERE cm.contract_name = k.contract
                      AND cm.message_type_name = m.message_type
                      AND cm.sent_by IN ('any',
                                         CASE WHEN k.ini THEN 'initiator' ELSE 'target' END)
                      AND mt.validation = 'none')))
    ), ins AS (
        INSERT INTO broker_message (
            queue_id, conversation_group_id, conversation_handle, message_sequence_number,
            status, priority, precedence, service_name, service_contract_name,
            message_type_name, validation, message_body, enqueued_at)
        SELECT c.queue_id, c.conversation_group_id, c.conversation_handle, m.seq,
               {STATUS_READY}, c.priority, {PRECEDENCE_NORMAL}, c.service_name, c.contract,
               m.message_type, '{_NO_VALIDATION}', m.body, p_now
        FROM c JOIN m ON m.i = c.i
        WHERE m.seq >= c.recv
        RETURNING conversation_handle, message_sequence_number
    ), upd AS (
        UPDATE broker_conversation_endpoint e
        SET receive_sequence = greatest(c.recv, c.last_seq + 1),
            far_broker_instance = coalesce(e.far_broker_instance, p_sender)
        FROM c
        WHERE e.conversation_handle = c.conversation_handle
          AND (c.last_seq >= c.recv OR e.far_broker_instance IS NULL)
    )
    SELECT c.cid, c.ini, greatest(c.recv, c.last_seq + 1),
           (SELECT count(*) FROM ins WHERE ins.conversation_handle = c.conversation_handle)
    FROM c;
END
$$
"""

DROP_ACCEPT_PLAIN_FUNCTION = (
    "DROP FUNCTION IF EXISTS broker_accept_plain(varchar, varchar, uuid[], boolean[], varchar[], "
    "bigint[], bigint[], integer[], bigint[], varchar[], bytea[], timestamptz)"
)

#: ``broker_accept_plain`` for :func:`airflow_broker.storage.direct.execute_committed`.
ACCEPT_PLAIN = Prepared(
    "SELECT * FROM broker_accept_plain($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
    (
        "varchar",
        "varchar",
        "uuid[]",
        "boolean[]",
        "varchar[]",
        "bigint[]",
        "bigint[]",
        "integer[]",
        "bigint[]",
        "varchar[]",
        "bytea[]",
        "timestamptz",
    ),
)

__all__ = ["ACCEPT_PLAIN", "ACCEPT_PLAIN_FUNCTION", "DROP_ACCEPT_PLAIN_FUNCTION"]
