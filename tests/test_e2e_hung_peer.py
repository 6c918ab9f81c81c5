"""End to end, issue 45 under Airflow: while far broker B hangs, the transmitter keeps delivering
to C, and no transmitter run stays running past its deadline.

A real scheduler, DAG processor, triggerer and API server (``support.airflow_stack``) run the
one-line transmitter DAG (tests/dags/hung_peer_transmitter.py) of broker A, the
``broker_default`` connection (a database on the shared test server). A routes ``TargetB`` to
``broker://b`` and ``TargetC`` to ``broker://c``: the Airflow connections ``b`` (a database on a
private cluster, ``support.frozen_cluster``) and ``c`` (the shared server). The Airflow processes
get a short answer timeout and patience (:data:`ANSWER`, :data:`PATIENCE`).

B's cluster is frozen (SIGSTOP: connections neither refused nor answered) while a transmitter
run is delivering to it: a stream of SENDs keeps a run's passes busy, and B freezes once B's
queue grew during that run, so the run's connections to B are made and then hang. Before the
fix that run's pass waited on B until TCP gave up (about 15 minutes), and no other run could
start (``max_active_runs=1``). For :data:`HANG` seconds the test then SENDs a message to B and
one to C every :data:`SEND_EVERY` seconds from outside Airflow. Every message to C must be in
C's queue within :data:`LATE` seconds of its SEND; every transmitter DAG run must end within
:data:`RUN_BOUND` seconds of its start (the runs after the first connect to B afresh, each
waiting for it at most its patience); A's rows for B say ``no answer from broker://b``. Then B
thaws: everything reaches B and C exactly once and in order, and A's transmission queue
empties, by the transmitter alone.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from support.airflow_stack import AirflowStack, airflow_stack
from support.frozen_cluster import FrozenCluster, frozen_cluster
from transport_procs import (
    INITIATOR,
    TARGET_QUEUE,
    assert_exactly_once_in_order,
    collect,
    conversation_ids,
    host,
    host_initiator,
    message_count,
    send_dialogs,
    send_more,
)

from airflow_broker import Broker, Message

DAG_FILE = Path(__file__).parent / "dags" / "hung_peer_transmitter.py"
DAG_ID = "broker_transmitter"

pytestmark = [pytest.mark.xdist_group("airflow_e2e"), pytest.mark.postgres, pytest.mark.slow]

#: far broker (its Airflow connection id) -> the service it hosts
SERVICES = {"b": "TargetB", "c": "TargetC"}
#: AIRFLOW_BROKER_ANSWER_TIMEOUT and AIRFLOW_BROKER_DELIVERY_PATIENCE of the Airflow processes
ANSWER = 12.0
PATIENCE = 2.0
#: how long B hangs, and how often a message goes to B and to C meanwhile
HANG = 36.0
SEND_EVERY = 3.0
#: the stream of SENDs goes on this long after B froze
STREAM_AFTER = 3.0
#: before the hang, a round of SENDs this often keeps a transmitter run busy: a run ends at its
#: first pass that moves nothing, and a loop of due work and a pass of a few messages takes
#: about 6 ms, so rounds must come faster than that (at 0.02 s most runs ended after a pass
#: or two, and five freezes in a row could miss a run still delivering)
STREAM_EVERY = 0.002
#: a message to C is in C's queue this long after its SEND at the latest, while B hangs: a new
#: transmitter run's start (trigger, scheduler, task process) and a pass, with room for a loaded
#: 2-core machine (at most 5.5 s measured); less than the answer timeout, which a run that
#: waited for B would add, and far less than a run blocked on B would take
LATE = 10.0
#: no transmitter run lasts longer than this (start to end, or to now while it runs): the answer
#: timeout (a push to B in a run's lane) plus the run's own start and passes
RUN_BOUND = ANSWER + 15.0
HUNG_TEXT = "no answer from broker://b"


@pytest.fixture(scope="module")
def cluster() -> Iterator[FrozenCluster]:
    with frozen_cluster() as c:
        yield c


def _conn(url: str) -> str:
    return json.dumps({"conn_type": "broker", "extra": {"url": url}})


def _moment(value: Any) -> datetime | None:
    """A dag_run timestamp as the metadata database gives it (SQLite: text), aware UTC."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


