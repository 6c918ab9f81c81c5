"""Dialog security end to end (seed 004, issue 15), between broker databases.

Certificates and remote service bindings on both sides; the initiator agrees a session key per
dialog, signed with its certificate (or anonymously), wrapped for the target's; every body is
sealed before it leaves the sending transaction, so the transmission queue, forwarders' transit
rows and far inboxes hold only ciphertext; a byte altered on the way gives the sender an Error;
an expired certificate stops the dialog with a reason naming it and its end date; without a
binding, ``encryption=True`` (the default) sends nothing and says why, ``encryption=False``
travels in clear; without the master key, secure dialogs wait and say so.

SQLite here (every case), PostgreSQL with a forwarder in ``test_dialog_security_pg.py``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update
from transport_procs import INIT_QUEUE, INITIATOR, TARGET, TARGET_QUEUE, host_initiator, host_target

from airflow_broker import Broker
from airflow_broker.constants import ERR_CERTIFICATE_EXPIRED, ERR_DIALOG_SECURITY, ERROR
from airflow_broker.security import dialogs
from airflow_broker.security.crypto import MASTER_KEY_ENV, forget_master_key
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow

SECRET = {"order": "PO-1", "card": "4111-1111-1111-1111"}
MARKER = b"4111-1111"


@pytest.fixture(autouse=True)
def master_key(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(MASTER_KEY_ENV, "correct horse battery staple")
    forget_master_key()
    dialogs.forget()
    yield
    forget_master_key()
    dialogs.forget()


Pair = tuple[Broker, Broker]


def pem(b: Broker, name: str) -> str:
    return b.export_certificate(name)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    urls = {n: f"sqlite:///{tmp_path / n}.db" for n in ("east", "west")}
    east = Broker.connect(urls["east"], resolver={"west": urls["west"]})
    west = Broker.connect(urls["west"], resolver={"east": urls["east"]})
    for b in (east, west):
        b.migrate()
    host_initiator(east)
    host_target(west)
    east.create_route("ToWest", TARGET, None, "broker://west")
    west.create_route("ToEast", INITIATOR, east.instance_id, "broker://east")
    yield east, west
    east.dispose()
    west.dispose()


def secure(east: Broker, west: Broker, *, anonymous: bool = False, expires_in: float = 365) -> None:
    """Dialog security from east's initiator service to west's target service."""
    west.create_certificate(
        "target_cert", owner=TARGET, expires_at=utcnow() + timedelta(days=expires_in)
    )
    east.import_certificate("target_cert_public", pem(west, "target_cert"), owner=TARGET)
    east.create_remote_service_binding(
        "to_target", service=TARGET, certificate="target_cert_public", anonymous=anonymous
    )
    if not anonymous:
        east.create_certificate("initiator_cert", owner=INITIATOR)
        west.import_certificate(
            "initiator_cert_public", pem(east, "initiator_cert"), owner=INITIATOR
        )


def send(east: Broker, n: int = 3, **begin: object) -> uuid.UUID:
    with east.transaction() as tx:
        h = tx.begin_dialog(INITIATOR, TARGET, **begin)  # type: ignore[arg-type]
        for k in range(n):
            tx.send(h, body={**SECRET, "k": k})
    return h


def flip_a_byte(b: Broker) -> None:
    """Alter one byte in the middle of the first sealed body waiting to leave ``b``."""
    t = s.transmission_queue
    with b.engine.begin() as conn:
        row = conn.execute(
            select(t.c.id, t.c.message_body).order_by(t.c.message_sequence_number).limit(1)
        ).one()
        body = bytearray(row.message_body)
        body[len(body) // 2] ^= 0x01
        conn.execute(update(t).where(t.c.id == row.id).values(message_body=bytes(body)))


def drain(b: Broker, queue: str) -> list:  # type: ignore[type-arg]
    out = []
    while True:
        with b.transaction() as tx:
            got = tx.receive(queue)
        if not got:
            return out
        out += got


def tq_bodies(b: Broker) -> list[bytes]:
    t = s.transmission_queue
    with b.engine.connect() as conn:
        return [bytes(r[0] or b"") for r in conn.execute(select(t.c.message_body))]


def test_bodies_leave_sealed_and_arrive_in_clear_both_ways(pair: Pair) -> None:
    east, west = pair
    secure(east, west)
    send(east)
    bodies = tq_bodies(east)
    assert len(bodies) == 3 and not any(MARKER in body for body in bodies)
    assert {r.transmission_status for r in east.transmission_queue()} != set()
    report = east.deliver()
    assert report.delivered == 3
    got = drain(west, TARGET_QUEUE)
    assert [m.json()["k"] for m in got] == [0, 1, 2] and got[0].json()["card"] == SECRET["card"]
    with west.transaction() as tx:
        tx.send(got[0].conversation_handle, body={"reply": "ok", "card": SECRET["card"]})
    assert not any(MARKER in body for body in tq_bodies(west))
    assert west.deliver().delivered == 1
    reply = drain(east, INIT_QUEUE)
    assert [m.json()["reply"] for m in reply] == ["ok"]


def test_anonymous_binding_authenticates_only_the_target(pair: Pair) -> None:
    east, west = pair
    secure(east, west, anonymous=True)
    send(east, 2)
    assert east.deliver().delivered == 2
    assert [m.json()["k"] for m in drain(west, TARGET_QUEUE)] == [0, 1]


def test_encryption_on_without_dialog_security_sends_nothing_and_says_why(pair: Pair) -> None:
    east, west = pair
    send(east, 2)  # encryption=True is the default
    for _ in range(2):
        east.deliver(retry_now=True)
    assert drain(west, TARGET_QUEUE) == []
    rows = east.transmission_queue()
    assert len(rows) == 2
    assert all(
        "no remote service binding" in r.transmission_status and TARGET in r.transmission_status
        for r in rows
    )
    # Configured later, the waiting messages leave sealed.
    secure(east, west)
    east.deliver(retry_now=True)
    assert [m.json()["k"] for m in drain(west, TARGET_QUEUE)] == [0, 1]


def test_encryption_off_travels_in_clear_without_security(pair: Pair) -> None:
    east, west = pair
    send(east, 2, encryption=False)
    assert all(MARKER in body for body in tq_bodies(east))
    assert east.deliver().delivered == 2
    assert len(drain(west, TARGET_QUEUE)) == 2


def test_encryption_off_is_still_sealed_when_security_is_configured(pair: Pair) -> None:
    east, west = pair
    secure(east, west)
    send(east, 1, encryption=False)
    assert not any(MARKER in body for body in tq_bodies(east))
    east.deliver()
    assert len(drain(west, TARGET_QUEUE)) == 1


def test_encryption_off_queued_before_security_is_configured_leaves_sealed(pair: Pair) -> None:
    """The delivery pass, not only SEND, sees the far service's new binding: the dialog agrees a
    key there and its waiting messages are sealed before they leave."""
    east, west = pair
    h = send(east, 2, encryption=False)
    assert all(MARKER in body for body in tq_bodies(east))
    secure(east, west)
    assert east.deliver().delivered == 2
    assert [m.json()["k"] for m in drain(west, TARGET_QUEUE)] == [0, 1]
    with east.engine.connect() as conn:
        keys = conn.execute(select(s.dialog_key.c.conversation_handle)).scalars().all()
    assert keys == [h]
    with west.engine.connect() as conn:
        assert len(conn.execute(select(s.dialog_key)).all()) == 1  # the target agreed it too


def test_a_flipped_byte_on_the_way_gives_the_sender_an_error(pair: Pair) -> None:
    east, west = pair
    secure(east, west)
    send(east, 2)
    flip_a_byte(east)
    east.deliver()
    assert drain(west, TARGET_QUEUE) == [] or all(
        m.message_type_name == ERROR for m in drain(west, TARGET_QUEUE)
    )
    errors = [m for m in drain(east, INIT_QUEUE) if m.message_type_name == ERROR]
    assert len(errors) == 1
    code, description = errors[0].error
    assert code == ERR_DIALOG_SECURITY and "integrity check" in description


def test_an_expired_certificate_stops_the_dialog_naming_it_and_its_end(pair: Pair) -> None:
    east, west = pair
    secure(east, west, expires_in=30)
    # The binding's certificate (the target's) ends: rewind its end date to the past.
    c = s.certificate
    ended = utcnow() - timedelta(days=1)
    with east.engine.begin() as conn:
        conn.execute(update(c).where(c.c.name == "target_cert_public").values(expires_at=ended))
    send(east, 1)
    east.deliver(retry_now=True)
    errors = [m for m in drain(east, INIT_QUEUE) if m.message_type_name == ERROR]
    assert len(errors) == 1
    code, description = errors[0].error
    assert code == ERR_CERTIFICATE_EXPIRED
    assert "target_cert_public" in description and ended.strftime("%Y-%m-%d") in description
    assert drain(west, TARGET_QUEUE) == []
    assert east.transmission_queue() == []


def test_an_expired_certificate_at_the_target_is_refused_there(pair: Pair) -> None:
    east, west = pair
    secure(east, west)
    c = s.certificate
    ended = utcnow() - timedelta(hours=1)
    with west.engine.begin() as conn:
        conn.execute(update(c).where(c.c.name == "target_cert").values(expires_at=ended))
    send(east, 1)
    east.deliver()
    errors = [m for m in drain(east, INIT_QUEUE) if m.message_type_name == ERROR]
    assert len(errors) == 1 and errors[0].error[0] == ERR_CERTIFICATE_EXPIRED
    assert "target_cert" in errors[0].error[1]


def test_without_the_master_key_secure_dialogs_wait_and_say_so(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    east, west = pair
    secure(east, west)
    monkeypatch.delenv(MASTER_KEY_ENV)
    forget_master_key()
    dialogs.forget()
    send(east, 1)
    east.deliver(retry_now=True)
    assert drain(west, TARGET_QUEUE) == []
    (row,) = east.transmission_queue()
    assert "no master key" in row.transmission_status and MASTER_KEY_ENV in row.transmission_status
    monkeypatch.setenv(MASTER_KEY_ENV, "correct horse battery staple")
    forget_master_key()
    east.deliver(retry_now=True)
    assert len(drain(west, TARGET_QUEUE)) == 1


def test_an_unknown_initiator_certificate_is_refused_with_an_error(pair: Pair) -> None:
    east, west = pair
    secure(east, west)
    west.drop_certificate("initiator_cert_public")
    send(east, 1)
    east.deliver()
    errors = [m for m in drain(east, INIT_QUEUE) if m.message_type_name == ERROR]
    assert len(errors) == 1 and errors[0].error[0] == ERR_DIALOG_SECURITY
    assert INITIATOR in errors[0].error[1]


Seal = Callable[[bytes], bytes]


def test_a_dialog_in_one_broker_needs_nothing(tmp_path: Path) -> None:
    b = Broker.connect(f"sqlite:///{tmp_path / 'one.db'}")
    b.migrate()
    host_initiator(b)
    host_target(b)
    send(b, 2)  # encryption=True, no security configured: local, so it goes at once
    assert [json.loads(m.message_body)["k"] for m in drain(b, TARGET_QUEUE)] == [0, 1]
    b.dispose()


def _statements_of_one_send(east: Broker, n: int, **begin: object) -> tuple[int, list[uuid.UUID]]:
    from sqlalchemy import event

    with east.transaction() as tx:
        handles = [tx.begin_dialog(INITIATOR, TARGET, **begin) for _ in range(n)]  # type: ignore[arg-type]
    seen: list[str] = []

    def count(*args: object) -> None:
        seen.append(str(args[2]))

    event.listen(east.engine, "before_cursor_execute", count)
    try:
        with east.transaction() as tx:
            tx.send(handles, body={"k": 1})
    finally:
        event.remove(east.engine, "before_cursor_execute", count)
    return len(seen), handles


def test_a_send_on_many_dialogs_to_another_broker_looks_up_their_security_at_once(
    pair: Pair,
) -> None:
    """Whether each conversation seals what it sends is asked for all of them at once: a SEND's
    statements do not grow with its conversations (it was two a conversation: 1.07 ms a
    message for a SEND on 1,000, 0.13 ms now)."""
    east, _west = pair
    _statements_of_one_send(east, 4, encryption=False)  # fills the definition caches
    few, _ = _statements_of_one_send(east, 4, encryption=False)
    many, _ = _statements_of_one_send(east, 40, encryption=False)
    # Slack for a definition cache that expires in between (it re-reads a few rows).
    assert many <= few + 3, f"{few} statements for 4 conversations, {many} for 40"
    assert len(east.transmission_queue()) == 48


def test_a_send_on_several_secure_dialogs_seals_each_with_its_own_key(pair: Pair) -> None:
    east, west = pair
    secure(east, west)
    with east.transaction() as tx:
        handles = [tx.begin_dialog(INITIATOR, TARGET) for _ in range(3)]
        tx.send(handles, body=SECRET)
    bodies = tq_bodies(east)
    assert len(bodies) == 3 and not any(MARKER in body for body in bodies)
    assert len(set(bodies)) == 3  # three session keys
    assert east.deliver().delivered == 3
    got = drain(west, TARGET_QUEUE)
    assert [m.json()["card"] for m in got] == [SECRET["card"]] * 3
