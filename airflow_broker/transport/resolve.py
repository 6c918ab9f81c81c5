"""Address resolution: from a route's logical address to a connected broker database.

The resolvers registered under the ``airflow_broker.address_resolvers`` entry-point group are
asked first (the Airflow provider registers one that reads Airflow connections), then the
environment (``AIRFLOW_BROKER_ADDRESS_<NAME>``), then the address itself as a URL.

Far brokers opened from URLs ("peers") are cached per process, one engine and connection pool
each, and bounded two ways:

- a peer not used (resolved, or a connection of it taken or given back) for
  :data:`PEER_IDLE_SECONDS` (300 s; environment ``AIRFLOW_BROKER_PEER_IDLE_SECONDS``) is closed:
  its pool's idle connections are closed (on PostgreSQL its server connections end) by a daemon
  thread that runs while some peer holds connections. The peer stays cached; its next use
  connects again.
- at most :data:`MAX_PEERS` (32; ``AIRFLOW_BROKER_MAX_PEERS``) are cached: opening one more
  forgets the least recently used and closes it.

Neither closes a connection in use: a peer with a connection checked out is not idle, and a
connection that is checked out while its peer is closed (evicted, or closed as idle a moment
before it was taken) goes on working and is closed when it is given back. Both values are
module attributes read at each decision, so a process (or a test) may change them at any time.
:func:`close_peers` closes them all at once.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from sqlalchemy import event, make_url

import airflow_broker.transport.deadlines as deadlines
from airflow_broker import routing
from airflow_broker.storage.context import BrokerContext
from airflow_broker.transport.deadlines import CONNECT_TIMEOUT as CONNECT_TIMEOUT
from airflow_broker.transport.deadlines import env_number as _env_number
from airflow_broker.transport.packets import Unreachable

log = logging.getLogger("airflow_broker")


#: A peer not used for this many seconds has its connections closed (the next use reconnects).
PEER_IDLE_SECONDS: float = _env_number("AIRFLOW_BROKER_PEER_IDLE_SECONDS", 300.0, float)
#: At most this many peers are cached; one more closes and forgets the least recently used.
MAX_PEERS: int = _env_number("AIRFLOW_BROKER_MAX_PEERS", 32, int)


@dataclass(eq=False)
class _Peer:
    """A cached far broker and what the idle closing needs to know of it."""

    url: str
    broker: BrokerContext
    #: time.monotonic() of its last use: resolved, a connection taken or given back
    last_used: float
    #: may hold connections: made one since it was last closed
    connected: bool = False
    #: bumped by each close; a connection made before it is closed when given back
    generation: int = 0

    def in_use(self) -> bool:
        checkedout = getattr(self.broker.engine.pool, "checkedout", None)
        return checkedout is not None and checkedout() > 0


_peers: OrderedDict[str, _Peer] = OrderedDict()
#: guards _peers, each peer's fields and the closer thread; waits of the closer thread
_peers_lock = threading.Condition()
_closer: threading.Thread | None = None


def env_name(name: str) -> str:
    """The environment variable that gives the URL of broker ``name`` outside Airflow."""
    return "AIRFLOW_BROKER_ADDRESS_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def address_name(address: str) -> str:
    if not address.startswith(routing.BROKER_SCHEME) or len(address) <= len(routing.BROKER_SCHEME):
        raise Unreachable(f"address {address!r} is not broker://NAME")
    return address[len(routing.BROKER_SCHEME) :]


#: Entry-point group of address resolvers that packages hand to the engine: each is a callable
#: ``NAME -> URL | None``, asked after the broker's own resolver and the environment. The Airflow
#: provider registers one that reads the Airflow connection of that id (when Airflow runs).
RESOLVER_ENTRY_POINTS = "airflow_broker.address_resolvers"


@functools.cache
def registered_resolvers() -> tuple[Callable[[str], str | None], ...]:
    """The address resolvers installed packages register under :data:`RESOLVER_ENTRY_POINTS`."""
    found = []
    for ep in sorted(entry_points(group=RESOLVER_ENTRY_POINTS), key=lambda e: e.name):
        try:
            found.append(ep.load())
        except Exception:  # a broken plugin must not stop delivery
            log.exception("address resolver %s (%s) does not load; ignored", ep.name, ep.value)
    return tuple(found)


def resolve(broker: BrokerContext, address: str) -> BrokerContext:
    """The broker at ``broker://NAME``: the resolver's entry for NAME (a URL or a broker), else
    the environment variable ``AIRFLOW_BROKER_ADDRESS_<NAME>``, else what a registered resolver
    answers (in Airflow: the Airflow connection whose id is NAME). Brokers opened from URLs are
    shared by the whole process, are of the asking broker's class, and inherit the resolver of
    the broker that first named them; their connections are closed when idle, and the least
    recently used beyond :data:`MAX_PEERS` forgotten (see the module docstring)."""
    name = address_name(address)
    resolver = broker.resolver
    target: Any = None
    if callable(resolver):
        target = resolver(name)
    elif resolver is not None:
        target = resolver.get(name)
    if target is None:
        target = os.environ.get(env_name(name))
    for registered in registered_resolvers():
        if target is not None:
            break
        try:
            target = registered(name)
        except ValueError as exc:
            raise Unreachable(f"cannot use {address}: {exc}") from exc
    if target is None:
        raise Unreachable(
            f"no connection for {address}: give the broker a resolver entry {name!r}, set "
            f"{env_name(name)}, or (in Airflow) create a connection with id {name!r}"
        )
    if isinstance(target, BrokerContext):
        return target
    url = str(target)
    evicted: list[_Peer] = []
    with _peers_lock:
        peer = _peers.get(url)
        if peer is None:
            # Bounded waits (deadlines): the peer's own answer timeout and patience come off the
            # URL; libpq gets the connect timeout, keepalives and tcp_user_timeout (the URL's
            # own values win: connect_args would override them).
            plain, limits = deadlines.split_limits(url)
            kwargs: dict[str, Any] = {"pool_pre_ping": True}
            if make_url(plain).get_backend_name() == "postgresql":
                kwargs["connect_args"] = deadlines.connect_args(plain, limits)
            peer = _Peer(url, type(broker).connect(plain, resolver=resolver, **kwargs), 0.0)
            deadlines.watch(peer.broker, limits)
            _watch(peer)
            _peers[url] = peer
            while len(_peers) > max(int(MAX_PEERS), 1):
                _url, oldest = _peers.popitem(last=False)
                evicted.append(_retire(oldest))
        _touch(peer)
    for old in evicted:
        _close(old, "more than MAX_PEERS peers")
    return peer.broker


# ---------------------------------------------------------------------------------------------
# Closing peers: idle ones, and the least recently used beyond MAX_PEERS
# ---------------------------------------------------------------------------------------------


def _touch(peer: _Peer) -> None:
    """``peer`` is used now (inside _peers_lock)."""
    peer.last_used = time.monotonic()
    if _peers.get(peer.url) is peer:
        _peers.move_to_end(peer.url)


def _watch(peer: _Peer) -> None:
    """Note the uses of ``peer``'s connections, and close those made before it was closed when
    they are given back (they were in use then: see the module docstring)."""
    engine = peer.broker.engine

    def made(_dbapi_conn: Any, record: Any) -> None:
        with _peers_lock:
            record.info["broker_peer_generation"] = peer.generation
            peer.connected = True
            _touch(peer)
            _start_closer()

    def taken(_dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        with _peers_lock:
            _touch(peer)

    def given_back(dbapi_conn: Any, record: Any) -> None:
        with _peers_lock:
            _touch(peer)
            stale = record.info.get("broker_peer_generation", peer.generation) != peer.generation
        if stale and dbapi_conn is not None:
            record.invalidate()  # its pool was closed while it was out: close it now

    event.listen(engine, "connect", made)
    event.listen(engine, "checkout", taken)
    event.listen(engine, "checkin", given_back)


def _retire(peer: _Peer) -> _Peer:
    """Mark ``peer`` closed (inside _peers_lock); :func:`_close` closes it, outside the lock."""
    peer.generation += 1
    peer.connected = False
    return peer


def _close(peer: _Peer, why: str, level: int = logging.INFO) -> None:
    """Close ``peer``'s pool (after :func:`_retire`): its idle connections now, those out when
    they are given back (a connection taken while the pool was being closed too)."""
    log.log(level, "closing the connections of peer broker %r (%s)", peer.broker, why)
    try:
        peer.broker.dispose()
    except Exception:  # closing must not fail a delivery, nor stop the closer thread
        log.warning("closing peer broker %r failed", peer.broker, exc_info=True)
    with _peers_lock:
        peer.generation += 1


def _start_closer() -> None:
    """Have the closer thread run (inside _peers_lock): started on demand, and again in a
    forked child, which has none."""
    global _closer
    if _closer is None or not _closer.is_alive():
        _closer = threading.Thread(target=_close_idle, name="airflow-broker-peers", daemon=True)
        _closer.start()
    else:
        _peers_lock.notify_all()


def _close_idle() -> None:
    """The closer thread: closes peers idle for PEER_IDLE_SECONDS; ends when none holds
    connections (the next connection starts it again)."""
    global _closer
    while True:
        idle: list[_Peer] = []
        with _peers_lock:
            if _closer is not threading.current_thread():
                return
            now = time.monotonic()
            wait = float(PEER_IDLE_SECONDS)
            next_look: float | None = None
            for peer in _peers.values():
                if not peer.connected:
                    continue
                due = peer.last_used + wait
                if due <= now:
                    if not peer.in_use():
                        idle.append(_retire(peer))
                        continue
                    due = now + wait  # idle at the earliest that long after it is given back
                next_look = due if next_look is None else min(next_look, due)
            if not idle:
                if next_look is None:
                    _closer = None
                    return
                _peers_lock.wait(next_look - now)
                continue
        for peer in idle:
            _close(peer, f"not used for {PEER_IDLE_SECONDS:g} s")


def close_peers() -> int:
    """Close the connections of every peer broker this process opened by URL and forget them
    (the next delivery opens them again); returns how many there were. For a long-lived process
    that talked to many short-lived databases (a test run), or before it forks."""
    with _peers_lock:
        peers = [_retire(peer) for peer in _peers.values()]
        _peers.clear()
        _peers_lock.notify_all()  # the closer thread ends: nothing left to close
    for peer in peers:
        _close(peer, "close_peers()", logging.DEBUG)
    return len(peers)
