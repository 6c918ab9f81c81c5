"""The Spark routing job: route and deliver a broker's transmission queue in bulk.

Run by ``spark-submit`` (this file is the application; :class:`SparkRoutingOperator` launches
it), or in-process with :func:`run`. One run:

1. reads one row per conversation of the source broker's due transmission-queue rows, with
   what routing needs of its endpoint (grouped by PostgreSQL in the query,
   :func:`jdbc.conversations_query`; by Spark, :func:`transforms.conversations`, for a
   classifier or a SQLite source);
2. plans every conversation with the pure transforms of :mod:`airflow_broker.spark.transforms`
   (classification, forwarding rules, routing and load balancing, by the rules of
   :mod:`airflow_broker.routing`);
3. for each far broker: deletes what earlier dead runs left in its staging tables and reads
   the messages of its conversations (in parallel JDBC queries, each holding whole
   conversations). At a PostgreSQL far broker each Spark task writes its conversations
   straight into the queues, in one transaction that checks and raises their sequence numbers
   (:mod:`airflow_broker.spark.direct_task`), and stages only those that need the Python
   path's receiving code; at a SQLite one (or with ``direct=False``) the job stages every
   conversation and message (JDBC). The staged commit (:func:`commit.commit`) takes what was
   staged into queues exactly once, and the source acknowledges everything delivered
   (:func:`commit.acknowledge`);
4. records why the others wait (no route, unreachable, not classified...), as the Python
   delivery pass does, and leaves conversations to services hosted by the source itself to the
   source's own delivery.

Brokers are named, never given with a password on the command line: ``--source NAME`` and every
``broker://NAME`` route address resolve through ``AIRFLOW_BROKER_ADDRESS_<NAME>`` (the URL, in
the environment of spark-submit), as :func:`airflow_broker.transport.resolve` does.

A run killed at any point and run again delivers every message once: see
:mod:`airflow_broker.spark.commit`.

A far broker that hangs holds back only its own messages: the driver's statements on it are
bounded (``--answer-timeout``, 300 s by default: a run's statements are bulk work), each task
writing into it is cut after that long without progress and run again by Spark
(:mod:`airflow_broker.spark.stall`), and a far broker whose delivery fails has its
conversations recorded as waiting with the reason while the run goes on with the others.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from airflow_broker import routing
from airflow_broker.errors import BrokerError
from airflow_broker.messaging.delivery import RETRY_BASE
from airflow_broker.messaging.lookups import hosted_services
from airflow_broker.routing import dynamic
from airflow_broker.routing.routes import routes_of
from airflow_broker.spark import commit, direct_task, jdbc, transforms
from airflow_broker.spark.direct import Written, write_direct
from airflow_broker.spark.stall import StalledError
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow
from airflow_broker.storage.identity import copy_refusal
from airflow_broker.transport import Inbound, Unreachable, deadlines, env_name, resolve

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from airflow_broker.spark.direct_stream import Source
    from airflow_broker.storage.context import BrokerContext

log = logging.getLogger("airflow_broker")

#: Set to ``NAME`` or ``NAME:SECONDS`` to pause the job at checkpoint NAME (crash tests kill it
#: there); each checkpoint is printed as it is reached. The tasks that write into queues pause
#: at ``task-written`` and ``task-committed`` (:mod:`~airflow_broker.spark.direct_task`).
PAUSE_ENV = direct_task.PAUSE_ENV
#: Parallel transactions committing at a PostgreSQL far broker (``--commit-parallelism``): the
#: insert into the queues is the far database's work, so its cores count, not Spark's.
COMMIT_PARALLELISM = 2
#: Seconds a far broker may go without answering the run's statements or a task's writes.
ANSWER_TIMEOUT = 300.0
#: The job's last line of output starts with this, then its report as JSON.
REPORT_PREFIX = "AIRFLOW_BROKER_SPARK_REPORT "


@dataclass
class RunReport:
    """What one run did, message counts by outcome."""

    run_id: str
    source_instance: str
    read: int = 0
    #: messages the far brokers committed into queues (duplicates of earlier runs not counted)
    delivered: int = 0
    #: transmission-queue rows removed at the source by acknowledgments
    acknowledged: int = 0
    #: messages through the general (Python) path at the far brokers
    general: int = 0
    #: messages still waiting, by outcome (delayed, unreachable, unclassified, held...)
    waiting: dict[str, int] = field(default_factory=dict)
    #: messages left to the source's own delivery (their service is hosted there)
    local: int = 0
    #: messages per far broker instance
    targets: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    #: far brokers whose delivery failed in this run (their messages wait), with why
    failed: dict[str, str] = field(default_factory=dict)
    #: seconds spent up to each checkpoint since the one before (summed over far brokers):
    #: planned (read and plan), written (straight into queues) or staged (every message into
    #: the staging table), committed (the staged commit), acknowledged
    phases: dict[str, float] = field(default_factory=dict)


class _Laps:
    """Times the phases of a run into ``RunReport.phases`` and passes each checkpoint."""

    def __init__(self, phases: dict[str, float]) -> None:
        self.phases = phases
        self.last = time.monotonic()

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = round(self.phases.get(name, 0.0) + now - self.last, 3)
        self.last = now
        checkpoint(name)


def checkpoint(name: str) -> None:
    """A point a crash test may kill the job at."""
    print(f"checkpoint {name}", flush=True)
    wanted, _, seconds = os.environ.get(PAUSE_ENV, "").partition(":")
    if wanted == name:
        time.sleep(float(seconds or 3600))


def source_url(name: str) -> str:
    """The URL of the broker ``--source`` names: ``AIRFLOW_BROKER_ADDRESS_<NAME>``, or a URL
    itself when it carries no password."""
    url = os.environ.get(env_name(name))
    if url:
        return url
    if "://" in name:
        if make_url(name).password:
            raise SystemExit(
                "refusing a broker URL with a password on the command line: put it in the "
                "environment (AIRFLOW_BROKER_ADDRESS_<NAME>) and pass --source NAME"
            )
        return name
    raise SystemExit(f"no broker named {name!r}: set {env_name(name)} to its URL")


def _bounds(source: BrokerContext, due_by: datetime | None) -> tuple[int, int] | None:
    t = s.transmission_queue
    stmt = select(func.min(t.c.id), func.max(t.c.id))
    if due_by is not None:
        stmt = stmt.where(t.c.next_attempt_at <= due_by)
    with source.engine.connect() as conn:
        low, high = conn.execute(stmt).one()
    return None if low is None else (int(low), int(high))


def _reachable(
    source: BrokerContext, addresses: tuple[str, ...]
) -> tuple[BrokerContext | None, str]:
    """The first address whose broker answers and is the principal (a mirror serves when the
    principal does not), as :meth:`transport.Transport.push_any` tries them; each within its
    answer timeout (a broker that hangs is passed over like one that refuses)."""
    failures: list[str] = []
    for address in addresses:
        try:
            peer = resolve(source, address)
            with deadlines.answer_within(peer, address), peer.engine.connect() as conn:
                settings = Inbound(peer)._settings(conn)
            if not settings.principal:
                raise Unreachable(f"broker instance {settings.instance_id} is not the principal")
            return peer, address
        except Exception as exc:
            failures.append(f"cannot deliver to {address}: {str(exc).splitlines()[0]}")
    return None, "; ".join(failures)


def _hung(exc: BaseException) -> bool:
    """Whether ``exc`` says a far broker did not answer: a driver statement past its answer
    timeout (:class:`Unreachable`), or a task whose connection was cut (its error, raised in
    the executor, reaches the driver as text in Spark's)."""
    return isinstance(exc, Unreachable) or StalledError.__name__ in str(exc)


def _hang_reason(exc: BaseException) -> str:
    """What :func:`_hung` found: the task's own words when Spark wraps them."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    marker = StalledError.__name__ + ": "
    for line in lines:
        if marker in line:
            return line[line.index(marker) + len(marker) :].strip()
    return lines[0]


def _wait_all(
    chosen: DataFrame, why: str, waiting: dict[uuid.UUID, str], counts: Counter[str]
) -> None:
    """Every conversation of ``chosen`` waits, with ``why``."""
    from pyspark.sql import functions as F

    for r in chosen.groupBy("conversation_handle").agg(F.sum("messages").alias("n")).collect():
        waiting[uuid.UUID(r.conversation_handle)] = why
        counts["unreachable"] += int(r.n)


def _write(df: DataFrame, target: BrokerContext, table: str) -> int:
    """Append ``df`` to ``table`` of ``target``: COPY from the executors on PostgreSQL, JDBC
    (one writer) on SQLite. Returns the rows written, each partition counted once."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    if target.dialect == "postgresql":
        return jdbc.copy_table(df, target.engine.url, table)
    counted = Observation(table)
    jdbc.write_table(
        df.observe(counted, F.count(F.lit(1)).alias("rows")),
        target.engine.url,
        table,
        partitions=1,
    )
    return int(counted.get["rows"])


def run(
    source: BrokerContext,
    spark: SparkSession,
    *,
    classifier: str | None = None,
    classify_service: str | None = None,
    now: datetime | None = None,
    retry_now: bool = False,
    partitions: int | None = None,
    commit_parallelism: int = COMMIT_PARALLELISM,
    direct: bool = True,
    source_work_mem: str | None = jdbc.SOURCE_WORK_MEM,
    answer_timeout: float = ANSWER_TIMEOUT,
) -> RunReport:
    """One run of the job from ``source`` (see the module's docstring). ``partitions``: the
    parallel JDBC reads (default: Spark's parallelism), each a transaction at a PostgreSQL far
    broker when ``direct``; ``commit_parallelism``: the parallel transactions of the staged
    commit there. ``direct=False`` stages every message, as the job did before it wrote into
    queues from its tasks. ``source_work_mem``: ``work_mem`` of the reads that group and sort
    at a PostgreSQL source (:data:`jdbc.SOURCE_WORK_MEM`; None keeps the server's).
    ``answer_timeout``: seconds a far broker may go without answering the run's statements or
    a task's writes (then its messages wait, and the run goes on with the other brokers)."""
    from pyspark.sql import functions as F

    if commit_parallelism < 1:
        raise ValueError(f"commit_parallelism must be 1 or more, not {commit_parallelism}")
    source_work_mem = jdbc.checked_work_mem(source_work_mem)
    started = time.monotonic()
    now = now or utcnow()
    run_id = uuid.uuid4().hex
    with source.engine.connect() as conn:
        me = source.instance_id_on(conn)
        refused = copy_refusal(source, conn)
        routes = routes_of(source, conn)
        hosted = list(hosted_services(source, conn))
    if refused is not None:  # a restored or cloned copy delivers nothing (storage.identity)
        raise BrokerError(refused)
    report = RunReport(run_id, me)
    laps = _Laps(report.phases)
    due_by = None if retry_now else now
    parts = partitions or max(2, spark.sparkContext.defaultParallelism)
    # Messages are read once, streaming, per far broker. The plan is made on one row per
    # conversation: grouped by PostgreSQL itself, so that only the groups travel, unless a
    # classifier reads the first bodies (or the source is SQLite): then Spark groups a read
    # without the other bodies.
    # Split by conversation for the tasks that write into queues; by row id for staging only.
    # Grouped by the source, the conversations' rows carry what their messages share: the
    # messages are read with only their own columns.
    grouped = source.dialect == "postgresql" and classifier is None
    # The tasks of a direct write from PostgreSQL read their messages from the source
    # themselves, not through Spark (spark.direct_stream).
    stream = (
        jdbc.stream_source(
            source.engine.url, due_by=due_by, partitions=parts, work_mem=source_work_mem
        )
        if grouped and direct
        else None
    )
    pending = jdbc.read_pending(
        spark,
        source.engine.url,
        due_by=due_by,
        bounds=None if direct else _bounds(source, due_by),
        partitions=parts,
        by_conversation=direct,
        own_columns=grouped,
    )
    if grouped:
        # The grouped read sets work_mem on its JDBC session (Spark runs the statement before
        # the read's transaction begins). Behind a transaction-mode pooler that session setting
        # would stay on a server process others use next: the server's own work_mem then.
        conv = jdbc.read_conversations(
            spark,
            source.engine.url,
            due_by=due_by,
            work_mem=None if source.adapter.pooled else source_work_mem,
        )
    else:
        conv = transforms.conversations(pending, with_body=classifier is not None)
    # One partition per read: a cached plan keeps its shuffles' partitioning (200 by default,
    # mostly empty, each a task for every action on it).
    conv = conv.coalesce(parts).persist()
    planned = transforms.conversation_plan(
        conv,
        routes=routes,
        me=me,
        now=now,
        hosted=hosted,
        dynamic=lambda service: dynamic.present(routes, service, now),
        classifier=classifier,
        classify_service=classify_service,
    )
    planned = planned.coalesce(parts).persist()
    # The tasks' (and the driver's reads for them) answer timeout, for this run only.
    token = jdbc.answer_timeout.set(answer_timeout)
    try:
        summary = planned.groupBy("outcome", "addresses").agg(F.sum("messages").alias("n"))
        outcomes: Counter[str] = Counter()
        groups: dict[tuple[str, ...], int] = {}
        for r in summary.collect():
            outcomes[r.outcome] += int(r.n)
            if r.outcome == "remote":
                groups[tuple(r.addresses)] = int(r.n)
        report.read = sum(outcomes.values())
        report.local = outcomes["local"]
        laps("planned")
        waiting: dict[uuid.UUID, str] = {}
        counts: Counter[str] = Counter()
        # Which conversations wait, and why: a Spark action, run only when the summary shows
        # some do (a run that moves everything spares it).
        held = [o for o in ("delayed", "unclassified", "discard") if outcomes[o]]
        held_rows = (
            planned.where(F.col("outcome").isin(*held))
            .groupBy("conversation_handle", "outcome", "reason", "discard", "classified")
            .agg(F.sum("messages").alias("n"))
            .collect()
            if held
            else []
        )
        for row in held_rows:
            waiting[uuid.UUID(row.conversation_handle)] = _why(row, classify_service)
            counts[row.outcome] += int(row.n)
        remote = planned.where(F.col("outcome") == "remote")
        for addresses, n in sorted(groups.items()):
            chosen = remote.where(F.col("addresses") == F.array(*[F.lit(a) for a in addresses]))
            target, failure = _reachable(source, addresses)
            if target is None:
                _wait_all(chosen, failure, waiting, counts)
                log.warning("%s", failure)
                continue
            address = failure  # the address that answered
            try:
                far = _deliver(
                    source,
                    target,
                    pending,
                    chosen,
                    report,
                    run_id,
                    me,
                    waiting,
                    counts,
                    laps,
                    commit_parallelism,
                    direct=direct,
                    stream=stream,
                    classifying=classifier is not None and classify_service is not None,
                    address=address,
                    answer_timeout=answer_timeout,
                )
            except Exception as exc:
                if not _hung(exc):
                    raise
                # A far broker that hangs holds back its own messages alone (what it committed
                # is recognized by sequence number next time): the others go on.
                why = f"cannot deliver to {address}: {_hang_reason(exc)}"
                log.warning("%s", why, exc_info=True)
                report.failed[address] = why
                _wait_all(chosen, why, waiting, counts)
                continue
            report.targets[far] = report.targets.get(far, 0) + n
        commit.record_waiting(source, waiting, retry_in=RETRY_BASE, now=now)
        report.waiting = dict(counts)
    finally:
        jdbc.answer_timeout.reset(token)
        planned.unpersist()
        conv.unpersist()
    report.seconds = round(time.monotonic() - started, 3)
    log.info("Spark routing run %s: %s", run_id, report)
    return report


def _why(row: Any, classify_service: str | None) -> str:
    if row.outcome == "unclassified":
        return (
            f"the classifier named no service for the first message of this conversation to "
            f"{classify_service!r} (it waits; fix the message or the classifier)"
        )
    if row.outcome == "discard":
        if row.discard == "hops":
            return f"forwarded more than {routing.MAX_HOPS} times: a routing loop?"
        return "the conversation's lifetime is over: it is not delivered any more"
    return f"{row.reason} (the conversation is delayed and retried)"


def _deliver(
    source: BrokerContext,
    target: BrokerContext,
    pending: DataFrame,
    chosen: DataFrame,
    report: RunReport,
    run_id: str,
    me: str,
    waiting: dict[uuid.UUID, str],
    counts: Counter[str],
    laps: _Laps,
    commit_parallelism: int,
    *,
    direct: bool,
    stream: Source | None = None,
    classifying: bool,
    address: str = "the far broker",
    answer_timeout: float = ANSWER_TIMEOUT,
) -> str:
    """Deliver to ``target`` the messages of ``pending`` whose conversations are the ``chosen``
    rows of the plan (straight into its queues, or staged and committed), and acknowledge them
    at the source; returns its instance id."""
    from pyspark.sql import functions as F

    def bounded() -> Any:  # the driver's statements on the far broker
        return deadlines.answer_within(target, address, seconds=answer_timeout)

    with bounded():
        commit.prepare(target, me, run_id)
    parts = 1 if target.dialect == "sqlite" else commit_parallelism
    written: Written | None = None
    if direct and target.dialect == "postgresql":
        # Each task stages what it cannot write into queues, conversations and messages.
        written = write_direct(pending, chosen, target, run_id, me, parts, stream)
        laps("written")
        staged = written.staged
    else:
        rows = transforms.with_plan(pending, chosen)
        # Conversations first: prepare() finds a dead run's messages by its conversations.
        _write(
            transforms.staged_conversations(chosen, run_id, me, target.dialect, parts),
            target,
            s.spark_staged_conversation.name,
        )
        staged = _write(
            transforms.staged_messages(rows, run_id, target.dialect, parts),
            target,
            s.spark_staging.name,
        )
        laps("staged")
    with bounded():
        done = commit.commit(target, run_id, me, written=staged, parts=parts)
    laps("committed")
    if written is not None:
        done.acks += written.acks
        done.inserted += written.inserted
    # The services a classifier named: a Spark action, so only when there is a classifier.
    classified = (
        {
            uuid.UUID(r[0]): r[1]
            for r in chosen.where(F.col("classified").isNotNull())
            .select("conversation_handle", "classified")
            .distinct()
            .collect()
        }
        if classifying
        else {}
    )
    report.acknowledged += commit.acknowledge(source, done, classified=classified)
    laps("acknowledged")
    report.delivered += done.inserted + sum(1 for a in done.answers if a.kind == "A")
    report.general += done.general
    for handle, why in done.waiting.items():
        waiting[handle] = why
        counts["held"] += 1
    return done.far_instance


# ---------------------------------------------------------------------------------------------
# spark-submit
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="airflow_broker.spark.job",
        description="Route and deliver a broker's transmission queue with Spark.",
    )
    p.add_argument(
        "--source",
        required=True,
        help="the broker to deliver from: a name whose URL is in AIRFLOW_BROKER_ADDRESS_<NAME> "
        "(or a URL without a password)",
    )
    p.add_argument("--classifier", help="sql:EXPR, json:$.path, xpath:/path or python:mod:name")
    p.add_argument("--classify-service", help="the service whose new conversations it routes")
    p.add_argument("--partitions", type=int, help="parallel JDBC reads (default: cores)")
    p.add_argument(
        "--commit-parallelism",
        type=int,
        default=COMMIT_PARALLELISM,
        help=f"parallel commit transactions at a PostgreSQL far broker (default "
        f"{COMMIT_PARALLELISM})",
    )
    p.add_argument("--retry-now", action="store_true", help="also rows not due yet")
    p.add_argument(
        "--staged",
        action="store_true",
        help="stage every message before committing it, instead of writing into the queues "
        "of a PostgreSQL far broker from the Spark tasks",
    )
    p.add_argument(
        "--source-work-mem",
        default=jdbc.SOURCE_WORK_MEM,
        help=f"work_mem of the reads that group and sort at a PostgreSQL source (default "
        f"{jdbc.SOURCE_WORK_MEM}; 'server' keeps the server's setting)",
    )
    p.add_argument(
        "--answer-timeout",
        type=float,
        default=ANSWER_TIMEOUT,
        help=f"seconds a far broker may go without answering a statement or a task's writes "
        f"before its connection is cut (default {ANSWER_TIMEOUT:g})",
    )
    p.add_argument("--master", help="Spark master when not set by spark-submit")
    args = p.parse_args(argv)
    if args.source_work_mem == "server":
        args.source_work_mem = None
    try:
        jdbc.checked_work_mem(args.source_work_mem)
    except ValueError as exc:
        p.error(f"--source-work-mem: {exc}")
    if args.commit_parallelism < 1:
        p.error("--commit-parallelism must be 1 or more")
    if args.answer_timeout <= 0:
        p.error("--answer-timeout must be a positive number of seconds")
    if bool(args.classifier) != bool(args.classify_service):
        p.error("--classifier and --classify-service go together")
    return args


def main(argv: list[str] | None = None) -> int:
    from airflow_broker.broker import Broker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    source = Broker.connect(source_url(args.source))
    spark = jdbc.session(master=args.master)
    try:
        report = run(
            source,
            spark,
            classifier=args.classifier,
            classify_service=args.classify_service,
            retry_now=args.retry_now,
            partitions=args.partitions,
            commit_parallelism=args.commit_parallelism,
            direct=not args.staged,
            source_work_mem=args.source_work_mem,
            answer_timeout=args.answer_timeout,
        )
    finally:
        spark.stop()
        source.dispose()
    print(REPORT_PREFIX + json.dumps(asdict(report), sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
