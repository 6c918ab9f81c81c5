"""ConversationSensor: wait, without holding a worker slot, for the next message on a dialog.

A long-running dialog is a chain of short tasks; between two of them the other side may take
days to answer. The sensor completes when a message is ready on the conversation, without
receiving it (the next task RECEIVEs it, with ``conversation_handle=...``), and returns what is
ready: ``conversation_handle``, ``conversation_group_id``, ``ready`` (how many messages) and
``message_type_name`` (the one RECEIVE returns first). A conversation timer counts: its
DialogTimer is a message, and the waiting trigger runs the broker's due work, so it fires.

It fails when the conversation does not exist, is on another queue, or is closed with nothing
left to read.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_broker.activation import due_step
from airflow_broker.errors import ConversationEnded, UnknownObject
from airflow_broker.hooks.broker import BrokerHook
from airflow_broker.provider.compat import BaseSensorOperator, PokeReturnValue
from airflow_broker.provider.triggers.conversation import (
    ConversationMessageTrigger,
    conversation_ready,
)

if TYPE_CHECKING:
    from airflow_broker.broker import Broker
    from airflow_broker.provider.compat import Context


class ConversationSensor(BaseSensorOperator):
    """Waits until a message is ready on ``conversation_handle``.

    :param queue: the queue of the conversation's local endpoint (templated, as
        ``queue_name``; ``BaseOperator.queue`` is the executor's queue: ``executor_queue``).
    :param conversation_handle: the local endpoint's handle (templated; e.g. the XCom of a
        ``BeginDialogOperator``).
    :param broker_conn_id: the Airflow connection of the broker database (templated).
    :param poll_interval: the longest wait between two looks, in the triggerer (seconds).
    :param deferrable: wait in the triggerer (default) rather than in a worker.
    :param executor_queue: the executor queue (Celery, ...) to run this task on.
    """

    template_fields: Sequence[str] = ("queue_name", "conversation_handle", "broker_conn_id")
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        queue: str,
        conversation_handle: str,
        broker_conn_id: str = BrokerHook.default_conn_name,
        poll_interval: float = 1.0,
        deferrable: bool = True,
        executor_queue: str | None = None,
        **kwargs: Any,
    ) -> None:
        if executor_queue is not None:
            kwargs["queue"] = executor_queue
        kwargs.setdefault("poke_interval", poll_interval)
        super().__init__(**kwargs)
        #: The broker queue (``self.queue`` stays the executor's, as on every operator).
        self.queue_name = queue
        self.conversation_handle = conversation_handle
        self.broker_conn_id = broker_conn_id
        self.poll_interval = poll_interval
        self.deferrable = deferrable
        self._hook: BrokerHook | None = None

    def _broker(self) -> Broker:
        """The broker database of ``broker_conn_id``."""
        if self._hook is None:
            self._hook = BrokerHook(broker_conn_id=self.broker_conn_id)
        return self._hook.get_broker()

    def _look(self) -> dict[str, Any] | None:
        try:
            broker = self._broker()
            due_step(broker)
            found = conversation_ready(broker, self.queue_name, self.conversation_handle)
            return self._checked(found)
        finally:
            hook, self._hook = self._hook, None
            if hook is not None:
                hook.close()

    @staticmethod
    def _checked(event: dict[str, Any] | None) -> dict[str, Any] | None:
        if event is not None and event.get("status") == "error":
            error = event.get("error") or "the conversation cannot be waited on"
            if event.get("reason") == "closed":
                raise ConversationEnded(error)
            raise UnknownObject(error)
        return event

    def trigger(self) -> ConversationMessageTrigger:
        """The trigger this sensor defers to."""
        return ConversationMessageTrigger(
            queue=self.queue_name,
            conversation_handle=self.conversation_handle,
            broker_conn_id=self.broker_conn_id,
            poll_interval=self.poll_interval,
        )

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        found = self._look()
        if found is not None:
            return found
        self.defer(
            trigger=self.trigger(),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout) if self.timeout else None,
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """The trigger fired: a message is ready (or the wait is pointless: then fail)."""
        checked = self._checked(event)
        assert checked is not None
        return checked

    def poke(self, context: Context) -> PokeReturnValue:
        found = self._look()
        return PokeReturnValue(is_done=found is not None, xcom_value=found)


__all__ = ["ConversationSensor"]
