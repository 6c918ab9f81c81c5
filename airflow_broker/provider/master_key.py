"""The master key from Airflow: the Variable ``airflow_broker_master_key``, which any configured
secrets backend (HashiCorp Vault, AWS Secrets Manager, environment ``AIRFLOW_VAR_...``) answers.

Registered under the entry-point group ``airflow_broker.master_key_sources``: the engine
(:func:`airflow_broker.security.crypto.master_key`) asks it when ``AIRFLOW_BROKER_MASTER_KEY`` is
not set. It reads through the Task SDK (``airflow.sdk.Variable``), never Airflow's ORM, and only
in a process that has already imported Airflow (a task, the triggerer, the API server): a plain
program that merely has Airflow installed does not start configuring it.
"""

from __future__ import annotations

import logging
import sys

from airflow_broker.security.crypto import MASTER_KEY_VARIABLE

log = logging.getLogger("airflow_broker")


def airflow_master_key() -> str | None:
    """The Airflow Variable (or secret) :data:`MASTER_KEY_VARIABLE`, or None outside Airflow or
    when it is not set."""
    if "airflow" not in sys.modules:
        return None
    try:
        from airflow.sdk import Variable
    except ImportError:
        return None
    value = Variable.get(MASTER_KEY_VARIABLE, default=None)
    if value is None or value == "":
        return None
    log.debug("master key taken from the Airflow Variable %s", MASTER_KEY_VARIABLE)
    return str(value)


__all__ = ["airflow_master_key"]
