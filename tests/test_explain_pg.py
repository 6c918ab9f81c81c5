"""The RECEIVE path keeps using its indexes when a queue is deep (PostgreSQL).

100,000 messages in 1,000 dialogs sit in one queue. The dialogs and their first message are
made through the public API (so endpoints, groups and messages are exactly what the engine
writes); the other 99 messages of each dialog are copies of the first with later sequence
numbers, made by one ``INSERT ... SELECT generate_series`` (seconds instead of minutes). Then
every variant of the claim statement (``airflow_broker.storage.queries``) is EXPLAINed: none may
read ``broker_message`` with a sequential scan.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

from airflow_broker import Broker
from airflow_broker.storage import direct, queries
from airflow_broker.storage.clock import utcnow
from airflow_broker.storage.schema import message as message_table

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

DIALOGS = 1_000
PER_DIALOG = 100
QUEUE = "explain_q"


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


def _sql(stmt: Any) -> str:
    """The SQL text of a statement from ``airflow_broker.storage.queries`` (text, or text +
    columns)."""
    clause = getattr(stmt, "element", stmt)
    sql: str = clause.text
    return sql


def _message_scans(conn: Connection, sql: str, params: dict[str, Any]) -> list[str]:
    """The node types that read broker_message in the plan of ``sql``; fails on a Seq Scan."""
    raw = conn.execute(text(f"EXPLAIN (FORMAT JSON) {sql}"), params).scalar_one()
    plan = raw[0]["Plan"]
    scans = [
        node["Node Type"]
        for node in _plan_nodes(plan)
        if node.get("Relation Name") == "broker_message" and "Scan" in node["Node Type"]
    ]
    text_plan = "\n".join(r[0] for r in conn.execute(text(f"EXPLAIN {sql}"), params))
    assert "Seq Scan" not in scans, f"sequential scan of broker_message:\n{text_plan}"
    assert scans, f"broker_message is not read at all?\n{text_plan}"
    assert all("Index" in s or s == "Bitmap Heap Scan" for s in scans), text_plan
    return scans


@pytest.fixture(scope="module")
def deep_queue(postgres_server: Any) -> Iterator[str]:
    """A broker database with 100k ready messages in one queue (built once for this module)."""
    url: str = postgres_server.create_database()
    broker = Broker.connect(url)
    t0 = time.monotonic()
    broker.create_queue("explain_initiator_q")
    broker.create_queue(QUEUE)
    broker.create_service("//explain/Initiator", queue="explain_initiator_q", contracts=["DEFAULT"])
    broker.create_service("//explain/Target", queue=QUEUE, contracts=["DEFAULT"])
    with broker.transaction() as tx:
        handles = [
            tx.begin_dialog("//explain/Initiator", "//explain/Target") for _ in range(DIALOGS)
        ]
        tx.send(handles, body={"n": 0})
    t_api = time.monotonic() - t0
    broker.dispose()

    copied = [
        c.name
        for c in message_table.columns
        if c.name not in ("queuing_order", "message_sequence_number")
    ]
    cols = ", ".join(copied)
    engine = create_engine(url, pool_size=1)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    f"INSERT INTO broker_message ({cols}, message_sequence_number) "
                    f"SELECT {', '.join('m.' + c for c in copied)}, "
                    "m.message_sequence_number + s.i "
                    "FROM broker_message m CROSS JOIN generate_series(1, :more) AS s(i) "
                    "ORDER BY s.i, m.queuing_order"
                ),
                {"more": PER_DIALOG - 1},
            )
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE"))
            total = conn.execute(
                text(
                    "SELECT count(*) FROM broker_message m JOIN broker_queue q "
                    "ON q.queue_id = m.queue_id WHERE q.name = :q AND m.status = 1"
                ),
                {"q": QUEUE},
            ).scalar_one()
    finally:
        engine.dispose()
    assert total == DIALOGS * PER_DIALOG
    print(f"\n{total} messages queued in {time.monotonic() - t0:.1f} s (API part {t_api:.1f} s)")
    yield url


@pytest.fixture
def conn(deep_queue: str) -> Iterator[Connection]:
    engine = create_engine(deep_queue, pool_size=1)
    with engine.connect() as connection:
        yield connection
        connection.rollback()
    engine.dispose()


def _ids(conn: Connection) -> dict[str, Any]:
    row = conn.execute(
        text(
            "SELECT q.queue_id, m.conversation_handle, m.conversation_group_id "
            "FROM broker_message m JOIN broker_queue q ON q.queue_id = m.queue_id "
            "WHERE q.name = :q ORDER BY m.queuing_order DESC LIMIT 1"
        ),
        {"q": QUEUE},
    ).one()
    return {"queue_id": row.queue_id, "handle": row.conversation_handle, "group": row[2]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("retention", [False, True], ids=["delete", "retention"])
@pytest.mark.parametrize(
    ("by_handle", "by_group"),
    [(False, False), (True, False), (False, True)],
    ids=["next-group", "by-handle", "by-group"],
)
@pytest.mark.parametrize("top", [None, 1, 10], ids=["all", "top1", "top10"])
def test_claim_statement_uses_indexes(
    conn: Connection, by_handle: bool, by_group: bool, retention: bool, top: int | None
) -> None:
    ids = _ids(conn)
    stmt = queries.claim_statement(
        "postgresql", top=top, by_handle=by_handle, by_group=by_group, retention=retention
    )
    params: dict[str, Any] = {"queue_id": ids["queue_id"], "now": utcnow()}
    if by_handle:
        params["handle"] = ids["handle"]
    if by_group:
        params["group_id"] = ids["group"]
    _message_scans(conn, _sql(stmt), params)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lease", [False, True], ids=["take", "lease"])
@pytest.mark.parametrize("top", [None, 1, 100], ids=["all", "top1", "top100"])
def test_claim_generic_plan_uses_indexes(conn: Connection, top: int | None, lease: bool) -> None:
    """psycopg prepares the claim after its fifth run; the plan the server may then keep for
    every run (the generic plan, planned without the values) must read broker_message by its
    indexes too. A bound LIMIT and ``IN (SELECT ...)`` once made it a hash join over the whole
    table (62 ms instead of 1 ms for 100 of 300,000 messages)."""
    ids = _ids(conn)
    stmt = queries.claim_statement("postgresql", top=top, mark=not lease, lease=lease)
    sql = _sql(stmt)
    names = ["queue_id", "now"] + (["token"] if lease else ["lease_key"])
    types = {"queue_id": "integer", "now": "timestamptz", "token": "uuid", "lease_key": "integer"}
    for i, name in enumerate(names, start=1):
        sql = sql.replace(f":{name}", f"${i}")
    conn.execute(text("SET plan_cache_mode = force_generic_plan"))
    conn.exec_driver_sql(f"PREPARE claim_generic ({', '.join(types[n] for n in names)}) AS {sql}")
    try:
        args = [str(ids["queue_id"]), "now()", "NULL" if lease else "1"]
        if lease:
            args[2] = "'00000000-0000-0000-0000-000000000001'"
        raw = conn.exec_driver_sql(
            f"EXPLAIN (FORMAT JSON) EXECUTE claim_generic({', '.join(args)})"
        ).scalar_one()
    finally:
        conn.exec_driver_sql("DEALLOCATE claim_generic")
        conn.execute(text("RESET plan_cache_mode"))
    nodes = list(_plan_nodes(raw[0]["Plan"]))
    reads = [
        n for n in nodes if n.get("Relation Name") == "broker_message" and "Scan" in n["Node Type"]
    ]
    assert reads and all(
        "Index" in n["Node Type"] or n["Node Type"] == "Bitmap Heap Scan" for n in reads
    ), [(n["Node Type"], n.get("Index Name")) for n in reads]
    assert not {"Hash Join", "Hash Semi Join", "Hash"} & {n["Node Type"] for n in nodes}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("by_handle", "by_group"),
    [(False, False), (True, False), (False, True)],
    ids=["next-group", "by-handle", "by-group"],
)
def test_lock_group_statement_uses_indexes(
    conn: Connection, by_handle: bool, by_group: bool
) -> None:
    ids = _ids(conn)
    stmt = queries.lock_group_statement("postgresql", by_handle=by_handle, by_group=by_group)
    params: dict[str, Any] = {"queue_id": ids["queue_id"], "now": utcnow()}
    if by_handle:
        params["handle"] = ids["handle"]
    if by_group:
        params["group_id"] = ids["group"]
    sql = _sql(stmt)
    raw = conn.execute(text(f"EXPLAIN (FORMAT JSON) {sql}"), params).scalar_one()
    seq = [
        n.get("Relation Name")
        for n in _plan_nodes(raw[0]["Plan"])
        if n["Node Type"] == "Seq Scan"
        and n.get("Relation Name") in ("broker_message", "broker_conversation_group")
    ]
    assert not seq, f"sequential scans of {seq}"


@pytest.mark.timeout(120)
def test_claim_really_runs_on_the_deep_queue_through_its_index(conn: Connection) -> None:
    """EXPLAIN ANALYZE the default claim (then roll it back): one group, 100 rows, no Seq Scan."""
    ids = _ids(conn)
    stmt = queries.claim_statement("postgresql", by_handle=False, by_group=False, retention=False)
    params = {"queue_id": ids["queue_id"], "now": utcnow()}
    raw = conn.execute(text(f"EXPLAIN (ANALYZE, FORMAT JSON) {_sql(stmt)}"), params).scalar_one()
    conn.rollback()
    plan = raw[0]["Plan"]
    nodes = list(_plan_nodes(plan))
    # broker_queue holds a handful of rows: the planner rightly reads it whole.
    seq = [
        n
        for n in nodes
        if n["Node Type"] == "Seq Scan" and n.get("Relation Name") != "broker_queue"
    ]
    assert not seq, f"sequential scans: {[n.get('Relation Name') for n in seq]}"
    assert plan["Actual Rows"] == PER_DIALOG, plan
    read = max(
        n["Actual Rows"] * n.get("Actual Loops", 1)
        for n in nodes
        if n.get("Relation Name") == "broker_message"
    )
    assert read <= 2 * PER_DIALOG, f"a scan of broker_message returned {read} rows"
    print(f"\nclaim of {PER_DIALOG} messages: {raw[0]['Execution Time']:.1f} ms")


def _analyze_claim(broker: Broker, queue: str, *, top: int) -> dict[str, Any]:
    """The plan of RECEIVE TOP (``top``)'s claim on ``queue``, run by EXPLAIN ANALYZE (and
    rolled back)."""
    stmt = queries.claim_statement("postgresql", top=top, mark=True)
    with broker.engine.connect() as conn:
        queue_id = conn.execute(
            text("SELECT queue_id FROM broker_queue WHERE name = :q"), {"q": queue}
        ).scalar_one()
        raw = conn.execute(
            text(f"EXPLAIN (ANALYZE, FORMAT JSON) {_sql(stmt)}"),
            {"queue_id": queue_id, "lease_key": 1, "now": utcnow()},
        ).scalar_one()
        conn.rollback()
    plan: dict[str, Any] = raw[0]["Plan"]
    return plan


def test_claim_plan_survives_statistics_taken_while_the_queue_was_empty(pg_broker: Broker) -> None:
    """Queue tables are often analyzed while empty. The claim must still walk the ready-message
    index in queue order and stop at the first free group, not hash-join and sort the queue."""
    with pg_broker.definitions() as d:
        d.create_queue("stats_q")
        d.create_service("//stats/s", queue="stats_q", contracts=["DEFAULT"])
    with pg_broker.transaction() as tx:
        handles = [tx.begin_dialog("//stats/s", "//stats/s") for _ in range(50)]
    autocommit = pg_broker.engine.execution_options(isolation_level="AUTOCOMMIT")
    with autocommit.connect() as conn:
        conn.execute(text("VACUUM ANALYZE"))
    for _ in range(20):
        with pg_broker.transaction() as tx:
            tx.send(handles, body=b"x")
    plan = _analyze_claim(pg_broker, "stats_q", top=1)
    nodes = list(_plan_nodes(plan))
    kinds = {n["Node Type"] for n in nodes}
    assert "Hash Join" not in kinds, kinds
    ready_reads = [
        n["Actual Rows"]
        for n in nodes
        if n.get("Relation Name") == "broker_message"
        and n.get("Index Name") == "ix_broker_message_ready"
    ]
    # 1,000 ready messages: the first one in order belongs to a free group, so one row is read.
    assert ready_reads == [1], ready_reads


def _seq_scans_of_messages(tx: Any) -> int:
    """Sequential scans of broker_message by ``tx``'s own transaction so far (the server's
    per-transaction counters, read on the transaction's connection)."""
    return int(
        tx.connection.execute(
            text("SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relname = 'broker_message'")
        ).scalar_one()
    )


