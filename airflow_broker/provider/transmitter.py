"""The transmitter DAG: Service Broker's always-on transmitter, in one line of a DAGs folder.

::

    # dags/broker_transmitter.py
    from airflow_broker.provider.transmitter import transmitter_dag

    transmitter_dag()               # the broker database of the broker_default connection

The DAG is scheduled on an asset watched by a
:class:`~airflow_broker.provider.triggers.transmission.TransmissionTrigger`: when messages are
due to leave the broker database the triggerer starts a run, whose
:class:`~airflow_broker.operators.transmit.TransmitOperator` delivers until nothing is due and
ends; the trigger wakes again when new messages are queued or a retry falls due. Runs also do
the due work of queues nobody reads and the housekeeping purge, and hand backlogs of
``spark_threshold`` messages or more to the Spark routing job. One DAG per broker database.
"""

from __future__ import annotations

import pendulum

from airflow_broker.activation.transmitter import DEFAULT_SPARK_THRESHOLD, DEFAULT_START_TIMEOUT
from airflow_broker.provider.compat import Asset, AssetWatcher
from airflow_broker.provider.triggers.transmission import TransmissionTrigger


def transmitter_asset(
    broker_conn_id: str = "broker_default",
    *,
    poll_interval: float = 5.0,
    start_timeout: float = DEFAULT_START_TIMEOUT,
) -> Asset:
    """The asset a transmitter DAG is scheduled on: ``broker_transmitter_<conn id>``, watched
    by the database's :class:`TransmissionTrigger`."""
    trigger = TransmissionTrigger(
        broker_conn_id=broker_conn_id, poll_interval=poll_interval, start_timeout=start_timeout
    )
    return Asset(
        name=f"broker_transmitter_{broker_conn_id}",
        watchers=[AssetWatcher(name=f"{broker_conn_id}_transmitter", trigger=trigger)],
    )


def transmitter_dag(
    dag_id: str | None = None,
    *,
    broker_conn_id: str = "broker_default",
    spark_threshold: int | None = DEFAULT_SPARK_THRESHOLD,
    spark_conn_id: str = "spark_default",
    poll_interval: float = 5.0,
    start_timeout: float = DEFAULT_START_TIMEOUT,
    **operator_kwargs: object,
) -> object:
    """The transmitter DAG of ``broker_conn_id``'s database (``dag_id`` default:
    ``broker_transmitter`` for ``broker_default``, else ``broker_transmitter_<conn id>``).

    ``spark_threshold=None`` never launches the Spark job; ``operator_kwargs`` go to the
    :class:`~airflow_broker.operators.transmit.TransmitOperator` (``spark_kwargs``,
    ``max_seconds``, the retention settings...)."""
    from airflow.sdk import DAG

    from airflow_broker.operators.transmit import TransmitOperator

    if dag_id is None:
        dag_id = (
            "broker_transmitter"
            if broker_conn_id == "broker_default"
            else f"broker_transmitter_{broker_conn_id}"
        )
    with DAG(
        dag_id,
        schedule=[
            transmitter_asset(
                broker_conn_id, poll_interval=poll_interval, start_timeout=start_timeout
            )
        ],
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        max_active_runs=1,
        tags=["airflow-broker"],
        doc_md=__doc__,
    ) as dag:
        TransmitOperator(
            task_id="transmit",
            broker_conn_id=broker_conn_id,
            spark_threshold=spark_threshold,
            spark_conn_id=spark_conn_id,
            **operator_kwargs,
        )
    return dag


def routing_service_dag(
    routing_service: str,
    queue: str,
    *,
    dag_id: str | None = None,
    broker_conn_id: str = "broker_default",
    max_readers: int = 1,
    poll_interval: float = 1.0,
    **operator_kwargs: object,
) -> object:
    """The reader DAG of a data-dependent routing service: scheduled on its queue's asset
    (:func:`~airflow_broker.provider.triggers.activation.queue_asset`), its run's
    :class:`~airflow_broker.operators.routing_service.RoutingServiceOperator` drains the queue
    through the router. ``dag_id`` default: ``routing_service_<queue>``."""
    from airflow.sdk import DAG

    from airflow_broker.operators.routing_service import RoutingServiceOperator
    from airflow_broker.provider.triggers.activation import queue_asset

    with DAG(
        dag_id or f"routing_service_{queue}",
        schedule=[
            queue_asset(
                queue,
                broker_conn_id=broker_conn_id,
                max_readers=max_readers,
                poll_interval=poll_interval,
            )
        ],
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        max_active_runs=max_readers,
        tags=["airflow-broker"],
        doc_md=f"Routing service `{routing_service}` on queue `{queue}`, activated.",
    ) as dag:
        RoutingServiceOperator(
            task_id="route",
            routing_service=routing_service,
            queue=queue,
            broker_conn_id=broker_conn_id,
            max_readers=max_readers,
            **operator_kwargs,
        )
    return dag


__all__ = ["routing_service_dag", "transmitter_asset", "transmitter_dag"]
