"""A reference model of the broker's dialog semantics, in plain Python (issue 18).

It knows nothing of the engine: endpoints and their states, sequence numbers, conversation groups,
queues with status and poison counting, timers and lifetimes on a clock the caller moves. Written
from Service Broker's semantics as the seeds and DESIGN.md state them:

- BEGIN DIALOG makes an initiator endpoint (SO) in a new group; its first SEND makes it CO and
  creates the target endpoint (CO, a new group on the target's queue). Each side numbers what it
  sends from 0.
- RECEIVE takes the ready messages of one conversation group: by queue, the group of the oldest
  ready message; returned by (precedence, conversation, sequence): DialogTimer, then Error, then
  the rest in order. TOP (n) takes the first n of them in that order, except that by queue the
  conversation of the oldest ready message goes before the group's other conversations.
- END: messages still queued for the ending side go with it. Plain END sends EndDialog (the far
  side goes DI) and waits (DO), unless the far side already ended or never heard of the dialog
  (then CD, and a far DO becomes CD too). WITH ERROR closes at once (CD) and sends Error (the far
  side goes ER). WITH CLEANUP removes the endpoint, telling nobody. A side that has ended takes
  no more messages: an EndDialog or Error closes a DO side (CD), anything else is discarded.
- A SEND to a far endpoint removed WITH CLEANUP fails the dialog: an Error to the sender (ER).
- A message for a disabled queue waits (in order, with whatever follows it on that dialog) until
  the queue is enabled and due work runs.
- Five receiving transactions in a row that roll back disable the queue; one that commits what it
  received resets the count; enabling resets it too.
- A lifetime that passes puts each open side in ER with an Error (lifetime expired).
- BEGIN CONVERSATION TIMER is refused on a side that has ended (DO, ER, CD); a timer fires a
  DialogTimer unless the side is closed by then.
- Closed (CD) endpoints are purged once the retention has passed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

END_DIALOG = "http://schemas.microsoft.com/SQL/ServiceBroker/EndDialog"
ERROR = "http://schemas.microsoft.com/SQL/ServiceBroker/Error"
DIALOG_TIMER = "http://schemas.microsoft.com/SQL/ServiceBroker/DialogTimer"
POISON_THRESHOLD = 5
SENDABLE = ("SO", "SI", "CO")
#: broker-raised error codes (Service Broker's numbers)
LIFETIME_EXPIRED = -8489
SERVICE_NOT_FOUND = -8470
#: how long a closed endpoint stays before due work purges it
CLOSED_RETENTION = 30 * 60


class Refused(Exception):
    """What the engine must refuse too: ``kind`` names the engine's error class."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


@dataclass
class Msg:
    handle: Any
    seq: int | None  # None: numbered by the broker, not by the far side (not compared)
    type: str
    body: Any
    order: int  # queuing order

    @property
    def precedence(self) -> int:
        return {DIALOG_TIMER: 0, ERROR: 1}.get(self.type, 2)


@dataclass
class Endpoint:
    handle: Any
    initiator: bool
    queue: str
    group: Any
    state: str
    far: Any = None  # the far endpoint's handle, once it exists
    send_seq: int = 0
    lifetime: bool = False
    pending: list[tuple[str, Any, int]] = field(default_factory=list)  # waiting to be delivered
    waiting_since: int = 0  # when its oldest waiting message began to wait (model order)
    closed_at: float | None = None  # on the model's clock, when it became CD


def placeholder(initiator: Any) -> tuple[str, Any]:
    """The model's name for a target endpoint the engine has just created (the test learns its
    real handle and group from the engine)."""
    return ("?", initiator)


@dataclass
class Queue:
    name: str
    enabled: bool = True
    rollbacks: int = 0
    messages: list[Msg] = field(default_factory=list)