def test_a_readers_claim_planned_on_a_small_queue_uses_indexes_after_a_burst(
    pg_broker: Broker,
) -> None:
    """A reader's connection plans its claim once and keeps that plan until the statistics
    change. Planned while the queue was small and freshly analyzed (autovacuum's usual moment),
    it read the whole queue by sequential scans once a burst filled it: the claim is planned
    with sequential scans off (``direct.Prepared(index_scans=True)``)."""
    with pg_broker.definitions() as d:
        d.create_queue("burst_q")
        d.create_service("//burst/s", queue="burst_q", contracts=["DEFAULT"])
    with pg_broker.transaction() as tx:
        handles = [tx.begin_dialog("//burst/s", "//burst/s") for _ in range(50)]
        tx.send(handles, body=b"x")
    autocommit = pg_broker.engine.execution_options(isolation_level="AUTOCOMMIT")
    with autocommit.connect() as conn:
        conn.execute(text("VACUUM ANALYZE broker_message"))
    # More than five claims: the server settles on the statement's generic plan.
    tx = pg_broker.transaction()
    assert len(tx.receive("burst_q", top=1)) == 1
    for _ in range(9):
        tx, got = tx.commit_and_receive("burst_q", top=1)
        assert len(got) == 1
    tx.commit()
    with pg_broker.transaction() as sender:  # the burst, with no ANALYZE after it
        for _ in range(60):
            sender.send(handles, body=b"y")
    tx = pg_broker.transaction()
    assert len(tx.receive("burst_q", top=1)) == 1  # BEGIN and the claim in one query
    assert _seq_scans_of_messages(tx) == 0
    tx, got = tx.commit_and_receive("burst_q", top=1)  # COMMIT; BEGIN; claim in one query
    assert len(got) == 1
    assert _seq_scans_of_messages(tx) == 0
    tx.commit()


