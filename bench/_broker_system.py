"""airflow-broker as a measured system: dialogs between two local services on PostgreSQL.

Setup (untimed) begins ``Workload.dialogs`` dialogs from ``bench/initiator`` to ``bench/target``
and sends one message on each, so that every target endpoint exists and both sides are
CONVERSING before the first measured SEND: the bench measures steady-state messaging, not
dialog creation (the peers have no equivalent of it).

The producer SENDs with ``broker.send``, a SEND in a transaction of its own (on PostgreSQL its
COMMIT goes in the SEND's own round trip, as pgmq's autocommitted ``send``); the consumers run a
reader's loop (``tx.commit_and_receive``, as ``drain()``: each COMMIT goes with the next
RECEIVE).

Single: each SEND goes to the next dialog, round robin; each RECEIVE takes ``top=1``.

Batched: one transaction SENDs one message to each of 100 dialogs (``broker.send`` with the list
of handles), the equivalent of pgmq's ``send_batch`` of 100. On the receiving side the 100 target
endpoints are moved into ``Workload.groups`` conversation groups, and each consuming
transaction is one ``RECEIVE TOP (100)``: one statement that returns up to 100 messages of one
group, the equivalent of pgmq's ``read(qty=100)``. Several groups (4 by default) let two
readers work at once, as Service Broker's group locking intends; one RECEIVE per transaction
keeps the round trips per batch comparable to the peers' one read per batch.

Backlog (the deep-queue round): :meth:`AirflowBrokerSystem.load` fills the target queue,
untimed, through the engine's batched SEND: ``tx.send(handles, ...)`` to every set-up dialog,
ten times per transaction (1,000 messages per commit with 100 dialogs), so the waiting
messages are spread over the same dialogs and groups the round uses. The engine has no public
bulk path (COPY) into a local queue; this loads about 15,000 msgs/s here, about a minute per
10^6.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from bench._scratch import Database
from bench._systems import SetupState, Workload, payload

if TYPE_CHECKING:
    from airflow_broker import Broker, Transaction

INITIATOR_QUEUE = "bench_initiator_q"
TARGET_QUEUE = "bench_target_q"
INITIATOR = "bench/initiator"
TARGET = "bench/target"
#: Batched SENDs (each to every dialog) per transaction when a backlog is loaded.
BACKLOG_SENDS_PER_TX = 10


def _connect(db: Database) -> Broker:
    from airflow_broker import Broker

    return Broker.connect(db.sqlalchemy_url)


class BrokerProducer:
    """``broker.send(handle or handles, body=...)``: a SEND in a transaction of its own (on
    PostgreSQL its COMMIT goes in the same round trip, as pgmq's autocommitted ``send``)."""

    def __init__(self, db: Database, state: SetupState) -> None:
        self.broker = _connect(db)
        self.handles: list[uuid.UUID] = list(state["handles"])
        self._next = 0

    def send(self, first_seq: int, count: int) -> None:
        """One transaction: one message, or one message to each of ``count`` dialogs."""
        if count == 1:
            self.broker.send(self.handles[self._next], body=payload(first_seq))
            self._next = (self._next + 1) % len(self.handles)
        else:
            # SEND ON CONVERSATION (h1, ..., h100): one body to every listed dialog.
            self.broker.send(self.handles[:count], body=payload(first_seq))

    def close(self) -> None:
        """Dispose of the engine."""
        self.broker.dispose()


class BrokerConsumer:
    """A reader's loop, as ``drain()`` runs it: ``tx.receive(queue, top=batch)``, then
    ``tx.commit_and_receive(...)`` for each next transaction (its COMMIT and the next RECEIVE
    in one round trip)."""

    def __init__(self, db: Database, batch: int) -> None:
        self.broker = _connect(db)
        self.batch = batch
        #: the open transaction and what it holds (received, not yet committed)
        self.tx: Transaction | None = None
        self.held = 0

    def receive(self) -> int:
        """Commit one RECEIVE TOP (batch) and return how many messages it took (0: the queue
        was empty); the next RECEIVE is already made, in a transaction left open while it
        holds messages."""
        if self.tx is None:
            self.tx = self.broker.transaction()
            self.held = len(self.tx.receive(TARGET_QUEUE, top=self.batch))
        done = self.held
        if not done:
            self.tx.commit()
            self.tx = None
            return 0
        self.tx, received = self.tx.commit_and_receive(TARGET_QUEUE, top=self.batch)
        self.held = len(received)
        if not self.held:  # no transaction (nor its snapshot) left open between rounds
            self.tx.commit()
            self.tx = None
        return done

    def end_round(self) -> int:
        """Commit the batch held, if any, and return its size. Only a deep queue's rounds end
        with one: the last COMMIT's RECEIVE took it off the backlog, beyond the round's count.
        Held into the next round, its transaction kept the group locked and held back VACUUM's
        horizon through the next round's vacuum and SENDs. Rolled back, it would count as a
        failed hand-out: with five readers holding one, poison handling disabled the queue and
        logged an error that was the bench's, not the broker's."""
        if self.tx is None or self.tx.ended:
            self.tx = None
            return 0
        self.tx.commit()
        self.tx = None
        held, self.held = self.held, 0
        return held

    def close(self) -> None:
        """Dispose of the engine (:meth:`end_round` left nothing held)."""
        self.end_round()
        self.broker.dispose()


class AirflowBrokerSystem:
    """airflow-broker on PostgreSQL (retention off, the default)."""

    name = "airflow-broker"

    def install(self, db: Database) -> None:
        """``broker.migrate()``."""
        broker = _connect(db)
        try:
            broker.migrate()
        finally:
            broker.dispose()

    def prepare(self, db: Database, workload: Workload) -> SetupState:
        """Queues, services, ``dialogs`` conversing dialogs, and the receiving side's groups."""
        from airflow_broker import DEFAULT

        batch_dialogs = workload.batch if workload.batch > 1 else 0
        dialogs = max(workload.dialogs, batch_dialogs)
        broker = _connect(db)
        try:
            with broker.definitions() as d:
                d.create_queue(INITIATOR_QUEUE)
                d.create_queue(TARGET_QUEUE)
                d.create_service(INITIATOR, queue=INITIATOR_QUEUE, contracts=[DEFAULT])
                d.create_service(TARGET, queue=TARGET_QUEUE, contracts=[DEFAULT])
            with broker.transaction() as tx:
                handles = [tx.begin_dialog(INITIATOR, TARGET) for _ in range(dialogs)]
                tx.send(handles, body=payload(-1))
            targets: list[uuid.UUID] = []
            while True:
                with broker.transaction() as tx:
                    msgs = tx.receive(TARGET_QUEUE)
                if not msgs:
                    break
                targets.extend(m.conversation_handle for m in msgs)
            if len(set(targets)) != dialogs:
                raise RuntimeError(f"setup: {len(set(targets))} target endpoints, not {dialogs}")
            if workload.groups:
                self._group(broker, sorted(set(targets)), workload.groups)
        finally:
            broker.dispose()
        return {"handles": handles}

    @staticmethod
    def _group(broker: Broker, targets: list[uuid.UUID], groups: int) -> None:
        """MOVE CONVERSATION the target endpoints into ``groups`` groups of equal size."""
        with broker.transaction() as tx:
            for g in range(groups):
                chunk = targets[g::groups]
                leader = tx.conversation(chunk[0]).conversation_group_id
                for handle in chunk[1:]:
                    tx.move_conversation(handle, leader)

    def producer(self, db: Database, workload: Workload, state: SetupState) -> BrokerProducer:
        """See :class:`BrokerProducer`."""
        return BrokerProducer(db, state)

    def consumer(self, db: Database, workload: Workload, state: SetupState) -> BrokerConsumer:
        """See :class:`BrokerConsumer`."""
        return BrokerConsumer(db, workload.batch)

    def load(self, db: Database, workload: Workload, state: SetupState, count: int) -> None:
        """``count`` messages waiting on the target queue, over the set-up dialogs (untimed)."""
        handles: list[uuid.UUID] = list(state["handles"])
        broker = _connect(db)
        try:
            left = count
            while left:
                with broker.transaction() as tx:
                    for _ in range(BACKLOG_SENDS_PER_TX):
                        if not left:
                            break
                        chunk = handles[: min(left, len(handles))]
                        tx.send(chunk, body=payload(-left))
                        left -= len(chunk)
        finally:
            broker.dispose()

    def remaining(self, db: Database, state: SetupState) -> int:
        """Ready messages on the target queue (``queue_status`` depth)."""
        broker = _connect(db)
        try:
            return sum(s.depth for s in broker.queue_status() if s.name == TARGET_QUEUE)
        finally:
            broker.dispose()


#: The names the two brokers of ``airflow-broker-remote`` have for each other (routes).
NEAR, FAR = "near", "far"


def _far_database(db: Database) -> Database:
    """The far broker of ``airflow-broker-remote``: a second database beside the round's
    (``ScratchServer.drop`` drops it with the round's)."""
    from bench._scratch import database, far_name

    return database(far_name(db.name), db.sqlalchemy_url)


class RemoteConsumer:
    """The far broker's side of ``airflow-broker-remote``, untimed in what the targets read: a
    delivery pass from the near broker (``deliver()``, one pass), then one RECEIVE TOP (batch)
    at the far broker, committed."""

    def __init__(self, db: Database, state: SetupState, batch: int) -> None:
        from airflow_broker import Broker

        far = Database(*state["far"])
        resolver = {NEAR: db.sqlalchemy_url, FAR: far.sqlalchemy_url}
        self.near = Broker.connect(db.sqlalchemy_url, resolver=resolver)
        self.far = Broker.connect(far.sqlalchemy_url, resolver=resolver)
        self.batch = batch

    def receive(self) -> int:
        self.near.deliver()
        with self.far.transaction() as tx:
            return len(tx.receive(TARGET_QUEUE, top=self.batch))

    def end_round(self) -> int:
        return 0

    def close(self) -> None:
        self.near.dispose()
        self.far.dispose()


class RemoteBrokerSystem(AirflowBrokerSystem):
    """airflow-broker SENDing to a service of another broker: the far broker is a second
    database on the same server (routes both ways, plain dialogs). The producer is the local
    system's (``broker.send``); the round's messages wait in the near broker's transmission
    queue, and the consumers deliver them and RECEIVE them at the far broker. Only the send
    time means anything against the local system's: ``target remote_send_vs_local_*``."""

    name = "airflow-broker-remote"

    def prepare(self, db: Database, workload: Workload) -> SetupState:
        """The far database (created empty and migrated: a broker instance of its own), both
        sides' definitions, and the dialogs begun, each with one message delivered and read,
        so that the far endpoints exist and both sides converse."""
        import psycopg
        from psycopg import sql

        from airflow_broker import DEFAULT, Broker

        far = _far_database(db)
        admin = _admin_conninfo(db)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(far.name))
            )
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(far.name)))
        resolver = {NEAR: db.sqlalchemy_url, FAR: far.sqlalchemy_url}
        near_b = Broker.connect(db.sqlalchemy_url, resolver=resolver)
        far_b = Broker.connect(far.sqlalchemy_url, resolver=resolver)
        batch_dialogs = workload.batch if workload.batch > 1 else 0
        dialogs = max(workload.dialogs, batch_dialogs)
        try:
            # The round's database is a clone of the template: a copy, as the broker sees it,
            # which delivers nothing until it has an identity of its own.
            near_b.reset_identity("new_broker")
            far_b.migrate()
            with far_b.definitions() as d:
                d.create_queue(TARGET_QUEUE)
                d.create_service(TARGET, queue=TARGET_QUEUE, contracts=[DEFAULT])
                d.create_route("bench_to_near", service_name=INITIATOR, address=f"broker://{NEAR}")
            with near_b.definitions() as d:
                d.create_queue(INITIATOR_QUEUE)
                d.create_queue(TARGET_QUEUE)  # empty: the local system's checks read it
                d.create_service(INITIATOR, queue=INITIATOR_QUEUE, contracts=[DEFAULT])
                d.create_route("bench_to_far", service_name=TARGET, address=f"broker://{FAR}")
            with near_b.transaction() as tx:
                handles = [
                    tx.begin_dialog(INITIATOR, TARGET, encryption=False) for _ in range(dialogs)
                ]
                tx.send(handles, body=payload(-1))
            for _ in range(100):
                if not near_b.deliver().delivered and not _waiting(near_b):
                    break
            got = 0
            while True:
                with far_b.transaction() as tx:
                    n = len(tx.receive(TARGET_QUEUE, top=1000))
                if not n:
                    break
                got += n
            if got != dialogs:
                raise RuntimeError(f"setup: {got} messages reached the far broker, not {dialogs}")
        finally:
            near_b.dispose()
            far_b.dispose()
        return {"handles": handles, "far": (far.name, far.sqlalchemy_url, far.conninfo)}

    def consumer(self, db: Database, workload: Workload, state: SetupState) -> RemoteConsumer:
        """See :class:`RemoteConsumer`."""
        return RemoteConsumer(db, state, workload.batch)

    def remaining(self, db: Database, state: SetupState) -> int:
        """Messages still in the near broker's transmission queue or the far target queue."""
        import psycopg

        far = Database(*state["far"])
        with psycopg.connect(db.conninfo) as conn:
            row = conn.execute("SELECT count(*) FROM broker_transmission_queue").fetchone()
            left = int(row[0]) if row else 0
        with psycopg.connect(far.conninfo) as conn:
            row = conn.execute(
                "SELECT count(*) FROM broker_message m JOIN broker_queue q USING (queue_id)"
                " WHERE q.name = %s",
                (TARGET_QUEUE,),
            ).fetchone()
            left += int(row[0]) if row else 0
        return left


