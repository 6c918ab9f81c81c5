"""storage.bulk: the set-based writes of the delivery path write what one INSERT or DELETE per
row would, on both engines, by COPY and by arrays."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import BigInteger, Column, MetaData, Table, func, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError, PendingRollbackError

from airflow_broker import Broker
from airflow_broker.storage import bulk
from airflow_broker.storage import schema as s

NOW = datetime(2026, 11, 27, 8, 30, 0, 123456, tzinfo=UTC)


def _queue_id(b: Broker) -> int:
    """A queue's id, for rows whose foreign key needs one."""
    with b.definitions() as d:
        d.create_queue("bulk_queue")
    with b.engine.connect() as conn:
        return int(conn.execute(select(s.queue.c.queue_id)).scalar_one())


def _messages(n: int) -> list[dict[str, object]]:
    """``n`` message rows over conversations of ten, with every kind of value a row holds:
    NULL and empty bodies, bytes of every value, far sequence numbers, times with micros."""
    rows: list[dict[str, object]] = []
    for i in range(n):
        if i % 10 == 0:
            handle, group = uuid.uuid4(), uuid.uuid4()
        rows.append(
            {
                "queue_id": 1 + i % 3,
                "conversation_group_id": group,
                "conversation_handle": handle,
                "message_sequence_number": 2**40 + i,
                "status": 1 if i % 7 else 0,
                "priority": i % 10 + 1,
                "precedence": i % 3,
                "service_name": f"//bulk/service/é{i % 4}",
                "service_contract_name": "DEFAULT",
                "message_type_name": "t'\"\\,{}" if i % 5 == 0 else "DEFAULT",
                "validation": "N",
                "message_body": None if i % 9 == 0 else bytes(range(256))[: i % 257],
                "enqueued_at": NOW + timedelta(microseconds=i),
            }
        )
    return rows


def _stored(b: Broker, handles: set[object]) -> list[dict[str, object]]:
    m = s.message
    columns = [m.c[c] for c in _messages(1)[0]]
    with b.engine.connect() as conn:
        rows = conn.execute(select(*columns).order_by(m.c.queuing_order)).all()
    out = [dict(r._mapping) for r in rows if r.conversation_handle in handles]
    for r in out:  # SQLite gives naive UTC times back
        at = r["enqueued_at"]
        assert isinstance(at, datetime)
        r["enqueued_at"] = at if at.tzinfo else at.replace(tzinfo=UTC)
    return out