def test_send_does_not_read_a_grown_transmission_queue_by_sequential_scans(
    pg_broker: Broker,
) -> None:
    """SEND's function checks that the conversation has nothing waiting to leave. Its plan,
    made while the transmission queue was small, read that whole queue on every SEND once a far
    broker fell behind: the SEND functions plan with sequential scans off (migration 0022)."""
    with pg_broker.definitions() as d:
        d.create_queue("tq_q")
        d.create_service("//tq/s", queue="tq_q", contracts=["DEFAULT"])
    with pg_broker.transaction() as tx:  # conversing: both endpoints exist (SEND's fast path)
        handles = [tx.begin_dialog("//tq/s", "//tq/s") for _ in range(200)]
        tx.send(handles, body=b"hello")
    while True:
        with pg_broker.transaction() as tx:
            if not tx.receive("tq_q"):
                break
    autocommit = pg_broker.engine.execution_options(isolation_level="AUTOCOMMIT")
    with autocommit.connect() as conn:
        conn.execute(text("VACUUM ANALYZE broker_transmission_queue"))
    tx = pg_broker.transaction()
    tx.send(handles[0], body=b"planned while the transmission queue is empty")
    # Messages of 100 other dialogs waiting to leave (rows as the engine writes them, copied),
    # committed meanwhile, with no ANALYZE after them.
    with autocommit.connect() as conn:
        conn.execute(
            text(
                "INSERT INTO broker_transmission_queue (conversation_handle, conversation_id, "
                "is_initiator, from_service_name, from_broker_instance, to_service_name, "
                "service_contract_name, message_type_name, message_sequence_number, priority, "
                "validation, enqueued_at) "
                "SELECT h, gen_random_uuid(), true, '//tq/s', 'here', '//far/s', 'DEFAULT', "
                "'DEFAULT', g, 5, 'N', now() "
                "FROM unnest(CAST(:waiting AS uuid[])) AS h, generate_series(1, 100) AS g"
            ),
            {"waiting": handles[100:]},
        )
    tx.send(handles[1], body=b"after 10,000 messages queued to leave")
    scans = tx.connection.execute(
        text(
            "SELECT seq_scan FROM pg_stat_xact_user_tables "
            "WHERE relname = 'broker_transmission_queue'"
        )
    ).scalar_one()
    assert scans == 0
    tx.commit()
    with pg_broker.transaction() as rx:
        assert len(rx.receive("tq_q")) >= 1


