"""The hot-path statements, in one place.

RECEIVE is one atomic statement: pick the highest-priority conversation group with ready
messages that no other transaction holds, lock it until this transaction ends, and take its
messages. On PostgreSQL the group row is locked ``FOR NO KEY UPDATE ... SKIP LOCKED`` (NO KEY, so
that SENDs into a locked group, whose foreign-key checks take KEY SHARE, still go through). On
SQLite the lock clause renders as nothing: a broker transaction there holds the database's single
write lock from its first statement (``BEGIN IMMEDIATE``), which serializes readers.

The DELETE (or, with retention, the UPDATE) is what makes a message taken exactly once: if two
transactions ever see the same ready row, the second one's DELETE finds it gone and skips it.
Values are always bound; the only text substituted is fixed in this module.
"""

from __future__ import annotations

import re
from functools import cache, lru_cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Text,
    Uuid,
    bindparam,
    column,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql.elements import TextClause

from airflow_broker.constants import PRECEDENCE_NORMAL
from airflow_broker.storage import direct

MESSAGE_COLUMNS = (
    "queuing_order",
    "conversation_group_id",
    "conversation_handle",
    "message_sequence_number",
    "priority",
    "precedence",
    "service_name",
    "service_contract_name",
    "message_type_name",
    "validation",
    "message_body",
    "receive_count",
    "dead_letter",
)

_COLUMN_TYPES: dict[str, Any] = {
    "queuing_order": BigInteger(),
    "conversation_group_id": Uuid(),
    "conversation_handle": Uuid(),
    "message_sequence_number": BigInteger(),
    "priority": SmallInteger(),
    "precedence": SmallInteger(),
    "service_name": String(),
    "service_contract_name": String(),
    "message_type_name": String(),
    "validation": String(),
    "message_body": LargeBinary(),
    "receive_count": Integer(),
    "dead_letter": Text(),
}

#: Messages of one group come out timers first, then errors, then each dialog in sequence order.
GROUP_ORDER = "m.priority DESC, m.precedence, m.conversation_handle, m.message_sequence_number"


#: The claimed rows in :data:`GROUP_ORDER` (PostgreSQL: a sort of at most ``top`` rows in the
#: server, cheaper than sorting them in Python by their UUIDs).
_TAKEN_ORDER = "ORDER BY " + GROUP_ORDER.replace("m.", "")


def claim_is_ordered(dialect: str) -> bool:
    """Whether :func:`claim_statement` returns its rows in :data:`GROUP_ORDER` (PostgreSQL's
    does; SQLite has no data-modifying CTE to sort them in)."""
    return dialect == "postgresql"


#: Every picker also checks the queue is enabled, so the hot path needs no separate lookup; on
#: PostgreSQL a claim that took nothing says whether the queue was enabled (its probe row).
_ENABLED = "EXISTS (SELECT 1 FROM broker_queue qq WHERE qq.queue_id = :queue_id AND qq.status)"

#: PostgreSQL: a row of :data:`MESSAGE_COLUMNS`, every one NULL of its type.
_PROBE_ROW = ", ".join(
    f"CAST(NULL AS {_COLUMN_TYPES[c].compile(dialect=postgresql.dialect())})"
    for c in MESSAGE_COLUMNS
)

#: PostgreSQL: what a claim returns. The messages taken, in GROUP_ORDER; when it took none, a
#: *probe row* (every column NULL; see :func:`is_probe`) if there is more to know than "nothing
#: is free": the queue is disabled or gone, or the claim locked a group whose ready messages
#: another reader committed away between this statement's snapshot and its lock. No row at all
#: says the queue is enabled and every group with ready messages (if any) is held by another
#: reader: an empty RECEIVE in one round trip, with nothing to ask afterwards.
_TAKEN_OR_PROBE = (
    f"SELECT * FROM taken UNION ALL SELECT {_PROBE_ROW} "
    "WHERE NOT EXISTS (SELECT 1 FROM taken) "
    f"AND (EXISTS (SELECT 1 FROM grp) OR NOT {_ENABLED}) {_TAKEN_ORDER}"
)


#: PostgreSQL: a claim that takes messages takes its receive lease's transaction-level advisory
#: lock (once, an InitPlan run on the first row), held until the transaction ends, however it
#: ends: the lease row's proof that its transaction is still open (storage.adapters). The lock
#: never refuses a row (it is held or not, never NULL).
_LEASE_LOCK = "(SELECT pg_try_advisory_xact_lock(CAST(:lease_key AS bigint))) IS NOT NULL"


