"""Routing: where a message goes, decided without moving it.

Seed 001's route matching and choosing, seed 003's deterministic load balancing and seed 002's
hop limit are pure functions in :mod:`~airflow_broker.routing.rules` (SEND, the delivery pass
and the Spark job share them); :mod:`~airflow_broker.routing.routes` reads a broker's routes;
:mod:`~airflow_broker.routing.dynamic` is matching step 4, the dynamic routing service. This layer
sits below messaging because SEND routes every first message of a dialog; moving messages
between databases is :mod:`airflow_broker.transport`.
"""

from airflow_broker.routing.rules import (
    BROKER_SCHEME,
    LOCAL,
    MAX_HOPS,
    TRANSPORT,
    Decision,
    Match,
    Route,
    choose_routes,
    delivery_choices,
    delivery_decision,
    dialog_bucket,
    hops_exceeded,
    lifetime_over,
    live_routes,
    match_candidates,
    match_routes,
    pick_broker_instance,
    route_conversation,
    transport_address,
)

__all__ = [
    "BROKER_SCHEME",
    "LOCAL",
    "MAX_HOPS",
    "TRANSPORT",
    "Decision",
    "Match",
    "Route",
    "choose_routes",
    "delivery_choices",
    "delivery_decision",
    "dialog_bucket",
    "hops_exceeded",
    "lifetime_over",
    "live_routes",
    "match_candidates",
    "match_routes",
    "pick_broker_instance",
    "route_conversation",
    "transport_address",
]
