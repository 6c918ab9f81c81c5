"""airflow-broker: SQL Server Service Broker's reliable, conversational messaging for Airflow 3.

The engine in this package runs without Airflow: ``Broker.connect(url)`` on PostgreSQL or SQLite.
Its layers, lowest first: ``storage``, ``routing``, ``messaging``, ``transport``, ``operations``,
``activation``, then the facade (``broker.py``) and what stands on it (``cli``, ``examples``,
``spark`` and the Airflow glue, ``provider``). This module is the public API.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from airflow_broker import _moved

if TYPE_CHECKING:
    from airflow_broker.activation import Activation, ActivationRunner
    from airflow_broker.broker import Broker, Transaction
    from airflow_broker.constants import DEFAULT, DIALOG_TIMER, END_DIALOG, ERROR
    from airflow_broker.errors import (
        BrokerError,
        ContractViolation,
        ConversationEnded,
        DialogSecurityError,
        InvalidDefinition,
        LeaseExpired,
        MessageValidationError,
        ObjectExists,
        PermissionDenied,
        QueueDisabled,
        UnknownObject,
    )
    from airflow_broker.messaging.leases import Lease
    from airflow_broker.messaging.objects import (
        ConversationEndpoint,
        DeadLetter,
        Message,
        QueueStatus,
    )

_moved.install()  # modules of the flat layout keep importing from their old paths

#: Where each public name lives. They are imported on first use (PEP 562): Airflow imports this
#: package in every process that reads its configuration (the provider's entry point,
#: ``airflow_broker.provider.get_provider_info``), and the engine's ninety-odd modules, with
#: SQLAlchemy's and jsonschema's, would otherwise load with it in every ``airflow`` command.
_PUBLIC: dict[str, str] = {
    "Activation": "airflow_broker.activation",
    "ActivationRunner": "airflow_broker.activation",
    "Broker": "airflow_broker.broker",
    "Transaction": "airflow_broker.broker",
    "DEFAULT": "airflow_broker.constants",
    "DIALOG_TIMER": "airflow_broker.constants",
    "END_DIALOG": "airflow_broker.constants",
    "ERROR": "airflow_broker.constants",
    "BrokerError": "airflow_broker.errors",
    "ContractViolation": "airflow_broker.errors",
    "ConversationEnded": "airflow_broker.errors",
    "DialogSecurityError": "airflow_broker.errors",
    "InvalidDefinition": "airflow_broker.errors",
    "LeaseExpired": "airflow_broker.errors",
    "MessageValidationError": "airflow_broker.errors",
    "ObjectExists": "airflow_broker.errors",
    "PermissionDenied": "airflow_broker.errors",
    "QueueDisabled": "airflow_broker.errors",
    "UnknownObject": "airflow_broker.errors",
    "Lease": "airflow_broker.messaging.leases",
    "ConversationEndpoint": "airflow_broker.messaging.objects",
    "DeadLetter": "airflow_broker.messaging.objects",
    "Message": "airflow_broker.messaging.objects",
    "QueueStatus": "airflow_broker.messaging.objects",
}


def __getattr__(name: str) -> Any:
    home = _PUBLIC.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later look-ups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


__all__ = [
    "DEFAULT",
    "DIALOG_TIMER",
    "END_DIALOG",
    "ERROR",
    "Activation",
    "ActivationRunner",
    "Broker",
    "BrokerError",
    "ContractViolation",
    "ConversationEnded",
    "ConversationEndpoint",
    "DeadLetter",
    "DialogSecurityError",
    "InvalidDefinition",
    "Lease",
    "LeaseExpired",
    "Message",
    "MessageValidationError",
    "ObjectExists",
    "PermissionDenied",
    "QueueDisabled",
    "QueueStatus",
    "Transaction",
    "UnknownObject",
]

__version__ = "0.1.0"