def is_probe(rows: list[Any]) -> bool:
    """Whether a PostgreSQL claim's answer is its probe row (it took nothing; see
    :data:`_TAKEN_OR_PROBE`): a message's ``queuing_order`` is never NULL."""
    return len(rows) == 1 and rows[0][0] is None


#: A group held without a transaction (a lease, or the backoff after a failed attempt) is not
#: picked, and neither are new messages in it: they wait with the others, so order holds.
_FREE = "g.lease_token IS NULL AND (g.held_until IS NULL OR g.held_until <= :now)"
_FREE_M = (
    "NOT EXISTS (SELECT 1 FROM broker_conversation_group g "
    "WHERE g.conversation_group_id = m.conversation_group_id "
    "AND (g.lease_token IS NOT NULL OR g.held_until > :now))"
)


#: PostgreSQL: how many of the oldest ready messages a claim tries the groups of, in queue order,
#: before it looks for a free group by walking the queue's groups (see :func:`_group_picker`).
FIRST_LOOK = 32
#: Above every conversation priority (1 to 10; the column is a smallint).
_ABOVE_PRIORITIES = 32767


def _group_picker(dialect: str, *, by_handle: bool, by_group: bool, first: bool = False) -> str:
    """The statement that locks the group a claim takes from: its ``conversation_group_id``,
    and with ``first`` (unfiltered claims only) also the conversation and priority of the oldest
    ready message, the one that chose the group (NULL when PostgreSQL's walk past the oldest
    messages chose it; see :func:`_picked`)."""
    pg = dialect == "postgresql"
    lock_g = "FOR NO KEY UPDATE OF g SKIP LOCKED" if pg else ""
    if by_handle:
        join = (
            "JOIN broker_conversation_group g ON g.conversation_group_id = e.conversation_group_id"
            if pg
            else ""
        )
        free = _FREE if pg else _FREE.replace("g.", "gg.")
        if not pg:
            join = (
                "JOIN broker_conversation_group gg "
                "ON gg.conversation_group_id = e.conversation_group_id"
            )
        return (
            "SELECT e.conversation_group_id FROM broker_conversation_endpoint e "
            f"{join} WHERE e.conversation_handle = :handle AND e.queue_id = :queue_id "
            f"AND {free} AND {_ENABLED} {lock_g}"
        )
    if by_group:
        lock = "FOR NO KEY UPDATE SKIP LOCKED" if pg else ""
        return (
            "SELECT g.conversation_group_id FROM broker_conversation_group g "
            f"WHERE g.conversation_group_id = :group_id AND g.queue_id = :queue_id "
            f"AND {_FREE} AND {_ENABLED} {lock}"
        )
    if pg:
        # First the groups of the oldest ready messages, in queue order: the group row is locked
        # in a LATERAL subquery, once per message, until one is free. A subquery with a locking
        # clause is never flattened, so this stays a nested loop over the ready-message index
        # whatever the statistics say: a queue table analyzed while empty would otherwise get a
        # hash join that reads and sorts every ready message (measured: 2.0 ms instead of
        # 0.13 ms for 1,000 messages).
        #
        # Only the first FIRST_LOOK of them, though: when every group holding ready messages is
        # locked (more readers than busy groups), walking on message by message tries the same
        # few locked groups once per message, the whole queue (measured: 65 ms for an empty
        # claim over 10,000 ready messages in 4 locked groups). Past them the queue's groups
        # with ready messages are walked one group at a time (a skip scan of the group index
        # that visits each group once), and the first free one is taken. Appended under LIMIT
        # 1, that walk runs only when the first part found nothing.
        lock_free = (
            "CROSS JOIN LATERAL (SELECT g.conversation_group_id "
            "FROM broker_conversation_group g "
            f"WHERE g.conversation_group_id = c.conversation_group_id AND {_FREE} "
            "FOR NO KEY UPDATE SKIP LOCKED) l"
        )
        chosen_by = ", c.conversation_handle, c.priority" if first else ""
        no_first = ", CAST(NULL AS uuid), CAST(NULL AS smallint)" if first else ""
        oldest = (
            f"SELECT l.conversation_group_id{chosen_by} FROM (SELECT m.conversation_group_id, "
            "m.conversation_handle, m.priority "
            "FROM broker_message m WHERE m.queue_id = :queue_id AND m.status = 1 "
            f"ORDER BY m.priority DESC, m.queuing_order LIMIT {FIRST_LOOK}) c {lock_free} LIMIT 1"
        )
        next_group = (
            "SELECT m.conversation_group_id FROM broker_message m "
            "WHERE m.queue_id = :queue_id AND m.status = 1{after} "
            "ORDER BY m.conversation_group_id LIMIT 1"
        )
        after = " AND m.conversation_group_id > c.conversation_group_id"
        walk = (
            "WITH RECURSIVE c (conversation_group_id) AS "
            f"(({next_group.format(after='')}) UNION ALL "
            f"SELECT ({next_group.format(after=after)}) "
            "FROM c WHERE c.conversation_group_id IS NOT NULL) "
            f"SELECT l.conversation_group_id{no_first} FROM c {lock_free} LIMIT 1"
        )
        # The queue's check is a one-time filter: a disabled queue runs neither part.
        return f"SELECT * FROM (({oldest}) UNION ALL ({walk})) p WHERE {_ENABLED} LIMIT 1"
    chosen_by = ", m.conversation_handle, m.priority" if first else ""
    return (
        f"SELECT m.conversation_group_id{chosen_by} FROM broker_message m "
        f"WHERE m.queue_id = :queue_id AND m.status = 1 AND {_FREE_M} AND {_ENABLED} "
        "ORDER BY m.priority DESC, m.queuing_order LIMIT 1"
    )


