"""One reader DAG for a family of queues: ``queue_family_dag``.

A queue's reader is a DAG scheduled on the queue's asset (``queue_asset``); a deployment with a
queue per service and per tenant would need a DAG file per queue. ``queue_family_dag`` builds
ONE DAG for many queues that share a handler::

    # dags/tenant_readers.py
    from airflow_broker.provider.readers import queue_family_dag

    queue_family_dag(
        "tenant_readers",
        queues=[f"orders_{tenant}" for tenant in TENANTS],
        handler="my_app.orders:handle",        # handler(tx, messages), as DrainQueueOperator's
        max_readers=1,                          # per queue
    )

The DAG is scheduled on any of the queues' assets (``queue_asset(queue)`` each, combined with
``|``: an ``AssetAny``), each watched by the queue's own ``QueueActivationTrigger`` (with
``max_readers``: the monitor never starts more readers of a queue than that). A run's one task,
:class:`~airflow_broker.operators.reader.DrainFamilyOperator`, reads the queue named by the asset
event that started the run; when Airflow merged the events of several queues into one run, it
reads each of them in turn, and releases the fires it does not take, as ``DrainQueueOperator``
does for one queue.

``max_active_runs`` is ``len(queues) * max_readers``, at most :data:`MAX_ACTIVE_RUNS` (16:
Airflow's default ``max_active_tasks`` of a DAG, and each run is one task); ``max_active_tasks``
follows it. Give either to override it. Events that arrive while that many runs are running
wait and are merged into the next run, so a busy family needs few runs, not one per queue.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import pendulum

from airflow_broker.errors import InvalidDefinition

#: The most runs of a family DAG at once, unless ``max_active_runs`` is given.
MAX_ACTIVE_RUNS = 16

_HANDLER = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _check_handler(owner: str, handler: Any) -> None:
    if callable(handler):
        return
    if not isinstance(handler, str) or not _HANDLER.match(handler):
        raise InvalidDefinition(
            f"{owner}: handler must be a callable or 'package.module:function', not {handler!r}"
        )


def _check_count(owner: str, name: str, value: Any, *, none: bool = False) -> None:
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidDefinition(f"{owner}: {name} must be a whole number >= 1, not {value!r}")


def queue_family_dag(
    dag_id: str,
    queues: Sequence[str],
    handler: Callable[..., Any] | str,
    *,
    broker_conn_id: str = "broker_default",
    max_readers: int | None = 1,
    poll_interval: float = 1.0,
    trigger_kwargs: dict[str, Any] | None = None,
    operator_kwargs: dict[str, Any] | None = None,
    **dag_kwargs: Any,
) -> Any:
    """The reader DAG ``dag_id`` of every queue of ``queues`` (see the module docstring).

    :param queues: the broker queues (distinct; at least one). Each must belong to this DAG
        only: another DAG scheduled on the same queue's asset would start readers too.
    :param handler: ``handler(tx, messages)``, ``"package.module:function"`` (imported when a
        task runs) or a callable; the same for every queue.
    :param broker_conn_id: the Airflow connection of the queues' broker database.
    :param max_readers: the most readers of each queue at once (None: each queue's
        ``Activation.max_readers``).
    :param poll_interval: the triggers' longest wait between two looks at a queue (seconds).
    :param trigger_kwargs: more arguments of each queue's ``QueueActivationTrigger``
        (``mode``, ``min_depth``, ``monitor_key``).
    :param operator_kwargs: more arguments of the run's ``DrainFamilyOperator`` (``top``,
        ``max_batches``, ``wait_seconds``, ``parallel``, ``executor_queue``, ``retries``...).
    :param dag_kwargs: the DAG's (``max_active_runs``, ``max_active_tasks``, ``tags``,
        ``start_date``, ``default_args``...).

    Raises :class:`~airflow_broker.errors.InvalidDefinition` (a ``ValueError``) naming the DAG
    and the problem: no queue, a queue named twice, a handler that is not a callable or
    ``"package.module:function"``, a count below 1.
    """
    from airflow.sdk import DAG, AssetAny

    from airflow_broker.operators.reader import DrainFamilyOperator, check_queues
    from airflow_broker.provider.triggers.activation import queue_asset

    if not isinstance(dag_id, str) or not dag_id:
        raise InvalidDefinition(
            f"queue_family_dag: dag_id must be a non-empty string, not {dag_id!r}"
        )
    owner = f"queue_family_dag {dag_id!r}"
    names = check_queues(owner, queues)
    _check_handler(owner, handler)
    _check_count(owner, "max_readers", max_readers, none=True)
    if "schedule" in dag_kwargs:
        raise InvalidDefinition(f"{owner}: the schedule is the queues' assets: do not give one")
    default_runs = MAX_ACTIVE_RUNS
    if max_readers is not None:
        default_runs = min(len(names) * max_readers, MAX_ACTIVE_RUNS)
    runs = dag_kwargs.pop("max_active_runs", default_runs)
    _check_count(owner, "max_active_runs", runs)
    tasks = dag_kwargs.pop("max_active_tasks", runs)
    _check_count(owner, "max_active_tasks", tasks)

    assets = [
        queue_asset(
            queue,
            broker_conn_id=broker_conn_id,
            max_readers=max_readers,
            poll_interval=poll_interval,
            **(trigger_kwargs or {}),
        )
        for queue in names
    ]
    schedule = assets[0] if len(assets) == 1 else AssetAny(*assets)
    dag_kwargs.setdefault("start_date", pendulum.datetime(2026, 1, 1, tz="UTC"))
    dag_kwargs.setdefault("catchup", False)
    dag_kwargs.setdefault("tags", ["airflow-broker"])
    dag_kwargs.setdefault(
        "doc_md",
        f"Reader of {len(names)} broker queue(s) ({', '.join(names[:5])}"
        f"{', ...' if len(names) > 5 else ''}); a run reads the queues its asset events name.",
    )
    with DAG(
        dag_id, schedule=schedule, max_active_runs=runs, max_active_tasks=tasks, **dag_kwargs
    ) as dag:
        DrainFamilyOperator(
            task_id="drain",
            queues=names,
            handler=handler,
            max_readers=max_readers,
            broker_conn_id=broker_conn_id,
            asset_names={q: a.name for q, a in zip(names, assets, strict=True)},
            **(operator_kwargs or {}),
        )
    return dag


__all__ = ["MAX_ACTIVE_RUNS", "queue_family_dag"]
