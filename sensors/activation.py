"""QueueActivationSensor: wait, without holding a worker slot, until a queue needs a reader.

A sensor is the other way to run seed 004's activation in Airflow (the first is an
``AssetWatcher`` with :class:`~airflow_broker.provider.triggers.activation.QueueActivationTrigger`):
a reader DAG that runs continuously starts with this sensor, then drains the queue::

    @dag(schedule="@continuous", max_active_runs=4)
    def supplier_reader():
        wait = QueueActivationSensor(task_id="wait", queue="SupplierQueue")
        drain = DrainQueueOperator(task_id="drain", queue="SupplierQueue", handler="pkg.mod:f")
        wait >> drain

What it waits for (``wait_for``):

- ``arrival``: seed 004's decision: messages wait and no reader runs or is starting, or the
  queue keeps growing and fewer readers run than ``max_readers`` and than its conversation
  groups with messages. One arrival completes one sensor, however many wait.
- ``depth``: at least ``min_depth`` messages wait, some of them new since this sensor last
  completed.
- ``growth``: the queue is deeper than when this sensor last looked.

Deferrable by default: the sensor looks once, and if it must wait, the triggerer waits for it.
With ``deferrable=False`` it pokes like any sensor (``mode="poke"`` or ``"reschedule"``). Its
state (cursor, last depth) is kept in the broker database under ``monitor_key`` (default
``DAG_ID.TASK_ID``), so consecutive runs continue where the last one stopped. It returns (and
pushes to XCom) the event: ``queue``, ``depth``, ``groups_ready``, ``cursor``, ``readers``,
``running``, ``fire_id``...
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_broker.activation import MODES, Monitor, check_mode, due_step
from airflow_broker.errors import InvalidDefinition
from airflow_broker.hooks.broker import BrokerHook
from airflow_broker.provider.compat import BaseSensorOperator, PokeReturnValue
from airflow_broker.provider.triggers.activation import QueueActivationTrigger

if TYPE_CHECKING:
    from airflow_broker.broker import Broker
    from airflow_broker.provider.compat import Context


class QueueActivationSensor(BaseSensorOperator):
    """Waits until ``queue`` needs a reader (or reaches a depth, or grows): see the module.

    :param queue: the broker queue's name (templated, as
        ``queue_name``; ``BaseOperator.queue`` is the executor's queue: ``executor_queue``).
    :param wait_for: ``"arrival"`` (default), ``"depth"`` or ``"growth"``. (``mode`` is the
        sensor's poke/reschedule mode; ``mode="arrival"`` etc. is accepted as ``wait_for``.)
    :param min_depth: wait for at least this many messages.
    :param max_readers: for ``arrival``: the most readers at once (None: the queue's
        ``Activation.max_readers``).
    :param broker_conn_id: the Airflow connection of the broker database (templated).
    :param poll_interval: the longest wait between two looks, in the triggerer (seconds).
    :param monitor_key: the name its state is kept under (templated; default ``DAG_ID.TASK_ID``).
    :param deferrable: wait in the triggerer (default) rather than in a worker.
    :param executor_queue: the executor queue (Celery, ...) to run this task on.
    """

    template_fields: Sequence[str] = ("queue_name", "broker_conn_id", "monitor_key")
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        queue: str,
        wait_for: str | None = None,
        min_depth: int = 1,
        max_readers: int | None = None,
        broker_conn_id: str = BrokerHook.default_conn_name,
        poll_interval: float = 1.0,
        monitor_key: str | None = None,
        deferrable: bool = True,
        executor_queue: str | None = None,
        **kwargs: Any,
    ) -> None:
        if executor_queue is not None:
            kwargs["queue"] = executor_queue
        mode = kwargs.get("mode")
        if mode in MODES:
            if wait_for is not None and wait_for != mode:
                raise InvalidDefinition(f"give wait_for={wait_for!r} or mode={mode!r}, not both")
            wait_for = kwargs.pop("mode")
        kwargs.setdefault("poke_interval", poll_interval)
        super().__init__(**kwargs)
        #: The broker queue (``self.queue`` stays the executor's, as on every operator).
        self.queue_name = queue
        self.wait_for = check_mode(wait_for or "arrival")
        self.min_depth = min_depth
        self.max_readers = max_readers
        self.broker_conn_id = broker_conn_id
        self.poll_interval = poll_interval
        self.monitor_key = monitor_key
        self.deferrable = deferrable
        self._hook: BrokerHook | None = None

    # -- the broker ----------------------------------------------------------------------------
    def _broker(self) -> Broker:
        """The broker database of ``broker_conn_id``."""
        if self._hook is None:
            self._hook = BrokerHook(broker_conn_id=self.broker_conn_id)
        return self._hook.get_broker()

    def _close(self) -> None:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.close()

    def _key(self) -> str:
        return self.monitor_key or f"{self.dag_id}.{self.task_id}"

    def _look(self) -> dict[str, Any] | None:
        broker = self._broker()
        due_step(broker)
        fire = Monitor(
            broker,
            self.queue_name,
            key=self._key(),
            mode=self.wait_for,
            min_depth=self.min_depth,
            max_readers=self.max_readers,
            sample_seconds=self.poll_interval,
        ).check()
        return None if fire is None else fire.payload()

    def trigger(self) -> QueueActivationTrigger:
        """The trigger this sensor defers to."""
        return QueueActivationTrigger(
            queue=self.queue_name,
            broker_conn_id=self.broker_conn_id,
            poll_interval=self.poll_interval,
            min_depth=self.min_depth,
            max_readers=self.max_readers,
            mode=self.wait_for,
            monitor_key=self._key(),
        )

    # -- running -------------------------------------------------------------------------------
    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        try:
            found = self._look()
        finally:
            self._close()
        if found is not None:
            return found
        self.defer(
            trigger=self.trigger(),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout) if self.timeout else None,
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """The trigger fired: its event is the sensor's result."""
        self.log.info(
            "queue %r: %s (depth %s)", event.get("queue"), self.wait_for, event.get("depth")
        )
        return event

    def poke(self, context: Context) -> PokeReturnValue:
        try:
            found = self._look()
        finally:
            self._close()
        return PokeReturnValue(is_done=found is not None, xcom_value=found)


__all__ = ["QueueActivationSensor"]
