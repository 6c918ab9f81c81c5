"""Permissions (seed 004, issue 15): SEND on services and RECEIVE on queues granted to real
PostgreSQL roles, which connect with their own credentials.

PostgreSQL enforces them: a role holding only these grants begins dialogs and SENDs to the
services granted, RECEIVEs (leases, peeks) from the queues granted, and nothing else; raw SQL on
the broker's tables fails for it. The engine refuses up front with PermissionDenied naming the
role, the permission and the object; a statement that slips past it is refused by the database.
Revoking counts from the next transaction. On SQLite a grant is a clear error.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import create_engine, make_url, text

from airflow_broker import Broker
from airflow_broker.cli import main
from airflow_broker.errors import InvalidDefinition, PermissionDenied, UnknownObject
from airflow_broker.operations import declarations

pytestmark = pytest.mark.postgres

CLIENT, SUPPLIER, OTHER = "//po/Client", "//po/Supplier", "//po/Other"


@dataclass
class Roles:
    """The roles of one test database (named after it: unique under xdist) and its URLs."""

    url: str
    clerk: str  # SEND on //po/Supplier
    reader: str  # RECEIVE on supplier_q
    spare: str  # nothing granted, until a test grants it something

    def url_as(self, role: str) -> str:
        return make_url(self.url).set(username=role).render_as_string(hide_password=False)

    def connect_as(self, role: str) -> Broker:
        return Broker.connect(self.url_as(role))

    def raw_as(self, role: str) -> psycopg.Connection:
        u = make_url(self.url)
        return psycopg.connect(host=u.host, port=u.port or 5432, dbname=u.database, user=role)


def _declare(b: Broker) -> None:
    for q in ("client_q", "supplier_q", "other_q"):
        b.create_queue(q)
    b.create_service(CLIENT, queue="client_q", contracts=["DEFAULT"])
    b.create_service(SUPPLIER, queue="supplier_q", contracts=["DEFAULT"])
    b.create_service(OTHER, queue="other_q", contracts=["DEFAULT"])


@pytest.fixture
def roles(postgres_server, pg_url: str) -> Iterator[Roles]:  # type: ignore[no-untyped-def]
    """Three LOGIN roles created as the superuser, dropped (with their grants) at teardown."""
    suffix = make_url(pg_url).database.rsplit("_", 1)[-1]
    r = Roles(pg_url, f"clerk_{suffix}", f"reader_{suffix}", f"spare_{suffix}")
    names = (r.clerk, r.reader, r.spare)
    with postgres_server._admin.connect() as conn:
        for name in names:
            conn.execute(text(f"DROP ROLE IF EXISTS {name}"))
            conn.execute(text(f"CREATE ROLE {name} LOGIN"))
    yield r
    engine = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE usename = ANY(:r) AND pid <> pg_backend_pid()"
                ),
                {"r": list(names)},
            )
            for name in names:
                conn.execute(text(f"DROP OWNED BY {name}"))
    finally:
        engine.dispose()
    with postgres_server._admin.connect() as conn:
        for name in names:
            conn.execute(text(f"DROP ROLE IF EXISTS {name}"))


@pytest.fixture
def owner(pg_broker: Broker, roles: Roles) -> Broker:
    _declare(pg_broker)
    pg_broker.grant_send(SUPPLIER, roles.clerk)
    pg_broker.grant_receive("supplier_q", roles.reader)
    return pg_broker


@pytest.fixture
def clerk(owner: Broker, roles: Roles) -> Iterator[Broker]:
    b = roles.connect_as(roles.clerk)
    yield b
    b.dispose()


@pytest.fixture
def reader(owner: Broker, roles: Roles) -> Iterator[Broker]:
    b = roles.connect_as(roles.reader)
    yield b
    b.dispose()


def _refused(raw: psycopg.Connection, sql: str) -> None:
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        raw.execute(sql)
    raw.rollback()


def _count(owner: Broker, table: str) -> int:
    with owner.engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


# --------------------------------------------------------------------------- SEND


def test_the_owner_is_not_a_client_role(owner: Broker) -> None:
    with owner.transaction() as tx:
        tx.begin_dialog(CLIENT, OTHER)
    assert owner.client_role is None


def test_a_send_role_begins_dialogs_and_sends_to_its_service(
    owner: Broker, clerk: Broker, roles: Roles
) -> None:
    with clerk.transaction() as tx:
        h = tx.begin_dialog(CLIENT, SUPPLIER)
        tx.send(h, "DEFAULT", b"order 1")
    with clerk.transaction() as tx:
        tx.send(h, "DEFAULT", b"order 2", dedupe_key="order-2")
        tx.send(h, "DEFAULT", b"order 2", dedupe_key="order-2")  # once only
        assert tx.conversation(h).far_service == SUPPLIER
        tx.begin_conversation_timer(h, 3600)
    with clerk.transaction() as tx:  # idempotent BEGIN DIALOG
        assert tx.begin_dialog(CLIENT, SUPPLIER, dedupe_key="po-7") == (
            tx.begin_dialog(CLIENT, SUPPLIER, dedupe_key="po-7")
        )
    assert clerk.client_role == roles.clerk
    with owner.transaction() as tx:
        got = tx.receive("supplier_q")
        assert [m.message_body for m in got] == [b"order 1", b"order 2"]
        tx.send(got[0].conversation_handle, "DEFAULT", b"reply")
    with clerk.transaction() as tx:
        tx.end_conversation(h)
    # The reply waiting on the clerk's side went with its END (it cannot see it: the database
    # removed it), and the target got the EndDialog.
    assert [m.message_body for m in owner.peek("client_q")] == []
    assert [m.message_type_name for m in owner.peek("supplier_q")] == [
        "http://schemas.microsoft.com/SQL/ServiceBroker/EndDialog"
    ]
    assert owner.check() == []


def test_a_send_role_cannot_send_to_another_service(
    owner: Broker, clerk: Broker, roles: Roles
) -> None:
    endpoints = _count(owner, "broker_conversation_endpoint")
    with pytest.raises(PermissionDenied) as refused, clerk.transaction() as tx:
        tx.begin_dialog(CLIENT, OTHER)
    assert str(refused.value) == (
        f"role {roles.clerk!r} has no SEND permission on service {OTHER!r}"
    )
    # A conversation to another service that the owner began: the clerk may not send on it.
    with owner.transaction() as tx:
        foreign = tx.begin_dialog(CLIENT, OTHER)
    to_other = f"SEND permission on service '{OTHER}'"
    with pytest.raises(PermissionDenied, match=to_other), clerk.transaction() as tx:
        tx.send(foreign, "DEFAULT", b"x")
    with pytest.raises(PermissionDenied, match=to_other), clerk.transaction() as tx:
        tx.end_conversation(foreign)
    with pytest.raises(UnknownObject), clerk.transaction() as tx:
        tx.send(uuid.uuid4(), "DEFAULT", b"x")
    # Nothing half-written.
    assert _count(owner, "broker_conversation_endpoint") == endpoints + 1
    assert _count(owner, "broker_message") == 0


def test_a_send_role_cannot_receive_nor_read_the_tables(
    owner: Broker, clerk: Broker, roles: Roles
) -> None:
    with clerk.transaction() as tx:
        tx.send(tx.begin_dialog(CLIENT, SUPPLIER), "DEFAULT", b"secret")
    denied = f"role {roles.clerk!r} has no RECEIVE permission on queue 'supplier_q'"
    with pytest.raises(PermissionDenied) as refused, clerk.transaction() as tx:
        tx.receive("supplier_q")
    assert str(refused.value) == denied
    with pytest.raises(PermissionDenied, match=denied):
        clerk.lease("supplier_q", lease_seconds=30)
    with pytest.raises(PermissionDenied, match=denied):
        clerk.peek("supplier_q")
    with pytest.raises(PermissionDenied), clerk.transaction() as tx:
        tx.get_conversation_group("client_q")
    with roles.raw_as(roles.clerk) as raw:
        for sql in (
            "SELECT * FROM broker_message",
            "SELECT * FROM public.broker_message",
            "SELECT * FROM broker_queue",
            "SELECT * FROM broker_conversation_endpoint",
            "SELECT * FROM broker_permission",
            "DELETE FROM public.broker_message",
        ):
            _refused(raw, sql)
        # Even through its views, it reads no message.
        assert raw.execute("SELECT count(*) FROM broker_client.broker_message").fetchone() == (0,)
    assert [m.message_body for m in owner.peek("supplier_q")] == [b"secret"]


# --------------------------------------------------------------------------- RECEIVE


def test_a_receive_role_drains_its_queue(owner: Broker, clerk: Broker, reader: Broker) -> None:
    with clerk.transaction() as tx:
        h = tx.begin_dialog(CLIENT, SUPPLIER)
        tx.send(h, "DEFAULT", b"1")
    with reader.transaction() as tx:
        [first] = tx.receive("supplier_q", wait_seconds=1)
        assert first.message_body == b"1"
        tx.send(first.conversation_handle, "DEFAULT", b"ack 1")  # a reply: its own queue

    def later() -> None:
        time.sleep(0.3)
        with clerk.transaction() as tx:
            tx.send(h, "DEFAULT", b"2")

    sender = threading.Thread(target=later)
    sender.start()
    started = time.monotonic()
    with reader.transaction() as tx:
        got = tx.receive("supplier_q", wait_seconds=10)
    sender.join()
    assert [m.message_body for m in got] == [b"2"]
    assert time.monotonic() - started < 5  # woken by the send, not by the timeout

    with clerk.transaction() as tx:
        tx.send(h, "DEFAULT", b"3")
    with reader.transaction() as tx:
        assert (
            tx.get_conversation_group("supplier_q", wait_seconds=1) == got[0].conversation_group_id
        )
        tx.rollback()
    assert [m.message_body for m in reader.peek("supplier_q")] == [b"3"]
    lease = reader.lease("supplier_q", lease_seconds=60)
    assert lease is not None and [m.message_body for m in lease.messages] == [b"3"]
    reader.extend(lease.token, 120)
    with reader.transaction() as tx:
        assert tx.complete(lease.token) == 1
    with clerk.transaction() as tx:
        tx.send(h, "DEFAULT", b"4")
    again = reader.lease("supplier_q", lease_seconds=60)
    assert again is not None
    reader.release(again.token)
    with reader.transaction() as tx:
        [m] = tx.receive("supplier_q")
        assert m.message_body == b"4" and m.receive_count == 2
        tx.end_conversation(m.conversation_handle)
    assert [m.message_body for m in owner.peek("client_q")] == [b"ack 1", None]
    assert owner.check() == []


def test_a_receive_role_cannot_read_another_queue(
    owner: Broker, reader: Broker, roles: Roles
) -> None:
    with owner.transaction() as tx:
        tx.send(tx.begin_dialog(CLIENT, OTHER), "DEFAULT", b"not yours")
    denied = f"role {roles.reader!r} has no RECEIVE permission on queue 'other_q'"
    with pytest.raises(PermissionDenied) as refused, reader.transaction() as tx:
        tx.receive("other_q", wait_seconds=0.1)
    assert str(refused.value) == denied
    with pytest.raises(PermissionDenied, match=denied):
        reader.lease("other_q", lease_seconds=30)
    with pytest.raises(PermissionDenied, match=denied):
        reader.peek("other_q")
    not_send = f"SEND permission on service '{SUPPLIER}'"  # RECEIVE is not SEND
    with pytest.raises(PermissionDenied, match=not_send), reader.transaction() as tx:
        tx.begin_dialog(CLIENT, SUPPLIER)
    # A lease of another queue: refused by name, not "expired".
    lease = owner.lease("other_q", lease_seconds=60)
    assert lease is not None
    with pytest.raises(PermissionDenied, match=denied), reader.transaction() as tx:
        tx.complete(lease.token)
    with pytest.raises(PermissionDenied, match=denied):
        reader.release(lease.token)
    with roles.raw_as(roles.reader) as raw:
        for sql in (
            "SELECT * FROM broker_message",
            "SELECT * FROM public.broker_message",
            "SELECT * FROM broker_queue",
            "UPDATE public.broker_queue SET status = true",
        ):
            _refused(raw, sql)
        rows = raw.execute("SELECT message_body FROM broker_client.broker_message").fetchall()
        assert rows == []  # its views show its own queue only (empty here)


def test_the_database_refuses_what_slips_past_the_engine(
    owner: Broker, clerk: Broker, reader: Broker, roles: Roles
) -> None:
    with clerk.transaction() as tx:
        h = tx.begin_dialog(CLIENT, SUPPLIER)
        tx.send(h, "DEFAULT", b"1")
    with roles.raw_as(roles.reader) as raw:
        # Re-enabling (or altering) a queue is the owner's; so is any queue it may not read.
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="may not alter queue"):
            raw.execute(
                "UPDATE broker_client.broker_queue SET retention = true WHERE name = 'supplier_q'"
            )
        raw.rollback()
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="'other_q'"):
            raw.execute(
                "UPDATE broker_client.broker_queue SET rollback_count = 0 WHERE name = 'other_q'"
            )
        raw.rollback()
    with roles.raw_as(roles.clerk) as raw:
        # A message into a queue none of its conversations leads to.
        with pytest.raises(psycopg.errors.WithCheckOptionViolation):
            raw.execute(
                "INSERT INTO broker_client.broker_message (queue_id, conversation_group_id, "
                "conversation_handle, message_sequence_number, status, priority, precedence, "
                "service_name, service_contract_name, message_type_name, validation, "
                "enqueued_at) SELECT queue_id, gen_random_uuid(), gen_random_uuid(), 0, 1, 5, "
                "0, 'x', 'DEFAULT', 'DEFAULT', 'N', now() FROM broker_client.broker_queue "
                "WHERE name = 'other_q'"
            )
        raw.rollback()
        _refused(raw, "SELECT broker_client.broker_queue_update()")
    assert [m.message_body for m in owner.peek("supplier_q")] == [b"1"]


# --------------------------------------------------------------------------- revoking


def test_revoking_takes_effect_on_the_next_transaction(
    owner: Broker, clerk: Broker, reader: Broker, roles: Roles
) -> None:
    with clerk.transaction() as tx:
        h = tx.begin_dialog(CLIENT, SUPPLIER)
        tx.send(h, "DEFAULT", b"before")
    owner.revoke_send(SUPPLIER, roles.clerk)
    with pytest.raises(PermissionDenied, match=roles.clerk), clerk.transaction() as tx:
        tx.send(h, "DEFAULT", b"after")
    with pytest.raises(PermissionDenied, match=roles.clerk), clerk.transaction() as tx:
        tx.begin_dialog(CLIENT, SUPPLIER)
    with roles.raw_as(roles.clerk) as raw:  # its last grant went: so did the views
        _refused(raw, "SELECT * FROM broker_client.broker_service")

    with reader.transaction() as tx:
        assert [m.message_body for m in tx.receive("supplier_q", top=1)] == [b"before"]
        tx.rollback()
    owner.revoke_receive("supplier_q", roles.reader)
    with pytest.raises(PermissionDenied, match=roles.reader), reader.transaction() as tx:
        tx.receive("supplier_q")
    assert [m.message_body for m in owner.peek("supplier_q")] == [b"before"]
    assert owner.permissions() == []


def test_a_revoke_reaches_an_open_session_at_its_next_statement(
    owner: Broker, reader: Broker, roles: Roles
) -> None:
    with owner.transaction() as tx:
        tx.send(tx.begin_dialog(CLIENT, SUPPLIER), "DEFAULT", b"m")
    owner.grant_receive("client_q", roles.reader)  # keeps the views after the revoke below
    with roles.raw_as(roles.reader) as raw:
        sql = "SELECT count(*) FROM broker_client.broker_message"
        assert raw.execute(sql).fetchone() == (1,)
        raw.commit()
        owner.revoke_receive("supplier_q", roles.reader)
        assert raw.execute(sql).fetchone() == (0,)


# --------------------------------------------------------------------------- more of the model


def test_a_group_role_grants_its_members(owner: Broker, roles: Roles, postgres_server) -> None:  # type: ignore[no-untyped-def]
    group = f"{roles.spare}_group"
    with postgres_server._admin.connect() as conn:
        conn.execute(text(f"DROP ROLE IF EXISTS {group}"))
        conn.execute(text(f"CREATE ROLE {group} NOLOGIN"))
        conn.execute(text(f"GRANT {group} TO {roles.spare}"))
    try:
        owner.grant_send(OTHER, group)
        member = roles.connect_as(roles.spare)
        try:
            with member.transaction() as tx:
                tx.send(tx.begin_dialog(CLIENT, OTHER), "DEFAULT", b"via the group")
            with pytest.raises(PermissionDenied, match=roles.spare), member.transaction() as tx:
                tx.begin_dialog(CLIENT, SUPPLIER)
        finally:
            member.dispose()
        assert [m.message_body for m in owner.peek("other_q")] == [b"via the group"]
    finally:
        with owner.engine.begin() as conn:
            conn.execute(text(f"DROP OWNED BY {group}"))
        with postgres_server._admin.connect() as conn:
            conn.execute(text(f"DROP ROLE {group}"))


def test_failure_handling_of_a_receive_role(owner: Broker, clerk: Broker, reader: Broker) -> None:
    owner.create_queue("dead_q")
    owner.alter_queue("supplier_q", max_receives=2, dead_letter_queue="dead_q")
    with clerk.transaction() as tx:
        tx.send(tx.begin_dialog(CLIENT, SUPPLIER), "DEFAULT", b"poison")
    for _ in range(2):
        with pytest.raises(RuntimeError), reader.transaction() as tx:
            assert tx.receive("supplier_q")
            raise RuntimeError("handler failed")
    assert [m.message_body for m in owner.peek("dead_q")] == [b"poison"]
    assert owner.peek("supplier_q") == []
    # Service Broker's rule where no dead-letter queue is set: five rollbacks disable the queue.
    owner.alter_queue("supplier_q", max_receives=None, dead_letter_queue=None)
    with clerk.transaction() as tx:
        tx.send(tx.begin_dialog(CLIENT, SUPPLIER), "DEFAULT", b"bad")
    for _ in range(5):
        with pytest.raises(RuntimeError), reader.transaction() as tx:
            assert tx.receive("supplier_q")
            raise RuntimeError("handler failed")
    assert {q.name: q.status for q in owner.queue_status()}["supplier_q"] is False
    assert owner.check() == []


def test_migrate_rebuilds_the_views_and_keeps_the_grants(owner: Broker, roles: Roles) -> None:
    owner.migrate()
    owner.migrate()
    b = roles.connect_as(roles.clerk)
    try:
        with b.transaction() as tx:
            tx.send(tx.begin_dialog(CLIENT, SUPPLIER), "DEFAULT", b"after migrate")
    finally:
        b.dispose()
    assert [m.message_body for m in owner.peek("supplier_q")] == [b"after migrate"]


# --------------------------------------------------------------------------- granting


def test_grants_are_listed_checked_and_dropped_with_their_object(
    owner: Broker, roles: Roles
) -> None:
    assert [(p.permission, p.object_name, p.grantee) for p in owner.permissions()] == [
        ("RECEIVE", "supplier_q", roles.reader),
        ("SEND", SUPPLIER, roles.clerk),
    ]
    with owner.definitions() as d:
        assert d.grant_send(SUPPLIER, roles.clerk) is False  # held already
        assert d.revoke_receive("client_q", roles.reader) is False  # never granted
    with pytest.raises(UnknownObject, match="service '//po/Nowhere' does not exist"):
        owner.grant_send("//po/Nowhere", roles.clerk)
    with pytest.raises(UnknownObject, match="queue 'nowhere_q' does not exist"):
        owner.grant_receive("nowhere_q", roles.clerk)
    with pytest.raises(UnknownObject, match="database role 'no_such_role_x' does not exist"):
        owner.grant_send(SUPPLIER, "no_such_role_x")
    owner.drop_service(SUPPLIER)
    assert [p.object_name for p in owner.permissions()] == ["supplier_q"]
    with roles.raw_as(roles.clerk) as raw:  # its only grant went with the service
        _refused(raw, "SELECT * FROM broker_client.broker_service")


def test_on_sqlite_a_grant_says_permissions_need_postgresql(tmp_path: Path) -> None:
    b = Broker.connect(f"sqlite:///{tmp_path / 'b.db'}")
    try:
        b.migrate()
        b.create_queue("q")
        b.create_service("s", queue="q")
        for verb, obj in (("grant_send", "s"), ("grant_receive", "q"), ("revoke_send", "s")):
            with pytest.raises(InvalidDefinition, match="need PostgreSQL"):
                getattr(b, verb)(obj, "clerk")
        assert b.permissions() == []
        assert b.client_role is None
    finally:
        b.dispose()


# --------------------------------------------------------------------------- YAML and CLI

_YAML = f"""
permissions:
  - send: "{SUPPLIER}"
    to: [{{clerk}}, {{spare}}]
  - receive: supplier_q
    to: {{reader}}
  - send: "{OTHER}"
    from: {{clerk}}
