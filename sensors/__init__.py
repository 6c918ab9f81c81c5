"""Airflow-facing sensors of airflow-broker (installed as `airflow_broker.sensors`).

- :mod:`.activation`: ``QueueActivationSensor`` (a queue needs a reader, reaches a depth, grows);
- :mod:`.conversation`: ``ConversationSensor`` (the next message on one conversation).

Both are deferrable. The names are also importable from this package; each module loads on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_broker.sensors.activation import QueueActivationSensor
    from airflow_broker.sensors.conversation import ConversationSensor

_MODULES = {
    "ConversationSensor": "conversation",
    "QueueActivationSensor": "activation",
}

__all__ = ["ConversationSensor", "QueueActivationSensor"]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
