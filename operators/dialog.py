"""Dialog operators: BEGIN DIALOG, SEND, RECEIVE and END CONVERSATION as Airflow tasks.

Each operator is one broker transaction over :class:`~airflow_broker.hooks.broker.BrokerHook`:
it commits when the task succeeds at its work and rolls back when it raises, so a failed task
leaves the broker as it was. Return values are XCom-safe (strings, ints, lists of plain dicts).

Names, handles and bodies are templated. A body may be a str (sent as UTF-8), bytes, or any
JSON value (a dict or list is rendered field by field, then sent as JSON); it may also come from
another task, as a template (``"{{ ti.xcom_pull(task_ids='quote') }}"``) or natively
(``body=quote.output``). A handle list may come natively from XCom or as a rendered list literal.

A retried task does not BEGIN, SEND or END twice: ``BeginDialogOperator``, ``SendOperator`` and
``EndConversationOperator`` pass a dedupe key (by default the task instance's identity,
``dag_id/run_id/task_id/map_index``, the same for every try), so a try that committed and then
failed (the worker died, a later step raised) leaves the retry nothing to do.

RECEIVE in a task commits before the messages reach the next task: the messages are then out
of the broker and in XCom. When the work done with a message must commit together with its
removal from the queue, do it in the same transaction (``DrainQueueOperator``'s handler).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

from airflow_broker.constants import DEFAULT
from airflow_broker.errors import BrokerError, InvalidDefinition
from airflow_broker.hooks.broker import BrokerHook
from airflow_broker.messaging.dedupe import MAX_KEY_LENGTH
from airflow_broker.operators._leasing import check_lease_arguments, take_lease
from airflow_broker.provider.compat import BaseOperator
from airflow_broker.provider.xcom import messages_to_dicts, rendered_literal

if TYPE_CHECKING:
    from airflow_broker.broker import Broker, Transaction
    from airflow_broker.provider.compat import Context

T = TypeVar("T")


class BrokerOperator(BaseOperator):
    """Base of the broker operators: the hook, one transaction, errors that say where.

    :param broker_conn_id: the Airflow connection of the broker database (see
        :class:`~airflow_broker.hooks.broker.BrokerHook`; without it the embedded store).
    """

    def __init__(self, *, broker_conn_id: str = BrokerHook.default_conn_name, **kwargs: Any):
        super().__init__(**kwargs)
        self.broker_conn_id = broker_conn_id

    @cached_property
    def hook(self) -> BrokerHook:
        """The hook of :attr:`broker_conn_id`."""
        return BrokerHook(broker_conn_id=self.broker_conn_id)

    def describe(self) -> str:
        """What this task does to which objects, for error messages."""
        return ""

    def run(self, work: Callable[[Broker], T]) -> T:
        """``work(broker)``; a broker error gets a note naming this task, its connection and
        what it was doing. The broker's engine is disposed afterwards."""
        try:
            return work(self.hook.get_broker())
        except BrokerError as exc:
            what = self.describe()
            exc.add_note(
                f"in {type(self).__name__} {self.task_id!r} on broker connection "
                f"{self.broker_conn_id!r}{': ' + what if what else ''}"
            )
            raise
        finally:
            self.hook.close()

    def in_transaction(self, work: Callable[[Transaction], T]) -> T:
        """``work(tx)`` in one broker transaction (committed unless it raises)."""

        def transact(broker: Broker) -> T:
            with broker.transaction() as tx:
                return work(tx)

        return self.run(transact)


# --------------------------------------------------------------------------------------------
# Argument shapes


