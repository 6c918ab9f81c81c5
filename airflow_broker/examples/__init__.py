"""Example applications of the broker, written as plain engine code (no Airflow import).

- :mod:`airflow_broker.examples.purchase_order`: seed 004's long-running purchase-order dialog
  between a buyer and a supplier, with application state keyed by conversation group id and
  idempotent compensating actions.
- :mod:`airflow_broker.examples.echo`: an echo service that answers liveness probes.

Each module declares its broker objects, creates its application tables in the broker database
(``setup(broker)``) and provides message handlers with the signature ``handler(tx, messages)``:
the same functions run in Airflow (``DrainQueueOperator(handler="module:function")``, the DAGs in
``dags/``) and outside it (``airflow_broker.runner.ActivationRunner``, ``make demo``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow_broker import declarations

if TYPE_CHECKING:
    from airflow_broker.broker import Broker


def apply_declarations(broker: Broker, text: str, name: str) -> list[str]:
    """Make ``broker`` match the declarations file ``text`` (the ``airflow-broker apply``
    format), in one transaction; returns what changed (nothing when it already matches).

    :param name: how problems name the file (``FILE:LINE: message``).
    """
    decls, problems = declarations.parse(text)
    if problems:
        raise declarations.DeclarationsInvalid(name, problems)
    the_plan, problems = declarations.plan(decls, broker.catalog())
    if problems:
        raise declarations.DeclarationsInvalid(name, problems)
    changes = [c.describe() for c in the_plan.changes if c.action != "unchanged"]
    if the_plan.has_changes:
        with broker.definitions() as d:
            declarations.apply_plan(the_plan, d)
    return changes


__all__ = ["apply_declarations"]
