"""Identity after a copy: a restored or cloned broker database is detected, refuses delivery to
and from other brokers, and an operator's reset-identity (new broker, error conversations, keep)
does what it says; on SQLite (a copied file) and PostgreSQL (``CREATE DATABASE ... TEMPLATE``).

The network: ``a`` hosts InitiatorService, ``b`` TargetService, routes both ways
(``transport_procs.two_way``). Dialogs from ``a`` reach ``b``; then ``b`` is cloned into ``c``,
which holds ``b``'s broker instance id, its conversations with ``a`` and whatever waited to
leave.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import create_engine, make_url, select, text
from sqlalchemy.pool import NullPool
from transport_procs import (
    INIT_QUEUE,
    INITIATOR,
    TARGET,
    TARGET_QUEUE,
    Net,
    connect_all,
    drain_all,
    endpoints,
    host,
    reply_to_all,
    send_dialogs,
    two_way,
)

from airflow_broker import Broker, InvalidDefinition
from airflow_broker.cli import main
from airflow_broker.constants import ERR_BROKER_IDENTITY_RESET
from airflow_broker.storage import schema as s
from airflow_broker.storage.identity import same_place
from airflow_broker.storage.migrations import alembic_config

LOCAL_A, LOCAL_B, LOCAL_QUEUE = "//local/A", "//local/B", "local_q"

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    """``run("status", "--json") -> (exit code, stdout, stderr)``."""

    def _run(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return _run


@pytest.fixture
def clone(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], str]:
    """``clone(url) -> url``: a copy of a broker database as an operator would make one (the
    SQLite file copied; CREATE DATABASE ... TEMPLATE), with nothing recorded about it. Every
    engine that uses the source must be disposed first."""

    def make(url: str) -> str:
        if url.startswith("sqlite"):
            source = Path(str(make_url(url).database))
            target = tmp_path / f"copy_{uuid.uuid4().hex[:8]}.db"
            shutil.copyfile(source, target)
            wal = Path(f"{source}-wal")
            if wal.exists():
                shutil.copyfile(wal, Path(f"{target}-wal"))
            return f"sqlite:///{target}"
        server = request.getfixturevalue("postgres_server")
        copied: str = server.create_database(copy_of=url, mirror=False)
        return copied

    return make


@dataclass
class Copied:
    """``a`` and ``b`` talking, and ``c``, a clone of ``b`` made after ``b`` received the
    dialogs :attr:`handles` from ``a`` and queued a reply on each (waiting in its transmission
    queue), with a dialog inside ``b`` whose first message waits in its queue."""

    net: Net
    handles: list[uuid.UUID]

    @property
    def a(self) -> Broker:
        return self.net["a"]

    @property
    def c(self) -> Broker:
        return self.net["c"]


@pytest.fixture
def copied(new_db: Callable[[str], str], clone: Callable[[str], str]) -> Iterator[Copied]:
    setup = connect_all({"a": new_db("a"), "b": new_db("b")})
    two_way(setup)
    host(setup["b"], LOCAL_A, LOCAL_QUEUE)
    setup["b"].create_service(LOCAL_B, LOCAL_QUEUE, ["DEFAULT"])
    handles = send_dialogs(setup["a"], [2, 2, 2])
    setup["a"].deliver()
    got = drain_all(setup["b"], TARGET_QUEUE)
    assert len(got) == 6
    reply_to_all(setup["b"], got, {"reply": 1})  # waits in b's transmission queue
    # A dialog inside b, one message on its way.
    with setup["b"].transaction() as tx:
        local = tx.begin_dialog(LOCAL_A, LOCAL_B, encryption=False)
        tx.send(local, body={"local": 1})
    setup.close()
    urls = {**setup.urls, "c": clone(setup.urls["b"])}
    net = connect_all(urls)
    yield Copied(net, handles)
    net.close()


def error_codes(broker: Broker, queue: str) -> list[tuple[int, str]]:
    """The (code, description) of every Error message RECEIVE gets from ``queue``."""
    return [m.error for m in drain_all(broker, queue) if m.error is not None]


def transmission_statuses(broker: Broker) -> set[str]:
    return {r.transmission_status for r in broker.transmission_queue()}


def states(broker: Broker, service: str) -> list[str]:
    return sorted(ep.state for ep in endpoints(broker).values() if ep.service_name == service)


def deliver_to(net: Net, sender: str, name: str, to: str) -> Broker:
    """``sender``'s database, connected with a resolver in which ``broker://name`` is the
    database ``to`` (the address an operator would re-point)."""
    return Broker.connect(net.urls[sender], resolver={**net.resolver, name: net.urls[to]})


# -- detection -------------------------------------------------------------------------------


def test_a_clone_is_detected_and_refuses_delivery_both_ways(copied: Copied) -> None:
    net, a, c = copied.net, copied.a, copied.c
    assert not net["b"].identity_status().copied
    assert not a.identity_status().copied
    status = c.identity_status()
    assert status.copied and status.instance_id == net.id("b")
    reason = status.reason
    assert reason is not None
    database = make_url(net.urls["c"]).render_as_string(hide_password=True)
    for words in (
        "copy detected",
        database,
        "reset-identity --new-broker",
        "--error-conversations",
        "--keep",
    ):
        assert words in reason, f"{words!r} not in {reason!r}"

    # Outbound: the replies that waited in the copy stay, with the reason.
    report = c.deliver()
    assert (report.delivered, report.delayed) == (0, 3)
    assert transmission_statuses(c) == {reason}
    assert drain_all(a, INIT_QUEUE) == []

    # Inbound: a sender whose route leads to the copy is refused, naming it.
    to_copy = deliver_to(net, "a", "b", "c")
    try:
        send_dialogs(to_copy, [1])
        before = {h for h, ep in endpoints(c).items()}
        to_copy.deliver()
        [waiting] = to_copy.transmission_queue()
        assert "copy detected" in waiting.transmission_status
        assert database in waiting.transmission_status
        assert set(endpoints(c)) == before, "the copy took a message"
    finally:
        to_copy.dispose()

    # Local work inside the copy goes on.
    with c.transaction() as tx:
        [m] = tx.receive(LOCAL_QUEUE)
        assert m.json() == {"local": 1}
        tx.send(m.conversation_handle, body={"local": 2})
    with c.transaction() as tx:
        assert [m.json() for m in tx.receive(LOCAL_QUEUE)] == [{"local": 2}]

    # The original delivers as before: its replies reach a.
    net["b"].deliver()
    assert len(drain_all(a, INIT_QUEUE)) == 3


def test_migrate_does_not_hide_a_copy(copied: Copied) -> None:
    copied.c.migrate()
    assert copied.c.identity_status().copied


def test_an_upgraded_database_is_not_taken_for_a_copy(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A database at revision 0008 with its broker instance row (as migrate() left it before
    0009) records its fingerprint when upgraded: it is the original, not a copy."""
    for engine_name in ("sqlite", "postgres"):
        if engine_name == "sqlite":
            url = f"sqlite:///{tmp_path / 'old.db'}"
        else:
            url = request.getfixturevalue("make_pg_database")(migrated=False)
        engine = create_engine(url, poolclass=NullPool)
        try:
            with engine.begin() as conn:
                command.upgrade(alembic_config(conn), "0008")
                conn.execute(
                    text(
                        "INSERT INTO broker_instance (id, instance_id, forwarding, created_at) "
                        "VALUES (1, :id, false, CURRENT_TIMESTAMP)"
                    ),
                    {"id": str(uuid.uuid4())},
                )
            with engine.begin() as conn:
                command.upgrade(alembic_config(conn), "0009")
                recorded = conn.execute(select(s.broker_instance.c.fingerprint)).scalar()
        finally:
            engine.dispose()
        assert recorded, f"{engine_name}: the upgrade recorded no fingerprint"
        b = Broker.connect(url)
        try:
            b.migrate()
            status = b.identity_status()
            assert not status.copied and status.recorded_fingerprint == recorded
            assert status.current_fingerprint == recorded
        finally:
            b.dispose()