@pytest.mark.parametrize("n", [1, 2, 57, 523])
@pytest.mark.parametrize("how", ["copy", "unnest"])
def test_insert_rows_writes_every_value_as_given(
    broker: Broker, n: int, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL COPYs, or INSERTs from arrays where COPY cannot write (forced here); SQLite
    runs executemany both times."""
    if how == "unnest":
        monkeypatch.setattr(bulk, "_copyable", lambda conn, table: False)
    rows = _messages(n)
    with broker.engine.begin() as conn:
        bulk.insert_rows(conn, s.message, rows)
    assert _stored(broker, {r["conversation_handle"] for r in rows}) == rows


@pytest.mark.postgres
@pytest.mark.parametrize("how", ["copy", "unnest"])
def test_copy_tuples_writes_what_insert_rows_writes(
    pg_broker: Broker, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows as tuples in the columns' order (the direct delivery path's queue rows): a COPY,
    or where COPY cannot write (forced here) the same rows through insert_rows."""
    if how == "unnest":
        monkeypatch.setattr(bulk, "_copyable", lambda conn, table: False)
    rows = _messages(57)
    columns = tuple(rows[0])
    with pg_broker.engine.begin() as conn:
        bulk.copy_tuples(conn, s.message, columns, [tuple(r.values()) for r in rows])
    assert _stored(pg_broker, {r["conversation_handle"] for r in rows}) == rows


def test_insert_rows_first_on_a_connection_is_committed_by_its_commit(broker: Broker) -> None:
    """``connect()``, ``insert_rows``, ``commit()``: the rows stay, though no statement began
    the connection's transaction (a COPY is not one SQLAlchemy sees)."""
    rows = _messages(3)
    with broker.engine.connect() as conn:
        bulk.insert_rows(conn, s.message, rows)
        conn.commit()
    assert _stored(broker, {r["conversation_handle"] for r in rows}) == rows


def test_insert_rows_of_one_column(broker: Broker) -> None:
    scratch = Table("bulk_one_column", MetaData(), Column("n", BigInteger, nullable=False))
    with broker.engine.begin() as conn:
        scratch.create(conn)
        bulk.insert_rows(conn, scratch, [{"n": n} for n in (3, 1, 2**40)])
        assert sorted(conn.execute(select(scratch.c.n)).scalars()) == [1, 3, 2**40]


def test_insert_rows_through_a_view_and_under_row_level_security(pg_broker: Broker) -> None:
    """A restricted role sees the broker's tables as views of its own schema, first on its
    search path, and COPY cannot write a view; nor a table with row-level security. Both take
    the INSERT, and the rows arrive."""
    g = s.conversation_group
    queue_id = _queue_id(pg_broker)
    rows = [{"conversation_group_id": uuid.uuid4(), "queue_id": queue_id} for _ in range(3)]
    with pg_broker.engine.begin() as conn:
        conn.execute(text("CREATE SCHEMA bulk_client"))
        conn.execute(text(f"CREATE VIEW bulk_client.{g.name} AS SELECT * FROM public.{g.name}"))
        conn.execute(text("SET LOCAL search_path = bulk_client, public"))
        assert not bulk._copyable(conn, g)
        bulk.insert_rows(conn, g, rows)
        conn.execute(text("DROP SCHEMA bulk_client CASCADE"))
        conn.info.clear()  # what it learnt of the name was for the view
    with pg_broker.engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {s.inbox.name} ENABLE ROW LEVEL SECURITY"))
        assert bulk._copyable(conn, g) and not bulk._copyable(conn, s.inbox)
    with pg_broker.engine.connect() as conn:
        got = conn.execute(select(g.c.conversation_group_id)).scalars().all()
    assert sorted(got, key=str) == sorted((r["conversation_group_id"] for r in rows), key=str)


def test_insert_rows_is_all_or_nothing_and_raises_what_sqlalchemy_raises(
    pg_broker: Broker,
) -> None:
    """A duplicate key in a COPY: an IntegrityError, as for a statement (the inbound accept
    retries on it), and none of the batch written."""
    group = uuid.uuid4()
    queue_id = _queue_id(pg_broker)
    rows = [{"conversation_group_id": uuid.uuid4(), "queue_id": queue_id} for _ in range(120)]
    rows[-1]["conversation_group_id"] = rows[0]["conversation_group_id"] = group
    g = s.conversation_group
    with (
        pytest.raises(
            IntegrityError, match=r"duplicate key value .* \"pk_broker_conversation_group\""
        ),
        pg_broker.engine.begin() as conn,
    ):
        bulk.insert_rows(conn, g, rows)
    with pg_broker.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(g)).scalar() == 0
        # and the connection went back to the pool usable
        assert conn.execute(select(1)).scalar() == 1


def test_a_copy_on_a_lost_connection_invalidates_it(pg_broker: Broker) -> None:
    """The server ends the connection (a crash, a restart, an operator's
    pg_terminate_backend) before a COPY: the error says the connection was invalidated, as for
    a statement, the transaction must be rolled back, and the pool hands out a working one."""
    queue_id = _queue_id(pg_broker)
    rows = [{"conversation_group_id": uuid.uuid4(), "queue_id": queue_id} for _ in range(3)]
    g = s.conversation_group
    with pg_broker.engine.connect() as conn:
        bulk.insert_rows(conn, g, rows[:1])  # what COPY may write is known on this connection
        conn.rollback()
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        conn.rollback()
        with pg_broker.engine.connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(DBAPIError) as raised:
            bulk.insert_rows(conn, g, rows)
        assert raised.value.connection_invalidated
        assert conn.invalidated
        with pytest.raises(PendingRollbackError):
            conn.execute(select(1))
        conn.rollback()
    with pg_broker.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(g)).scalar() == 0


def test_delete_runs_deletes_exactly_the_pairs(broker: Broker) -> None:
    rows = _messages(40)
    with broker.engine.begin() as conn:
        bulk.insert_rows(conn, s.message, rows)
    handles = sorted({r["conversation_handle"] for r in rows}, key=str)
    seqs = {
        h: [r["message_sequence_number"] for r in rows if r["conversation_handle"] == h]
        for h in handles
    }
    # runs with gaps, a repeated pair, a pair that matches nothing, one conversation untouched
    gone = [(handles[0], seqs[handles[0]][i]) for i in (0, 1, 2, 5, 6, 9)]
    gone += [(handles[1], seqs[handles[1]][3]), (handles[1], seqs[handles[1]][3])]
    gone += [(handles[2], q) for q in seqs[handles[2]]] + [(handles[2], 7)]
    m = s.message
    with broker.engine.begin() as conn:
        bulk.delete_runs(conn, m, "conversation_handle", "message_sequence_number", gone)
    left = {
        (r["conversation_handle"], r["message_sequence_number"])
        for r in _stored(broker, set(handles))
    }
    every = {(r["conversation_handle"], r["message_sequence_number"]) for r in rows}
    assert left == every - set(gone)