def _waiting(broker: Broker) -> int:
    from sqlalchemy import text

    with broker.engine.connect() as conn:
        return int(
            conn.execute(text("SELECT count(*) FROM broker_transmission_queue")).scalar_one()
        )


def _admin_conninfo(db: Database) -> str:
    """A conninfo to the server's ``postgres`` database, beside ``db``."""
    from sqlalchemy import make_url

    url = make_url(db.sqlalchemy_url).set(database="postgres", drivername="postgresql")
    return url.render_as_string(hide_password=False)


#: The port of the PgBouncer that ``airflow-broker-pgbouncer`` goes through (set by
#: bench.pgbouncer before the reader processes start, which inherit it).
PGBOUNCER_PORT_ENV = "BROKER_BENCH_PGBOUNCER_PORT"


def through_pgbouncer(db: Database) -> Database:
    """``db`` reached through the PgBouncer on :data:`PGBOUNCER_PORT_ENV`'s port."""
    import os

    from sqlalchemy import make_url

    port = os.environ.get(PGBOUNCER_PORT_ENV)
    if not port:
        raise RuntimeError(
            f"{PGBOUNCER_PORT_ENV} is not set: airflow-broker-pgbouncer runs under "
            "`python -m bench.pgbouncer`, which starts the PgBouncer"
        )
    url = make_url(db.sqlalchemy_url).set(host="127.0.0.1", port=int(port))
    conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
    return Database(db.name, url.render_as_string(hide_password=False), conninfo)


class PgBouncerBrokerSystem(AirflowBrokerSystem):
    """airflow-broker whose producer and consumers reach the server through PgBouncer in
    transaction mode; the set-up (schema, queues, dialogs) and the checks go directly."""

    name = "airflow-broker-pgbouncer"

    def producer(self, db: Database, workload: Workload, state: SetupState) -> BrokerProducer:
        return super().producer(through_pgbouncer(db), workload, state)

    def consumer(self, db: Database, workload: Workload, state: SetupState) -> BrokerConsumer:
        consumer = super().consumer(through_pgbouncer(db), workload, state)
        if not consumer.broker.adapter.pooled:  # type: ignore[union-attr]
            raise RuntimeError("the consumer does not see PgBouncer: it would measure nothing")
        return consumer