"""


def test_apply_grants_and_revokes_permissions(pg_broker: Broker, roles: Roles) -> None:
    _declare(pg_broker)
    pg_broker.grant_send(OTHER, roles.clerk)
    text_ = _YAML.format(clerk=roles.clerk, spare=roles.spare, reader=roles.reader)
    changes = declarations.apply_declarations(pg_broker, text_, "p.yaml")
    assert changes == [
        f"+ permission SEND on service {SUPPLIER} to role {roles.clerk}: granted",
        f"+ permission SEND on service {SUPPLIER} to role {roles.spare}: granted",
        f"+ permission RECEIVE on queue supplier_q to role {roles.reader}: granted",
        f"- permission SEND on service {OTHER} from role {roles.clerk}: revoked",
    ]
    held = {(p.permission, p.object_name, p.grantee) for p in pg_broker.permissions()}
    assert held == {
        ("SEND", SUPPLIER, roles.clerk),
        ("SEND", SUPPLIER, roles.spare),
        ("RECEIVE", "supplier_q", roles.reader),
    }
    assert declarations.apply_declarations(pg_broker, text_, "p.yaml") == []  # converged


def test_a_permissions_section_is_checked(pg_broker: Broker, tmp_path: Path) -> None:
    _declare(pg_broker)
    bad = """
