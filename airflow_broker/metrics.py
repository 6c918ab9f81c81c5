"""The broker's metrics, sent to a pluggable sink (Airflow's Stats in Airflow, nothing outside).

The engine never imports Airflow. By default no sink is installed and every function here returns
at once; code that must do work to compute a value (a query, a count) first asks
:func:`enabled`. The Airflow-facing modules (hooks, operators, sensors, triggers, the plugin:
everything that imports :mod:`airflow_broker.provider.compat`) install Airflow's Stats as the sink
when Airflow's metrics are on (``[metrics] statsd_on``, ``otel_on`` or ``statsd_datadog_enabled``),
see :mod:`airflow_broker.provider.stats`; anything else with ``gauge(name, value, tags)`` and
``incr(name, count, tags)`` methods can be installed with :func:`install`.

Metrics (names before Airflow's ``statsd_prefix``):

=====================================  =======  ==================================================
``broker.queue_depth.<queue>``         gauge    messages of a queue a reader could take now
                                                (held and leased ones are not), at each depth sample
                                                (:func:`airflow_broker.operations.sampling.sample_queue_depths`)
``broker.queue_held.<queue>``          gauge    messages whose conversation group waits out a
                                                failed attempt's backoff (``retry_delay``)
``broker.queue_leased.<queue>``        gauge    messages a lease holds (``Broker.lease``)
``broker.queue_oldest_age.<queue>``    gauge    seconds the oldest message a reader could take
                                                now has waited (0 when none), at each sample
``broker.transmission_queue.depth``    gauge    messages waiting to leave (transmission queue)
``broker.transmission_queue.oldest_age`` gauge  seconds the oldest of them has waited (0: none)
``broker.messages_sent``               counter  messages SENT by committed transactions (one per
                                                conversation a SEND names)
``broker.messages_received``           counter  messages RECEIVEd by committed transactions
``broker.transport_failed``            counter  messages a delivery pass could not hand to a far
                                                broker (unreachable, refused): they wait and retry
``broker.delivery_failed``             counter  conversations a delivery pass failed with an Error
                                                (contract not supported, invalid body, hops...)
``broker.queues_disabled``             counter  queues disabled by poison message handling
=====================================  =======  ==================================================

Tags (for backends that keep them: OpenTelemetry, Datadog, InfluxDB-style StatsD): ``queue`` on
the per-queue metrics. Plain StatsD drops tags, hence the queue in the depth gauge's name
(:func:`queue_stat`: characters StatsD does not allow become ``_``, dots ``__``).

A sink that raises is logged (at debug level) and ignored: metrics never fail the broker.
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Protocol

log = logging.getLogger("airflow_broker.metrics")

QUEUE_DEPTH = "broker.queue_depth"
QUEUE_HELD = "broker.queue_held"
QUEUE_LEASED = "broker.queue_leased"
QUEUE_OLDEST_AGE = "broker.queue_oldest_age"
TRANSMISSION_DEPTH = "broker.transmission_queue.depth"
TRANSMISSION_OLDEST_AGE = "broker.transmission_queue.oldest_age"
MESSAGES_SENT = "broker.messages_sent"
MESSAGES_RECEIVED = "broker.messages_received"
TRANSPORT_FAILED = "broker.transport_failed"
DELIVERY_FAILED = "broker.delivery_failed"
QUEUES_DISABLED = "broker.queues_disabled"
DEAD_LETTERED = "broker.dead_lettered"

#: Longest metric name this module makes (Airflow refuses names over 250 characters, prefix
#: included).
MAX_NAME = 200
_NOT_ALLOWED = re.compile(r"[^a-zA-Z0-9_-]")

Tags = dict[str, str]


class Sink(Protocol):
    """Where metrics go."""

    def gauge(self, name: str, value: float, tags: Tags | None) -> None: ...

    def incr(self, name: str, count: int, tags: Tags | None) -> None: ...


_sink: Sink | None = None


def install(sink: Sink | None) -> Sink | None:
    """Send metrics to ``sink`` from now on (None: nowhere); returns the sink it replaces."""
    global _sink
    previous, _sink = _sink, sink
    return previous


def installed() -> Sink | None:
    """The sink metrics go to, or None."""
    return _sink


def enabled() -> bool:
    """Whether metrics go anywhere: compute a value only when they do."""
    return _sink is not None


def gauge(name: str, value: float, tags: Tags | None = None) -> None:
    """Set gauge ``name`` to ``value``."""
    sink = _sink
    if sink is None:
        return
    try:
        sink.gauge(name, value, tags)
    except Exception:
        log.debug("metrics sink failed on gauge %s", name, exc_info=True)


def incr(name: str, count: int = 1, tags: Tags | None = None) -> None:
    """Add ``count`` to counter ``name`` (nothing for a count of 0)."""
    sink = _sink
    if sink is None or count <= 0:
        return
    try:
        sink.incr(name, count, tags)
    except Exception:
        log.debug("metrics sink failed on incr %s", name, exc_info=True)


def stat_part(value: str) -> str:
    """A queue (or other object) name as one segment of a metric name: dots become ``__`` (a
    dot separates StatsD's levels), other characters StatsD does not allow become ``_``."""
    return _NOT_ALLOWED.sub("_", value.replace(".", "__")) or "_"


def queue_stat(name: str, queue: str) -> str:
    """``name.<queue>``, at most :data:`MAX_NAME` characters (a long queue name is cut and
    suffixed with a hash of the whole, so two long names stay apart)."""
    stat = f"{name}.{stat_part(queue)}"
    if len(stat) <= MAX_NAME:
        return stat
    digest = hashlib.sha1(queue.encode()).hexdigest()[:10]
    return f"{stat[: MAX_NAME - 11]}_{digest}"


__all__ = [
    "DELIVERY_FAILED",
    "MESSAGES_RECEIVED",
    "MESSAGES_SENT",
    "QUEUES_DISABLED",
    "QUEUE_DEPTH",
    "QUEUE_HELD",
    "QUEUE_LEASED",
    "QUEUE_OLDEST_AGE",
    "TRANSMISSION_DEPTH",
    "TRANSMISSION_OLDEST_AGE",
    "TRANSPORT_FAILED",
    "Sink",
    "enabled",
    "gauge",
    "incr",
    "install",
    "installed",
    "queue_stat",
    "stat_part",
]
