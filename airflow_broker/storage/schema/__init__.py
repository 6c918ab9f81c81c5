"""The broker's tables, in SQLAlchemy Core: one :class:`~sqlalchemy.MetaData` (``metadata``),
its core tables (:mod:`.core`), failure handling's (:mod:`.failure`), security's
(:mod:`.security`) and the Spark routing job's scratch tables (:mod:`.spark`), the monitoring
lists' indexes (:mod:`.listing`) and the due work's (:mod:`.due`).
``from airflow_broker.storage import schema as s; s.message`` reaches any.
"""

from typing import Any

from airflow_broker.storage.schema.core import *  # noqa: F403
from airflow_broker.storage.schema.core import (
    NAME,
    NAMING_CONVENTION,
    BigId,
    Timestamp,
    metadata,
)
from airflow_broker.storage.schema.due import endpoint_closed_at
from airflow_broker.storage.schema.failure import dedupe, lease
from airflow_broker.storage.schema.listing import (
    endpoint_by_creation,
    endpoint_by_queue_and_creation,
)
from airflow_broker.storage.schema.security import (
    certificate,
    dialog_key,
    inbox,
    inbox_answer,
    permission,
    remote_service_binding,
)
from airflow_broker.storage.schema.spark import spark_staged_conversation, spark_staging
from airflow_broker.storage.schema.waits import transmission_wait


def exists_on(obj: Any, dialect: str) -> bool:
    """Whether a constraint or index of the metadata is created on ``dialect`` (its
    ``ddl_if``): Alembic's comparisons, which do not read ``ddl_if``, skip the others."""
    only = getattr(obj, "_ddl_if", None)
    if only is None or only.dialect is None:
        return True
    return dialect == only.dialect if isinstance(only.dialect, str) else dialect in only.dialect


__all__ = [
    "NAME",
    "NAMING_CONVENTION",
    "BigId",
    "Timestamp",
    "certificate",
    "dedupe",
    "dialog_key",
    "endpoint_by_creation",
    "endpoint_by_queue_and_creation",
    "endpoint_closed_at",
    "exists_on",
    "inbox",
    "inbox_answer",
    "lease",
    "metadata",
    "permission",
    "remote_service_binding",
    "spark_staged_conversation",
    "spark_staging",
    "transmission_wait",
]
