"""The ``broker`` scheme of the common-messaging provider's ``MessageQueueTrigger``.

Registered through the provider info (``queues``), so that::

    MessageQueueTrigger(scheme="broker", broker_queue="SupplierQueue", broker_conn_id="broker")

runs a :class:`~airflow_broker.provider.triggers.activation.QueueActivationTrigger` (every other
keyword goes to it). ``MessageQueueTrigger``'s own ``queue`` argument is its older, deprecated
queue-URI
form, which takes precedence over ``scheme``: ``MessageQueueTrigger(queue="broker://SupplierQueue")``
matches here too, and names the queue after ``broker://``.
"""

from __future__ import annotations

from typing import Any

# Not in airflow_broker.provider.compat: only this module needs the common-messaging provider.
from airflow.providers.common.messaging.providers.base_provider import BaseMessageQueueProvider

from airflow_broker.provider.triggers.activation import QueueActivationTrigger

SCHEME = "broker"
PREFIX = f"{SCHEME}://"


class BrokerMessageQueueProvider(BaseMessageQueueProvider):
    """Broker queues for ``MessageQueueTrigger``: scheme ``broker``, or a ``broker://QUEUE``
    queue URI."""

    scheme = SCHEME

    def queue_matches(self, queue: str) -> bool:
        return isinstance(queue, str) and queue.startswith(PREFIX) and len(queue) > len(PREFIX)

    def trigger_class(self) -> type[QueueActivationTrigger]:
        return QueueActivationTrigger

    def trigger_kwargs(self, queue: str, **kwargs: Any) -> dict[str, Any]:
        return {"queue": queue[len(PREFIX) :]}


__all__ = ["BrokerMessageQueueProvider"]
