"""Airflow's Stats as the sink of the broker's metrics (:mod:`airflow_broker.metrics`).

Imported, and :func:`install` run, by :mod:`airflow_broker.provider.compat`, so every Airflow-facing
module (hooks, operators, sensors, triggers, the plugin, which Airflow loads in every process)
sends the broker's metrics where Airflow sends its own: StatsD, Datadog's DogStatsD or
OpenTelemetry, as ``[metrics]`` configures (``statsd_on``, ``statsd_host``, ``statsd_port``,
``statsd_prefix``, allow and block lists, ``otel_on``...). With Airflow's metrics off nothing is
installed, and the engine does no metrics work at all.

Where Stats lives: Airflow 3.2 and newer keep it in the Task SDK
(``airflow.sdk.observability.stats``, module functions over a per-process backend that each
Airflow process initializes from its configuration; the API server and the triggerer initialize
airflow-core's copy instead). So that the broker's metrics leave from every process, tasks,
triggerer and API server alike, the SDK's backend is initialized here, the way Airflow's own
processes do it, when nothing in this process has done so yet. Airflow 3.1 has
``airflow.stats.Stats``, configured on first use.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from airflow_broker import metrics

log = logging.getLogger("airflow_broker.metrics")

#: ``[metrics]`` options that turn Airflow's metrics on.
SWITCHES = ("statsd_on", "statsd_datadog_enabled", "otel_on")


class AirflowStats:
    """A :class:`~airflow_broker.metrics.Sink` over Airflow's Stats (module or class)."""

    def __init__(self, stats: Any) -> None:
        self.stats = stats

    def gauge(self, name: str, value: float, tags: metrics.Tags | None) -> None:
        self.stats.gauge(name, value, tags=tags)

    def incr(self, name: str, count: int, tags: metrics.Tags | None) -> None:
        self.stats.incr(name, count, tags=tags)

    def __repr__(self) -> str:
        return f"AirflowStats({getattr(self.stats, '__name__', self.stats)!r})"


def _conf() -> Any:
    try:
        from airflow.sdk.configuration import conf
    except ImportError:  # pragma: no cover - Airflow 3.1
        from airflow.configuration import conf  # type: ignore[no-redef,unused-ignore]
    return conf


def metrics_on() -> bool:
    """Whether Airflow's configuration turns any metrics backend on."""
    conf = _conf()
    return any(conf.getboolean("metrics", key, fallback=False) for key in SWITCHES)


def airflow_stats() -> Any:
    """Airflow's Stats in this process, its backend initialized."""
    try:
        from airflow.sdk.observability import stats
    except ImportError:  # pragma: no cover - Airflow 3.1
        from airflow.stats import Stats  # type: ignore[attr-defined,unused-ignore]

        return Stats
    backend = sys.modules.get(stats.initialize.__module__)
    if getattr(backend, "_factory", None) is None:
        # Nothing in this process initialized the SDK's Stats (the API server, the triggerer's
        # trigger runner, a plain script): do what Airflow's processes do.
        from airflow.sdk.observability.metrics import stats_utils

        stats.initialize(
            factory=stats_utils.get_stats_factory(),
            export_legacy_names=_conf().getboolean("metrics", "legacy_names_on", fallback=True),
        )
    return stats


def install(*, force: bool = False) -> metrics.Sink | None:
    """Install Airflow's Stats as the metrics sink when Airflow's metrics are on (or
    ``force``); returns the sink installed (None: metrics stay off). Never raises: metrics are
    not worth failing an import."""
    current = metrics.installed()
    if isinstance(current, AirflowStats):
        return current
    try:
        if not (force or metrics_on()):
            return None
        sink = AirflowStats(airflow_stats())
    except Exception:
        log.warning("Airflow's Stats cannot be used for the broker's metrics", exc_info=True)
        return None
    metrics.install(sink)
    return sink


__all__ = ["AirflowStats", "airflow_stats", "install", "metrics_on"]
