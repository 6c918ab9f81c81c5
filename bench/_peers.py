"""The peers: pgmq (SQL-only install from its PyPI package) and pgqueuer, through their own APIs.

pgmq is measured two ways:

- ``pgmq-pop``, pgmq at its fastest and the peer the targets are held against: every send and
  every consume is one statement on an autocommit connection, that is one round trip and its
  own committed transaction. The consume is ``pgmq.pop(queue, qty)`` (one ``DELETE ...
  RETURNING`` of the oldest visible rows, ``FOR UPDATE SKIP LOCKED``): the exactly-once consume
  that RECEIVE + COMMIT compares to. ``pop`` takes ``qty`` in the SQL the ``pgmq`` package ships
  (pgmq 1.13.0 here), so the batched workload pops 100 in one statement.
- ``pgmq``: ``read`` (visibility timeout) then ``archive`` in one transaction, kept as an info
  line: what a consumer that keeps its messages in the archive table pays.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

import psycopg
from psycopg_pool import ConnectionPool

from bench._scratch import Database
from bench._systems import SetupState, Workload, payload, payload_bytes

if TYPE_CHECKING:
    from pgmq import PGMQueue
    from pgqueuer.queries import Queries, SyncQueries

PGMQ_QUEUE = "bench"
#: Visibility timeout of pgmq reads: far longer than any round, so nothing is read twice.
PGMQ_VT_SECONDS = 300
PGQUEUER_ENTRYPOINT = "bench"
#: Messages per statement when a backlog is loaded.
BACKLOG_CHUNK = 1000


# --- pgmq -------------------------------------------------------------------------------------


def _pgmq_client(db: Database) -> tuple[PGMQueue, ConnectionPool]:
    """pgmq's sync client on a one-connection pool (no CREATE EXTENSION: SQL-only install)."""
    from pgmq import PGMQueue

    pool = ConnectionPool(db.conninfo, min_size=1, max_size=1, open=True)
    return PGMQueue(pool=pool, init_extension=False), pool


class PgmqProducer:
    """``pgmq.send`` (single) or ``pgmq.send_batch`` (batched); each call its own transaction."""

    def __init__(self, db: Database) -> None:
        self.queue, self.pool = _pgmq_client(db)

    def send(self, first_seq: int, count: int) -> None:
        """Enqueue ``count`` messages in one transaction."""
        if count == 1:
            self.queue.send(PGMQ_QUEUE, payload(first_seq))
        else:
            self.queue.send_batch(PGMQ_QUEUE, [payload(first_seq + i) for i in range(count)])

    def close(self) -> None:
        """Close the pool."""
        self.pool.close()


class PgmqConsumer:
    """``read(qty=batch)`` then ``archive`` of what was read, in one transaction.

    pgmq's read commits a visibility timeout, and the archive is a second statement; running both
    in one transaction makes a consume atomic, like RECEIVE + COMMIT (and saves pgmq a commit).
    """

    def __init__(self, db: Database, batch: int) -> None:
        self.queue, self.pool = _pgmq_client(db)
        self.batch = batch

    def receive(self) -> int:
        """Read and archive up to ``batch`` messages in one transaction."""
        with self.pool.connection() as conn, conn.transaction():
            if self.batch == 1:
                msg = self.queue.read(PGMQ_QUEUE, vt=PGMQ_VT_SECONDS, qty=1, conn=conn)
                if msg is None:
                    return 0
                self.queue.archive(PGMQ_QUEUE, msg.msg_id, conn=conn)  # type: ignore[union-attr]
                return 1
            msgs = self.queue.read(PGMQ_QUEUE, vt=PGMQ_VT_SECONDS, qty=self.batch, conn=conn)
            if not msgs:
                return 0
            assert isinstance(msgs, list)
            self.queue.archive_batch(PGMQ_QUEUE, [m.msg_id for m in msgs], conn=conn)
            return len(msgs)

    def end_round(self) -> int:
        """Nothing is held between two consumes."""
        return 0

    def close(self) -> None:
        """Close the pool."""
        self.pool.close()


