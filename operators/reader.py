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

import contextlib
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from airflow_broker.activation import Handler, ReaderSlot, drain, release_fires, resolve_handler
from airflow_broker.errors import InvalidDefinition
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
        try:
            broker, fires = self._broker(), self._fire_ids(context)
            return read_queue(self, broker, self.queue_name, fires, handler, _label(self, context))
        finally:
            hook, self._hook = self._hook, None
            if hook is not None:
                hook.close()


def _label(op: BaseOperator, context: Context) -> str:
    """The reader's label in ``broker_activation_reader``: the task instance, or the task."""
    ti = context.get("ti")
    label = f"{ti.dag_id}/{ti.run_id}/{ti.task_id}" if ti is not None else f"task {op.task_id}"
    return label[:256]


class _ReaderOptions(Protocol):
    """What :func:`read_queue` reads from its operator."""

    top: int | None
    max_batches: int | None
    wait_seconds: float
    max_readers: int | None

    @property
    def log(self) -> Any: ...  # Airflow's logger (its type differs between releases)


def read_queue(
    op: _ReaderOptions,
    broker: Broker,
    queue: str,
    fire_ids: list[str],
    handler: Handler,
    label: str,
) -> dict[str, Any]:
    """One reader of ``queue``, as ``op`` is set (``top``, ``max_batches``, ``wait_seconds``,
    ``max_readers``): takes the last of ``fire_ids`` (the monitor's reader rows for this run,
    oldest first), releases the others (``merged``), registers, drains, finishes. Returns the
    reader's result (``admitted``, ``reader_id``, ``batches``, ``messages``, ``drained``)."""
    if len(fire_ids) > 1:
        # One run for several fires: the readers of the others will never come.
        release_fires(broker, fire_ids[:-1])
    with ReaderSlot(
        broker,
        queue,
        max_readers=op.max_readers,
        label=label,
        fire_id=fire_ids[-1] if fire_ids else None,
    ) as slot:
        if not slot.admitted:
            op.log.info("queue %r has enough readers for its messages: nothing to do", queue)
            return {
                "admitted": False,
                "reader_id": str(slot.reader_id),
                "batches": 0,
                "messages": 0,
                "drained": False,
            }
        report = drain(
            broker,
            queue,
            handler,
            top=op.top,
            max_batches=op.max_batches,
            wait_seconds=op.wait_seconds,
        )
        slot.outcome = "drained" if report.drained else "stopped"
    op.log.info(
        "queue %r: %d message(s) in %d transaction(s)%s",
        queue,
        report.messages,
        report.batches,
        "; the queue is empty" if report.drained else "",
    )
    return {"admitted": True, "reader_id": str(slot.reader_id), **report.to_dict()}


