"""Delivery with least privilege (seed 004, issue 15): a peer whose role may only deliver.

Real PostgreSQL roles: the far broker grants a role the delivery right (``grant_delivery``);
the sender's route connects as that role. The role pushes batches into the far inbox and
collects their answers, and nothing else: raw SQL on the far broker's queues, endpoints and
definitions fails. The far broker's own pass accepts the batches; messages arrive exactly once
and in order, and the sender's transmission queue empties on the acknowledgments. Through a
forwarder, each hop delivers through the next one's inbox.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.exc import DBAPIError, ProgrammingError
from transport_procs import INIT_QUEUE, INITIATOR, TARGET, TARGET_QUEUE, host_initiator, host_target

from airflow_broker import Broker
from airflow_broker.errors import InvalidDefinition, UnknownObject
from airflow_broker.transport import inbox

pytestmark = [pytest.mark.postgres, pytest.mark.xdist_group("transport")]


@pytest.fixture
def roles(postgres_server) -> Iterator[Callable[[], str]]:  # type: ignore[no-untyped-def]
    made: list[str] = []

    def make() -> str:
        name = f"deliver_{uuid.uuid4().hex[:10]}"
        with postgres_server._admin.connect() as conn:
            conn.execute(text(f"CREATE ROLE {name} LOGIN"))
        made.append(name)
        return name

    yield make
    inbox.forget_modes()
    with postgres_server._admin.connect() as conn:
        for name in made:
            for (db,) in conn.execute(
                text("SELECT datname FROM pg_database WHERE NOT datistemplate")
            ):
                if db.startswith("broker_test_"):
                    eng = create_engine(
                        make_url(postgres_server.url_for(db)), isolation_level="AUTOCOMMIT"
                    )
                    try:
                        with eng.connect() as c:
                            c.execute(text(f"DROP OWNED BY {name}"))
                    except DBAPIError:
                        pass
                    finally:
                        eng.dispose()
            conn.execute(text(f"DROP ROLE IF EXISTS {name}"))


def as_role(url: str, role: str) -> str:
    return make_url(url).set(username=role, password=None).render_as_string(hide_password=False)


def _send(east: Broker, dialogs: int, per: int) -> list[uuid.UUID]:
    handles = []
    with east.transaction() as tx:
        for _ in range(dialogs):
            h = tx.begin_dialog(INITIATOR, TARGET, encryption=False)
            for k in range(per):
                tx.send(h, body={"n": k})
            handles.append(h)
    return handles


def _drain(b: Broker, queue: str) -> list:  # type: ignore[type-arg]
    out = []
    while True:
        with b.transaction() as tx:
            got = tx.receive(queue)
        if not got:
            return out
        out += got


def test_a_delivery_role_delivers_through_the_inbox_and_can_do_nothing_else(
    make_pg_database: Callable[..., str], roles: Callable[[], str]
) -> None:
    east_url, west_url = make_pg_database(), make_pg_database()
    role = roles()
    west = Broker.connect(west_url)
    west.grant_delivery(role)
    assert west.delivery_roles() == [role]
    east = Broker.connect(east_url, resolver={"west": as_role(west_url, role)})
    host_initiator(east)
    host_target(west)
    east.create_route("ToWest", TARGET, None, "broker://west")
    _send(east, 4, 5)

    first = east.deliver()
    assert first.delayed == 20 and first.acknowledged == 0
    statuses = {r.transmission_status for r in east.transmission_queue()}
    assert statuses == {
        "in the inbox of broker://west: waiting for that broker's delivery pass to accept it"
    }
    assert _drain(west, TARGET_QUEUE) == []  # nothing arrives until west's own pass runs
    accepted = west.deliver()
    assert accepted.delivered == 20
    got = _drain(west, TARGET_QUEUE)
    by_conv: dict[uuid.UUID, list[int]] = {}
    for m in got:
        by_conv.setdefault(m.conversation_handle, []).append(m.json()["n"])
    assert len(got) == 20 and all(v == list(range(5)) for v in by_conv.values())
    second = east.deliver()  # collects the acknowledgments
    assert second.acknowledged == 20
    assert east.transmission_queue() == []
    # A duplicate push (a retry before the answers came back) is acknowledged, not delivered.
    assert west.deliver().delivered == 0

    # The role itself: the inbox, its answers, nothing more.
    eng = create_engine(as_role(west_url, role))
    try:
        for sql in (
            "SELECT * FROM broker_message",
            "SELECT * FROM broker_conversation_endpoint",
            "SELECT * FROM broker_queue",
            "SELECT * FROM broker_service",
            "SELECT * FROM broker_inbox",
            "UPDATE broker_queue SET status = false",
            "DELETE FROM broker_message",
            "INSERT INTO broker_route (name, address, created_at) VALUES ('x', 'LOCAL', now())",
        ):
            with eng.connect() as conn, pytest.raises(ProgrammingError, match="permission denied"):
                conn.execute(text(sql))
        with eng.connect() as conn, pytest.raises(DBAPIError, match="row-level security"):
            conn.execute(
                text(
                    "INSERT INTO broker_inbox (pushed_by, depth, packets, pushed_at) "
                    "VALUES ('postgres', 0, '\\x00', now())"
                )
            )
    finally:
        eng.dispose()
    west.revoke_delivery(role)
    assert west.delivery_roles() == []
    east.dispose()
    west.dispose()


def test_a_role_reads_only_its_own_answers(
    make_pg_database: Callable[..., str], roles: Callable[[], str]
) -> None:
    west_url = make_pg_database()
    west = Broker.connect(west_url)
    a, b = roles(), roles()
    west.grant_delivery(a)
    west.grant_delivery(b)
    with west.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO broker_inbox_answer (pushed_by, inbox_id, answers, answered_at) "
                "VALUES (:r, 1, '\\x00', now())"
            ),
            {"r": a},
        )
    for role, seen in ((a, 1), (b, 0)):
        eng = create_engine(as_role(west_url, role))
        with eng.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM broker_inbox_answer")).scalar() == seen
        eng.dispose()
    west.dispose()


def test_granting_needs_postgresql_and_a_role(tmp_path, make_pg_database) -> None:  # type: ignore[no-untyped-def]
    lite = Broker.connect(f"sqlite:///{tmp_path / 'b.db'}")
    lite.migrate()
    with pytest.raises(InvalidDefinition, match="need PostgreSQL"):
        lite.grant_delivery("peer")
    pg = Broker.connect(make_pg_database())
    with pytest.raises(UnknownObject, match="no_such_role_x"):
        pg.grant_delivery("no_such_role_x")
    pg.dispose()
    lite.dispose()


def test_through_a_forwarder_each_hop_delivers_through_the_next_inbox(
    make_pg_database: Callable[..., str], roles: Callable[[], str]
) -> None:
    east_url, gw_url, west_url = make_pg_database(), make_pg_database(), make_pg_database()
    to_gw, to_west = roles(), roles()
    gw, west = Broker.connect(gw_url), Broker.connect(west_url)
    gw.grant_delivery(to_gw)
    west.grant_delivery(to_west)
    east = Broker.connect(east_url, resolver={"gw": as_role(gw_url, to_gw)})
    gw = Broker.connect(gw_url, resolver={"west": as_role(west_url, to_west), "east": east_url})
    host_initiator(east)
    host_target(west)
    gw.configure(forwarding=True)
    east.create_route("ToGw", TARGET, None, "broker://gw")
    gw.create_route("ToWest", TARGET, None, "broker://west")
    gw.create_route("BackToEast", INITIATOR, east.instance_id, "broker://east")
    _send(east, 3, 4)
    for _ in range(4):
        for b in (east, gw, west):
            b.deliver()
    got = _drain(west, TARGET_QUEUE)
    assert len(got) == 12
    assert len({(m.conversation_handle, m.message_sequence_number) for m in got}) == 12
    assert east.transmission_queue() == []
    assert _drain(east, INIT_QUEUE) == []
    for b in (east, gw, west):
        b.dispose()


def test_why_the_far_broker_dropped_a_batch_comes_back_to_the_sender(
    make_pg_database: Callable[..., str], roles: Callable[[], str]
) -> None:
    """West hosts no target service and does not forward: its pass drops the inbox batch, and
    the sender's rows then say why (the note travels back with the answers)."""
    east_url, west_url = make_pg_database(), make_pg_database()
    role = roles()
    west = Broker.connect(west_url)
    west.grant_delivery(role)
    east = Broker.connect(east_url, resolver={"west": as_role(west_url, role)})
    host_initiator(east)
    east.create_route("ToWest", TARGET, None, "broker://west")
    _send(east, 1, 2)
    east.deliver()
    west.deliver()
    east.deliver()  # collects the answer: no acknowledgment, a note per packet
    statuses = {r.transmission_status for r in east.transmission_queue()}
    assert len(east.transmission_queue()) == 2
    assert statuses == {
        f"service {TARGET!r} is not hosted by broker instance {west.instance_id}, "
        "which does not forward"
    }
    east.dispose()
    west.dispose()