def _pgmq_autocommit(db: Database) -> tuple[PGMQueue, psycopg.Connection]:
    """pgmq's sync client for calls given ``conn=``, and the autocommit connection to give it.

    Every call passes the connection, so the client's pool is never opened (no idle connection:
    8 readers of every system must fit under ``max_connections``).
    """
    from pgmq import PGMQueue

    pool = ConnectionPool(db.conninfo, min_size=1, max_size=1, open=False)
    conn = psycopg.connect(db.conninfo, autocommit=True)
    return PGMQueue(pool=pool, init_extension=False), conn


class PgmqPopProducer:
    """``pgmq.send`` or ``pgmq.send_batch`` as one autocommitted statement (one round trip)."""

    def __init__(self, db: Database) -> None:
        self.queue, self.conn = _pgmq_autocommit(db)

    def send(self, first_seq: int, count: int) -> None:
        """Enqueue ``count`` messages in one statement, its own transaction."""
        # conn= skips the client's BEGIN/COMMIT around the call: the statement autocommits.
        if count == 1:
            self.queue.send(PGMQ_QUEUE, payload(first_seq), conn=self.conn)
        else:
            msgs = [payload(first_seq + i) for i in range(count)]
            self.queue.send_batch(PGMQ_QUEUE, msgs, conn=self.conn)

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()


class PgmqPopConsumer:
    """``pgmq.pop(queue, qty=batch)`` as one autocommitted statement: read and delete at once."""

    def __init__(self, db: Database, batch: int) -> None:
        self.queue, self.conn = _pgmq_autocommit(db)
        self.batch = batch

    def receive(self) -> int:
        """Pop up to ``batch`` messages in one statement, its own transaction."""
        got = self.queue.pop(PGMQ_QUEUE, qty=self.batch, conn=self.conn)
        if self.batch == 1:
            return 0 if got is None else 1
        assert isinstance(got, list)
        return len(got)

    def end_round(self) -> int:
        """Nothing is held between two pops."""
        return 0

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()


class PgmqSystem:
    """pgmq, installed from the ``pgmq.sql`` its PyPI package ships (no server extension)."""

    name = "pgmq"

    def install(self, db: Database) -> None:
        """Run the bundled ``pgmq/sql/pgmq.sql`` in one transaction."""
        from pgmq import get_embedded_install_sql, install_pgmq_sql

        with psycopg.connect(db.conninfo) as conn:
            install_pgmq_sql(get_embedded_install_sql(), conn=conn)

    def prepare(self, db: Database, workload: Workload) -> SetupState:
        """A logged queue (the broker's tables are logged too)."""
        queue, pool = _pgmq_client(db)
        try:
            queue.create_queue(PGMQ_QUEUE)
        finally:
            pool.close()
        return {}

    def producer(self, db: Database, workload: Workload, state: SetupState) -> PgmqProducer:
        """See :class:`PgmqProducer`."""
        return PgmqProducer(db)

    def consumer(self, db: Database, workload: Workload, state: SetupState) -> PgmqConsumer:
        """See :class:`PgmqConsumer`."""
        return PgmqConsumer(db, workload.batch)

    def remaining(self, db: Database, state: SetupState) -> int:
        """Rows left in the queue table."""
        with psycopg.connect(db.conninfo) as conn:
            row = conn.execute(f"SELECT count(*) FROM pgmq.q_{PGMQ_QUEUE}").fetchone()
        return int(row[0]) if row else 0


class PgmqPopSystem(PgmqSystem):
    """pgmq at its fastest: autocommitted ``send``/``send_batch`` and ``pop`` (see the module)."""

    name = "pgmq-pop"

    def producer(self, db: Database, workload: Workload, state: SetupState) -> PgmqPopProducer:
        """See :class:`PgmqPopProducer`."""
        return PgmqPopProducer(db)

    def consumer(self, db: Database, workload: Workload, state: SetupState) -> PgmqPopConsumer:
        """See :class:`PgmqPopConsumer`."""
        return PgmqPopConsumer(db, workload.batch)

    def load(self, db: Database, workload: Workload, state: SetupState, count: int) -> None:
        """A backlog of ``count`` messages, ``send_batch`` of 1,000 per statement (untimed)."""
        producer = PgmqPopProducer(db)
        try:
            for first in range(0, count, BACKLOG_CHUNK):
                producer.send(-1 - first, min(BACKLOG_CHUNK, count - first))
        finally:
            producer.close()