def _typed(sql: str, *, by_handle: bool, by_group: bool) -> TextClause:
    params: list[Any] = [
        bindparam("queue_id", type_=Integer()),
        bindparam("now", type_=DateTime(timezone=True)),
    ]
    if by_handle:
        params.append(bindparam("handle", type_=Uuid()))
    if by_group:
        params.append(bindparam("group_id", type_=Uuid()))
    return text(sql).bindparams(*params)


@lru_cache(maxsize=256)
def claim_statement(
    dialect: str,
    *,
    top: int | None = None,
    by_handle: bool = False,
    by_group: bool = False,
    retention: bool = False,
    mark: bool = False,
    lease: bool = False,
) -> TextClause:
    """RECEIVE: lock one conversation group and take up to ``top`` of its ready messages (all of
    them when None).

    Bind ``queue_id`` and ``handle`` or ``group_id`` when filtering. On PostgreSQL the rows come
    back in :data:`GROUP_ORDER`; on SQLite unordered (RETURNING keeps no order, and SQLite has
    no data-modifying CTE to sort): sort them there by :data:`GROUP_ORDER`'s columns.

    The statement is shaped for the plan cache. psycopg prepares it on its fifth run, and the
    server then keeps one generic plan only if that plan looks no dearer than planning each run
    anew; otherwise it plans every run, which on PostgreSQL costs twice what running the claim
    does. So ``top`` is written into the text (a bound LIMIT is estimated at a tenth of the
    table, which priced the generic plan out), and the messages are taken by
    ``queuing_order = ANY(ARRAY(...))``, which stays an index scan of the primary key in any
    plan (``IN (SELECT ...)`` became a hash join over the whole table in the generic plan).

    ``mark`` (PostgreSQL; bind ``lease_key``): when messages are taken, the same statement takes
    the receive lease's transaction-level advisory lock and ends the queue's run of rolled-back
    receives (which takes effect only if the transaction commits).

    ``lease`` (bind ``token``): instead of taking the messages, mark them with the lease's token
    and count the hand-out (:mod:`airflow_broker.messaging.leases` holds the group).
    Messages marked by a lease are never picked (a MOVE CONVERSATION may have carried them out
    of their leased group).
    """
    sql = _claim_sql(dialect, top, by_handle, by_group, retention, mark, lease)
    clause = _typed(sql, by_handle=by_handle, by_group=by_group)
    if lease:
        clause = clause.bindparams(bindparam("token", type_=Uuid()))
    return clause.columns(*(_col(name) for name in MESSAGE_COLUMNS))  # type: ignore[return-value]


#: The SQL type of each bound name of the claim, for its prepared form.
_CLAIM_PARAM_TYPES = {
    "queue_id": "integer",
    "now": "timestamptz",
    "lease_key": "bigint",
    "token": "uuid",
    "handle": "uuid",
    "group_id": "uuid",
}
_BOUND_NAME = re.compile(r"(?<![:\w]):(\w+)")


