"""airflow-broker: SQL Server Service Broker's reliable, conversational messaging for Airflow 3.

The engine in this package runs without Airflow: ``Broker.connect(url)`` on PostgreSQL or SQLite.
"""

from __future__ import annotations

from airflow_broker.activation import Activation
from airflow_broker.broker import Broker, Transaction
from airflow_broker.constants import DEFAULT, DIALOG_TIMER, END_DIALOG, ERROR
from airflow_broker.errors import (
    BrokerError,
    ContractViolation,
    ConversationEnded,
    InvalidDefinition,
    MessageValidationError,
    ObjectExists,
    QueueDisabled,
    UnknownObject,
)
from airflow_broker.objects import ConversationEndpoint, Message, QueueStatus

__all__ = [
    "DEFAULT",
    "DIALOG_TIMER",
    "END_DIALOG",
    "ERROR",
    "Activation",
    "Broker",
    "BrokerError",
    "ContractViolation",
    "ConversationEnded",
    "ConversationEndpoint",
    "InvalidDefinition",
    "Message",
    "MessageValidationError",
    "ObjectExists",
    "QueueDisabled",
    "QueueStatus",
    "Transaction",
    "UnknownObject",
]

__version__ = "0.1.0"
