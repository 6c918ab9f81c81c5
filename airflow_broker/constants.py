"""Names and codes shared with SQL Server Service Broker."""

from __future__ import annotations

from typing import Final

#: The message type and contract every broker has.
DEFAULT: Final = "DEFAULT"

#: System message types, spelled as Service Broker spells them.
END_DIALOG: Final = "http://schemas.microsoft.com/SQL/ServiceBroker/EndDialog"
ERROR: Final = "http://schemas.microsoft.com/SQL/ServiceBroker/Error"
DIALOG_TIMER: Final = "http://schemas.microsoft.com/SQL/ServiceBroker/DialogTimer"
ECHO: Final = "http://schemas.microsoft.com/SQL/ServiceBroker/ServiceEcho"
#: The data-dependent routing service's answer in redirect mode (seed 000): a JSON body
#: ``{"to_service": ..., "broker_instance": ...}`` naming the service to talk to instead.
REDIRECT: Final = "urn:airflow-broker:Redirect"
SYSTEM_MESSAGE_TYPES: Final = frozenset({END_DIALOG, ERROR, DIALOG_TIMER, REDIRECT})

#: Namespace of the XML body of Error messages.
ERROR_NAMESPACE: Final = "http://schemas.microsoft.com/SQL/ServiceBroker/Error"

#: Error codes the broker itself puts in Error messages (Service Broker's numbers, negated).
ERR_LIFETIME_EXPIRED: Final = -8489
ERR_CONTRACT_NOT_SUPPORTED: Final = -8408
ERR_SERVICE_NOT_FOUND: Final = -8470
#: DROP SERVICE ends each open conversation of the service with this error (Service Broker's
#: 8470, "Remote service has been dropped": the same number as ERR_SERVICE_NOT_FOUND).
ERR_SERVICE_DROPPED: Final = -8470
ERR_MESSAGE_INVALID: Final = -9615
ERR_HOPS_EXCEEDED: Final = -8492
ERR_NOT_CLASSIFIED: Final = -8493
ERR_WRONG_BROKER_INSTANCE: Final = -8494
#: ``reset-identity`` ended the conversation: its database was restored, cloned or copied.
ERR_BROKER_IDENTITY_RESET: Final = -8495

#: The Error code of a conversation ended by dead-lettering: one of its messages reached its
#: queue's ``max_receives``, and its unprocessed messages moved to the dead-letter queue.
DEAD_LETTERED: Final = -8496
#: Dialog security refused a message or a key exchange: it failed its integrity check (altered
#: in transit), its signature did not verify, or a certificate it needs is missing.
ERR_DIALOG_SECURITY: Final = -8497
#: A certificate of a secure dialog is past its end date: the dialog stops.
ERR_CERTIFICATE_EXPIRED: Final = -8498

#: Consecutive rolled-back receiving transactions that disable a queue.
POISON_THRESHOLD: Final = 5

#: The route every broker starts with: any service, delivered locally when it is hosted here.
AUTO_CREATED_LOCAL: Final = "AutoCreatedLocal"

#: Conversation endpoint states (sys.conversation_endpoints.state) and their descriptions.
STATE_DESC: Final = {
    "SO": "STARTED_OUTBOUND",
    "SI": "STARTED_INBOUND",
    "CO": "CONVERSING",
    "DI": "DISCONNECTED_INBOUND",
    "DO": "DISCONNECTED_OUTBOUND",
    "ER": "ERROR",
    "CD": "CLOSED",
}
#: States in which the local side may still SEND.
SENDABLE_STATES: Final = frozenset({"SO", "SI", "CO"})

#: Message status values of the RECEIVE ``status`` column.
STATUS_RECEIVED: Final = 0  # received, kept because the queue has retention on
STATUS_READY: Final = 1
STATUS_NOT_COMPLETE: Final = 2  # arrived out of order; waits for the gap to fill
STATUS_RETAINED_SENT: Final = 3  # a copy of a message this side sent, kept by retention

#: Within one dialog a receiver sees DialogTimer first, then Error, then the rest in order.
PRECEDENCE_TIMER: Final = 0
PRECEDENCE_ERROR: Final = 1
PRECEDENCE_NORMAL: Final = 2

VALIDATIONS: Final = ("none", "empty", "json", "json_schema", "well_formed_xml", "xml_schema")
SENT_BY: Final = ("initiator", "target", "any")


def state_desc(state: str) -> str:
    """The spelled-out name of an endpoint state code."""
    return STATE_DESC.get(state, state)


#: Dynamic routing (seed 001's matching step 4): Service Broker's names for the dynamic routing
#: service, its contract and its message; ``migrate()`` creates the contract and message type.
BROKER_CONFIGURATION = "http://schemas.microsoft.com/SQL/ServiceBroker/BrokerConfiguration"
BROKER_CONFIGURATION_NOTICE = (
    "http://schemas.microsoft.com/SQL/ServiceBroker/BrokerConfigurationNotice"
)
MISSING_ROUTE = (
    "http://schemas.microsoft.com/SQL/ServiceBroker/BrokerConfigurationNotice/MissingRoute"
)
