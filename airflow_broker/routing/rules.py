"""Service Broker's routing rules as pure functions (seed 001, with seed 003's load balancing).

Nothing here touches a database: the delivery path and the Spark routing job both call these
functions (the Spark job through the same hash, see :func:`dialog_bucket`), so a message is
routed the same way whichever of them moves it.

Routing a conversation has two steps:

1. :func:`match_routes` finds the candidate routes, stopping at the first of seven steps that
   matches anything (expired routes never match).
2. :func:`choose_routes` picks among them by address kind: mirrored routes first, then LOCAL (if
   the service is hosted here), then explicit broker addresses, then TRANSPORT.

No route is not an error: the decision is ``delayed`` and the conversation is tried again later.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

LOCAL = "LOCAL"
TRANSPORT = "TRANSPORT"
BROKER_SCHEME = "broker://"

#: Seed 002: a message forwarded more often than this is discarded (its sender gets an Error).
MAX_HOPS = 16


@dataclass(frozen=True, slots=True)
class Route:
    """A row of the routing table, as the rules see it."""

    name: str
    service_name: str | None = None
    broker_instance: str | None = None
    address: str = LOCAL
    mirror_address: str | None = None
    expires_at: datetime | None = None

    def identity(self) -> tuple[str | None, str | None, str]:
        """Routes with the same broker id, service name and address count as one."""
        return (self.broker_instance, self.service_name, self.address)


@dataclass(frozen=True, slots=True)
class Match:
    """The routes found for a conversation, and the matching step that found them (1-7)."""

    step: int
    routes: tuple[Route, ...] = ()
    #: the broker instance the conversation is bound to (asked for, or picked at step 3)
    broker_instance: str | None = None
    #: step 4: ask the dynamic routing service and wait
    dynamic: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    """Where the messages of a conversation go now."""

    kind: Literal["local", "remote", "delayed"]
    #: the addresses to try, in order of preference (alternatives for availability: any one
    #: that works will do; a mirrored route lists principal then mirror)
    addresses: tuple[str, ...] = ()
    broker_instance: str | None = None
    step: int = 7
    reason: str = ""
    routes: tuple[Route, ...] = field(default=())


def dialog_bucket(dialog_id: uuid.UUID | str, buckets: int) -> int:
    """A stable bucket in ``range(buckets)`` for a dialog id: the first 15 hex digits of the
    SHA-256 of its canonical text, modulo ``buckets``. Spark computes the same with
    ``pmod(conv(substr(sha2(id, 256), 1, 15), 16, 10), buckets)``."""
    text = str(uuid.UUID(str(dialog_id)))
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16) % buckets


def pick_broker_instance(dialog_id: uuid.UUID | str, broker_instances: Iterable[str]) -> str:
    """Seed 003's deterministic load balancing: the dialog id's hash picks one of the distinct
    broker ids, so every message of a dialog goes to the same instance. How many routes name
    an id does not weight the choice."""
    distinct = sorted(set(broker_instances))
    if not distinct:
        raise ValueError("no broker instance to pick from")
    return distinct[dialog_bucket(dialog_id, len(distinct))]


def live_routes(routes: Iterable[Route], now: datetime) -> list[Route]:
    """Expired routes are ignored."""
    return [r for r in routes if r.expires_at is None or r.expires_at > now]


def match_candidates(
    routes: Iterable[Route],
    service_name: str,
    broker_instance: str | None,
    *,
    now: datetime,
    local_services: Sequence[str] = (),
    dynamic_routing: bool = False,
) -> list[Match]:
    """Seed 001's seven matching steps, stopping at the first that matches, for every dialog to
    ``service_name`` at once: one :class:`Match`, except at step 3 (several broker ids) where
    there is one per distinct broker id, in the order :func:`pick_broker_instance` numbers them.
    A dialog takes the candidate at :func:`dialog_bucket` of its id; the Spark job joins the
    same list and picks with the same hash, so the rules live here only."""
    live = live_routes(routes, now)
    named = [r for r in live if r.service_name == service_name]
    # 1. exact service name and broker instance
    if broker_instance is not None:
        found = [r for r in named if r.broker_instance == broker_instance]
        if found:
            return [Match(1, tuple(found), broker_instance)]
    # 2. the service name among routes without a broker instance
    found = [r for r in named if r.broker_instance is None]
    if found:
        return [Match(2, tuple(found), broker_instance)]
    # 3. no broker instance asked: the name among routes with one; the dialog's hash picks one id
    if broker_instance is None:
        with_id = [r for r in named if r.broker_instance is not None]
        if with_id:
            distinct = sorted({r.broker_instance for r in with_id if r.broker_instance})
            return [
                Match(3, tuple(r for r in with_id if r.broker_instance == chosen), chosen)
                for chosen in distinct
            ]
    # 4. a dynamic routing service answers later
    if dynamic_routing:
        return [Match(4, (), broker_instance, dynamic=True)]
    # 5. the wildcard route (neither service name nor broker instance)
    found = [r for r in live if r.service_name is None and r.broker_instance is None]
    if found:
        return [Match(5, tuple(found), broker_instance)]
    # 6. a broker instance was asked and a service of that name is hosted here
    if broker_instance is not None and service_name in local_services:
        implied = Route(name="(local service)", service_name=service_name, address=LOCAL)
        return [Match(6, (implied,), broker_instance)]
    # 7. nothing: delayed
    return [Match(7, (), broker_instance)]


def match_routes(
    routes: Iterable[Route],
    service_name: str,
    broker_instance: str | None,
    *,
    dialog_id: uuid.UUID | str,
    now: datetime,
    local_services: Sequence[str] = (),
    dynamic_routing: bool = False,
) -> Match:
    """Seed 001's seven matching steps for one dialog (see :func:`match_candidates`)."""
    candidates = match_candidates(
        routes,
        service_name,
        broker_instance,
        now=now,
        local_services=local_services,
        dynamic_routing=dynamic_routing,
    )
    return candidates[dialog_bucket(dialog_id, len(candidates))]


