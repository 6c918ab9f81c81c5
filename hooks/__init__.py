"""Airflow-facing hooks of airflow-broker (installed as `airflow_broker.hooks`).

``BrokerHook`` is loaded on first use: the engine imports ``airflow_broker.hooks.connections``
to resolve ``broker://NAME`` addresses, and that must not import Airflow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_broker.hooks.broker import BrokerHook

__all__ = ["BrokerHook"]


def __getattr__(name: str) -> Any:
    if name == "BrokerHook":
        from airflow_broker.hooks.broker import BrokerHook

        return BrokerHook
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
