"""Dialog security through a forwarder, on PostgreSQL (seed 004 with seed 002, issue 15).

East's initiator talks to west's target through gw, a forwarding broker. With dialog security
the forwarder never holds a readable body: not in its transit rows while the next hop is down,
not in a far inbox when it delivers with a role that may only deliver. A byte flipped in the
forwarder's transit row reaches west, which refuses it; east gets the Error.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import create_engine, select, text, update
from sqlalchemy.engine import make_url
from test_dialog_security import MARKER, drain, pem, send
from transport_procs import INIT_QUEUE, INITIATOR, TARGET, TARGET_QUEUE, host_initiator, host_target

from airflow_broker import Broker
from airflow_broker.constants import ERR_DIALOG_SECURITY, ERROR
from airflow_broker.security import dialogs
from airflow_broker.security.crypto import MASTER_KEY_ENV, forget_master_key
from airflow_broker.storage import schema as s
from airflow_broker.transport import inbox

pytestmark = [pytest.mark.postgres, pytest.mark.xdist_group("transport")]


@pytest.fixture(autouse=True)
def master_key(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(MASTER_KEY_ENV, "a master key for the forwarder tests")
    forget_master_key()
    dialogs.forget()
    yield
    forget_master_key()
    dialogs.forget()


class Chain:
    def __init__(self, make: Callable[..., str]) -> None:
        self.urls = {n: make() for n in ("east", "gw", "west")}
        # One resolver for all (a pushed-to broker inherits its pusher's); "west" is added
        # when the forwarder may reach it.
        self.gw_resolver: dict[str, str] = {"east": self.urls["east"], "gw": self.urls["gw"]}
        self.east = Broker.connect(self.urls["east"], resolver=self.gw_resolver)
        self.gw = Broker.connect(self.urls["gw"], resolver=self.gw_resolver)
        self.west = Broker.connect(self.urls["west"], resolver=self.gw_resolver)
        host_initiator(self.east)
        host_target(self.west)
        self.gw.configure(forwarding=True)
        self.east.create_route("ToGw", TARGET, None, "broker://gw")
        self.gw.create_route("ToWest", TARGET, None, "broker://west")
        self.gw.create_route("ToEast", INITIATOR, self.east.instance_id, "broker://east")
        self.west.create_route("BackViaGw", INITIATOR, self.east.instance_id, "broker://gw")
        self.west.create_certificate("target_cert", owner=TARGET)
        self.east.import_certificate("target_public", pem(self.west, "target_cert"), owner=TARGET)
        self.east.create_remote_service_binding(
            "to_target", service=TARGET, certificate="target_public"
        )
        self.east.create_certificate("initiator_cert", owner=INITIATOR)
        self.west.import_certificate(
            "initiator_public", pem(self.east, "initiator_cert"), owner=INITIATOR
        )

    def dispose(self) -> None:
        for b in (self.east, self.gw, self.west):
            b.dispose()


@pytest.fixture
def chain(make_pg_database: Callable[..., str]) -> Iterator[Chain]:
    c = Chain(make_pg_database)
    yield c
    c.dispose()


def transit_bodies(gw: Broker) -> list[bytes]:
    with gw.engine.connect() as conn:
        return [bytes(r[0]) for r in conn.execute(select(s.transit.c.message_body))]


def test_a_forwarder_holds_only_ciphertext_and_the_dialog_works_both_ways(chain: Chain) -> None:
    send(chain.east, 3)
    chain.east.deliver()  # gw cannot reach west yet: it holds the messages in transit
    held = transit_bodies(chain.gw)
    assert len(held) == 3 and not any(MARKER in b for b in held)
    chain.gw_resolver["west"] = chain.urls["west"]
    chain.gw.deliver(retry_now=True)
    got = drain(chain.west, TARGET_QUEUE)
    assert [m.json()["k"] for m in got] == [0, 1, 2]
    assert MARKER.decode() in got[0].text()
    with chain.west.transaction() as tx:
        tx.send(got[0].conversation_handle, body={"reply": "shipped"})
    chain.west.deliver()
    assert [m.json()["reply"] for m in drain(chain.east, INIT_QUEUE)] == ["shipped"]
    chain.east.deliver(retry_now=True)
    assert chain.east.transmission_queue() == []


def test_a_dialog_queued_in_clear_before_its_binding_reaches_the_forwarder_sealed(
    chain: Chain,
) -> None:
    """A delivery batch reads, with its rows, whether each far service has a binding now: the
    messages queued in clear leave sealed once it does."""
    chain.east.drop_remote_service_binding("to_target")
    send(chain.east, 2, encryption=False)
    chain.east.create_remote_service_binding(
        "to_target", service=TARGET, certificate="target_public"
    )
    chain.east.deliver()
    held = transit_bodies(chain.gw)
    assert len(held) == 2 and not any(MARKER in b for b in held)
    chain.gw_resolver["west"] = chain.urls["west"]
    chain.gw.deliver(retry_now=True)
    assert [m.json()["k"] for m in drain(chain.west, TARGET_QUEUE)] == [0, 1]


def test_a_byte_flipped_in_the_forwarder_gives_the_sender_an_error(chain: Chain) -> None:
    send(chain.east, 1)
    chain.east.deliver()
    tr = s.transit
    with chain.gw.engine.begin() as conn:
        row = conn.execute(select(tr.c.id, tr.c.message_body)).one()
        body = bytearray(row.message_body)
        body[-3] ^= 0x40
        conn.execute(update(tr).where(tr.c.id == row.id).values(message_body=bytes(body)))
    chain.gw_resolver["west"] = chain.urls["west"]
    chain.gw.deliver(retry_now=True)
    # West refused it: its side of the dialog failed too (an Error, no data).
    assert [m.message_type_name for m in drain(chain.west, TARGET_QUEUE)] == [ERROR]
    errors = [m for m in drain(chain.east, INIT_QUEUE) if m.message_type_name == ERROR]
    assert len(errors) == 1 and errors[0].error[0] == ERR_DIALOG_SECURITY
    assert "integrity check" in errors[0].error[1]


@pytest.fixture
def delivery_role(postgres_server) -> Iterator[str]:  # type: ignore[no-untyped-def]
    name = f"deliver_{uuid.uuid4().hex[:10]}"
    with postgres_server._admin.connect() as conn:
        conn.execute(text(f"CREATE ROLE {name} LOGIN"))
    yield name
    inbox.forget_modes()
    with postgres_server._admin.connect() as conn:
        for (db,) in conn.execute(text("SELECT datname FROM pg_database")).all():
            if db.startswith("broker_test_"):
                eng = create_engine(make_url(postgres_server.url_for(db)))
                with eng.begin() as c:
                    c.execute(text(f"DROP OWNED BY {name}"))
                eng.dispose()
        conn.execute(text(f"DROP ROLE {name}"))


def test_the_far_inbox_holds_only_ciphertext(chain: Chain, delivery_role: str) -> None:
    chain.west.grant_delivery(delivery_role)
    west_as_role = (
        make_url(chain.urls["west"])
        .set(username=delivery_role)
        .render_as_string(hide_password=False)
    )
    chain.gw_resolver["west"] = west_as_role
    send(chain.east, 2)
    chain.east.deliver()
    with chain.west.engine.connect() as conn:
        batches = [bytes(r[0]) for r in conn.execute(select(s.inbox.c.packets))]
    assert batches and not any(MARKER in b for b in batches)
    chain.west.deliver()
    assert [m.json()["k"] for m in drain(chain.west, TARGET_QUEUE)] == [0, 1]


def test_a_restricted_reader_replies_on_a_secure_dialog(
    make_pg_database: Callable[..., str],
    postgres_server,  # type: ignore[no-untyped-def]
) -> None:
    """West's reader holds only RECEIVE on the target queue: it sees the opened bodies, and its
    reply (queued unsealed: a restricted role sees no keys) is sealed by west's own pass."""
    east_url, west_url = make_pg_database(), make_pg_database()
    resolver = {"east": east_url, "west": west_url}
    east = Broker.connect(east_url, resolver=resolver)
    west = Broker.connect(west_url, resolver=resolver)
    role = f"reader_{uuid.uuid4().hex[:10]}"
    with postgres_server._admin.connect() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN"))
    reader = None
    try:
        host_initiator(east)
        host_target(west)
        east.create_route("ToWest", TARGET, None, "broker://west")
        west.create_route("ToEast", INITIATOR, east.instance_id, "broker://east")
        west.create_certificate("target_cert", owner=TARGET)
        east.import_certificate("target_public", pem(west, "target_cert"), owner=TARGET)
        east.create_remote_service_binding("to_target", service=TARGET, certificate="target_public")
        east.create_certificate("initiator_cert", owner=INITIATOR)
        west.import_certificate("initiator_public", pem(east, "initiator_cert"), owner=INITIATOR)
        west.grant_receive(TARGET_QUEUE, role)
        send(east, 1)
        east.deliver()
        reader = Broker.connect(
            make_url(west_url).set(username=role).render_as_string(hide_password=False)
        )
        with reader.transaction() as tx:
            (got,) = tx.receive(TARGET_QUEUE)
            assert got.json()["card"] == "4111-1111-1111-1111"
            tx.send(got.conversation_handle, body={"reply": "ok", "card": "4111-1111-1111-1111"})
        t = s.transmission_queue
        with west.engine.connect() as conn:
            assert conn.execute(select(t.c.sealed)).scalars().all() == [None]
        west.deliver()
        assert [m.json()["reply"] for m in drain(east, INIT_QUEUE)] == ["ok"]
    finally:
        if reader is not None:
            reader.dispose()
        east.dispose()
        west.dispose()
        eng = create_engine(west_url, isolation_level="AUTOCOMMIT")
        with eng.connect() as conn:
            conn.execute(text(f"DROP OWNED BY {role}"))
        eng.dispose()
        with postgres_server._admin.connect() as conn:
            conn.execute(text(f"DROP ROLE {role}"))