@lru_cache(maxsize=256)
def claim_prepared(
    *,
    top: int | None = None,
    by_handle: bool = False,
    by_group: bool = False,
    retention: bool = False,
    mark: bool = False,
    lease: bool = False,
) -> tuple[direct.Prepared, tuple[str, ...]]:
    """PostgreSQL: :func:`claim_statement` prepared for :mod:`~airflow_broker.storage.direct`,
    and the names of its parameters in their order (bind them by name as for the other)."""
    sql = _claim_sql("postgresql", top, by_handle, by_group, retention, mark, lease)
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    numbered = _BOUND_NAME.sub(number, sql)
    # Planned with index scans, whatever the queue's size when it is planned; prepared behind
    # a pooler too, its plan costing more than its run (direct.Prepared).
    types = [_CLAIM_PARAM_TYPES[n] for n in names]
    prepared = direct.Prepared(numbered, types, index_scans=True, costly_plan=True)
    return prepared, tuple(names)


def _claim_sql(
    dialect: str,
    top: int | None,
    by_handle: bool,
    by_group: bool,
    retention: bool,
    mark: bool,
    lease: bool,
) -> str:
    take = "UPDATE broker_message SET status = 0" if retention else "DELETE FROM broker_message"
    if lease:
        take = "UPDATE broker_message SET lease_token = :token, receive_count = receive_count + 1"
    picked = _picked(dialect, top, by_handle, by_group)
    taking = (
        f"{take} WHERE queuing_order {_picked_ones(dialect)} RETURNING {', '.join(MESSAGE_COLUMNS)}"
    )
    if mark:
        sql = (
            f"{picked}, taken AS ({taking}), "
            "reset AS (UPDATE broker_queue SET rollback_count = 0 "
            "WHERE queue_id = :queue_id AND rollback_count > 0 "
            "AND EXISTS (SELECT 1 FROM taken)) "
            f"{_TAKEN_OR_PROBE.replace('FROM taken ', f'FROM taken WHERE {_LEASE_LOCK} ', 1)}"
        )
    elif claim_is_ordered(dialect):
        sql = f"{picked}, taken AS ({taking}) {_TAKEN_OR_PROBE}"
    else:
        sql = f"{picked} {taking}"
    return sql


def _group_rows(group_id: str) -> str:
    """The FROM and WHERE of every pick: the claimed group's (``group_id``, an expression) ready
    messages that no lease holds."""
    return (
        f"FROM broker_message m WHERE m.conversation_group_id = {group_id} "
        "AND m.queue_id = :queue_id AND m.status = 1 AND m.lease_token IS NULL"
    )


_GROUP_ROWS = _group_rows("(SELECT conversation_group_id FROM grp)")