class Model:
    def __init__(self, buyer_queue: str, supplier_queue: str) -> None:
        self.queues = {buyer_queue: Queue(buyer_queue), supplier_queue: Queue(supplier_queue)}
        self.buyer, self.supplier = buyer_queue, supplier_queue
        self.endpoints: dict[Any, Endpoint] = {}
        self._order = itertools.count()
        self.now = 0.0  # seconds, moved with the broker's clock

    # -- helpers -------------------------------------------------------------------------------
    def endpoint(self, handle: Any) -> Endpoint:
        if handle not in self.endpoints:
            raise Refused("UnknownObject")
        return self.endpoints[handle]

    def far_of(self, ep: Endpoint) -> Endpoint | None:
        return self.endpoints.get(ep.far) if ep.far is not None else None

    def rename(self, old: Any, handle: Any, group: Any) -> None:
        """The engine's handle and group for a placeholder target endpoint."""
        ep = self.endpoints.pop(old)
        ep.handle, ep.group = handle, group
        self.endpoints[handle] = ep
        for other in self.endpoints.values():
            if other.far == old:
                other.far = handle
        for q in self.queues.values():
            for m in q.messages:
                if m.handle == old:
                    m.handle = handle

    def _close(self, ep: Endpoint) -> None:
        ep.state, ep.closed_at = "CD", self.now

    def _enqueue(self, ep: Endpoint, seq: int | None, mtype: str, body: Any) -> None:
        self.queues[ep.queue].messages.append(Msg(ep.handle, seq, mtype, body, next(self._order)))

    # -- BEGIN DIALOG, SEND --------------------------------------------------------------------
    def begin(self, handle: Any, group: Any, *, lifetime: bool = False) -> None:
        self.endpoints[handle] = Endpoint(handle, True, self.buyer, group, "SO", lifetime=lifetime)

    def send(self, handle: Any, mtype: str, body: Any) -> None:
        ep = self.endpoint(handle)
        if ep.state not in SENDABLE:
            raise Refused("ConversationEnded")
        allowed = {"//po/Order": True, "//po/Invoice": False, "//po/Note": None}[mtype]
        if allowed is not None and allowed != ep.initiator:
            raise Refused("ContractViolation")
        if ep.state == "SO":
            ep.state = "CO"
        self._system(ep, mtype, body)

    def _wait(self, sender: Endpoint, mtype: str, body: Any, seq: int) -> None:
        if not sender.pending:
            sender.waiting_since = next(self._order)
        sender.pending.append((mtype, body, seq))

    def _deliver(self, sender: Endpoint, mtype: str, body: Any, seq: int) -> None:
        if sender.pending:
            sender.pending.append((mtype, body, seq))
            return
        if sender.far is None:  # the dialog's first message: the target endpoint is created
            if not self.queues[self.supplier].enabled:
                self._wait(sender, mtype, body, seq)
                return
            t = placeholder(sender.handle)
            self.endpoints[t] = Endpoint(
                t, False, self.supplier, None, "CO", far=sender.handle, lifetime=sender.lifetime
            )
            sender.far = t
        far = self.far_of(sender)
        if far is None:  # removed WITH CLEANUP: the dialog fails for the sender
            self._enqueue(sender, None, ERROR, SERVICE_NOT_FOUND)
            sender.state = "ER"
            return
        if not self.queues[far.queue].enabled:
            self._wait(sender, mtype, body, seq)
            return
        if far.state in ("DO", "CD"):
            if far.state == "DO" and mtype in (END_DIALOG, ERROR):
                self._close(far)
            return
        if mtype == END_DIALOG and far.state in SENDABLE:
            far.state = "DI"
        elif mtype == ERROR:
            far.state = "ER"
        self._enqueue(far, seq, mtype, body)

    def flush(self) -> None:
        """Due work: what waited for a disabled queue goes now if the queue is enabled, the
        conversation that has waited longest first."""
        waiting = [ep for ep in self.endpoints.values() if ep.pending]
        for ep in sorted(waiting, key=lambda ep: ep.waiting_since):
            rest, ep.pending, since = ep.pending, [], ep.waiting_since
            for i, (mtype, body, seq) in enumerate(rest):
                if ep.handle not in self.endpoints or (
                    ep.state in ("ER", "CD") and mtype not in (END_DIALOG, ERROR)
                ):
                    break
                self._deliver(ep, mtype, body, seq)
                if ep.far is not None and self.far_of(ep) is None:
                    break  # the far side is gone: the dialog failed, what was to follow goes
                if ep.pending:  # still cannot go: it and the rest wait, in order, as long
                    ep.pending += rest[i + 1 :]
                    ep.waiting_since = since
                    break

    # -- RECEIVE ------------------------------------------------------------------------------
    def receive(
        self, queue: str, *, handle: Any = None, group: Any = None, top: int | None = None
    ) -> list[Msg]:
        q = self.queues[queue]
        ready = q.messages
        if handle is not None:
            ep = self.endpoints.get(handle)
            if ep is None or ep.queue != queue:
                ready = []
            else:
                ready = [m for m in ready if m.handle == handle]
        elif group is not None:
            ready = [m for m in ready if self.endpoints[m.handle].group == group]
        if not ready:
            if not q.enabled:
                raise Refused("QueueDisabled")
            return []
        if not q.enabled:
            raise Refused("QueueDisabled")
        g = self.endpoints[ready[0].handle].group
        taken = [m for m in ready if self.endpoints[m.handle].group == g]
        if top is not None:
            # TOP (n): system messages of the group first, then the conversation of the oldest
            # ready message (the one that chose the group, by queue only), then the others by
            # handle; each conversation in sequence order.
            first = ready[0].handle if handle is None and group is None else None
            taken = sorted(
                taken,
                key=lambda m: (
                    m.precedence,
                    not (m.handle == first and m.precedence == 2),
                    str(m.handle),
                    m.seq or 0,
                ),
            )[:top]
        q.messages = [m for m in q.messages if m not in taken]
        return sorted(taken, key=lambda m: (m.precedence, str(m.handle), m.seq or 0))

    def received(self, queue: str, taken: list[Msg], *, committed: bool) -> None:
        """The receiving transaction ended: committed, or rolled back (the messages return)."""
        q = self.queues[queue]
        if committed:
            q.rollbacks = 0
            return
        q.messages = sorted(q.messages + taken, key=lambda m: m.order)
        q.rollbacks += 1
        if q.rollbacks >= POISON_THRESHOLD:
            q.enabled = False

    # -- END, MOVE, timers, lifetimes, queues --------------------------------------------------
    def end(
        self, handle: Any, *, error: tuple[int, str] | None = None, cleanup: bool = False
    ) -> None:
        ep = self.endpoint(handle)
        q = self.queues[ep.queue]
        if cleanup:
            q.messages = [m for m in q.messages if m.handle != handle]
            del self.endpoints[handle]
            return
        if ep.state in ("CD", "DO"):
            raise Refused("ConversationEnded")
        q.messages = [m for m in q.messages if m.handle != handle]
        far = self.far_of(ep)
        # the far side knows of the dialog, or will: something is on its way
        told = not ep.initiator or ep.far is not None or bool(ep.pending) or ep.send_seq > 0
        if error is not None:
            was = ep.state
            ep.pending = []
            told = not ep.initiator or ep.far is not None or ep.send_seq > 0
            self._close(ep)
            if was not in ("DI", "ER") and told:
                self._system(ep, ERROR, error[0])
            return
        if ep.state in ("DI", "ER") or not told:
            self._close(ep)
            if far is not None and far.state == "DO":
                self._close(far)
            return
        ep.state = "DO"
        self._system(ep, END_DIALOG, None)

    def _system(self, ep: Endpoint, mtype: str, body: Any) -> None:
        seq = ep.send_seq
        ep.send_seq += 1
        self._deliver(ep, mtype, body, seq)

    def move(self, handle: Any, group: Any) -> None:
        self.endpoint(handle).group = group

    def set_timer(self, handle: Any) -> None:
        if self.endpoint(handle).state in ("CD", "ER", "DO"):
            raise Refused("ConversationEnded")

    def timer_fires(self, handle: Any) -> None:
        ep = self.endpoints.get(handle)
        if ep is not None and ep.state != "CD":
            self._enqueue(ep, None, DIALOG_TIMER, None)

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def purge_closed(self) -> None:
        """Due work purges closed endpoints once they have been closed for the retention."""
        for h in [
            h
            for h, ep in self.endpoints.items()
            if ep.state == "CD"
            and ep.closed_at is not None
            and ep.closed_at <= self.now - CLOSED_RETENTION
        ]:
            del self.endpoints[h]

    def lifetimes_pass(self) -> None:
        # The engine queues the Errors of conversations that expire together in handle order.
        for ep in sorted(self.endpoints.values(), key=lambda ep: str(ep.handle)):
            if ep.lifetime and ep.state not in ("CD", "ER"):
                ep.state, ep.lifetime, ep.pending = "ER", False, []
                self._enqueue(ep, None, ERROR, LIFETIME_EXPIRED)
            ep.lifetime = False

    def set_queue(self, queue: str, enabled: bool) -> None:
        q = self.queues[queue]
        q.enabled = enabled
        if enabled:
            q.rollbacks = 0
