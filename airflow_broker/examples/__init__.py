"""Example applications of the broker, written as plain engine code (no Airflow import).

- :mod:`airflow_broker.examples.purchase_order`: seed 004's long-running purchase-order dialog
  between a buyer and a supplier, with application state keyed by conversation group id and
  idempotent compensating actions.
- :mod:`airflow_broker.operations.echo`: an echo service that answers liveness probes.
- :mod:`airflow_broker.examples.long_jobs`: a handler that works for minutes on leased messages
  and completes the lease with its results and replies, exactly once.

Each module declares its broker objects, creates its application tables in the broker database
(``setup(broker)``) and provides message handlers with the signature ``handler(tx, messages)``:
the same functions run in Airflow (``DrainQueueOperator(handler="module:function")``, the DAGs in
``dags/``) and outside it (``airflow_broker.activation.runner.ActivationRunner``, ``make demo``).
"""

from __future__ import annotations

from airflow_broker.operations.declarations import apply_declarations

__all__ = ["apply_declarations"]