def _picked(dialect: str, top: int | None, by_handle: bool, by_group: bool) -> str:
    """``WITH grp AS (...), picked AS (...)``: the group a claim locks, and the queuing orders of
    the messages it takes from it.

    Without a filter and with ``top``, the conversation of the oldest ready message (the one
    that chose the group) goes first: RECEIVE TOP (n) from a group of many conversations takes
    them in the order their messages came, not in the order of their handles. That is fairer
    (a conversation whose handle sorts late is not passed over while the others keep
    receiving), and it keeps a deep queue's pages together: in a queue filled by SENDs to many
    conversations at once, one conversation's next 100 messages lie on 100 heap pages that
    hold the next messages of every other conversation too. Taken by handle, every RECEIVE
    changed 100 pages no other RECEIVE of the round would touch, each written whole to the WAL
    (first change since a checkpoint); taken by age, the round's RECEIVEs share those pages.

    Within a conversation the order is the same either way: DialogTimer, then Error, then
    sequence order. What the claim takes is the first ``top`` of the group's ready messages in
    :data:`GROUP_ORDER`, except that the first conversation's normal messages go before the
    other conversations' normal messages of the same priority (system messages of every
    conversation still come first, as always). That order is read from four disjoint ranges
    of the group index, each in GROUP_ORDER and read no further than ``top``: higher
    priorities; the first conversation's priority, system messages; its normal messages; and
    the rest of that priority with the lower ones. Appended in that order under one ``LIMIT``,
    a range runs only while the ones before it have not filled the claim (a statement that
    locks rows is never planned in parallel, so the Append runs its parts in order): when the
    first conversation has ``top`` messages waiting, as in a busy queue, no other range reads a
    row. The last range steps over what the two before it took, by a filter; it runs only when
    they took fewer than ``top``, so that is never more than ``top`` entries.

    Measured on PostgreSQL (a claim and its round trip, 10,000 messages in 4 groups of 25
    conversations): TOP (100) 1.99 ms against 2.45 ms for the merge of two overlapping ranges
    this replaces (the first conversation's, and the whole group's, each read up to ``top``,
    then grouped to count a message found by both once, and sorted); TOP (1) the same, 0.57
    against 0.59 ms. Leaving the first conversation out of one whole-group range that always
    runs would step over all of its messages when its handle sorts first (2.3 ms for 3,000 of
    them).
    """
    if top is None or by_handle or by_group:
        # All of the group's messages (the order of the output is sorted apart), one
        # conversation's, or a named group's (no message chose it).
        handle_filter = " AND m.conversation_handle = :handle" if by_handle else ""
        picker = _group_picker(dialect, by_handle=by_handle, by_group=by_group)
        return (
            f"WITH grp AS ({picker}), "
            f"picked AS (SELECT m.queuing_order {_GROUP_ROWS}{handle_filter} "
            f"ORDER BY {GROUP_ORDER}{_limit(top)})"
        )
    picker = _group_picker(dialect, by_handle=False, by_group=False, first=True)
    pg = dialect == "postgresql"

    def grp(name: str) -> str:
        # PostgreSQL joins the one row of grp LATERAL (one CTE scan for all four ranges);
        # SQLite has no LATERAL and reads it by scalar subqueries.
        return f"grp.{name}" if pg else f"(SELECT {name} FROM grp)"

    # No first conversation (the walk chose the group): a priority above every message's makes
    # the first three ranges empty and the last the whole group. The first range is empty too
    # when the oldest message chose the group (it is the group's highest priority); it is read
    # all the same, one index descent, so that no message is passed over if that ever changes.
    fp = f"COALESCE({grp('first_priority')}, {_ABOVE_PRIORITIES})"
    first = f"m.conversation_handle = {grp('first_handle')}"
    ranges = (
        f"m.priority > {fp}",
        f"m.priority = {fp} AND m.precedence < {PRECEDENCE_NORMAL}",
        f"m.priority = {fp} AND m.precedence = {PRECEDENCE_NORMAL} AND {first}",
        f"m.priority <= {fp} "
        f"AND NOT (m.priority = {fp} AND (m.precedence < {PRECEDENCE_NORMAL} OR {first}))",
    )
    rows = _group_rows(grp("conversation_group_id"))
    union = " UNION ALL ".join(
        f"SELECT * FROM (SELECT m.queuing_order {rows} AND {where} "
        f"ORDER BY {GROUP_ORDER}{_limit(top)}) r{i}"
        for i, where in enumerate(ranges)
    )
    source = f"grp CROSS JOIN LATERAL ({union}) u" if pg else f"({union}) u"
    return (
        "WITH grp (conversation_group_id, first_handle, first_priority) AS "
        f"({picker}), "
        f"picked AS (SELECT u.queuing_order FROM {source}{_limit(top)})"
    )


def _picked_ones(dialect: str) -> str:
    if dialect == "postgresql":
        return "= ANY(ARRAY(SELECT queuing_order FROM picked))"
    return "IN (SELECT queuing_order FROM picked)"


def _limit(top: int | None) -> str:
    if top is None:
        return ""
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"top must be a whole number >= 1, not {top!r}")
    return f" LIMIT {int(top)}"


def _col(name: str) -> Any:
    return column(name, _COLUMN_TYPES[name])


@cache
def lock_group_statement(
    dialect: str, *, by_handle: bool = False, by_group: bool = False
) -> TextClause:
    """GET CONVERSATION GROUP: lock and return the next group with ready messages."""
    picker = _group_picker(dialect, by_handle=by_handle, by_group=by_group)
    clause = _typed(picker, by_handle=by_handle, by_group=by_group)
    return clause.columns(_col("conversation_group_id"))  # type: ignore[return-value]


#: On PostgreSQL a claim can come back empty although ready messages exist in an unlocked group:
#: another reader committed between this statement's snapshot and its lock on the group, so the
#: group it locked holds only messages that are already gone. Its probe row says so
#: (:data:`_TAKEN_OR_PROBE`), and RECEIVE runs the claim again (a new statement, a new snapshot),
#: at most this many times in all.
CLAIM_ATTEMPTS = 4
