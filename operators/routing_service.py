"""RoutingServiceOperator: a data-dependent routing service (seed 000) as an activated reader.

The routing service's queue is activated like any reader queue (``queue_asset``, a
``QueueActivationTrigger``); the run's ``RoutingServiceOperator`` drains it as a
:class:`~airflow_broker.operators.reader.DrainQueueOperator` does, routing each conversation
group inside its RECEIVE's transaction (classify the first message of a new inbound dialog,
begin or reuse the outbound dialog, forward; replies and ends travel back by the mapping), then
forgets the mappings of dialog pairs that have ended. Dialogs to other broker databases leave
through the transmitter (:func:`airflow_broker.provider.transmitter.transmitter_dag`).

:func:`airflow_broker.provider.transmitter.routing_service_dag` builds the reader DAG in one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_broker.hooks.broker import BrokerHook
from airflow_broker.operators.reader import DrainQueueOperator
from airflow_broker.transport.routing_service import routing_handler, sweep_mappings

if TYPE_CHECKING:
    from airflow_broker.provider.compat import Context


def _not_resolved(tx: Any, messages: Any) -> None:  # pragma: no cover - replaced in execute
    raise RuntimeError("the routing service's handler is resolved when the task runs")


class RoutingServiceOperator(DrainQueueOperator):
    """Runs routing service ``routing_service`` until its queue is empty.

    :param routing_service: the routing service's name (its service).
    :param queue: its queue (the one the DAG's asset watches); checked against the routing
        service's definition when the task runs.
    :param broker_conn_id: the Airflow connection of the broker database.

    Every other argument is :class:`DrainQueueOperator`'s (``top``, ``max_batches``,
    ``wait_seconds``, ``max_readers``...). Returns its result plus ``routing_service`` and
    ``mappings_swept``.
    """

    ui_color = "#e6d8f0"

    def __init__(
        self,
        *,
        routing_service: str,
        queue: str,
        broker_conn_id: str = BrokerHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            queue=queue, handler=_not_resolved, broker_conn_id=broker_conn_id, **kwargs
        )
        self.routing_service = routing_service

    def execute(self, context: Context) -> dict[str, Any]:
        broker = self._broker()
        queue, self.handler = routing_handler(broker, self.routing_service)
        if queue != self.queue_name:
            raise ValueError(
                f"{type(self).__name__}: routing service {self.routing_service!r} reads queue "
                f"{queue!r}, not {self.queue_name!r}"
            )
        result = super().execute(context)
        return {
            **result,
            "routing_service": self.routing_service,
            "mappings_swept": sweep_mappings(broker, self.routing_service),
        }


__all__ = ["RoutingServiceOperator"]