class Stream(threading.Thread):
    """SENDs round after round, message ``{"n": k}`` on every dialog of ``handles`` in one
    transaction, every STREAM_EVERY seconds, until :meth:`stop`; ``n`` is the next round."""

    def __init__(self, a: Broker, handles: list[uuid.UUID], first: int) -> None:
        super().__init__(name="hung-peer-stream", daemon=True)
        self.a, self.handles, self.n = a, handles, first
        #: round -> when its SEND committed (time.monotonic())
        self.sent: dict[int, float] = {}
        self._stop_now = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self._stop_now.is_set():
                send_more(self.a, self.handles, self.n, 1)
                self.sent[self.n] = time.monotonic()
                self.n += 1
                self._stop_now.wait(STREAM_EVERY)
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        """Stop (at once if stopped already); raise what the SENDs raised, if anything."""
        self._stop_now.set()
        self.join(timeout=30)
        if self.error is not None:
            raise self.error


def wait_for_a_run_delivering_to_b(af: AirflowStack, b: Broker, timeout: float = 90) -> str:
    """The id of a transmitter run that is running, and during which B's queue grew (between
    two looks both after its start): it holds connections to B now."""
    deadline = time.monotonic() + timeout
    before, looked = message_count(b, TARGET_QUEUE), datetime.now(UTC)
    while time.monotonic() < deadline:
        af.check_alive()
        time.sleep(0.1)
        count, now = message_count(b, TARGET_QUEUE), datetime.now(UTC)
        if count > before:
            for run in af.runs(DAG_ID):
                start = _moment(run.start_date)
                if run.state == "running" and start is not None and start <= looked:
                    return str(run.run_id)
        before, looked = count, now
    raise AssertionError(f"no transmitter run was seen delivering to B within {timeout} s")


def freeze_while_a_run_delivers_to_b(
    af: AirflowStack, b: Broker, cluster: FrozenCluster, attempts: int = 8
) -> tuple[str, float, datetime]:
    """Freeze B while a transmitter run is delivering to it; the run, and when B froze
    (monotonic and wall clock).

    A run ends as soon as a pass finds nothing due, which the stream makes rare but not
    impossible: the run seen delivering may have ended its last pass just before the freeze
    (its end recorded a fraction of a second after). Such a run is not the premise, so B
    thaws and the test waits for another: the run must still be running a second after B
    froze."""
    for _ in range(attempts):
        active = wait_for_a_run_delivering_to_b(af, b)
        cluster.freeze()
        frozen_at, frozen_wall = time.monotonic(), datetime.now(UTC)
        time.sleep(1.0)
        (run,) = [r for r in af.runs(DAG_ID) if r.run_id == active]
        end = _moment(run.end_date)
        if end is None or (end - frozen_wall).total_seconds() >= 1.0:
            return active, frozen_at, frozen_wall
        print(f"run {active} ended {(end - frozen_wall).total_seconds():.2f} s after B froze")
        cluster.thaw()
    raise AssertionError(
        f"no run was still delivering to B a second after B froze ({attempts} tries)"
    )


class RunWatch:
    """The transmitter's DAG runs, looked at again and again: how long each lasted (or has
    lasted so far, while it runs) at the longest, and their states."""

    def __init__(self, af: AirflowStack) -> None:
        self.af = af
        #: run_id -> the longest duration seen (seconds)
        self.longest: dict[str, float] = {}
        self.states: dict[str, str] = {}

    def look(self) -> None:
        now = datetime.now(UTC)
        for run in self.af.runs(DAG_ID):
            self.states[run.run_id] = run.state
            start = _moment(run.start_date)
            if start is None:
                continue
            end = _moment(run.end_date) or now
            seconds = (end - start).total_seconds()
            self.longest[run.run_id] = max(self.longest.get(run.run_id, 0.0), seconds)

    def too_long(self) -> dict[str, float]:
        return {r: round(s, 1) for r, s in self.longest.items() if s > RUN_BOUND}