class DrainFamilyOperator(BaseOperator):
    """The body of a family reader DAG's run (:func:`~airflow_broker.provider.readers.
    queue_family_dag`): one DAG scheduled on the assets of several queues, whose run reads each
    queue named by the asset events that started it, as :class:`DrainQueueOperator` reads one.

    Each asset event of a ``QueueActivationTrigger`` names its queue and its fire (the monitor's
    reader row); Airflow merges the events that arrive before a run starts into that run, so a
    run may name several queues, and a queue several times. For each queue named (in the order
    of its first event) the task releases all but the last of that queue's fires (``merged``),
    registers as a reader of the queue in the last one's place (refused beyond ``max_readers``,
    as ever), drains it and finishes, then goes on to the next queue. A queue whose handler
    raised does not stop the others: the task fails after them, with the first error (its note
    names every queue that failed). A run started without asset events (triggered by hand)
    reads every queue of the family.

    :param queues: the family's broker queues.
    :param handler: ``handler(tx, messages)``, a callable or ``"package.module:function"``,
        the same for every queue.
    :param top, max_batches, wait_seconds, max_readers, broker_conn_id, executor_queue: as
        :class:`DrainQueueOperator`'s, for each queue (``max_readers`` per queue).
    :param parallel: how many of the run's queues are read at once, each in a thread of its own
        with a connection of its own (1: one after the other). The handler is then called from
        several threads at once (each with its own transaction).
    :param asset_names: the asset name of each queue, to find the queue of an asset event that
        carries no trigger payload (one made by hand); default ``broker_queue_<queue>``.

    Returns ``{"queues": {queue: {"admitted", "reader_id", "batches", "messages",
    "drained"}}, "batches", "messages"}`` (the sums).
    """

    template_fields: Sequence[str] = ("broker_conn_id",)
    ui_color = "#d8f0e0"

    def __init__(
        self,
        *,
        queues: Sequence[str],
        handler: Handler | str,
        top: int | None = None,
        max_batches: int | None = None,
        wait_seconds: float = 0,
        max_readers: int | None = None,
        broker_conn_id: str = BrokerHook.default_conn_name,
        executor_queue: str | None = None,
        asset_names: dict[str, str] | None = None,
        parallel: int = 1,
        **kwargs: Any,
    ) -> None:
        if executor_queue is not None:
            kwargs["queue"] = executor_queue
        super().__init__(**kwargs)
        self.queues = check_queues(f"task {self.task_id!r}", queues)
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise InvalidDefinition(
                f"task {self.task_id!r}: parallel must be a whole number >= 1, not {parallel!r}"
            )
        self.parallel = parallel
        self.handler = handler
        self.top = top
        self.max_batches = max_batches
        self.wait_seconds = wait_seconds
        self.max_readers = max_readers
        self.broker_conn_id = broker_conn_id
        self.asset_names = dict(asset_names or {})
        self._hook: BrokerHook | None = None

    def _broker(self) -> Broker:
        if self._hook is None:
            self._hook = BrokerHook(broker_conn_id=self.broker_conn_id)
        return self._hook.get_broker()

    def plan(self, context: Context) -> dict[str, list[str]]:
        """The queues this run reads, each with its fires (oldest first): those named by the
        asset events that started it, in the order of their first event; every queue of the
        family, with no fire, when no asset event started it."""
        family = set(self.queues)
        by_asset = {f"broker_queue_{q}": q for q in self.queues}
        by_asset.update({name: q for q, name in self.asset_names.items() if q in family})
        seen: list[tuple[Any, int, str, str | None]] = []
        events = context.get("triggering_asset_events") or {}
        for key, asset_events in events.items():
            for event in asset_events:
                payload = (getattr(event, "extra", None) or {}).get("payload") or {}
                queue = payload.get("queue")
                if queue is None:  # an event made by hand: the queue of its asset
                    asset = getattr(event, "asset", None) or key
                    queue = by_asset.get(str(getattr(asset, "name", asset)))
                if queue not in family:
                    self.log.warning(
                        "asset event %s names no queue of this family (%s): ignored",
                        getattr(event, "id", "?"),
                        queue,
                    )
                    continue
                fire = payload.get("fire_id")
                stamp = getattr(event, "timestamp", None)
                seen.append((stamp, len(seen), queue, str(fire) if fire else None))
        if not seen:
            return {q: [] for q in self.queues}
        with contextlib.suppress(TypeError):  # timestamps missing or not comparable
            seen.sort(key=lambda s: (s[0], s[1]))
        plan: dict[str, list[str]] = {}
        for _stamp, _n, queue, fire in seen:
            fires = plan.setdefault(queue, [])
            if fire is not None and fire not in fires:
                fires.append(fire)
        return plan

    def execute(self, context: Context) -> dict[str, Any]:
        handler = resolve_handler(self.handler)
        plan = self.plan(context)
        label = _label(self, context)
        self.log.info("reading %d queue(s): %s", len(plan), ", ".join(list(plan)[:20]))
        results: dict[str, dict[str, Any]] = {}
        failed: dict[str, BaseException] = {}
        try:
            broker = self._broker()

            def read(queue: str) -> None:
                try:
                    results[queue] = read_queue(self, broker, queue, plan[queue], handler, label)
                except Exception as exc:  # the other queues are still read
                    self.log.exception("queue %r: the reader failed", queue)
                    failed[queue] = exc

            if self.parallel == 1 or len(plan) == 1:
                for queue in plan:
                    read(queue)
            else:
                with ThreadPoolExecutor(
                    min(self.parallel, len(plan)), thread_name_prefix="broker-family"
                ) as pool:
                    list(pool.map(read, plan))
        finally:
            hook, self._hook = self._hook, None
            if hook is not None:
                hook.close()
        if failed:
            failed = {q: failed[q] for q in plan if q in failed}  # in the plan's order
            first = next(iter(failed.values()))
            first.add_note(
                f"{type(self).__name__} {self.task_id!r}: {len(failed)} of {len(plan)} "
                f"queue(s) failed: {', '.join(failed)}"
            )
            raise first
        return {
            "queues": {q: results[q] for q in plan if q in results},
            "batches": sum(r["batches"] for r in results.values()),
            "messages": sum(r["messages"] for r in results.values()),
        }


def check_queues(owner: str, queues: Any) -> list[str]:
    """``queues`` as a list of distinct, non-empty queue names; else :class:`InvalidDefinition`
    naming ``owner`` (a DAG or a task) and what is wrong."""
    if isinstance(queues, str | bytes) or not isinstance(queues, Iterable):
        kind = type(queues).__name__
        raise InvalidDefinition(
            f"{owner}: queues must be a list of queue names, not {kind} {queues!r}"
        )
    names = list(queues)
    if not names:
        raise InvalidDefinition(f"{owner}: queues is empty: name at least one queue")
    bad = [q for q in names if not isinstance(q, str) or not q.strip()]
    if bad:
        raise InvalidDefinition(f"{owner}: queue names must be non-empty strings, not {bad!r}")
    twice = sorted({q for q in names if names.count(q) > 1})
    if twice:
        raise InvalidDefinition(f"{owner}: queue(s) named more than once: {', '.join(twice)}")
    return names


__all__ = ["DrainFamilyOperator", "DrainQueueOperator", "read_queue"]