def test_the_fingerprint_of_each_engine(broker: Broker) -> None:
    status = broker.identity_status()
    assert status.recorded_fingerprint == status.current_fingerprint
    if broker.dialect == "postgresql":
        assert status.current_fingerprint.startswith("postgresql:system_identifier=")
        assert ";database_oid=" in status.current_fingerprint
    else:
        path = str(make_url(broker.engine.url).database)
        assert status.current_fingerprint == f"sqlite:path={Path(path).resolve()}"


def test_fingerprints_compare_the_fields_both_have() -> None:
    full = "postgresql:system_identifier=7;database_oid=16384"
    assert same_place(full, full)
    # A role that may not call pg_control_system() still compares the oid.
    assert same_place(full, "postgresql:database_oid=16384")
    assert not same_place(full, "postgresql:database_oid=16385")
    assert not same_place(full, "postgresql:system_identifier=8;database_oid=16384")
    assert not same_place(full, "sqlite:path=/x.db")
    assert same_place("sqlite:path=/a;b=c.db", "sqlite:path=/a;b=c.db")
    assert not same_place("sqlite:path=/a.db", "sqlite:path=/b.db")


def test_an_unknown_mode_is_refused(broker: Broker) -> None:
    with pytest.raises(InvalidDefinition, match="new_broker, error_conversations, keep"):
        broker.reset_identity("new")


