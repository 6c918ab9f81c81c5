"""DrainQueueOperator: the body of a reader DAG run (seed 004's activated procedure).

A queue's reader is a DAG: its monitor (``QueueActivationTrigger`` in an ``AssetWatcher``, or a
``QueueActivationSensor``) starts a run when a reader is needed, and the run's
``DrainQueueOperator`` reads the queue until it is empty, then the run ends::

    def handle(tx, messages):               # inside the RECEIVE's transaction
        for m in messages:
            tx.connection.execute(...)      # application state commits with the RECEIVE
            tx.send(m.conversation_handle, "//po/Invoice", {...})

    DrainQueueOperator(task_id="drain", queue="SupplierQueue", handler="po.handlers:handle")

The task registers as a running reader of the queue (``broker_activation_reader``) for its whole
run, keeping a heartbeat, so that the monitor counts it and starts no more readers than the
queue's ``max_readers``. It is refused, and returns at once, when that many readers already run
or when no conversation group is left for it. It RECEIVEs one conversation group per transaction
and calls ``handler(tx, messages)`` inside it: the handler's SENDs, ENDs and application writes
(through ``tx.connection``) commit together with the RECEIVE; an exception rolls all of it back,
the messages return to the queue, and the task fails (five such rollbacks in a row disable the
queue: poison-message handling).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow_broker.activation import Handler, ReaderSlot, drain, release_fires, resolve_handler
from airflow_broker.hooks.broker import BrokerHook
from airflow_broker.provider.compat import BaseOperator

if TYPE_CHECKING:
    from airflow_broker.broker import Broker
    from airflow_broker.provider.compat import Context


class DrainQueueOperator(BaseOperator):
    """Reads ``queue`` until it is empty, handing each conversation group to ``handler``.

    :param queue: the broker queue (templated, as ``queue_name``: ``BaseOperator.queue`` is the
        executor's queue, which this task gets from ``executor_queue``).
    :param handler: ``handler(tx, messages)``, a callable or ``"package.module:function"``
        (resolved in the worker); called inside each receiving transaction.
    :param top: at most this many messages per RECEIVE.
    :param max_batches: stop after this many transactions (the monitor starts another reader
        for what is left).
    :param wait_seconds: how long a RECEIVE waits for more before the reader decides the queue
        is empty.
    :param max_readers: the most readers at once (None: the queue's ``Activation.max_readers``).
    :param fire_id: the monitor's reader row to take over (templated; by default the one named
        by the asset event that started this run, else the oldest one waiting). When Airflow
        merged several asset events into this run, the other rows are released (``merged``).
    :param broker_conn_id: the Airflow connection of the broker database (templated).
    :param executor_queue: the executor queue (Celery, ...) to run this task on; what other
        operators take as ``queue``.

    Returns ``{"admitted", "reader_id", "batches", "messages", "drained"}``.
    """

    template_fields: Sequence[str] = ("queue_name", "fire_id", "broker_conn_id")
    ui_color = "#d8f0e0"

    def __init__(
        self,
        *,
        queue: str,
        handler: Handler | str,
        top: int | None = None,
        max_batches: int | None = None,
        wait_seconds: float = 0,
        max_readers: int | None = None,
        fire_id: str | None = None,
        broker_conn_id: str = BrokerHook.default_conn_name,
        executor_queue: str | None = None,
        **kwargs: Any,
    ) -> None:
        if executor_queue is not None:
            kwargs["queue"] = executor_queue
        super().__init__(**kwargs)
        #: The broker queue (``self.queue`` stays the executor's, as on every operator).
        self.queue_name = queue
        self.handler = handler
        self.top = top
        self.max_batches = max_batches
        self.wait_seconds = wait_seconds
        self.max_readers = max_readers
        self.fire_id = fire_id
        self.broker_conn_id = broker_conn_id
        self._hook: BrokerHook | None = None

    def _broker(self) -> Broker:
        """The broker database of ``broker_conn_id``."""
        if self._hook is None:
            self._hook = BrokerHook(broker_conn_id=self.broker_conn_id)
        return self._hook.get_broker()

    def _fire_ids(self, context: Context) -> list[str]:
        """The reader rows the monitor created for this run: ``fire_id``, or those named by the
        asset events that started it (an ``AssetWatcher`` event carries the trigger's payload;
        events that arrive before the run starts are merged into it), oldest first."""
        if self.fire_id:
            return [str(self.fire_id)]
        found: list[str] = []
        try:
            events = context.get("triggering_asset_events") or {}
            for asset_events in events.values():
                for event in asset_events:
                    payload = (getattr(event, "extra", None) or {}).get("payload") or {}
                    if payload.get("queue") == self.queue_name and payload.get("fire_id"):
                        found.append(str(payload["fire_id"]))
        except Exception:  # not an asset-triggered run, or an Airflow without this context
            return []
        return list(dict.fromkeys(found))

    def execute(self, context: Context) -> dict[str, Any]:
        handler = resolve_handler(self.handler)
        ti = context.get("ti")
        label = (
            f"{ti.dag_id}/{ti.run_id}/{ti.task_id}" if ti is not None else f"task {self.task_id}"
        )
        fire_ids = self._fire_ids(context)
        try:
            broker = self._broker()
            if len(fire_ids) > 1:
                # One run for several fires: the readers of the others will never come.
                release_fires(broker, fire_ids[:-1])
            with ReaderSlot(
                broker,
                self.queue_name,
                max_readers=self.max_readers,
                label=label[:256],
                fire_id=fire_ids[-1] if fire_ids else None,
            ) as slot:
                if not slot.admitted:
                    self.log.info(
                        "queue %r has enough readers for its messages: nothing to do",
                        self.queue_name,
                    )
                    return {
                        "admitted": False,
                        "reader_id": str(slot.reader_id),
                        "batches": 0,
                        "messages": 0,
                        "drained": False,
                    }
                report = drain(
                    broker,
                    self.queue_name,
                    handler,
                    top=self.top,
                    max_batches=self.max_batches,
                    wait_seconds=self.wait_seconds,
                )
                slot.outcome = "drained" if report.drained else "stopped"
        finally:
            hook, self._hook = self._hook, None
            if hook is not None:
                hook.close()
        self.log.info(
            "queue %r: %d message(s) in %d transaction(s)%s",
            self.queue_name,
            report.messages,
            report.batches,
            "; the queue is empty" if report.drained else "",
        )
        return {"admitted": True, "reader_id": str(slot.reader_id), **report.to_dict()}


__all__ = ["DrainQueueOperator"]
