"""TransmitOperator: the body of a transmitter DAG run (Service Broker's transmitter, activated).

A :class:`~airflow_broker.provider.triggers.transmission.TransmissionTrigger` starts a run when
messages are due to leave the broker database; the run's ``TransmitOperator`` delivers until
nothing is due (:func:`airflow_broker.activation.transmitter.transmit`), then ends. It also runs
the due work of queues nobody reads and the housekeeping purge. When ``spark_threshold`` or more
messages are due it first launches the Spark routing job
(:class:`~airflow_broker.operators.spark.SparkRoutingOperator`, on ``spark_conn_id``) for them.

:func:`airflow_broker.provider.transmitter.transmitter_dag` builds the whole DAG in one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_broker.activation.transmitter import (
    DEFAULT_MAX_SECONDS,
    DEFAULT_SPARK_THRESHOLD,
    Backlog,
    transmit,
)
from airflow_broker.hooks.broker import BrokerHook
from airflow_broker.operations.housekeeping import Retention
from airflow_broker.provider.compat import BaseOperator

if TYPE_CHECKING:
    from airflow_broker.provider.compat import Context


class TransmitOperator(BaseOperator):
    """Delivers this broker database's transmission queue until nothing is due.

    :param broker_conn_id: the Airflow connection of the broker database (templated).
    :param spark_threshold: from this many due messages on, the Spark routing job moves them;
        None never uses Spark. The default is where ``bench.spark_routing`` measured the job
        overtaking the Python pass.
    :param spark_conn_id: the Spark connection the job is submitted to.
    :param spark_kwargs: more arguments for the ``SparkRoutingOperator`` that runs the job
        (``partitions``, ``conf``, ``classifier``...).
    :param max_seconds: end the run after this long even if more keeps arriving (the trigger
        starts the next).
    :param event_retention_days, sample_retention_days, closed_endpoint_retention_minutes:
        what the housekeeping purge keeps.

    Returns the run's report: ``skipped``, ``passes``, ``spark_runs``, ``seconds``, the
    delivery counts (``delivered``, ``acknowledged``, ``delayed``, ``failed``, ``discarded``,
    ``forwarded``), ``hung`` (far brokers that did not answer during the run: address -> why)
    and what still waits (``left_waiting``, ``left_due``, ``next_attempt_at``).
    """

    template_fields: Sequence[str] = ("broker_conn_id",)
    ui_color = "#cfe2f3"

    def __init__(
        self,
        *,
        broker_conn_id: str = BrokerHook.default_conn_name,
        spark_threshold: int | None = DEFAULT_SPARK_THRESHOLD,
        spark_conn_id: str = "spark_default",
        spark_kwargs: dict[str, Any] | None = None,
        max_seconds: float = DEFAULT_MAX_SECONDS,
        event_retention_days: float = Retention().events / timedelta(days=1),
        sample_retention_days: float = Retention().samples / timedelta(days=1),
        closed_endpoint_retention_minutes: float = (
            Retention().closed_endpoints / timedelta(minutes=1)
        ),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if spark_threshold is not None and (
            not isinstance(spark_threshold, int) or spark_threshold < 1
        ):
            raise ValueError(
                f"{type(self).__name__}: spark_threshold must be a whole number >= 1 or None, "
                f"not {spark_threshold!r}"
            )
        self.broker_conn_id = broker_conn_id
        self.spark_threshold = spark_threshold
        self.spark_conn_id = spark_conn_id
        self.spark_kwargs = dict(spark_kwargs or {})
        self.max_seconds = max_seconds
        self.retention = Retention(
            events=timedelta(days=event_retention_days),
            samples=timedelta(days=sample_retention_days),
            closed_endpoints=timedelta(minutes=closed_endpoint_retention_minutes),
        )

    def _spark(self, context: Context) -> Any:
        """The hand-off to the Spark routing job, submitted as a SparkRoutingOperator would."""

        def run_job(backlog: Backlog) -> None:
            from airflow_broker.operators.spark import SparkRoutingOperator

            self.log.info(
                "%d messages due (threshold %s): submitting the Spark routing job on %r",
                backlog.due,
                self.spark_threshold,
                self.spark_conn_id,
            )
            job = SparkRoutingOperator(
                task_id=f"{self.task_id}__spark",
                broker_conn_id=self.broker_conn_id,
                conn_id=self.spark_conn_id,
                **self.spark_kwargs,
            )
            job.execute(context)

        return run_job

    def execute(self, context: Context) -> dict[str, Any]:
        hook = BrokerHook(broker_conn_id=self.broker_conn_id)
        try:
            report = transmit(
                hook.get_broker(),
                spark=self._spark(context) if self.spark_threshold is not None else None,
                spark_threshold=self.spark_threshold or DEFAULT_SPARK_THRESHOLD,
                max_seconds=self.max_seconds,
                retention=self.retention,
            )
        finally:
            hook.close()
        left = report.left
        return {
            "skipped": report.skipped,
            "passes": report.passes,
            "spark_runs": report.spark_runs,
            "seconds": round(report.seconds, 3),
            **dataclasses.asdict(report.delivery),
            "left_waiting": left.waiting,
            "left_due": left.due,
            "next_attempt_at": None
            if left.next_attempt_at is None
            else left.next_attempt_at.isoformat(),
        }


__all__ = ["TransmitOperator"]