# -- the three choices -----------------------------------------------------------------------


def test_new_broker_gives_the_copy_an_identity_of_its_own(copied: Copied) -> None:
    net, a, c = copied.net, copied.a, copied.c
    old = net.id("b")
    # One conversation the copy ended itself (DO): its EndDialog waits with the replies.
    with c.transaction() as tx:
        [first, *_] = sorted(
            (ep for ep in endpoints(c).values() if ep.service_name == TARGET),
            key=lambda ep: ep.conversation_handle,
        )
        tx.end_conversation(first.conversation_handle)
    received = set(endpoints(c))
    with c.transaction() as tx:
        # Not bound to a broker yet, but its message is routed to a's: it involves a.
        routed = tx.begin_dialog(TARGET, INITIATOR, encryption=False)
        tx.send(routed, body={"n": 0})
        # Nothing sent: it involves no one yet, and goes on under the new id.
        unsent = tx.begin_dialog(TARGET, INITIATOR, encryption=False)
    unsent_state = endpoints(c)[unsent].state
    done = c.reset_identity("new_broker")
    assert done.previous_instance_id == old and done.instance_id != old
    assert c.instance_id == done.instance_id
    assert net["b"].instance_id == old
    assert (done.conversations_ended, done.conversations_closed) == (3, 1)
    assert done.transmissions_removed == 5  # 3 replies, the EndDialog and the routed message
    assert not c.identity_status().copied
    assert c.transmission_queue() == []

    # The conversations with a ended with an Error the application receives.
    after = endpoints(c)
    assert sorted(
        ep.state for h, ep in after.items() if h in received and ep.service_name == TARGET
    ) == [
        "CD",
        "ER",
        "ER",
    ]
    assert (after[routed].state, after[unsent].state) == ("ER", unsent_state)
    errors = error_codes(c, TARGET_QUEUE)
    assert [code for code, _ in errors] == [ERR_BROKER_IDENTITY_RESET] * 3
    assert all("--new-broker" in why and old in why for _, why in errors)
    # The dialog inside the copy goes on, under the new id.
    assert states(c, LOCAL_A) == ["CO"] and states(c, LOCAL_B) == ["CO"]
    assert {
        ep.far_broker_instance for ep in endpoints(c).values() if ep.service_name == LOCAL_B
    } == {done.instance_id}
    with c.transaction() as tx:
        [m] = tx.receive(LOCAL_QUEUE)
        assert m.json() == {"local": 1}

    # Delivery works again, both ways, as a broker of its own.
    with c.transaction() as tx:
        h = tx.begin_dialog(TARGET, INITIATOR, encryption=False)
        tx.send(h, body={"from": "c"})
    assert c.deliver().delivered == 1
    [m] = drain_all(a, INIT_QUEUE)
    assert m.json() == {"from": "c"}
    assert endpoints(a)[m.conversation_handle].far_broker_instance == done.instance_id
    to_copy = deliver_to(net, "a", "b", "c")
    try:
        send_dialogs(to_copy, [1])
        assert to_copy.deliver().delivered == 1
    finally:
        to_copy.dispose()
    assert [m.json() for m in drain_all(c, TARGET_QUEUE)] == [{"n": 0}]
    assert any(e.event == "identity_reset" for e in c.events())


def test_error_conversations_ends_every_conversation(copied: Copied) -> None:
    net, a, c = copied.net, copied.a, copied.c
    done = c.reset_identity("error_conversations")
    assert done.instance_id == done.previous_instance_id == net.id("b") == c.instance_id
    # Three with a, and both sides of the dialog inside the copy.
    assert (done.conversations_ended, done.conversations_closed) == (5, 0)
    assert done.transmissions_removed == 3
    assert c.transmission_queue() == []
    assert not c.identity_status().copied
    assert states(c, TARGET) == ["ER"] * 3
    assert states(c, LOCAL_A) == ["ER"] and states(c, LOCAL_B) == ["ER"]
    for queue, expected in ((TARGET_QUEUE, 3), (LOCAL_QUEUE, 2)):
        errors = error_codes(c, queue)
        assert [code for code, _ in errors] == [ERR_BROKER_IDENTITY_RESET] * expected
        assert all("--error-conversations" in why for _, why in errors)

    # Delivery works again.
    with c.transaction() as tx:
        h = tx.begin_dialog(TARGET, INITIATOR, encryption=False)
        tx.send(h, body={"from": "c"})
    assert c.deliver().delivered == 1
    assert [m.json() for m in drain_all(a, INIT_QUEUE)] == [{"from": "c"}]


