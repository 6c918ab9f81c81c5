"""Transport: delivery between broker databases (the transmission queue, acknowledgments,
forwarding, resolution).

- :mod:`~airflow_broker.transport.outbound`: :class:`Transport`, the pass over the transmission
  queue that pushes batches to far brokers and applies their answers;
- :mod:`~airflow_broker.transport.pipeline`: on PostgreSQL, a pass's batches in overlapping
  stages (take, push, record), never two in flight on one conversation;
- :mod:`~airflow_broker.transport.plan`: a batch routed conversation by conversation, and its
  rows made packets; :mod:`~airflow_broker.transport.direct`: the common conversation between
  PostgreSQL brokers taken without packets;
- :mod:`~airflow_broker.transport.inbound`: :class:`Inbound`, the far broker's receiving
  transaction, and :mod:`~airflow_broker.transport.taker`, what it does conversation by
  conversation;
- :mod:`~airflow_broker.transport.forwarding`: :class:`Forwarder` and the non-durable store of
  what a forwarder holds in transit;
- :mod:`~airflow_broker.transport.resolve`: from a route's address to a broker database;
- :mod:`~airflow_broker.transport.packets`: what travels (packets, outcomes, reports);
- :mod:`~airflow_broker.transport.routing_service` and
  :mod:`~airflow_broker.transport.route_requests`: the data-dependent routing service (seed 000)
  and dynamic routing's requests.

Each broker database is one broker instance. A message for a service that is not hosted here waits
in this broker's transmission queue (``broker_transmission_queue``) until :meth:`Transport.deliver`
moves it. There is no wire and no daemon: the delivering process opens a connection to the far
database itself (through the broker's *resolver*, from the logical name in a route's address) and
runs the far broker's receiving code, :class:`Inbound`, in one transaction there.

Exactly once across two databases
    The far broker inserts a message only if its sequence number is new for that conversation and
    direction (the endpoint's ``receive_sequence``, plus the out-of-order messages it holds), and
    answers with an acknowledgment either way. The sender removes a message from its transmission
    queue only when that acknowledgment arrives. A delivery process that dies between the far
    commit and its own leaves the message in place; the next pass sends it again, the far broker
    recognizes the duplicate and acknowledges it again.

Without packets, between PostgreSQL brokers
    The common conversation (an open endpoint, in order, types the far broker does not validate)
    goes from the sender's rows into the far queue by COPY, and the far broker answers with one
    number per conversation, below which it has every message (:mod:`.direct`); the same checks
    hold under the same locks. Everything else goes as packets in the same pass.

Acknowledgments and errors
    travel back as :class:`Packet` objects returned by the far broker's :meth:`Inbound.accept`.
    Along a chain of forwarders they travel back the way the message came: each forwarder hands
    its caller whatever the next hop returned.

Forwarding (seed 002)
    A broker with forwarding on passes messages for services it does not host to the next hop by
    its own routes, adding one to the hop count; past :data:`routing.MAX_HOPS` or the message's
    lifetime it discards the message and returns an Error for the sender. When the next hop cannot
    be reached the forwarder keeps the message in non-durable storage (an UNLOGGED table on
    PostgreSQL, process memory on SQLite) for its own :meth:`Transport.deliver` to retry; it never
    acknowledges anything itself, so the sender keeps every message until the final destination
    has it.

Mirrors
    A database that says it is not the principal (``Broker.configure(principal=False)``, or a
    PostgreSQL server in recovery) refuses deliveries; the sender then tries the route's mirror
    address, which names a copy of the same broker instance.
"""

from __future__ import annotations

from airflow_broker.transport.forwarding import Forwarder, in_transit
from airflow_broker.transport.inbound import Inbound
from airflow_broker.transport.outbound import Transport
from airflow_broker.transport.packets import (
    ACK,
    MESSAGE,
    NOTICE,
    DeliveryReport,
    Outcome,
    Packet,
    Unreachable,
)
from airflow_broker.transport.resolve import env_name, resolve
from airflow_broker.transport.taker import apply_answers

__all__ = [
    "ACK",
    "MESSAGE",
    "NOTICE",
    "DeliveryReport",
    "Forwarder",
    "Inbound",
    "Outcome",
    "Packet",
    "Transport",
    "Unreachable",
    "apply_answers",
    "env_name",
    "in_transit",
    "resolve",
]
