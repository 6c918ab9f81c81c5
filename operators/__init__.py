"""Airflow-facing operators of airflow-broker (installed as `airflow_broker.operators`).

- :mod:`.dialog`: ``BeginDialogOperator``, ``SendOperator``, ``ReceiveOperator``,
  ``EndConversationOperator`` (and their base, ``BrokerOperator``);
- :mod:`.declarations`: ``ApplyDeclarationsOperator`` (the ``airflow-broker apply`` YAML);
- :mod:`.lease`: ``CompleteLeaseOperator``, ``ReleaseLeaseOperator`` (what
  ``ReceiveOperator(lease_seconds=...)`` leased, for handlers that run for minutes);
- :mod:`.reader`: ``DrainQueueOperator`` (an activated reader: registers, drains, exits) and
  ``DrainFamilyOperator`` (the same for the queues a family reader DAG's run was started for);
- :mod:`.spark`: ``SparkRoutingOperator`` (the Spark routing job through spark-submit);
- :mod:`.transmit`: ``TransmitOperator`` (a transmitter run: delivers until nothing is due);
- :mod:`.routing_service`: ``RoutingServiceOperator`` (a data-dependent routing service, activated).

The names are also importable from this package; each module loads on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_broker.operators.declarations import ApplyDeclarationsOperator
    from airflow_broker.operators.dialog import (
        BeginDialogOperator,
        BrokerOperator,
        EndConversationOperator,
        ReceiveOperator,
        SendOperator,
    )
    from airflow_broker.operators.lease import CompleteLeaseOperator, ReleaseLeaseOperator
    from airflow_broker.operators.reader import DrainFamilyOperator, DrainQueueOperator
    from airflow_broker.operators.routing_service import RoutingServiceOperator
    from airflow_broker.operators.spark import SparkRoutingOperator
    from airflow_broker.operators.transmit import TransmitOperator

_MODULES = {
    "ApplyDeclarationsOperator": "declarations",
    "BeginDialogOperator": "dialog",
    "BrokerOperator": "dialog",
    "CompleteLeaseOperator": "lease",
    "DrainFamilyOperator": "reader",
    "DrainQueueOperator": "reader",
    "EndConversationOperator": "dialog",
    "ReceiveOperator": "dialog",
    "ReleaseLeaseOperator": "lease",
    "RoutingServiceOperator": "routing_service",
    "SendOperator": "dialog",
    "SparkRoutingOperator": "spark",
    "TransmitOperator": "transmit",
}

__all__ = [
    "ApplyDeclarationsOperator",
    "BeginDialogOperator",
    "BrokerOperator",
    "CompleteLeaseOperator",
    "DrainFamilyOperator",
    "DrainQueueOperator",
    "EndConversationOperator",
    "ReceiveOperator",
    "ReleaseLeaseOperator",
    "RoutingServiceOperator",
    "SendOperator",
    "SparkRoutingOperator",
    "TransmitOperator",
]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
