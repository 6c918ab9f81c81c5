"""One cause, one wait (issue 46): dialogs held up by the same cause back off together.

Thousands of dialogs waiting for one cause (no route to their service, no remote service binding
for an encrypted dialog, a far broker that does not answer) used to keep a backoff each, so some
were always due: the transmission trigger started a transmitter run every few seconds, each
delivering nothing. Here, on both engines, with the broker's clock moved by the test
(:func:`airflow_broker.storage.clock.advance`) instead of sleeping:

- over 60 s of waiting the transmitter is started once per backoff step of the cause, and each
  attempt tries one dialog, not all of them;
- :func:`~airflow_broker.activation.transmitter.watch` starts no run while nothing can leave,
  and says when the cause is tried next;
- the definition that cures the cause (the route, the remote service binding) makes every
  dialog due at once, and one pass delivers them all (PostgreSQL: the transmitter is NOTIFYed);
- an unreachable far broker's dialogs are tried one for all, and all go when it answers.

The real :class:`~airflow_broker.provider.triggers.transmission.TransmissionTrigger` is in
``test_one_cause_one_wait_trigger.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import transport_procs as tp
from sqlalchemy import func, select
from transport_procs import INITIATOR, TARGET, TARGET_QUEUE, UNREACHABLE_URL, send_dialogs

from airflow_broker import Broker
from airflow_broker.activation import transmitter as tm
from airflow_broker.security import dialogs
from airflow_broker.security.crypto import MASTER_KEY_ENV, forget_master_key
from airflow_broker.storage import clock
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import utcnow

#: dialogs waiting for one cause (the issue's case had about 7,000 messages)
MANY = 2000


@pytest.fixture(autouse=True)
def wall_clock() -> Iterator[None]:
    clock.reset()
    yield
    clock.reset()


def without_route(net: tp.Net) -> None:
    """``a`` hosts the initiator and ``b`` the target; ``b`` can answer, ``a`` has no route."""
    tp.host_initiator(net["a"])
    tp.host_target(net["b"])
    net["b"].create_route("ReturnRoute", INITIATOR, net.id("a"), "broker://a")


def attempts(b: Broker) -> int:
    """Attempts made so far, added up over every waiting message."""
    t = s.transmission_queue
    with b.engine.connect() as conn:
        return int(conn.execute(select(func.coalesce(func.sum(t.c.attempts), 0))).scalar_one())


def waits(b: Broker) -> list[tuple[str, str, int]]:
    """The causes that hold messages: (kind, destination, messages)."""
    t, w = s.transmission_queue, s.transmission_wait
    with b.engine.connect() as conn:
        return [
            (r.kind, r.destination, int(r.n))
            for r in conn.execute(
                select(w.c.kind, w.c.destination, func.count().label("n"))
                .join(t, t.c.wait_id == w.c.id)
                .group_by(w.c.kind, w.c.destination)
            )
        ]


def wait_a_minute(b: Broker, seconds: float = 60.0, step: float = 0.5) -> int:
    """``seconds`` of broker time, a watcher's look every ``step``: the transmitter runs it
    starts (each run to its end, as the transmitter DAG would)."""
    runs = 0
    for _ in range(int(seconds / step)):
        clock.advance(step)
        fire, _seen = tm.watch(b)
        if fire is not None:
            tm.transmit(b)
            runs += 1
    return runs


def test_dialogs_without_a_route_wait_together(network: Callable[..., tp.Net]) -> None:
    net = network("a", "b")
    without_route(net)
    a = net["a"]
    # Sent in waves a moment apart, as an application does: each wave is tried when it comes.
    for _wave in range(4):
        send_dialogs(a, [1] * (MANY // 4))
        first = tm.transmit(a)
        # (the run may also try the cause once for the waves before, if it fell due)
        assert first.delivery.delivered == 0 and first.delivery.delayed >= MANY // 4
        clock.advance(0.3)
    assert waits(a) == [("route", TARGET, MANY)]
    status = a.transmission_queue()[0].transmission_status
    assert TARGET in status and "route" in status, status  # each message names the cause
    tried = attempts(a)
    assert MANY <= tried <= MANY + 4  # each tried once, when it was sent

    runs = wait_a_minute(a)
    # One attempt per backoff step of the cause (1, 2, 4 ... 32 s: six or seven in a minute),
    # each trying one dialog for all of them; not one run every few seconds for ever.
    assert runs <= 8, runs
    assert attempts(a) - tried <= runs, (attempts(a) - tried, runs)
    left = tm.backlog(a)
    assert left.waiting == MANY and left.causes == 1


def test_watch_starts_no_run_while_nothing_can_leave(network: Callable[..., tp.Net]) -> None:
    net = network("a", "b")
    without_route(net)
    a = net["a"]
    send_dialogs(a, [2] * 50)
    fire, seen = tm.watch(a)
    assert fire is not None and seen.due == 100  # new messages: a run routes them
    tm.transmit(a)
    assert attempts(a) == 100
    for _ in range(5):
        fire, seen = tm.watch(a)
        assert seen.waiting == 100 and seen.causes == 1
        if seen.due == 0:
            # The watcher starts nothing however many messages wait, and wakes at the cause's
            # next attempt (not at any message's).
            assert fire is None
            assert seen.next_attempt_at is not None
            assert seen.next_attempt_at <= utcnow() + timedelta(seconds=1.5)
        else:  # (a slow machine got there already: it is one attempt)
            assert fire is not None and seen.due == 1
            break
        clock.advance(0.1)
    else:
        clock.advance(1.5)
        fire, seen = tm.watch(a)
        assert fire is not None and seen.due == 1  # the cause: one attempt, for all of them
    report = tm.transmit(a)
    assert report.delivery.delivered == 0
    assert attempts(a) == 100 + 2  # one dialog (its two messages) was tried again
    fire, seen = tm.watch(a)
    assert fire is None and seen.due == 0 and seen.next_attempt_at is not None
    assert seen.next_attempt_at > utcnow()  # backed off: 2 s from the attempt


def test_creating_the_route_sends_them_all_at_once(network: Callable[..., tp.Net]) -> None:
    net = network("a", "b")
    without_route(net)
    a = net["a"]
    handles = send_dialogs(a, [3] * 200)
    tm.transmit(a)
    for _ in range(4):  # the cause backs off for a while
        clock.advance(40)
        tm.transmit(a)
    seen = tm.backlog(a)
    assert seen.due == 0 and seen.next_attempt_at is not None
    assert seen.next_attempt_at > utcnow() + timedelta(seconds=10)

    # The NOTIFY is seen on a session of its own (not through a transaction-mode pooler).
    listener = _listen(a) if a.dialect == "postgresql" and not a.adapter.pooled else None
    try:
        a.create_route("ToTarget", TARGET, None, "broker://b")
        if listener is not None:
            assert _notified(listener), "creating the route did not NOTIFY the transmitter"
    finally:
        if listener is not None:
            listener.close()
    seen = tm.backlog(a)
    assert seen.due == 600 and seen.causes == 0
    fire, _ = tm.watch(a)
    assert fire is not None
    report = a.deliver()  # one pass
    assert report.delivered == 600 and report.delayed == 0
    assert tm.backlog(a) == tm.Backlog()
    got = tp.by_conversation(net["b"], tp.drain_all(net["b"], TARGET_QUEUE))
    conv = tp.conversation_ids(a, handles)
    tp.assert_exactly_once_in_order(got, {conv[h]: range(3) for h in handles}, "b")


def test_an_unreachable_broker_is_tried_with_one_dialog_for_all(
    network: Callable[..., tp.Net],
) -> None:
    net = network("a", "b")
    tp.two_way(net)
    a = net["a"]
    real = a.resolver["b"]  # type: ignore[index]
    a.resolver["b"] = UNREACHABLE_URL  # type: ignore[index]
    handles = send_dialogs(a, [2] * 300)
    down = tm.transmit(a)
    assert down.delivery.delivered == 0
    assert waits(a) == [("address", "broker://b", 600)]
    status = a.transmission_queue()[0].transmission_status
    assert "cannot deliver to broker://b" in status
    tried = attempts(a)
    runs = wait_a_minute(a, 30, 1.0)
    assert 1 <= runs <= 6
    assert attempts(a) - tried <= 2 * runs  # one dialog of two messages per attempt
    # It answers again: at the cause's next attempt, the dialog tried goes, and so do the rest.
    a.resolver["b"] = real  # type: ignore[index]
    clock.advance(61)
    up = tm.transmit(a)
    assert up.delivery.delivered == 600 and up.left == tm.Backlog()
    got = tp.by_conversation(net["b"], tp.drain_all(net["b"], TARGET_QUEUE))
    conv = tp.conversation_ids(a, handles)
    tp.assert_exactly_once_in_order(got, {conv[h]: range(2) for h in handles}, "b")


def test_the_binding_wakes_the_dialogs_that_waited_for_dialog_security(
    network: Callable[..., tp.Net], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MASTER_KEY_ENV, "correct horse battery staple")
    forget_master_key()
    dialogs.forget()
    try:
        net = network("a", "b")
        tp.two_way(net)
        a, b = net["a"], net["b"]
        # Certificates on both sides; a has no remote service binding for the target yet.
        b.create_certificate("target_cert", owner=TARGET)
        a.import_certificate("target_public", b.export_certificate("target_cert"), owner=TARGET)
        a.create_certificate("initiator_cert", owner=INITIATOR)
        b.import_certificate(
            "initiator_public", a.export_certificate("initiator_cert"), owner=INITIATOR
        )
        handles = send_dialogs(a, [2] * 150, encryption=True)
        tm.transmit(a)
        assert waits(a) == [("security", TARGET, 300)]
        assert "no remote service binding" in a.transmission_queue()[0].transmission_status
        runs = wait_a_minute(a, 20, 1.0)
        assert runs <= 5
        assert tm.watch(a)[0] is None

        a.create_remote_service_binding("to_target", service=TARGET, certificate="target_public")
        assert tm.backlog(a).due == 300
        report = a.deliver()
        assert report.delivered == 300 and tm.backlog(a) == tm.Backlog()
        got = tp.by_conversation(b, tp.drain_all(b, TARGET_QUEUE))
        conv = tp.conversation_ids(a, handles)
        tp.assert_exactly_once_in_order(got, {conv[h]: range(2) for h in handles}, "b")
    finally:
        forget_master_key()
        dialogs.forget()


def _listen(b: Broker):  # type: ignore[no-untyped-def]
    import psycopg

    from airflow_broker.storage.adapters import TRANSMIT_CHANNEL

    url = b.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    conn = psycopg.connect(url, autocommit=True)
    conn.execute(f"LISTEN {TRANSMIT_CHANNEL}")
    return conn


def _notified(conn) -> bool:  # type: ignore[no-untyped-def]
    return any(True for _ in conn.notifies(timeout=5, stop_after=1))


def test_the_page_shows_when_a_cause_is_tried_next_and_retry_now_takes_a_dialog_out(
    network: Callable[..., tp.Net],
) -> None:
    """The broker page's transmission list: a message parked under a cause has no next attempt
    of its own, so it shows its cause's. "Retry now" on one conversation makes its messages due
    on their own, out of the cause, while the others keep waiting for it."""
    from airflow_broker.operations import monitoring

    net = network("a", "b")
    without_route(net)
    a = net["a"]
    send_dialogs(a, [1] * 20)
    tm.transmit(a)
    clock.advance(0.3)
    tm.transmit(a)  # the later rows are parked under the cause now
    w, t = s.transmission_wait, s.transmission_queue
    with a.engine.connect() as conn:
        cause_next = conn.execute(select(w.c.next_attempt_at)).scalar_one()
        parked = (
            conn.execute(select(t.c.conversation_handle).where(t.c.wait_id.is_not(None)))
            .scalars()
            .all()
        )
    assert parked, "no row parked under the cause"
    page = monitoring.transmission_queue(a).page
    shown = {str(i.conversation_handle): i.next_attempt_at for i in page.items}
    for handle in parked:
        assert shown[str(handle)] is not None, "a parked row shows no next attempt"
        assert shown[str(handle)] == clock.aware(cause_next)

    one = parked[0]
    result = monitoring.retry_transmission(a, one, deliver=False)
    assert result.changed
    with a.engine.connect() as conn:
        mine = conn.execute(
            select(t.c.wait_id, t.c.next_attempt_at).where(t.c.conversation_handle == one)
        ).all()
        others = conn.execute(
            select(func.count()).where(t.c.wait_id.is_not(None), t.c.conversation_handle != one)
        ).scalar_one()
    assert all(r.wait_id is None and r.next_attempt_at is not None for r in mine), mine
    assert others == len(parked) - 1
