"""Errors raised by the broker.

Every error names the object it is about and says what was wrong, so that a log line alone is
enough to act on. All subclass :class:`BrokerError`; each also subclasses the builtin that best
describes it, so generic ``except LookupError`` / ``except ValueError`` code keeps working.
"""

from __future__ import annotations


class BrokerError(Exception):
    """Base class of every error raised by airflow-broker."""


class UnknownObject(BrokerError, LookupError):
    """A named object (queue, service, contract, message type, conversation...) does not exist."""


class ObjectExists(BrokerError):
    """CREATE of an object whose name is already taken."""


class InvalidDefinition(BrokerError, ValueError):
    """A definition or argument is malformed or inconsistent (bad validation, bad schema...)."""


class ContractViolation(BrokerError):
    """A SEND of a message type the contract does not allow this side of the dialog to send."""


class MessageValidationError(BrokerError, ValueError):
    """A message body does not satisfy the validation of its message type."""


class ConversationEnded(BrokerError):
    """The conversation has ended, errored or expired: nothing more may be sent on it."""


class QueueDisabled(BrokerError):
    """RECEIVE from a queue whose status is off (by an operator, or by poison-message handling)."""


class LeaseExpired(BrokerError):
    """``complete`` (or ``extend``, ``release``) of a lease that lapsed and was taken back: its
    messages were returned to the queue, and may since have been handed to another reader."""


class PermissionDenied(BrokerError):
    """The database role may not do this: SEND to a service or RECEIVE from a queue it was not
    granted (``grant_send``, ``grant_receive``), or anything else a broker's owner does."""


class DialogSecurityError(BrokerError):
    """Dialog security cannot do what was asked: no master key, a certificate that does not
    parse or does not match its private key, a binding to a certificate that does not exist."""