def test_keep_records_the_new_place_and_changes_nothing_else(copied: Copied) -> None:
    """``c`` is ``b`` moved (``b`` is not used again): its conversations go on."""
    net, a, c = copied.net, copied.a, copied.c
    # Another process's broker object sees the refusal, then its end within a second.
    other = Broker.connect(net.urls["c"], resolver=dict(net.resolver))
    try:
        assert other.deliver().delivered == 0
        before = endpoints(c)
        done = c.reset_identity("keep")
        assert done.instance_id == done.previous_instance_id == net.id("b")
        assert (done.conversations_ended, done.conversations_closed) == (0, 0)
        assert done.transmissions_removed == 0
        assert endpoints(c) == before
        assert not c.identity_status().copied
        assert len(c.transmission_queue()) == 3
        assert not any("copy detected" in st for st in transmission_statuses(c))
        time.sleep(1.1)
        assert other.deliver().delivered == 3  # due at once, not after their backoff
    finally:
        other.dispose()
    replies = drain_all(a, INIT_QUEUE)
    assert sorted(m.conversation_handle for m in replies) == sorted(copied.handles)
    # a's conversations go on with the moved database.
    to_moved = deliver_to(net, "a", "b", "c")
    try:
        reply_to_all(to_moved, replies, {"again": 1})
        assert to_moved.deliver().delivered == 3
    finally:
        to_moved.dispose()
    assert len(drain_all(c, TARGET_QUEUE)) == 3


# -- the command line ------------------------------------------------------------------------


def test_the_commands_and_their_exit_codes(copied: Copied, run: Run) -> None:
    url = copied.net.urls["c"]
    code, out, err = run("--url", url, "status")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("identity: "))
    assert lines[at] == "identity: COPY DETECTED, delivery to and from other brokers refused"
    assert lines[at + 1].startswith("  copy detected: broker database")
    reason = " ".join(x.strip() for x in lines[at + 1 :] if x.startswith("  "))
    assert "reset-identity --new-broker" in reason
    code, out, _ = run("--url", url, "status", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["identity"]["copy_detected"] is True
    assert "reset-identity --new-broker" in doc["identity"]["reason"]

    code, out, err = run("--url", url, "deliver")
    assert code == 1
    assert "delayed: 3" in out
    assert err.startswith("error: copy detected: broker database")

    code, _, err = run("--url", url, "reset-identity")
    assert code == 2 and "one of the arguments" in err
    code, _, err = run("--url", url, "reset-identity", "--new-broker", "--keep")
    assert code == 2 and "not allowed with argument" in err

    code, out, err = run("--url", url, "reset-identity", "--new-broker")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[1].startswith("copy detected: yes (identity recorded at ")
    assert lines[2].startswith("reset-identity --new-broker: broker instance ")
    assert lines[2].endswith(" (new)")
    assert lines[3] == (
        "conversations ended with an error: 3; closed: 0; "
        "messages removed from the transmission queue: 3"
    )
    assert lines[4].startswith("fingerprint recorded: ")

    code, out, err = run("--url", url, "status")
    assert (code, err) == (0, "")
    assert "identity: where it was recorded (not a copy)" in out.splitlines()
    code, out, err = run("--url", url, "deliver")
    assert (code, err) == (0, "")

    code, out, err = run("--url", url, "reset-identity", "--keep", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["copy_detected"] is False and doc["mode"] == "keep"
    assert doc["instance_id"] == doc["previous_instance_id"]


def test_reset_identity_of_a_database_without_broker_tables_fails(tmp_path: Path, run: Run) -> None:
    code, _, err = run("--url", f"sqlite:///{tmp_path / 'empty.db'}", "reset-identity", "--keep")
    assert code == 1 and "has no broker tables" in err and "migrate" in err


def test_the_spark_job_finds_a_copy_unreachable(copied: Copied) -> None:
    """The Spark routing job delivers to a far broker only if it would accept: not a copy."""
    from airflow_broker.spark import job

    target, failure = job._reachable(copied.a, ("broker://c",))
    assert target is None
    assert "cannot deliver to broker://c: copy detected: broker database" in failure
    target, _ = job._reachable(copied.a, ("broker://c", "broker://b"))
    assert target is not None and target.engine.url == copied.net["b"].engine.url
