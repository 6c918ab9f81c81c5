"""Messaging: Service Broker's verbs inside one broker database.

- :mod:`~airflow_broker.messaging.transaction`: :class:`Transaction`, BEGIN DIALOG, SEND, RECEIVE
  (with WAITFOR), GET CONVERSATION GROUP, END CONVERSATION, timers, MOVE CONVERSATION;
- :mod:`~airflow_broker.messaging.delivery`: where a sent message goes in this database (the far
  endpoint's queue, or the transmission queue with the reason it waits), contract rules and
  priorities; :mod:`~airflow_broker.messaging.duework`: timers, lifetimes, dead readers and
  waiting local transmissions when they fall due;
- :mod:`~airflow_broker.messaging.definitions`: CREATE / ALTER / DROP of every object (services
  in :mod:`~airflow_broker.messaging.service_definitions`: ALTER SERVICE ... ON QUEUE moves the
  service's conversations, DROP SERVICE ends them WITH ERROR; routes and priorities in
  :mod:`~airflow_broker.messaging.route_definitions`);
- :mod:`~airflow_broker.messaging.events`: broker events and poison handling's rollback count;
- :mod:`~airflow_broker.messaging.validation`: body encoding and message-type validation;
- :mod:`~airflow_broker.messaging.objects`: the value objects handed out (Message, endpoints,
  catalog rows); :mod:`~airflow_broker.messaging.arguments`: argument checks.

Moving messages to other broker databases is :mod:`airflow_broker.transport`, above this layer.

The lock order (PostgreSQL)
    No message exists without its endpoint, and none is filed under a group its endpoint has
    left: a conversation endpoint's row is the lock of everything stored for it.

    0. The conversation group comes first, as in Service Broker: RECEIVE and GET CONVERSATION
       GROUP lock it (skipping locked groups), END CONVERSATION and MOVE CONVERSATION wait for
       it (MOVE for both groups, in id order) before they lock the endpoint, and ALTER SERVICE
       ... ON QUEUE and DROP SERVICE for the groups of all the service's endpoints, in id order,
       before they lock those. A reader that answers or ends on what it received therefore
       never waits for an END that waits for it.
    1. Whoever writes a message into an endpoint's queue holds a lock on that endpoint taken
       before the write, reads the endpoint after the lock is granted, and writes nothing if it
       is gone: SEND's fast path takes the far endpoint's advisory lock *shared*
       (:mod:`airflow_broker.storage.endpoint_locks`: in memory, nothing written; past a budget
       per transaction its row ``FOR KEY SHARE``) and reads its queue and group afresh in the
       next statement of the same server-side function; the general path locks the far
       endpoint ``FOR KEY SHARE`` and updates it (its receive sequence) before inserting;
       system messages and timers write to an endpoint they have just updated; the inbound
       accept of delivery updates the receiving endpoint first.
    2. Whoever changes its own endpoint (SEND's sequence numbers, END) takes ``FOR NO KEY
       UPDATE``, which does not conflict with the far side's ``KEY SHARE``: the two sides of a
       dialog still send at the same time without waiting for each other.
    3. Whoever removes an endpoint or its messages (END CONVERSATION of every kind, DROP, a
       reset of the broker's identity) or moves its messages (MOVE CONVERSATION, ALTER SERVICE
       ... ON QUEUE) first takes its advisory lock *exclusive*, then ``FOR UPDATE`` on its row
       (``endpoint_locks.exclude_writers``), which wait for every writer of rule 1; the
       messages they committed are then visible to the removal. Several endpoints are locked in
       handle order. The purge of closed endpoints takes only the rows (``FOR UPDATE SKIP
       LOCKED``): the END that closed an endpoint already waited for the fast path, which
       writes into no closed endpoint.
    4. A transaction that holds its own endpoint never waits for the far one: the general path
       locks the far endpoint with SKIP LOCKED, and when another transaction holds it (the far
       side is sending or ending too) the message waits in the transmission queue, behind
       nothing and ahead of what follows, until due work delivers it. Both sides of a dialog
       ENDing at once would otherwise deadlock. A far endpoint that has ended (DO, CD) takes no
       more messages: an EndDialog or Error closes it, anything else is discarded. END on a
       side whose far side ended first (DI) closes the far endpoint the same way: at once when
       it is free, else by an EndDialog that waits in the transmission queue (a SEND that
       holds the far endpoint may be waiting for this one).
    5. SEND's fast path is one statement; when it had to wait for its sender's row, which
       another SEND changed meanwhile, it hands over to the general path rather than act on
       its older snapshot (which could not see that SEND's message waiting in the transmission
       queue, and would overtake it).

    On SQLite every broker transaction holds the database's only write lock from its first
    statement (``BEGIN IMMEDIATE``), so writers and removers never interleave.
"""
