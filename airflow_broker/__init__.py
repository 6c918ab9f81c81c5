"""airflow-broker: SQL Server Service Broker's reliable, conversational messaging for Airflow 3.

The engine in this package runs without Airflow: ``Broker.connect(url)`` on PostgreSQL or SQLite.
Its layers, lowest first: ``storage``, ``routing``, ``messaging``, ``transport``, ``operations``,
``activation``, then the facade (``broker.py``) and what stands on it (``cli``, ``examples``,
``spark`` and the Airflow glue, ``provider``). This module is the public API.
"""

from __future__ import annotations

from airflow_broker import _moved
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
from airflow_broker.messaging.objects import ConversationEndpoint, DeadLetter, Message, QueueStatus

_moved.install()  # modules of the flat layout keep importing from their old paths

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