def transport_address(service_name: str) -> str | None:
    """A TRANSPORT route takes the address from the service name: ``broker://NAME/...`` names
    the broker ``broker://NAME``. Other service names give no address."""
    if not service_name.startswith(BROKER_SCHEME):
        return None
    host = service_name[len(BROKER_SCHEME) :].split("/", 1)[0]
    return f"{BROKER_SCHEME}{host}" if host else None


def choose_routes(match: Match, service_name: str, *, service_is_local: bool) -> Decision:
    """Seed 001's choice among matching routes: mirror, LOCAL, explicit address, TRANSPORT."""
    if match.dynamic:
        return Decision(
            "delayed",
            step=4,
            broker_instance=match.broker_instance,
            reason="waiting for the dynamic routing service",
        )
    unique: dict[tuple[str | None, str | None, str], Route] = {}
    for route in match.routes:
        unique.setdefault(route.identity(), route)
    routes = list(unique.values())
    mirrored = [r for r in routes if r.mirror_address]
    if mirrored:
        addresses: list[str] = []
        for r in mirrored:
            addresses += [r.address, r.mirror_address or r.address]
        return _remote(match, mirrored, addresses, "mirrored route")
    if service_is_local and any(r.address == LOCAL for r in routes):
        return Decision(
            "local",
            (LOCAL,),
            match.broker_instance,
            match.step,
            f"service {service_name!r} is hosted by this broker",
            tuple(r for r in routes if r.address == LOCAL),
        )
    explicit = [r for r in routes if r.address.startswith(BROKER_SCHEME)]
    if explicit:
        return _remote(match, explicit, [r.address for r in explicit], "route address")
    transport = [r for r in routes if r.address == TRANSPORT]
    if transport:
        address = transport_address(service_name)
        if address is not None:
            return _remote(match, transport, [address], "TRANSPORT (address from service name)")
    reason = (
        f"no route to service {service_name!r}"
        if match.step == 7
        else f"routes matched at step {match.step} but none can deliver to {service_name!r}"
    )
    return Decision("delayed", (), match.broker_instance, match.step, reason, tuple(routes))


def _remote(match: Match, routes: list[Route], addresses: list[str], why: str) -> Decision:
    ordered = tuple(dict.fromkeys(addresses))
    return Decision(
        "remote",
        ordered,
        match.broker_instance,
        match.step,
        f"{why} at matching step {match.step}",
        tuple(routes),
    )


def route_conversation(
    routes: Iterable[Route],
    service_name: str,
    broker_instance: str | None,
    *,
    dialog_id: uuid.UUID | str,
    now: datetime,
    local_services: Sequence[str] = (),
    dynamic_routing: bool = False,
) -> Decision:
    """Match, then choose: the whole routing decision for one conversation."""
    match = match_routes(
        routes,
        service_name,
        broker_instance,
        dialog_id=dialog_id,
        now=now,
        local_services=local_services,
        dynamic_routing=dynamic_routing,
    )
    return choose_routes(match, service_name, service_is_local=service_name in local_services)


def delivery_choices(
    routes: Iterable[Route],
    service_name: str,
    bound_instance: str | None,
    *,
    me: str,
    now: datetime,
    hosted: Sequence[str] = (),
    dynamic_routing: bool = False,
) -> list[Decision]:
    """Where the delivery pass sends a waiting conversation to ``service_name`` whose far
    broker instance is ``bound_instance`` (None until the first acknowledgment binds it), for
    every dialog at once: one decision per :func:`match_candidates` candidate. A conversation
    bound to this broker (``me``) is local whatever the routes say. The Python delivery path
    takes ``choices[dialog_bucket(dialog_id, len(choices))]``; the Spark job the same."""
    local_services = list(hosted) if bound_instance in (None, me) else []
    matches = match_candidates(
        list(routes),
        service_name,
        bound_instance,
        now=now,
        local_services=local_services,
        dynamic_routing=dynamic_routing,
    )
    decisions = []
    for match in matches:
        decision = choose_routes(
            match, service_name, service_is_local=service_name in local_services
        )
        if bound_instance == me and decision.kind != "local":
            decision = Decision(
                "local",
                (LOCAL,),
                me,
                decision.step,
                f"the conversation is bound to this broker instance ({me})",
            )
        decisions.append(decision)
    return decisions


def delivery_decision(
    routes: Iterable[Route],
    service_name: str,
    bound_instance: str | None,
    *,
    dialog_id: uuid.UUID | str,
    me: str,
    now: datetime,
    hosted: Sequence[str] = (),
    dynamic_routing: bool = False,
) -> Decision:
    """:func:`delivery_choices` for one dialog."""
    choices = delivery_choices(
        routes,
        service_name,
        bound_instance,
        me=me,
        now=now,
        hosted=hosted,
        dynamic_routing=dynamic_routing,
    )
    return choices[dialog_bucket(dialog_id, len(choices))]


def hops_exceeded(hops: int) -> bool:
    """Seed 002: a forwarder discards a message it would pass on for more than
    :data:`MAX_HOPS` hops."""
    return hops + 1 > MAX_HOPS


def lifetime_over(lifetime: datetime | None, now: datetime) -> bool:
    """A message whose conversation's lifetime has passed is not delivered any more."""
    return lifetime is not None and lifetime <= now
