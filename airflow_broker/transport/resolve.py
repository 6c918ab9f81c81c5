"""Address resolution: from a route's logical address to a connected broker database.

The resolvers registered under the ``airflow_broker.address_resolvers`` entry-point group are
asked first (the Airflow provider registers one that reads Airflow connections), then the
environment (``AIRFLOW_BROKER_ADDRESS_<NAME>``), then the address itself as a URL. Far brokers
are cached per process.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from sqlalchemy import make_url

from airflow_broker import routing
from airflow_broker.storage.context import BrokerContext
from airflow_broker.transport.packets import Unreachable

log = logging.getLogger("airflow_broker")


#: Seconds to wait for a far database's server to answer a connection attempt.
CONNECT_TIMEOUT = 5


_peers: dict[str, BrokerContext] = {}


_peers_lock = threading.Lock()


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
    the broker that first named them."""
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
    with _peers_lock:
        peer = _peers.get(url)
        if peer is None:
            kwargs: dict[str, Any] = {"pool_pre_ping": True}
            if not url.startswith("sqlite") and "connect_timeout" not in make_url(url).query:
                # connect_args would override the URL's own ?connect_timeout=: that one wins.
                kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT}
            peer = type(broker).connect(url, resolver=resolver, **kwargs)
            _peers[url] = peer
    return peer


def close_peers() -> int:
    """Close the connections of every peer broker this process opened by URL and forget them
    (the next delivery opens them again); returns how many there were. For a long-lived process
    that talked to many short-lived databases (a test run), or before it forks."""
    with _peers_lock:
        peers = list(_peers.values())
        _peers.clear()
    for peer in peers:
        peer.dispose()
    return len(peers)