def handle_list(value: Any, field: str) -> list[str]:
    """Conversation handles from a str, a UUID, a list of them, or a rendered list literal
    (``"['…', '…']"`` or JSON); each checked to be a UUID. ``field`` names the argument."""
    if isinstance(value, str) and value.strip().startswith("["):
        text = value.strip()
        try:
            value = rendered_literal(text)
        except ValueError:
            raise InvalidDefinition(
                f"{field} {text[:80]!r} is neither a conversation handle nor a list of them"
            ) from None
    if isinstance(value, str | uuid.UUID):
        items: list[Any] = [value]
    elif isinstance(value, list | tuple | set | frozenset):
        items = list(value)
    else:
        raise InvalidDefinition(
            f"{field} must be a conversation handle (a UUID string) or a list of them, "
            f"not {type(value).__name__} {value!r}"
        )
    out: list[str] = []
    for item in items:
        try:
            out.append(str(item if isinstance(item, uuid.UUID) else uuid.UUID(str(item).strip())))
        except ValueError:
            raise InvalidDefinition(
                f"{field}: {item!r} is not a conversation handle (a UUID)"
            ) from None
    return out


def optional_name(value: Any, field: str) -> str | None:
    """A templated name: None or empty (a template that rendered nothing) means not given."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidDefinition(f"{field} must be a string, not {type(value).__name__} {value!r}")
    return value.strip() or None


def optional_handle(value: Any, field: str) -> str | None:
    """One optional handle (a conversation or conversation group id)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    handles = handle_list(value, field)
    if len(handles) != 1:
        raise InvalidDefinition(f"{field} must be one UUID, not {len(handles)}")
    return handles[0]


def dedupe_key_for(dedupe: bool, dedupe_key: Any, context: Context) -> str | None:
    """The dedupe key of a dialog operator: None when ``dedupe`` is off; ``dedupe_key`` when
    given (a template that rendered nothing counts as not given); else the task instance's
    identity, ``dag_id/run_id/task_id/map_index`` (no try number: every try shares it; hashed
    when too long), or None outside a task run (a context without ``ti``)."""
    if not dedupe:
        return None
    if dedupe_key is not None and not (isinstance(dedupe_key, str) and not dedupe_key.strip()):
        if not isinstance(dedupe_key, str):
            raise InvalidDefinition(
                f"dedupe_key must be a string, not {type(dedupe_key).__name__} {dedupe_key!r}"
            )
        return dedupe_key
    ti = context.get("ti")
    if ti is None:
        return None
    key = f"{ti.dag_id}/{ti.run_id}/{ti.task_id}/{getattr(ti, 'map_index', -1)}"
    if len(key) > MAX_KEY_LENGTH - 16:  # room for SendOperator's "#<i>" of each body
        key = "sha256:" + hashlib.sha256(key.encode()).hexdigest()
    return key


# --------------------------------------------------------------------------------------------
# Operators