def _two_groups(broker: Broker, queue: str, first: int, second: int) -> tuple[Any, Any]:
    """A queue whose oldest ``first`` ready messages are in one conversation group (10 dialogs)
    and the next ``second`` in another (10 more); returns the two group ids."""
    initiator, target = f"//{queue}/initiator", f"//{queue}/target"
    with broker.definitions() as d:
        d.create_queue(f"{queue}_initiator")
        d.create_queue(queue)
        d.create_service(initiator, queue=f"{queue}_initiator", contracts=["DEFAULT"])
        d.create_service(target, queue=queue, contracts=["DEFAULT"])
    groups, senders = [], []
    for _ in range(2):
        with broker.transaction() as tx:
            handles = [tx.begin_dialog(initiator, target) for _ in range(10)]
            tx.send(handles, body={"n": -1})
        far: set[Any] = set()
        for _ in range(10):  # one dialog's group per RECEIVE
            with broker.transaction() as tx:
                far |= {m.conversation_handle for m in tx.receive(queue)}
        assert len(far) == 10
        with broker.transaction() as tx:
            leader = tx.conversation(min(far)).conversation_group_id
            for h in far - {min(far)}:
                tx.move_conversation(h, leader)
        groups.append(leader)
        senders.append(handles)
    for handles, count in zip(senders, (first, second), strict=True):
        with broker.transaction() as tx:
            for i in range(count // 10):
                tx.send(handles, body={"n": i})
    return groups[0], groups[1]


def _lock_group(broker: Broker, group: Any) -> Connection:
    """Another transaction holding ``group`` as a RECEIVE holds it (roll back to free it)."""
    holder = create_engine(broker.engine.url, poolclass=NullPool).connect()
    holder.execute(
        text(
            "SELECT 1 FROM broker_conversation_group WHERE conversation_group_id = :g "
            "FOR NO KEY UPDATE"
        ),
        {"g": group},
    )
    return holder


def test_a_claim_with_every_busy_group_locked_does_not_walk_the_queue(pg_broker: Broker) -> None:
    """More readers than busy groups: the readers left over find every group locked. Their
    claim tries the groups of the first messages and then each group of the queue once; it must
    not try the same locked groups again for each of the thousands of messages behind them."""
    a, b = _two_groups(pg_broker, "locked_q", 2_000, 2_000)
    holders = [_lock_group(pg_broker, g) for g in (a, b)]
    try:
        plan = _analyze_claim(pg_broker, "locked_q", top=100)
    finally:
        for h in holders:
            h.rollback()
            h.close()
    assert plan["Actual Rows"] == 0, "a locked group's messages were claimed"
    read = sum(
        n["Actual Rows"] * n.get("Actual Loops", 1)
        for n in _plan_nodes(plan)
        if n.get("Relation Name") == "broker_message"
    )
    assert read <= queries.FIRST_LOOK + 10, f"an empty claim read {read} of 4,000 messages"


def test_a_free_group_behind_the_first_look_is_claimed(pg_broker: Broker) -> None:
    """The oldest ready messages, many more than a claim first looks at, are in a locked group;
    a free group's messages come after them. RECEIVE takes the free group's, all of them, and
    none of the locked group's."""
    busy, free = _two_groups(pg_broker, "behind_q", 10 * queries.FIRST_LOOK, 50)
    holder = _lock_group(pg_broker, busy)
    try:
        with pg_broker.transaction() as tx:
            got = tx.receive("behind_q", top=1_000)
    finally:
        holder.rollback()
        holder.close()
    assert {m.conversation_group_id for m in got} == {free}
    assert len(got) == 50
    with pg_broker.transaction() as tx:
        rest = tx.receive("behind_q", top=10_000)
    assert len(rest) == 10 * queries.FIRST_LOOK
    assert {m.conversation_group_id for m in rest} == {busy}


def test_an_empty_receive_with_every_group_locked_claims_once(
    pg_broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader left over (every group with ready messages held by another reader) gets an
    empty RECEIVE from one claim: a claim that locked no group is not run again, as one that
    locked a group whose messages another reader had just taken is."""
    a, b = _two_groups(pg_broker, "idle_q", 100, 100)
    claims: list[object] = []
    real = direct.execute

    def counted(conn: Any, prepared: Any, args: Any, **options: Any) -> Any:
        claims.append(prepared)
        return real(conn, prepared, args, **options)

    monkeypatch.setattr(direct, "execute", counted)
    holders = [_lock_group(pg_broker, g) for g in (a, b)]
    try:
        with pg_broker.transaction() as tx:
            assert tx.receive("idle_q", top=10) == []
        assert len(claims) == 1, f"{len(claims)} claims for one empty RECEIVE"
    finally:
        for h in holders:
            h.rollback()
            h.close()
    with pg_broker.transaction() as tx:
        assert len(tx.receive("idle_q", top=1_000)) == 100
