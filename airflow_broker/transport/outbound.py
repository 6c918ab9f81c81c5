"""The outbound pass: :class:`Transport` moves due rows of the transmission queue to the far
broker databases, in batches per conversation and destination, and applies their answers.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select, tuple_, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

import airflow_broker.transport.causes as causes
import airflow_broker.transport.deadlines as deadlines
import airflow_broker.transport.direct as direct
import airflow_broker.transport.inbox as inbox
import airflow_broker.transport.lanes as lanes
import airflow_broker.transport.pipeline as pipeline
import airflow_broker.transport.route_requests as route_requests
from airflow_broker import metrics, routing
from airflow_broker.messaging.delivery import RETRY_BASE
from airflow_broker.messaging.duework import DueWork
from airflow_broker.storage import bulk
from airflow_broker.storage import direct as storage_direct
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware, utcnow
from airflow_broker.storage.context import BrokerContext
from airflow_broker.storage.identity import copy_refusal
from airflow_broker.transport.arrival import fail_endpoint
from airflow_broker.transport.direct import Conversation
from airflow_broker.transport.forwarding import (
    _key,
    _memory_lock,
    _memory_transit,
    _packet_of_transit,
)
from airflow_broker.transport.inbound import Inbound
from airflow_broker.transport.outcomes import Sent, outcomes
from airflow_broker.transport.packets import (
    _UNREACHABLE,
    DROPPED,
    DeliveryReport,
    Outcome,
    Packet,
    Unreachable,
    _first_line,
)
from airflow_broker.transport.pipeline import Batch
from airflow_broker.transport.plan import message_packets, plan_batch
from airflow_broker.transport.resolve import resolve
from airflow_broker.transport.survey import survey
from airflow_broker.transport.take import due_select, take_rows
from airflow_broker.transport.taker import apply_answers

log = logging.getLogger("airflow_broker")


#: What a batch's plan may hold that its transaction must commit durably (a session key, a
#: local message, an Error, a reason to wait...): without any, the commit does not wait for
#: the WAL flush.
_DURABLE = ("local", "delayed", "waiting", "stopped", "seal_now", "sealings", "missing")
_NO_FLUSH = b"SET LOCAL synchronous_commit = off;"


class Transport:
    """Moves this broker's transmission queue (and, forwarding, its messages in transit)."""

    #: messages per push to a far broker (one transaction there)
    BATCH = 500
    #: PostgreSQL: batches of a pass in flight at once (:mod:`.pipeline`); 1: one at a time
    IN_FLIGHT = 2

    def __init__(self, broker: BrokerContext) -> None:
        self.b = broker
        #: why this pass may not deliver to other brokers (this database is a copy), or None
        self.refused: str | None = None
        #: this pass: destinations that did not answer in time, and why
        self.hung: dict[str, str] = {}
        #: when this pass started
        self.started = utcnow()

    def after_push(self, address: str, sent: int) -> None:
        """Called after a far broker committed a batch of ``sent`` messages and before this
        broker records the acknowledgments (an instrumentation point; crash tests use it)."""

    # -- pushing -------------------------------------------------------------------------------
    def push(self, address: str, packets: Sequence[Packet], depth: int = 0) -> Outcome:
        """Hand ``packets`` to the broker at ``address``; raises :class:`Unreachable`."""
        try:
            peer = resolve(self.b, address)
        except DBAPIError as exc:
            raise Unreachable(f"{address}: {_first_line(exc)}") from exc
        # Bounded by the peer's answer timeout (deadlines): a hung broker raises Unreachable.
        with deadlines.answer_within(peer, address):
            try:
                if inbox.inbox_mode(peer):
                    # A role that may only deliver: the far broker accepts it on its own pass.
                    return inbox.push(self.b, peer, address, packets, depth)
                outcome = Inbound(peer, Transport(peer).push_any).accept(packets, depth=depth)
            except Unreachable as exc:
                raise Unreachable(f"cannot deliver to {address}: {exc}") from exc
            except DBAPIError as exc:
                raise Unreachable(f"cannot deliver to {address}: {_first_line(exc)}") from exc
        self.after_push(address, len(packets))
        return outcome

    def push_any(
        self, addresses: Iterable[str], packets: Sequence[Packet], depth: int = 0
    ) -> tuple[Outcome | None, list[str]]:
        """Try the addresses in order (alternatives: mirror, several routes to one broker) until
        one takes the batch. Returns its outcome (None if none could) and the failures."""
        failures: list[str] = []
        for address in addresses:
            if depth > routing.MAX_HOPS + 1:
                failures.append("too deep a chain of forwarders")
                break
            try:
                return self.push(address, packets, depth), failures
            except Unreachable as exc:
                failures.append(str(exc))
                log.info("%s", exc)
        return None, failures

    # -- the delivery pass ---------------------------------------------------------------------
    def deliver(
        self, max_messages: int | None = None, *, retry_now: bool = False
    ) -> DeliveryReport:
        counts: dict[str, int] = defaultdict(int)
        self.hung = {}
        self.started = utcnow()  # a cause of waiting is one attempt more once per pass
        # A restored or cloned copy delivers nothing between databases until an operator
        # decides (storage.identity): remote messages wait with the reason, local ones go on.
        self.refused = copy_refusal(self.b)
        work = survey(self.b, self.started, retry_now)  # which steps have work
        accepted = 0
        if self.refused is not None:
            log.info("%s", self.refused)  # as for an unreachable broker: the rows say it too
        else:
            if work.inbox:
                accepted = inbox.accept_inbox(self, counts)  # pushed by peers that only deliver
            self._collect_answers(counts)
        if not retry_now and work.causes:
            # One dialog of each cause of waiting that falls due, tried for all (.causes).
            causes.probe_due(self.b, utcnow())
        if work.due or work.causes:  # (a cause's probe makes rows due)
            self._batches(max_messages, retry_now, counts)
        if self.refused is None and (work.transit or accepted or counts["forwarded"]):
            self._transit_pass(retry_now, counts)
        if work.route_answers:
            route_requests.answer_requests(self.b)
        unreachable = counts.pop(_UNREACHABLE, 0)
        report = DeliveryReport(**counts, hung=dict(self.hung))
        for address, why in self.hung.items():
            log.warning("delivery to %s: %s", address, why)
        metrics.incr(metrics.TRANSPORT_FAILED, unreachable)
        metrics.incr(metrics.DELIVERY_FAILED, report.failed)
        return report

    def _batches(self, budget: int | None, retry_now: bool, counts: dict[str, int]) -> None:
        """The due messages of the transmission queue (at most ``budget``), batch by batch."""
        if self.b.dialect == "postgresql" and self.IN_FLIGHT > 1:
            pipeline.deliver_batches(self, budget, retry_now, counts)
            return
        after: list[Any] = []
        while budget is None or budget > 0:
            limit = self.BATCH if budget is None else min(self.BATCH, budget)
            n = self._transmission_batch(limit, retry_now, counts, after)
            if n < limit:  # every due message was in it
                break
            if budget is not None:
                budget -= n

    def _collect_answers(self, counts: dict[str, int]) -> None:
        """Answers far brokers wrote in their inboxes' answer tables for this broker's batches."""
        for address in inbox.inbox_addresses(self.b):
            try:
                peer = resolve(self.b, address)
                with deadlines.answer_within(peer, address):
                    answers, notes = inbox.collect(peer, address)
            except (Unreachable, DBAPIError) as exc:
                log.info("%s", exc)
                continue
            if answers or notes:
                with self.b.engine.begin() as conn:
                    me = self.b.instance_id_on(conn)
                    self._apply_answers(conn, me, answers, counts)
                    self._late_notes(conn, notes)

    def _apply_answers(
        self, conn: Connection, me: str, answers: list[Packet], counts: dict[str, int]
    ) -> None:
        mine = [a for a in answers if a.to_broker_instance == me]
        if mine:
            acks, notices = apply_answers(self.b, conn, me, mine)
            counts["acknowledged"] += acks
            counts["delivered"] += acks
            counts["failed"] += notices
        relay = [a for a in answers if a.to_broker_instance != me]
        if relay:
            self._relay(relay, counts)

    def _late_notes(self, conn: Connection, notes: list[inbox.Note]) -> None:
        """Why a far broker held or dropped packets of earlier batches: the rows say it."""
        t = s.transmission_queue
        for conversation_id, from_initiator, seq, _kind, reason in notes:
            conn.execute(
                update(t)
                .where(
                    t.c.conversation_id == conversation_id,
                    t.c.is_initiator == from_initiator,
                    t.c.message_sequence_number == seq,
                )
                .values(transmission_status=reason)
            )

    def _transmission_batch(
        self, limit: int, retry_now: bool, counts: dict[str, int], after: list[Any]
    ) -> int:
        """Take up to ``limit`` due messages (none taken before in this pass), deliver them;
        returns how many were taken. One batch at a time (SQLite, or ``IN_FLIGHT`` 1)."""
        batch = self._take(limit, retry_now, after, room=0)
        if batch is None:
            return 0
        try:
            if self.b.dialect != "postgresql":
                # SQLite: no lock is held while far brokers are called; results are written in
                # one write transaction afterwards (a duplicate push is harmless). The plan's
                # only writes, session keys agreed for secure dialogs, commit before they go.
                batch.conn.commit()
            self._finish(batch, self._send(batch.plan), counts)
        finally:
            batch.conn.close()
        return len(batch.rows)

    def _take(self, limit: int, retry_now: bool, after: list[Any], *, room: int) -> Batch | None:
        """Up to ``limit`` due messages after ``after`` (a keyset it moves on), locked in a new
        source transaction, and their plan; None when there are none. With ``room`` > 0, a full
        batch takes up to ``room`` more rows to complete its last conversation, and unless that
        conversation may still go on after them, the next batch starts after it (the batch is
        not open-ended: no later batch of the pass shares a conversation with it)."""
        b = self.b
        t = s.transmission_queue
        now = utcnow()
        conn = b.engine.connect()
        try:
            if b.dialect == "postgresql":
                rows: list[Any] = take_rows(conn, now, limit, retry_now, after)
            else:
                # Keyset: each batch starts where the last one ended (rows it could not
                # deliver stay): after its last row, or after its last conversation when that
                # one is closed for this pass (then no later batch shares it, whatever is sent
                # on it meanwhile).
                first = due_select(b.dialect, now, retry_now).limit(limit)
                if after:
                    handle, seq, closed = after
                    first = first.where(
                        t.c.conversation_handle > handle
                        if closed
                        else tuple_(t.c.conversation_handle, t.c.message_sequence_number)
                        > tuple_(handle, seq)
                    )
                rows = list(conn.execute(first).all())
            if not rows:
                conn.rollback()
                conn.close()
                return None
            # A full batch's last conversation may go on after it, unless its last row is the
            # last message sent on it.
            last = rows[-1]
            open_ended = (
                len(rows) == limit and last.message_sequence_number + 1 < last.send_sequence
            )
            if open_ended and room > 0 and last.conversation_handle != rows[0].conversation_handle:
                rest = conn.execute(
                    due_select(b.dialect, now, retry_now)
                    .where(
                        t.c.conversation_handle == last.conversation_handle,
                        t.c.message_sequence_number > last.message_sequence_number,
                    )
                    .limit(room)
                ).all()
                rows += rest
                open_ended = len(rest) == room
            # Closed: the next batch starts after this one's last conversation.
            closed = room > 0 and not open_ended
            after[:] = [rows[-1].conversation_handle, rows[-1].message_sequence_number, closed]
            me = b.instance_id_on(conn)
            plan = plan_batch(self.b, self.refused, conn, rows, me, now)
        except BaseException:
            conn.close()
            raise
        return Batch(conn, rows, plan, me, now, not closed)

    def _finish(
        self,
        batch: Batch,
        results: list[tuple[list[Packet], Outcome | None, str]],
        counts: dict[str, int],
    ) -> None:
        """What the far brokers answered, applied in the batch's source transaction, and its
        commit."""
        plan = batch.plan
        acknowledged = self._record(batch.conn, plan, results, batch.me, batch.now, counts)
        if acknowledged:  # (PostgreSQL) their DELETE in the COMMIT's round trip
            statement = bulk.delete_ranges_statement(*direct.TRANSMITTED)
            delete = storage_direct.written(batch.conn, statement, bulk.ranges_args(acknowledged))
            if not any(plan[k] for k in _DURABLE) and not results:
                # All this transaction writes is what far brokers have durably: lost in a
                # crash, the rows are sent again and acknowledged as the duplicates they are.
                delete = _NO_FLUSH + delete
            storage_direct.commit(batch.conn, before=delete)
        elif self.b.dialect == "postgresql":
            storage_direct.commit(batch.conn)
        else:
            batch.conn.commit()
        route_requests.request_routes(self.b, batch.plan["missing"])

    def _send(self, plan: dict[str, Any]) -> list[tuple[list[Packet], Outcome | None, str]]:
        """Push the batch's messages to their far brokers, each destination in its own lane
        (:mod:`.lanes`), waiting for each at most its patience. What a destination did not
        answer in time goes into ``plan["waiting"]`` (recorded as waiting, with the reason) and
        is recorded when it answers (:meth:`_late`)."""
        jobs: dict[tuple[str, ...], tuple[list[Conversation], list[Packet]]] = {}
        for addresses, conversations in plan["direct"].items():
            jobs.setdefault(addresses, ([], []))[0].extend(conversations)
        for addresses, packets in plan["remote"].items():
            jobs.setdefault(addresses, ([], []))[1].extend(packets)
        results: list[tuple[list[Packet], Outcome | None, str]] = []
        started = time.monotonic()
        running: list[tuple[float, str, tuple[str, ...], Future[Sent]]] = []
        for addresses, (conversations, packets) in jobs.items():
            address = addresses[0]
            lane = lanes.lane(self.b, address)
            busy = lane.busy()
            if busy is not None:
                self._left_waiting(plan, address, conversations, packets, busy)
                continue
            peer: Any = None
            try:
                peer = resolve(self.b, address)
                suspect, limits = deadlines.hung(peer), deadlines.limits_of(peer)
            except Unreachable:
                suspect, limits = None, deadlines.Limits()  # the push says why
            if suspect is not None:
                # It did not answer a moment ago: tried again once that moment has passed.
                self._left_waiting(plan, address, conversations, packets, suspect)
                continue
            # One that did not answer last time is not waited for: tried in the background.
            suspect_peer = peer is not None and deadlines.suspected(peer)
            patience = 0.0 if suspect_peer else limits.patience_seconds()
            why = (
                f"no answer from {address} for {patience:g} s yet (the delivery goes on in the "
                "background); tried again when it answers"
                if patience
                else f"{address} did not answer last time: tried again in the background"
            )
            future = lane.submit(self._send_to, addresses, conversations, packets, plan)
            running.append((started + patience, why, addresses, future))
        for until, why, addresses, future in sorted(running, key=lambda r: r[0]):
            try:
                sent = future.result(timeout=max(until - time.monotonic(), 0.0))
            except FutureTimeout:
                conversations, packets = jobs[addresses]
                self._left_waiting(plan, addresses[0], conversations, packets, why)
                lanes.lane(self.b, addresses[0]).overdue(future, started)
                future.add_done_callback(functools.partial(self._late, plan, addresses[0]))
                continue
            plan["taken"] += sent.taken
            plan["seal_now"] += sent.seal_now
            results += sent.results
        return results

    def _left_waiting(
        self,
        plan: dict[str, Any],
        address: str,
        conversations: list[Conversation],
        packets: list[Packet],
        why: str,
    ) -> None:
        """Messages for ``address`` that wait (it has not answered): recorded so, with ``why``."""
        rows = plan["packet_rows"]
        plan["waiting"] += [(r, why) for c in conversations for r in c.rows]
        plan["waiting"] += [(rows[(p.conversation_id, p.seq)], why) for p in packets]
        self.hung[address] = why

    def _send_to(
        self,
        addresses: tuple[str, ...],
        conversations: list[Conversation],
        packets: list[Packet],
        plan: dict[str, Any],
    ) -> Sent:
        """One destination's share of a batch (in its lane): conversations without packets
        where the far broker takes them so, the rest as packets."""
        # Its own lists of what the far broker took and what was sealed: another lane, or the
        # batch's recording if this destination answers late, must not share them.
        own = {**plan, "taken": [], "seal_now": []}
        sent = Sent(own["taken"], own["seal_now"], [])
        packets = list(packets)
        if conversations:
            for c in self._send_direct(addresses[0], conversations, own):
                packets += message_packets(
                    c.rows,
                    plan["me"],
                    c.target,
                    plan["sealings"].get(c.handle),
                    sent.seal_now,
                    plan["packet_rows"],
                )
        for start in range(0, len(packets), self.BATCH):
            batch = packets[start : start + self.BATCH]
            outcome, failures = self.push_any(addresses, batch)
            if outcome is not None:
                # Dropped by the first broker that answered: try the alternatives for those.
                dropped = [j for j, (kind, _) in outcome.notes.items() if kind == DROPPED]
                if dropped and len(addresses) > 1:
                    retry = [batch[j] for j in dropped]
                    alt, _ = self.push_any(addresses[1:], retry)
                    if alt is not None:
                        outcome.answers.extend(alt.answers)
                        for j in dropped:
                            outcome.notes.pop(j, None)
                        for k, note in alt.notes.items():
                            outcome.notes[dropped[k]] = note
            sent.results.append((batch, outcome, "; ".join(failures)))
        return sent

    def _late(self, plan: dict[str, Any], address: str, future: Future[Sent]) -> None:
        """What a destination brought back after its batch was recorded without it (it did not
        answer within its patience), recorded in a transaction of its own."""
        try:
            sent = future.result()
            counts: dict[str, int] = defaultdict(int)
            with self.b.engine.begin() as conn:
                bulk.update_rows(conn, s.transmission_queue, "id", sent.seal_now)
                direct.record(conn, plan["rows"], sent.taken, counts)
                answers, late, waiting, _inboxed = outcomes(sent.results, plan, counts)
                self._apply_answers(conn, plan["me"], answers, counts)
                self._late_notes(conn, late)
                bulk.update_rows(
                    conn,
                    s.transmission_queue,
                    "id",
                    [{"id": r.id, "transmission_status": why} for r, why, _ in waiting],
                )
                if counts["acknowledged"] or sent.taken:
                    causes.answered(self.b, conn, address)  # what waits for it goes now
        except Exception:
            log.warning("recording what %s answered late failed", address, exc_info=True)
            return
        log.info(
            "%s answered late: %d acknowledged, %d failed, %d still waiting",
            address,
            counts["acknowledged"],
            counts["failed"],
            len(waiting),
        )
        self.b.note_due(utcnow())

    def _send_direct(
        self,
        address: str,
        conversations: list[Conversation],
        plan: dict[str, Any],
    ) -> list[Conversation]:
        """Conversations into the PostgreSQL broker at ``address`` without packets
        (:mod:`.direct`); returns those left to packets (all of them if it cannot be reached
        that way: the packets' push says why, or tries the route's other addresses)."""
        try:
            peer = resolve(self.b, address)
            if peer.dialect != "postgresql" or inbox.inbox_mode(peer):
                return conversations
        except (DBAPIError, Unreachable) as exc:
            log.info("%s: delivering as packets: %s", address, _first_line(exc))
            return conversations
        taken: list[direct.Taken] = []  # what the far broker committed, even if a part failed
        try:
            with deadlines.answer_within(peer, address):
                direct.accept(peer, plan["me"], conversations, taken)
        except (DBAPIError, Unreachable) as exc:
            log.info("%s: delivering as packets: %s", address, _first_line(exc))
        plan["taken"] += taken
        for t in taken:
            self.after_push(address, t.inserted)
        done = {h for t in taken for h in t.upto}
        return [c for c in conversations if c.handle not in done]

    def _record(
        self,
        conn: Connection,
        plan: dict[str, Any],
        results: list[tuple[list[Packet], Outcome | None, str]],
        me: str,
        now: datetime,
        counts: dict[str, int],
    ) -> list[tuple[uuid.UUID, int, int]]:
        """What the far brokers answered, written in the batch's transaction; returns the
        ranges of rows taken without packets, for the caller to delete with its COMMIT."""
        t = s.transmission_queue
        # Bodies sealed by this pass stay sealed in the transmission queue.
        bulk.update_rows(conn, t, "id", plan["seal_now"])
        self._stop(conn, plan["stopped"], now, counts)
        work = DueWork(self.b, conn)
        for handle in plan["local"]:
            went = work.flush_conversation(handle, now)
            counts["delivered"] += went
            counts["delayed"] += len(plan["rows"][handle]) - went
        # What waits, with why and the cause it shares with others (None: its own backoff).
        waiting: list[tuple[Any, str, causes.Key | None]] = []
        for handle, reason in plan["delayed"].items():
            key = plan["causes"].get(handle)
            waiting += [(r, reason, key) for r in plan["rows"][handle]]
        acknowledged: list[tuple[uuid.UUID, int, int]] = []
        direct.record(conn, plan["rows"], plan["taken"], counts, deferred=acknowledged)
        answers, late, went_waiting, inboxed = outcomes(results, plan, counts)
        waiting += [(r, why, causes.of_push(plan, r, kind, why)) for r, why, kind in went_waiting]
        waiting += [(r, why, causes.of_address(plan, r)) for r, why in plan["waiting"]]
        self._apply_answers(conn, me, answers, counts)
        self._late_notes(conn, late)
        causes.record(conn, self.b, plan, waiting, inboxed, now, self.started)
        counts["delayed"] += len(waiting)
        if waiting:
            self.b.note_due(now + RETRY_BASE)
        return acknowledged

    def _stop(
        self,
        conn: Connection,
        stopped: dict[uuid.UUID, tuple[int, str]],
        now: datetime,
        counts: dict[str, int],
    ) -> None:
        """Dialogs dialog security stops (a certificate expired): an Error to this side."""
        e = s.conversation_endpoint
        for handle, (code, reason) in stopped.items():
            ep = conn.execute(select(e).where(e.c.conversation_handle == handle)).first()
            if ep is not None:
                counts["failed"] += 1
                fail_endpoint(conn, dict(ep._mapping), code, reason, now)

    def _relay(self, answers: list[Packet], counts: dict[str, int]) -> None:
        """Answers for other brokers (this one forwards): pass them on like any packet."""
        outcome = Inbound(self.b, self.push_any).accept(answers)
        counts["forwarded"] += outcome.forwarded
        counts["discarded"] += outcome.discarded

    def _transit_pass(self, retry_now: bool, counts: dict[str, int]) -> None:
        """A forwarder's held packets: try their next hop again."""
        b = self.b
        now = utcnow()
        if b.dialect == "postgresql":
            tr = s.transit
            with b.engine.begin() as conn:
                stmt = (
                    select(tr).order_by(tr.c.id).limit(self.BATCH).with_for_update(skip_locked=True)
                )
                if not retry_now:
                    stmt = stmt.where(tr.c.next_attempt_at <= now)
                rows = [dict(r._mapping) for r in conn.execute(stmt)]
                if not rows:
                    return
                ids = [r["id"] for r in rows]
                conn.execute(delete(tr).where(bulk.any_of(tr.c.id, ids, b.dialect)))
        else:
            with _memory_lock:
                store = _memory_transit.get(_key(b), [])
                rows = [
                    r
                    for r in store
                    if retry_now or aware(r["next_attempt_at"]) <= now  # type: ignore[operator]
                ]
                if not rows:
                    return
                taken = {id(r) for r in rows}
                store[:] = [r for r in store if id(r) not in taken]
        packets = [_packet_of_transit(r) for r in rows]
        outcome = Inbound(b, Transport(b).push_any).accept(packets)
        counts["forwarded"] += outcome.forwarded
        counts["discarded"] += outcome.discarded
        if outcome.answers:
            # Answers for the senders of what was just forwarded: relay them on the way back.
            self._relay(outcome.answers, counts)
