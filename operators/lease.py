"""Lease operators: complete or release what ``ReceiveOperator(lease_seconds=...)`` leased.

A lease (``Broker.lease``) holds one conversation group's messages for a handler that runs for
minutes, with no transaction open meanwhile: the messages stay in the queue, hidden from other
readers, until the lease is completed (they are removed), released (they are ready again at once,
or after ``delay``) or expires (they are ready again, counted as a failed attempt)::

    receive = ReceiveOperator(task_id="receive", queue="jobs", lease_seconds=600)
    work = long_work(receive.output)            # minutes; no broker transaction open
    complete = CompleteLeaseOperator(task_id="complete", lease=receive.output)
    release = ReleaseLeaseOperator(task_id="release", lease=receive.output)
    receive >> work >> complete >> release

``CompleteLeaseOperator`` removes the messages in a transaction of its own: the work before it
happens at least once (again, after a failure, when the lease is released or expires). For
exactly once, the handler task itself completes the lease in the transaction that holds its
writes and SENDs (``with broker.transaction() as tx: ...; tx.complete(token)``), and no
``CompleteLeaseOperator`` is needed (``dags/long_handler.py``).

``ReleaseLeaseOperator`` runs only when something upstream failed (trigger rule ``one_failed``)
and gives the lease back at once, instead of leaving the messages hidden until the lease
expires. It is a teardown task, so the DAG run's state stays the failed handler's (see the
class).

The lease comes from XCom, as the other operators take handles: natively (``receive.output``,
which also makes the task downstream of the receive) or rendered by a template
(``"{{ ti.xcom_pull(task_ids='receive') }}"``); or by task id (``receive_task_id="receive"``). No
lease in XCom (the queue was empty) means nothing to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow_broker.errors import LeaseExpired
from airflow_broker.operators.dialog import BrokerOperator
from airflow_broker.provider.compat import AirflowFailException
from airflow_broker.provider.xcom import lease_from_xcom

if TYPE_CHECKING:
    from airflow_broker.broker import Broker, Transaction
    from airflow_broker.messaging.leases import Lease
    from airflow_broker.provider.compat import Context


class LeaseOperator(BrokerOperator):
    """Base of the lease operators: the lease from XCom.

    :param lease: the lease, as ``ReceiveOperator(lease_seconds=...)`` returned it (templated;
        natively ``receive.output``). None or empty: no lease, nothing to do.
    :param receive_task_id: instead of ``lease``, the task id whose return value is the lease
        (pulled when the task runs; make this task downstream of it).
    """

    template_fields: Sequence[str] = ("lease",)
    template_fields_renderers = {"lease": "json"}

    def __init__(
        self, *, lease: Any = None, receive_task_id: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if (lease is None) == (receive_task_id is None):
            raise ValueError(
                f"{type(self).__name__} {self.task_id!r}: give the lease (lease=receive.output) "
                "or the task that took it (receive_task_id=...), exactly one of them"
            )
        self.lease = lease
        self.receive_task_id = receive_task_id
        self._taken: Lease | None = None

    def describe(self) -> str:
        lease = self._taken
        if lease is None:
            return ""
        return (
            f"lease {lease.token} of queue {lease.queue!r} (conversation group "
            f"{lease.conversation_group_id}, {len(lease.messages)} message(s))"
        )

    def pull_lease(self, context: Context) -> Lease | None:
        """The lease this task acts on, or None (no lease was taken)."""
        if self.receive_task_id is not None:
            value = context["ti"].xcom_pull(task_ids=self.receive_task_id)
            self._taken = lease_from_xcom(value, f"the return value of {self.receive_task_id!r}")
        else:
            self._taken = lease_from_xcom(self.lease, "lease")
        return self._taken


class CompleteLeaseOperator(LeaseOperator):
    """Completes a lease: its messages leave the queue, in one broker transaction.

    Fails (without retrying: a retry cannot complete it either) when the lease expired and was
    taken back before this task ran: its messages went back to the queue, counted as a failed
    attempt, and another reader may have had them since. Nothing (no XCom) when there is no
    lease.

    :param lease: the lease (templated; natively ``receive.output``).
    :param receive_task_id: instead of ``lease``, the task whose return value is the lease.
    """

    ui_color = "#eaf7ea"

    def execute(self, context: Context) -> None:
        lease = self.pull_lease(context)
        if lease is None:
            self.log.info("no lease to complete: the receive found no message")
            return

        def complete(tx: Transaction) -> None:
            tx.complete(lease.token)

        try:
            self.in_transaction(complete)
        except LeaseExpired as exc:
            raise AirflowFailException(
                f"{self.describe()} expired at {lease.expires_at.isoformat()} and was taken "
                f"back before {type(self).__name__} {self.task_id!r} could complete it: its "
                f"messages went back to queue {lease.queue!r} (a failed attempt, counted in "
                "their receive_count) and may have been handled by another reader since. "
                "Nothing was removed. Give the handler a longer lease_seconds, or extend the "
                f"lease while it works (Broker.extend). ({exc})"
            ) from exc
        self.log.info("completed %s", self.describe())


class ReleaseLeaseOperator(LeaseOperator):
    """Releases a lease when the task that should have completed it failed: the messages are
    ready again at once (or after ``delay`` seconds), instead of when the lease expires.

    Its trigger rule is ``one_failed`` (it runs only when an upstream task failed; otherwise it
    is skipped), and it **is a teardown task** (``is_teardown``): Airflow leaves teardowns out of
    the DAG run's state. Without that, this task would be the run's only leaf, and a run whose
    handler failed would be marked successful once the release succeeded; with it, the run's
    state is the handler's (failed), the release shown beside it. Pass ``teardown=False`` for a
    plain task (then another leaf must carry the failure).

    A lease that already expired (or was completed) has nothing left to give back: the task
    logs it and succeeds. Nothing happens without a lease.

    :param lease: the lease (templated; natively ``receive.output``).
    :param receive_task_id: instead of ``lease``, the task whose return value is the lease.
    :param delay: the messages are ready again after this many seconds (a back-off before the
        next attempt); 0: at once.
    :param teardown: mark the task as a teardown (default), so the run's state ignores it.
    """

    ui_color = "#fbeaea"

    def __init__(self, *, delay: float = 0, teardown: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("trigger_rule", "one_failed")
        super().__init__(**kwargs)
        if delay < 0:
            raise ValueError(
                f"{type(self).__name__} {self.task_id!r}: delay must be 0 or more, not {delay!r}"
            )
        self.delay = delay
        if teardown:
            self.is_teardown = True

    def execute(self, context: Context) -> bool:
        lease = self.pull_lease(context)
        if lease is None:
            self.log.info("no lease to release: the receive found no message (or failed)")
            return False

        def release(broker: Broker) -> None:
            broker.release(lease.token, delay=self.delay)

        try:
            self.run(release)
        except LeaseExpired as exc:
            self.log.warning(
                "nothing to release: %s is no longer held (%s); its messages are back in "
                "queue %r already",
                self.describe(),
                exc,
                lease.queue,
            )
            return False
        self.log.info(
            "released %s: its messages are ready again%s",
            self.describe(),
            f" in {self.delay:g} s" if self.delay else "",
        )
        return True


__all__ = ["CompleteLeaseOperator", "LeaseOperator", "ReleaseLeaseOperator"]