class BeginDialogOperator(BrokerOperator):
    """BEGIN DIALOG from a local service; with ``message_type``, also SEND the first message.

    Returns (XCom) the initiator's conversation handle, as a string.

    :param from_service: the local service that begins the dialog (templated).
    :param to_service: the target service, here or in another broker (templated).
    :param contract: the contract of the dialog (templated).
    :param broker_instance: the target's broker instance id, when it must be one (templated).
    :param lifetime_seconds: the dialog ends in error after this long.
    :param related_conversation_group: join this conversation group (templated).
    :param related_conversation: join the group of this conversation (templated).
    :param message_type: send a first message of this type in the same transaction (templated).
    :param body: the first message's body (templated; str, bytes or JSON value).
    :param dedupe_key: the dedupe key (templated; None or empty: the task instance's identity):
        a retry returns the first try's handle and sends nothing (:func:`dedupe_key_for`).
    :param dedupe: ``False``: no key; each try begins a new dialog.
    :param encryption: BEGIN DIALOG's ENCRYPTION (default on): a dialog with another broker
        leaves only under dialog security; off, it travels in clear where none is configured.
    """

    template_fields: Sequence[str] = (
        "from_service",
        "to_service",
        "contract",
        "broker_instance",
        "related_conversation_group",
        "related_conversation",
        "message_type",
        "body",
        "dedupe_key",
    )
    template_fields_renderers = {"body": "json"}
    ui_color = "#e8f1fb"

    def __init__(
        self,
        *,
        from_service: str,
        to_service: str,
        contract: str = DEFAULT,
        broker_instance: str | None = None,
        lifetime_seconds: int | None = None,
        related_conversation_group: str | None = None,
        related_conversation: str | None = None,
        message_type: str | None = None,
        body: Any = None,
        dedupe_key: str | None = None,
        dedupe: bool = True,
        encryption: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.from_service = from_service
        self.to_service = to_service
        self.contract = contract
        self.encryption = encryption
        self.broker_instance = broker_instance
        self.lifetime_seconds = lifetime_seconds
        self.related_conversation_group = related_conversation_group
        self.related_conversation = related_conversation
        self.message_type = message_type
        self.body = body
        self.dedupe_key = dedupe_key
        self.dedupe = dedupe

    def describe(self) -> str:
        first = f", first message {self.message_type!r}" if self.message_type else ""
        return (
            f"BEGIN DIALOG from service {self.from_service!r} to service {self.to_service!r} "
            f"on contract {self.contract!r}{first}"
        )

    def execute(self, context: Context) -> str:
        key = dedupe_key_for(self.dedupe, self.dedupe_key, context)
        # Checked before the broker is reached: a task that cannot succeed touches nothing.
        message_type = optional_name(self.message_type, "message_type")
        if message_type is None and self.body is not None:
            raise InvalidDefinition(
                "body given without message_type (the first message needs a message type; "
                "use 'DEFAULT' for the default one)"
            )

        def begin(tx: Transaction) -> str:
            handle = tx.begin_dialog(
                self.from_service,
                self.to_service,
                contract=self.contract,
                broker_instance=optional_name(self.broker_instance, "broker_instance"),
                lifetime_seconds=self.lifetime_seconds,
                related_conversation=optional_handle(
                    self.related_conversation, "related_conversation"
                ),
                related_conversation_group=optional_handle(
                    self.related_conversation_group, "related_conversation_group"
                ),
                dedupe_key=key,
                encryption=self.encryption,
            )
            if message_type is not None:
                tx.send(handle, message_type, self.body, dedupe_key=key)
            return str(handle)

        handle = self.in_transaction(begin)
        self.log.info("%s: conversation handle %s", self.describe(), handle)
        return handle


class SendOperator(BrokerOperator):
    """SEND ON CONVERSATION: one message, or several in order, on one or several conversations,
    in one transaction (all are sent or none).

    Returns (XCom) how many messages were sent (conversations x bodies).

    :param conversation_handle: a handle, or a list of handles (templated; natively from XCom
        with ``begin.output``).
    :param message_type: the message type (templated).
    :param body: the body (templated; str, bytes or JSON value).
    :param bodies: instead of ``body``, several bodies, sent in this order on each conversation
        (templated; natively from XCom with ``task.output``).
    :param dedupe_key: the dedupe key (templated; None or empty: the task instance's identity):
        a retry skips the conversations the first try sent on (with ``bodies``, body ``i`` is
        keyed ``<key>#<i>``).
    :param dedupe: ``False``: no key; each try sends again.
    """

    template_fields: Sequence[str] = (
        "conversation_handle",
        "message_type",
        "body",
        "bodies",
        "dedupe_key",
    )
    template_fields_renderers = {"body": "json", "bodies": "json"}
    ui_color = "#e8f1fb"

    def __init__(
        self,
        *,
        conversation_handle: str | Sequence[str],
        message_type: str = DEFAULT,
        body: Any = None,
        bodies: Sequence[Any] | None = None,
        dedupe_key: str | None = None,
        dedupe: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if body is not None and bodies is not None:
            raise ValueError(
                f"{type(self).__name__} {kwargs.get('task_id')!r}: give body or bodies, not both"
            )
        self.conversation_handle = conversation_handle
        self.message_type = message_type
        self.body = body
        self.bodies = bodies
        self.dedupe_key = dedupe_key
        self.dedupe = dedupe

    def describe(self) -> str:
        return f"SEND {self.message_type!r} on conversation {self.conversation_handle}"

    def execute(self, context: Context) -> int:
        key = dedupe_key_for(self.dedupe, self.dedupe_key, context)

        def send(tx: Transaction) -> tuple[int, int]:
            handles = handle_list(self.conversation_handle, "conversation_handle")
            if not handles:
                raise InvalidDefinition("conversation_handle is an empty list")
            bodies = self._bodies()
            for i, body in enumerate(bodies):
                keyed = key if key is None or self.bodies is None else f"{key}#{i}"
                tx.send(handles, self.message_type, body, dedupe_key=keyed)
            return len(handles) * len(bodies), len(handles)

        count, conversations = self.in_transaction(send)
        self.log.info(
            "sent %d message(s) of type %r on %d conversation(s)",
            count,
            self.message_type,
            conversations,
        )
        return count

    def _bodies(self) -> list[Any]:
        if self.bodies is None:
            return [self.body]
        bodies = self.bodies
        if isinstance(bodies, str):
            # A template rendered the list as text (without native rendering): parse it back.
            try:
                bodies = json.loads(bodies)
            except ValueError:
                raise InvalidDefinition(
                    f"bodies rendered as {bodies[:80]!r}, which is not a JSON list"
                ) from None
        if not isinstance(bodies, list | tuple):
            raise InvalidDefinition(f"bodies must be a list, not {type(bodies).__name__}")
        return list(bodies)


class ReceiveOperator(BrokerOperator):
    """RECEIVE from a queue: the ready messages of one conversation group, in one transaction.

    Returns (XCom) the messages as plain dicts
    (:func:`airflow_broker.provider.xcom.message_to_dict`): the RECEIVE columns, ``body_text``,
    ``body_base64``, ``body_json`` when the body is JSON,
    and ``error``. An empty list when nothing arrived within ``wait_seconds``.

    **With** ``lease_seconds``, the task takes a lease instead (``Broker.lease``): the messages
    stay in the queue, their conversation group held by the lease (no transaction stays open),
    until a later task completes it (``CompleteLeaseOperator``, or ``tx.complete(token)`` in the
    handler's own broker transaction), releases it (``ReleaseLeaseOperator``) or it expires.
    Returns (XCom) the lease as a dict (:func:`airflow_broker.provider.xcom.lease_to_dict`:
    ``token``, ``queue``, ``conversation_group_id``, ``expires_at`` and ``messages`` as above),
    or None (no XCom) when nothing arrived within ``wait_seconds``.

    :param queue: the broker queue (templated, as ``queue_name``: ``BaseOperator.queue`` is the
        executor's queue, which this task gets from ``executor_queue``).
    :param top: at most this many messages.
    :param wait_seconds: wait this long for messages (WAITFOR); 0 returns at once.
    :param conversation_handle: only from this conversation (templated); not with a lease,
        which holds a whole conversation group (give ``conversation_group``).
    :param conversation_group: only from this conversation group (templated).
    :param lease_seconds: lease the messages for this long instead of receiving them.
    :param executor_queue: the executor queue (Celery, ...) to run this task on; what other
        operators take as ``queue``.
    """

    template_fields: Sequence[str] = ("queue_name", "conversation_handle", "conversation_group")
    ui_color = "#eaf7ea"

    def __init__(
        self,
        *,
        queue: str,
        top: int | None = None,
        wait_seconds: float = 0,
        conversation_handle: str | None = None,
        conversation_group: str | None = None,
        lease_seconds: float | None = None,
        executor_queue: str | None = None,
        **kwargs: Any,
    ) -> None:
        if executor_queue is not None:
            kwargs["queue"] = executor_queue
        super().__init__(**kwargs)
        if lease_seconds is not None:
            check_lease_arguments(self.task_id, lease_seconds, conversation_handle)
        #: The broker queue (``self.queue`` stays the executor's, as on every operator).
        self.queue_name = queue
        self.top = top
        self.wait_seconds = wait_seconds
        self.conversation_handle = conversation_handle
        self.conversation_group = conversation_group
        self.lease_seconds = lease_seconds

    def describe(self) -> str:
        if self.lease_seconds is not None:
            return f"RECEIVE from queue {self.queue_name!r} with a lease of {self.lease_seconds} s"
        return f"RECEIVE from queue {self.queue_name!r}"

    def execute(self, context: Context) -> list[dict[str, Any]] | dict[str, Any] | None:
        if self.lease_seconds is not None:
            group = optional_handle(self.conversation_group, "conversation_group")
            return take_lease(self, self.lease_seconds, group)

        def receive(tx: Transaction) -> list[dict[str, Any]]:
            messages = tx.receive(
                self.queue_name,
                top=self.top,
                conversation_handle=optional_handle(
                    self.conversation_handle, "conversation_handle"
                ),
                conversation_group=optional_handle(self.conversation_group, "conversation_group"),
                wait_seconds=self.wait_seconds,
            )
            return messages_to_dicts(messages)

        messages = self.in_transaction(receive)
        if messages:
            self.log.info(
                "received %d message(s) from queue %r, conversation group %s",
                len(messages),
                self.queue_name,
                messages[0]["conversation_group_id"],
            )
        else:
            self.log.info("no message ready on queue %r", self.queue_name)
        return messages


class EndConversationOperator(BrokerOperator):
    """END CONVERSATION: plain, WITH ERROR (``error_code`` and ``error_description``) or WITH
    CLEANUP. Several handles end in one transaction.

    :param conversation_handle: a handle, or a list of handles (templated).
    :param error_code: end with an Error message of this code (a positive integer).
    :param error_description: the Error message's text (templated).
    :param cleanup: remove the local endpoint and its messages, telling no one.
    :param dedupe_key: the dedupe key (templated; None or empty: the task instance's identity):
        a retry leaves the conversations the first try ended as they are, without an error.
    :param dedupe: ``False``: no key; a retry ends again (and fails: the conversation ended).
    """

    template_fields: Sequence[str] = ("conversation_handle", "error_description", "dedupe_key")
    ui_color = "#fbeaea"

    def __init__(
        self,
        *,
        conversation_handle: str | Sequence[str],
        error_code: int | None = None,
        error_description: str | None = None,
        cleanup: bool = False,
        dedupe_key: str | None = None,
        dedupe: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.conversation_handle = conversation_handle
        self.error_code = error_code
        self.error_description = error_description
        self.cleanup = cleanup
        self.dedupe_key = dedupe_key
        self.dedupe = dedupe

    def describe(self) -> str:
        how = (
            f" WITH ERROR {self.error_code}"
            if self.error_code is not None
            else " WITH CLEANUP"
            if self.cleanup
            else ""
        )
        return f"END CONVERSATION {self.conversation_handle}{how}"

    def execute(self, context: Context) -> None:
        key = dedupe_key_for(self.dedupe, self.dedupe_key, context)

        def end(tx: Transaction) -> list[str]:
            handles = handle_list(self.conversation_handle, "conversation_handle")
            for handle in handles:
                tx.end_conversation(
                    handle,
                    error_code=self.error_code,
                    error_description=self.error_description,
                    cleanup=self.cleanup,
                    dedupe_key=key,
                )
            return handles

        handles = self.in_transaction(end)
        self.log.info("ended %d conversation(s): %s", len(handles), ", ".join(handles))


__all__ = [
    "BeginDialogOperator",
    "BrokerOperator",
    "EndConversationOperator",
    "ReceiveOperator",
    "SendOperator",
]
