"""The engine against the reference model (``tests/model/reference.py``) under random operations.

A Hypothesis ``RuleBasedStateMachine`` begins dialogs (some with a lifetime), SENDs on either side
(including what the contract forbids and what an ended conversation refuses), RECEIVEs by queue,
by conversation and by group, commits or rolls back what it received (rollbacks count toward
poison handling), ENDs plain, WITH ERROR and WITH CLEANUP, MOVEs conversations between groups,
fires conversation timers and lifetimes on the broker's clock, and disables and enables queues.
After every step what the engine returned, and every queue's depth and every endpoint's state,
must equal the model's. Both engines run it, SQLite and PostgreSQL.

The profile ``ci`` (the default) is bounded; ``HYPOTHESIS_PROFILE=soak`` (``make soak``) runs many
more, longer examples. Each example declares its own two queues and services in the test's one
database, so examples cost a few statements, not a database.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from model.reference import (
    DIALOG_TIMER,
    END_DIALOG,
    ERROR,
    POISON_THRESHOLD,
    Model,
    Msg,
    Refused,
)
from sqlalchemy import select

from airflow_broker import Broker, BrokerError, Message
from airflow_broker.storage import clock, schema

settings.register_profile(
    "ci",
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile(
    "soak",
    max_examples=2000,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")

ORDER, INVOICE, NOTE = "//po/Order", "//po/Invoice", "//po/Note"
CONTRACT = "//po/OrderContract"
_examples = itertools.count()
#: longer than all the timer and backoff steps of an example together: lifetimes pass only when
#: the machine says so
LIFETIME = 100_000
#: RECEIVE's TOP: all of the group, or the first few (it may cut a conversation short)
TOPS = st.sampled_from([None, 1, 2, 3])


class _Rollback(Exception):
    pass


def _declare_types(broker: Broker) -> None:
    with broker.definitions() as d:
        d.create_message_type(ORDER, validation="json")
        d.create_message_type(INVOICE, validation="json")
        d.create_message_type(NOTE, validation="none")
        d.create_contract(CONTRACT, {ORDER: "initiator", INVOICE: "target", NOTE: "any"})


class BrokerMachine(RuleBasedStateMachine):
    broker: Broker  # set by the test for each engine

    initiators = Bundle("initiators")
    targets = Bundle("targets")

    def __init__(self) -> None:
        super().__init__()
        n = next(_examples)
        self.bq, self.sq = f"m{n}_buyer_q", f"m{n}_supplier_q"
        self.buyer, self.supplier = f"//m{n}/Buyer", f"//m{n}/Supplier"
        with self.broker.definitions() as d:
            d.create_queue(self.bq)
            d.create_queue(self.sq)
            d.create_service(self.buyer, queue=self.bq, contracts=[CONTRACT])
            d.create_service(self.supplier, queue=self.sq, contracts=[CONTRACT])
        self.model = Model(self.bq, self.sq)
        self.bodies = itertools.count()
        self._targets_known: list[uuid.UUID] = []

    # -- doing the same thing to both --------------------------------------------------------
    def both(self, engine_step: Any, model_step: Any) -> Any:
        """Run a step on the engine and the model; they must agree on refusing it, and how."""
        try:
            expected = model_step()
        except Refused as refused:
            with pytest.raises(BrokerError) as raised:
                engine_step()
            assert type(raised.value).__name__ == refused.kind, (refused.kind, raised.value)
            return None
        got = engine_step()
        return got, expected

    def same_messages(self, got: list[Message], expected: list[Msg]) -> None:
        def seen(m: Message) -> tuple[Any, ...]:
            body: Any = m.json() if m.message_type_name in (ORDER, INVOICE) else m.text()
            if m.message_type_name == ERROR:
                assert m.error is not None
                body = m.error[0]
            if m.message_type_name in (END_DIALOG, DIALOG_TIMER):
                body = None
            seq = m.message_sequence_number
            if m.message_type_name == DIALOG_TIMER or (
                m.message_type_name == ERROR and body is not None and body < 0
            ):
                seq = None
            return (m.conversation_handle, m.message_type_name, body, seq)

        assert [seen(m) for m in got] == [(e.handle, e.type, e.body, e.seq) for e in expected]

    # -- rules -------------------------------------------------------------------------------
    @rule(target=initiators, orders=st.integers(1, 2), lifetime=st.booleans())
    def begin(self, orders: int, lifetime: bool) -> uuid.UUID:
        with self.broker.transaction() as tx:
            h = tx.begin_dialog(
                self.buyer,
                self.supplier,
                CONTRACT,
                lifetime_seconds=LIFETIME if lifetime else None,
                encryption=False,
            )
            group = tx.conversation(h).conversation_group_id
        self.model.begin(h, group, lifetime=lifetime)
        for _ in range(orders):
            self._send(h, ORDER)
        return h

    def _send(self, h: uuid.UUID, mtype: str) -> None:
        body: Any = {"n": next(self.bodies)} if mtype != NOTE else f"note {next(self.bodies)}"

        def engine() -> None:
            with self.broker.transaction() as tx:
                tx.send(h, mtype, body)

        self.both(engine, lambda: self.model.send(h, mtype, body))
        self._learn_targets()

    def _learn_targets(self) -> None:
        """Target endpoints the model created as placeholders: learn the engine's handle and
        group for each (it must have created them too)."""
        for key in [k for k in self.model.endpoints if isinstance(k, tuple)]:
            initiator = key[1]
            with self.broker.transaction() as tx:
                cid = tx.conversation(initiator).conversation_id
            e = schema.conversation_endpoint
            with self.broker.engine.connect() as conn:
                row = conn.execute(
                    select(e.c.conversation_handle, e.c.conversation_group_id).where(
                        e.c.conversation_id == cid, e.c.is_initiator.is_(False)
                    )
                ).one_or_none()
            assert row is not None, f"the engine has no target endpoint for {initiator}"
            self.model.rename(key, row.conversation_handle, row.conversation_group_id)
            self._targets_known.append(row.conversation_handle)

    @rule(target=targets)
    @precondition(lambda self: bool(self._targets_known))
    def a_target(self) -> uuid.UUID:
        return self._targets_known.pop(0)

    @rule(h=initiators, mtype=st.sampled_from([ORDER, NOTE, INVOICE]))
    def send_initiator(self, h: uuid.UUID, mtype: str) -> None:
        self._send(h, mtype)

    @rule(h=targets, mtype=st.sampled_from([INVOICE, NOTE, ORDER]))
    def send_target(self, h: uuid.UUID, mtype: str) -> None:
        self._send(h, mtype)

    def _receive(self, queue: str, commit: bool, **how: Any) -> None:
        model_taken: list[Msg] = []

        def model() -> list[Msg]:
            model_taken.extend(
                self.model.receive(
                    queue,
                    handle=how.get("conversation_handle"),
                    group=how.get("conversation_group"),
                    top=how.get("top"),
                )
            )
            return model_taken

        def engine() -> list[Message]:
            try:
                with self.broker.transaction() as tx:
                    got = tx.receive(queue, **how)
                    engine_taken.extend(got)
                    if not commit and got:
                        raise _Rollback
            except _Rollback:
                pass
            return engine_taken

        engine_taken: list[Message] = []
        out = self.both(engine, model)
        if out is not None:
            self.same_messages(*out)
            if model_taken:
                self.model.received(queue, model_taken, committed=commit)

    @rule(side=st.booleans(), commit=st.booleans(), top=TOPS)
    def receive_queue(self, side: bool, commit: bool, top: int | None) -> None:
        self._receive(self.bq if side else self.sq, commit, top=top)

    @rule(h=st.one_of(initiators, targets), commit=st.booleans(), top=TOPS)
    def receive_conversation(self, h: uuid.UUID, commit: bool, top: int | None) -> None:
        ep = self.model.endpoints.get(h)
        queue = ep.queue if ep is not None else self.sq
        self._receive(queue, commit, conversation_handle=h, top=top)

    @rule(h=targets, top=TOPS)
    def receive_group(self, h: uuid.UUID, top: int | None) -> None:
        ep = self.model.endpoints.get(h)
        if ep is not None:
            self._receive(ep.queue, True, conversation_group=ep.group, top=top)

    @rule(h=st.one_of(initiators, targets), how=st.sampled_from(["plain", "error", "cleanup"]))
    def end(self, h: uuid.UUID, how: str) -> None:
        kwargs: dict[str, Any] = {}
        if how == "error":
            kwargs = {"error_code": 4242, "error_description": "refused by the model test"}
        elif how == "cleanup":
            kwargs = {"cleanup": True}

        def engine() -> None:
            with self.broker.transaction() as tx:
                tx.end_conversation(h, **kwargs)

        def model() -> None:
            self.model.end(
                h,
                error=(4242, "x") if how == "error" else None,
                cleanup=how == "cleanup",
            )

        self.both(engine, model)
        self._learn_targets()

    @rule(h=consumes(targets), into=targets)
    def move(self, h: uuid.UUID, into: uuid.UUID) -> None:
        a, b = self.model.endpoints.get(h), self.model.endpoints.get(into)
        if a is None or b is None or h == into:
            return
        with self.broker.transaction() as tx:
            tx.move_conversation(h, b.group)
        self.model.move(h, b.group)

    @rule(h=st.one_of(initiators, targets))
    def timer(self, h: uuid.UUID) -> None:
        def engine() -> None:
            with self.broker.transaction() as tx:
                tx.begin_conversation_timer(h, 30)

        if self.both(engine, lambda: self.model.set_timer(h)) is None:
            return
        self._advance(31)
        self.model.timer_fires(h)
        self.model.flush()
        self.model.purge_closed()
        self._learn_targets()

    @rule()
    def lifetimes_pass(self) -> None:
        self._advance(LIFETIME + 1)  # past the closed endpoints' retention too
        self.model.lifetimes_pass()
        self.model.flush()
        self.model.purge_closed()
        self._learn_targets()

    @rule(side=st.booleans(), enabled=st.booleans())
    def queue_status(self, side: bool, enabled: bool) -> None:
        queue = self.bq if side else self.sq
        self.broker.alter_queue(queue, status=enabled)
        self.model.set_queue(queue, enabled)
        if enabled:
            self._advance(61)  # past any backoff of what waited for the queue
            self.model.flush()
            self.model.purge_closed()
            self._learn_targets()

    @rule(side=st.booleans())
    def poison(self, side: bool) -> None:
        """Roll back receives until poison handling disables the queue (if it has messages)."""
        queue = self.bq if side else self.sq
        for _ in range(POISON_THRESHOLD):
            self._receive(queue, False)

    def _advance(self, seconds: float) -> None:
        """Move the broker's clock and the model's, and run due work (the caller then does the
        model's: timers, lifetimes, waiting messages, then the purge, in the engine's order)."""
        clock.advance(seconds)
        self.model.advance(seconds)
        self.broker.run_due()

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def same_queues_and_states(self) -> None:
        if not hasattr(self, "model"):
            return
        status = {q.name: q for q in self.broker.queue_status()}
        for name, q in self.model.queues.items():
            assert status[name].depth == len(q.messages), name
            assert status[name].status == q.enabled, name
        with self.broker.transaction() as tx:
            for h, ep in self.model.endpoints.items():
                assert tx.conversation(h).state == ep.state, (h, ep)

    def teardown(self) -> None:
        clock.reset()


@pytest.fixture
def machine_broker(broker_url: str) -> Iterator[Broker]:
    b = Broker.connect(broker_url)
    _declare_types(b)
    BrokerMachine.broker = b
    yield b
    clock.reset()
    b.dispose()


@pytest.mark.xdist_group("model")
def test_the_engine_behaves_like_the_reference_model(machine_broker: Broker) -> None:
    run_state_machine_as_test(BrokerMachine, settings=settings.get_profile(PROFILE))
    assert machine_broker.check() == []