permissions:
  - send: //po/Nowhere
    to: clerk
  - receive: supplier_q
  - send: //po/Client
    receive: client_q
    to: clerk
  - receive: supplier_q
    to: [a, a]
"""
    decls, problems = declarations.parse(bad)
    messages = [p.message for p in problems]
    assert "permission #2: give to: ROLE (grant) or from: ROLE (revoke), one of them" in messages
    assert "permission #3: give one of send: SERVICE or receive: QUEUE" in messages
    assert any("role 'a' is named twice" in m for m in messages)
    _, plan_problems = declarations.plan(decls, pg_broker.catalog(), granted=[])
    [unknown] = [p.message for p in plan_problems]
    assert unknown.startswith(
        "permission SEND on service //po/Nowhere to role clerk: service '//po/Nowhere' is "
        "declared neither in this file nor in the database"
    )
    _, on_sqlite = declarations.plan(decls, pg_broker.catalog(), granted=None)
    assert "need PostgreSQL" in on_sqlite[0].message


def test_cli_grant_revoke_and_list(
    owner: Broker, roles: Roles, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url = roles.url
    assert main(["--url", url, "grant", "send", OTHER, roles.spare]) == 0
    assert main(["--url", url, "grant", "receive", "other_q", roles.spare]) == 0
    assert main(["--url", url, "revoke", "send", SUPPLIER, roles.clerk]) == 0
    out = capsys.readouterr().out
    assert f"SEND on service '{OTHER}' granted to role '{roles.spare}'" in out
    assert f"SEND on service '{SUPPLIER}' revoked from role '{roles.clerk}'" in out
    assert main(["--url", url, "permissions"]) == 0
    listing = capsys.readouterr().out
    assert roles.spare in listing and "other_q" in listing and roles.clerk not in listing
    assert main(["--url", url, "grant", "send", "//po/Nowhere", roles.spare]) == 1
    assert "service '//po/Nowhere' does not exist" in capsys.readouterr().err
    sqlite_url = f"sqlite:///{tmp_path / 'b.db'}"
    assert main(["--url", sqlite_url, "migrate"]) == 0
    assert main(["--url", sqlite_url, "grant", "receive", "q", "clerk"]) == 1
    assert "need PostgreSQL" in capsys.readouterr().err
    yaml_file = tmp_path / "p.yaml"
    yaml_file.write_text(f"permissions:\n  - receive: client_q\n    to: {roles.spare}\n")
    assert main(["--url", url, "apply", "--dry-run", str(yaml_file)]) == 0
    assert f"+ permission RECEIVE on queue client_q to role {roles.spare}: granted" in (
        capsys.readouterr().out
    )
    assert ("RECEIVE", "client_q", roles.spare) not in {
        (p.permission, p.object_name, p.grantee) for p in owner.permissions()
    }