# About 110 s alone on two cores (Airflow's start, a 36 s hang, the thaw's retries); room for a
# machine loaded by the other half of `make test -n 2`.
@pytest.mark.timeout(420)
def test_while_b_hangs_the_transmitter_delivers_to_c_and_every_run_ends(
    tmp_path: Path, cluster: FrozenCluster, make_pg_database: Callable[..., str]
) -> None:
    b_db = cluster.create_database(f"e2e_b_{uuid.uuid4().hex[:12]}")
    urls = {"broker_default": make_pg_database(), "b": cluster.url(b_db), "c": make_pg_database()}
    brokers = {name: Broker.connect(url, resolver=dict(urls)) for name, url in urls.items()}
    a, b, c = brokers["broker_default"], brokers["b"], brokers["c"]
    b.migrate()
    host_initiator(a)
    for far, service in SERVICES.items():
        host(brokers[far], service, TARGET_QUEUE)
        a.create_route(f"To{far.upper()}", service, None, f"broker://{far}")
        brokers[far].create_route("Back", INITIATOR, a.instance_id, "broker://broker_default")
    env = {f"AIRFLOW_CONN_{name.upper()}": _conn(url) for name, url in urls.items()}
    env["AIRFLOW_BROKER_ANSWER_TIMEOUT"] = str(ANSWER)
    env["AIRFLOW_BROKER_DELIVERY_PATIENCE"] = str(PATIENCE)
    # The DAG file is parsed once, not every 30 s: from Airflow 3.2 a parse during a run sets
    # dag.exceeds_max_non_backfill from the runs it saw, and a parse that saw the run still
    # going can commit after the scheduler cleared the flag at the run's end. No run of the
    # max_active_runs=1 transmitter is then created until the next parse (seen here: a run
    # asked for at 04:41:32.96 created at 04:42:03.96, right after the next parse): a stall of
    # Airflow's, not of the delivery this test measures.
    env["AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL"] = "600"
    dags = tmp_path / "dags"
    dags.mkdir()
    shutil.copy(DAG_FILE, dags)

    got: dict[str, dict[uuid.UUID, list[Message]]] = {far: {} for far in SERVICES}
    sent: dict[int, float] = {}  # n -> when message n went to B and C (SEND committed)
    arrived: dict[int, float] = {}  # n -> when C's queue held message n of each dialog
    b_statuses: set[str] = set()  # what A's rows for B said while B hung
    safety: threading.Timer | None = None
    try:
        with airflow_stack(tmp_path, dags, extra_env=env) as af:
            af.wait_for_dags(DAG_ID)
            runs = RunWatch(af)

            # Before the hang: one dialog pair to each far broker, message 0, delivered.
            handles = {far: send_dialogs(a, [1, 1], to_service=SERVICES[far]) for far in SERVICES}
            conv = {far: conversation_ids(a, handles[far]) for far in SERVICES}
            t0 = time.monotonic()
            af.wait_for(
                "message 0 at B and at C",
                lambda: all(message_count(brokers[f], TARGET_QUEUE) == 2 for f in SERVICES),
                timeout=120,
            )
            print(f"before the hang, message 0 reached B and C in {time.monotonic() - t0:.1f} s")
            for far in SERVICES:
                assert collect(brokers[far], TARGET_QUEUE, got[far]) == 2

            # A run is delivering when B freezes: a stream of SENDs (to B and C, every
            # STREAM_EVERY seconds) keeps a run's passes busy; B freezes once B's queue grew
            # while that run was running (its connections to B are made, and then hang), and
            # the stream goes on for STREAM_AFTER seconds, so that the run's next passes push
            # to B on those connections. Before the fix such a pass waited on B until TCP gave
            # up, and with it the run and every message to C.
            everyone = handles["b"] + handles["c"]
            stream = Stream(a, everyone, first=1)
            stream.start()
            try:
                active, frozen_at, frozen_wall = freeze_while_a_run_delivers_to_b(af, b, cluster)
            except BaseException:
                stream.stop()
                raise
            safety = threading.Timer(HANG + 60, cluster.thaw)  # if the test itself gets stuck
            safety.start()

            # The hang: after the stream, a message to B and one to C every SEND_EVERY s.
            n: int | None = None  # the next round, once the stream has stopped
            next_send = next_look = frozen_at
            while (now := time.monotonic()) < frozen_at + HANG:
                if n is None and now >= frozen_at + STREAM_AFTER:
                    stream.stop()
                    n = stream.n
                    sent.update({k: t for k, t in stream.sent.items() if t >= frozen_at})
                    print(f"B froze during run {active}; {n - 1} rounds streamed")
                # The last SENDs leave each its LATE within the hang.
                if n is not None and now >= next_send and now < frozen_at + HANG - LATE:
                    send_more(a, everyone, n, 1)
                    sent[n] = time.monotonic()
                    n, next_send = n + 1, next_send + SEND_EVERY
                in_c = message_count(c, TARGET_QUEUE) // len(handles["c"])
                for k in range(1, in_c + 1):
                    arrived.setdefault(k, time.monotonic())
                if now >= next_look:
                    runs.look()
                    b_statuses.update(
                        r.transmission_status
                        for r in a.transmission_queue()
                        if r.to_service_name == SERVICES["b"] and r.transmission_status
                    )
                    next_look = now + 1.0
                af.check_alive()
                time.sleep(0.2)
            assert n is not None
            hang_end = time.monotonic()
            frozen_throughout = cluster.frozen and cluster.all_stopped()
            cluster.thaw()
            safety.cancel()
            runs.look()
            print(
                f"B hung for {hang_end - frozen_at:.1f} s; {len(sent)} rounds sent; "
                f"{len(runs.longest)} transmitter runs so far, the longest "
                f"{max(runs.longest.values(), default=0):.1f} s"
            )

            # After the thaw: everything reaches B, A's transmission queue empties.
            expected = 2 * (n - 1)  # rounds 1..n-1 on B's two dialogs
            t1 = time.monotonic()

            def settled() -> bool:
                runs.look()
                return message_count(b, TARGET_QUEUE) >= expected and not a.transmission_queue()

            af.wait_for("B's messages and an empty transmission queue", settled, timeout=150)
            print(f"after the thaw, B had everything in {time.monotonic() - t1:.1f} s")
            af.wait_for(
                "the transmitter to go idle",
                lambda: not [r for r in af.runs(DAG_ID) if r.state in ("queued", "running")],
                timeout=60,
            )
            runs.look()
            final = af.runs(DAG_ID)
            reports = [
                v if isinstance(v, dict) else json.loads(v)
                for (v,) in af.query(
                    "SELECT value FROM xcom WHERE dag_id = :d AND task_id = 'transmit'"
                    " AND key = 'return_value'",
                    d=DAG_ID,
                )
            ]
    finally:
        if safety is not None:
            safety.cancel()
        cluster.thaw()
        try:
            for far in SERVICES:
                collect(brokers[far], TARGET_QUEUE, got[far])
            left = a.transmission_queue()
        finally:
            for broker in brokers.values():
                broker.dispose()

    assert frozen_throughout, "B's cluster thawed before the end of the hang"
    (first,) = [r for r in final if r.run_id == active]
    first_end = _moment(first.end_date)
    assert first_end is not None and (first_end - frozen_wall).total_seconds() >= 1.0, (
        f"premise: run {active}, which had delivered to B, was not delivering any more when B "
        f"froze (it ended at {first_end}, B froze at {frozen_wall})"
    )
    durations = {r: round(s, 1) for r, s in runs.longest.items()}
    print(f"transmitter runs, longest duration seen (s): {sorted(durations.values())}")
    assert not runs.too_long(), f"runs that lasted longer than {RUN_BOUND} s: {runs.too_long()}"
    assert len(sent) >= 6, f"only {len(sent)} rounds were sent during the hang"
    late = {k: round(arrived.get(k, hang_end) - t, 1) for k, t in sent.items()}
    print(
        f"seconds from SEND to C's queue while B hung: {len(late)} rounds, at most "
        f"{max(late.values())} s; the rounds after the stream: {dict(list(late.items())[-9:])}"
    )
    assert all(s <= LATE for s in late.values()), (
        f"messages to C arrived later than {LATE} s after their SEND while B hung "
        f"(n: seconds; at the end of the hang if never): {late}"
    )
    print(f"A's rows for B said: {sorted(b_statuses)[:4]}")
    print(f"the runs' reports: hung {[r.get('hung') for r in reports]}")
    assert any(HUNG_TEXT in s for s in b_statuses), (
        f"A's rows for B never said {HUNG_TEXT!r} while B hung: {sorted(b_statuses)[:5]}"
    )
    assert all(r.state == "success" for r in final), [(r.run_id, r.state) for r in final]
    assert left == [], f"{len(left)} messages still in A's transmission queue"
    for far in SERVICES:
        expected_n = {conv[far][h]: range(n) for h in handles[far]}
        assert_exactly_once_in_order(got[far], expected_n, far)
