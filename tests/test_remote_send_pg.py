"""A SEND to a service of another broker costs what a local SEND costs (issue 44), PostgreSQL.

Once a dialog's far side has answered (its broker instance is known), a SEND on it in clear is
``broker_send_one``'s remote branch: the sender's sequence number and the transmission-queue
row in one statement, one round trip. Counted here: every statement the broker sends, through
SQLAlchemy (engine events) and through :mod:`airflow_broker.storage.direct` (its observer).
And what the general path decides must still hold on this path: a dialog that must be secured
(a remote service binding created after the first SEND, ENCRYPTION on) is not sent in clear.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import transport_procs as tp
from sqlalchemy import event, select

from airflow_broker import Broker
from airflow_broker.storage import direct
from airflow_broker.storage import schema as s

pytestmark = [pytest.mark.postgres, pytest.mark.parametrize("new_db", ["postgres"], indirect=True)]


class Statements:
    """Every statement ``broker`` sends while counting (SQLAlchemy and the direct path)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.seen: list[str] = []
        self._on = False
        event.listen(broker.engine, "before_cursor_execute", self._sqlalchemy)

    def _sqlalchemy(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if self._on:
            self.seen.append(statement)

    def __enter__(self) -> list[str]:
        self.seen.clear()
        self._before = direct.observer
        direct.observer = lambda query, _s: self.seen.append(query.decode(errors="replace"))
        self._on = True
        return self.seen

    def __exit__(self, *_exc: Any) -> None:
        self._on = False
        direct.observer = self._before


@pytest.fixture
def pair(network: Callable[..., tp.Net], monkeypatch: pytest.MonkeyPatch) -> Iterator[tp.Net]:
    """``a`` (initiator) and ``b`` (target), routes both ways. Definitions (message types,
    contracts) are read once, not once a second as usual: the counts are of SEND's own
    statements."""
    from airflow_broker.storage import context

    monkeypatch.setattr(context, "DEFINITION_CACHE_SECONDS", 3600.0)
    net = network("a", "b")
    tp.two_way(net)
    yield net


def open_dialog(net: tp.Net, **begin: Any) -> tuple[uuid.UUID, uuid.UUID]:
    """A dialog a -> b with its first message delivered: (initiator handle, target handle)."""
    a, b = net["a"], net["b"]
    [handle] = tp.send_dialogs(a, [1], **begin)
    tp.deliver_until_empty(a)
    [first] = tp.drain_all(b, tp.TARGET_QUEUE)
    return handle, first.conversation_handle


def waiting(broker: Broker, handle: uuid.UUID) -> list[Any]:
    t = s.transmission_queue
    with broker.engine.connect() as conn:
        return list(
            conn.execute(
                select(t.c.message_sequence_number, t.c.sealed, t.c.transmission_status)
                .where(t.c.conversation_handle == handle)
                .order_by(t.c.message_sequence_number)
            )
        )


def test_a_remote_send_on_a_plain_dialog_is_one_round_trip(pair: tp.Net) -> None:
    a, b = pair["a"], pair["b"]
    handle, far = open_dialog(pair)
    counted = Statements(a)
    with counted as seen:
        a.send(handle, body={"n": 1})  # its own transaction: SEND and COMMIT in one query
    assert len(seen) == 1, seen
    with a.transaction() as tx:
        tx.send(handle, body={"n": 2})
    with counted as seen:
        with a.transaction() as tx:
            tx.send(handle, body={"n": 3})
        sent = list(seen)
    # BEGIN goes with the SEND (storage.direct); then the COMMIT
    assert len(sent) == 2, sent
    rows = waiting(a, handle)
    assert [r.message_sequence_number for r in rows] == [1, 2, 3]
    assert all(not r.sealed for r in rows)
    # ... and they arrive, in order, once.
    tp.deliver_until_empty(a)
    got = tp.drain_all(b, tp.TARGET_QUEUE)
    assert [m.json() for m in got] == [{"n": 1}, {"n": 2}, {"n": 3}]

    # The reply direction: b's side of the dialog knows a's instance from the first message.
    b.send(far, body={"reply": 0})  # b's process reads the message type once
    counted_b = Statements(b)
    with counted_b as seen:
        b.send(far, body={"reply": 1})
    assert len(seen) == 1, seen
    tp.deliver_until_empty(b)
    replies = tp.drain_all(a, tp.INIT_QUEUE)
    assert [m.json() for m in replies] == [{"reply": 0}, {"reply": 1}]


@pytest.fixture
def master_key(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from airflow_broker.security import dialogs
    from airflow_broker.security.crypto import MASTER_KEY_ENV, forget_master_key

    monkeypatch.setenv(MASTER_KEY_ENV, "correct horse battery staple")
    forget_master_key()
    dialogs.forget()
    yield
    forget_master_key()
    dialogs.forget()


def test_a_binding_created_after_a_send_in_clear_is_honoured_by_the_next_send(
    pair: tp.Net, master_key: None
) -> None:
    """With a remote service binding for the far service, an initiator's dialog must be
    secured (seed 004): the next SEND after the binding is created does not go in clear."""
    a, b = pair["a"], pair["b"]
    handle, _far = open_dialog(pair)
    a.send(handle, body={"n": 1})
    assert [r.sealed for r in waiting(a, handle)] == [None]
    b.create_certificate("target_cert", owner=tp.TARGET)
    a.import_certificate("target_public", b.export_certificate("target_cert"), owner=tp.TARGET)
    a.create_certificate("initiator_cert", owner=tp.INITIATOR)
    a.create_remote_service_binding("to_target", service=tp.TARGET, certificate="target_public")
    counted = Statements(a)
    with counted as seen:
        a.send(handle, body={"n": 2})
    assert len(seen) > 1, "the SEND took the one-statement path past a new binding"
    second = waiting(a, handle)[-1]
    assert second.message_sequence_number == 2
    assert second.sealed or "security" in second.transmission_status, second


def test_a_dialog_with_encryption_never_takes_the_path_in_clear(pair: tp.Net) -> None:
    a = pair["a"]
    with a.transaction() as tx:
        handle = tx.begin_dialog(tp.INITIATOR, tp.TARGET, encryption=True)
        tx.send(handle, body={"n": 0})
    with a.engine.begin() as conn:  # as if the far side had answered: its instance is known
        e = s.conversation_endpoint
        conn.execute(
            e.update()
            .where(e.c.conversation_handle == handle)
            .values(far_broker_instance=pair.id("b"))
        )
    counted = Statements(a)
    with counted as seen:
        a.send(handle, body={"n": 1})
    assert len(seen) > 1, "an ENCRYPTION dialog took the path in clear"


def test_a_batched_remote_send_is_one_round_trip_and_all_or_nothing(pair: tp.Net) -> None:
    """SEND on 20 dialogs to the far service: one statement. With one of them secured
    (ENCRYPTION), none goes by that statement: all by the general path, in the same order."""
    a, b = pair["a"], pair["b"]
    handles = tp.send_dialogs(a, [1] * 20)
    tp.deliver_until_empty(a)
    assert len(tp.drain_all(b, tp.TARGET_QUEUE)) == 20
    a.send(handles, body={"n": 1})
    counted = Statements(a)
    with counted as seen:
        a.send(handles, body={"n": 2})
    assert len(seen) == 1, seen
    with a.engine.begin() as conn:
        e = s.conversation_endpoint
        conn.execute(
            e.update().where(e.c.conversation_handle == handles[7]).values(encryption=True)
        )
    with counted as seen, a.transaction() as tx:
        tx.send(handles, body={"n": 3})
    assert len(seen) > 2, "a batch with a secured dialog went by the statement in clear"
    rows = waiting(a, handles[0])
    assert [r.message_sequence_number for r in rows] == [1, 2, 3]