# --- pgqueuer ---------------------------------------------------------------------------------


class PgqueuerProducer:
    """``SyncQueries.enqueue``: one job, or a list of jobs in one statement; autocommit."""

    def __init__(self, db: Database) -> None:
        from pgqueuer.adapters.drivers.psycopg import SyncPsycopgDriver
        from pgqueuer.queries import SyncQueries

        self.conn = psycopg.connect(db.conninfo, autocommit=True)
        self.queries: SyncQueries = SyncQueries(SyncPsycopgDriver(self.conn))

    def send(self, first_seq: int, count: int) -> None:
        """Enqueue ``count`` jobs in one statement (its own transaction)."""
        if count == 1:
            self.queries.enqueue(PGQUEUER_ENTRYPOINT, payload_bytes(first_seq))
        else:
            self.queries.enqueue(
                [PGQUEUER_ENTRYPOINT] * count,
                [payload_bytes(first_seq + i) for i in range(count)],
                [0] * count,
            )

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()


class PgqueuerConsumer:
    """``Queries.dequeue(batch_size=batch)`` then ``log_jobs(successful)`` in one transaction.

    pgqueuer's own worker runs these as two autocommitted statements (job marked picked, then
    moved to the log); one transaction around both is the atomic consume the others do.
    """

    def __init__(self, db: Database, batch: int) -> None:
        self.db = db
        self.batch = batch
        self.conn: psycopg.AsyncConnection | None = None
        self.queries: Queries | None = None
        self.manager_id = uuid.uuid4()

    async def open(self) -> None:
        """Connect with autocommit on, as pgqueuer's driver requires."""
        from pgqueuer.adapters.drivers.psycopg import PsycopgDriver
        from pgqueuer.ports.repository import EntrypointExecutionParameter
        from pgqueuer.queries import Queries

        self.conn = await psycopg.AsyncConnection.connect(self.db.conninfo, autocommit=True)
        self.queries = Queries(PsycopgDriver(self.conn))
        self.entrypoints = {PGQUEUER_ENTRYPOINT: EntrypointExecutionParameter(concurrency_limit=0)}

    async def receive(self) -> int:
        """Dequeue and acknowledge up to ``batch`` jobs in one transaction."""
        assert self.conn is not None and self.queries is not None
        async with self.conn.transaction():
            jobs = await self.queries.dequeue(
                batch_size=self.batch,
                entrypoints=self.entrypoints,  # type: ignore[arg-type]
                queue_manager_id=self.manager_id,  # type: ignore[arg-type]
                global_concurrency_limit=None,
                heartbeat_timeout=timedelta(seconds=PGMQ_VT_SECONDS),
            )
            if jobs:
                await self.queries.log_jobs([(job, "successful", None) for job in jobs])
        return len(jobs)

    async def close(self) -> None:
        """Close the connection."""
        if self.conn is not None:
            await self.conn.close()


class PgqueuerSystem:
    """pgqueuer, schema from its ``Queries.install()``."""

    name = "pgqueuer"

    def install(self, db: Database) -> None:
        """``Queries.install()`` on an autocommit connection."""
        import asyncio

        async def _install() -> None:
            from pgqueuer.adapters.drivers.psycopg import PsycopgDriver
            from pgqueuer.queries import Queries

            async with await psycopg.AsyncConnection.connect(db.conninfo, autocommit=True) as conn:
                await Queries(PsycopgDriver(conn)).install()

        asyncio.run(_install())

    def prepare(self, db: Database, workload: Workload) -> SetupState:
        """Nothing to create: entrypoints are just a column value."""
        return {}

    def producer(self, db: Database, workload: Workload, state: SetupState) -> PgqueuerProducer:
        """See :class:`PgqueuerProducer`."""
        return PgqueuerProducer(db)

    def consumer(self, db: Database, workload: Workload, state: SetupState) -> PgqueuerConsumer:
        """See :class:`PgqueuerConsumer`."""
        return PgqueuerConsumer(db, workload.batch)

    def remaining(self, db: Database, state: SetupState) -> int:
        """Jobs left in the queue table."""
        producer = PgqueuerProducer(db)
        try:
            return sum(s.count for s in producer.queries.queue_size())
        finally:
            producer.close()
