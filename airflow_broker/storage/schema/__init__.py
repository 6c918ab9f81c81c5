"""The broker's tables, in SQLAlchemy Core: one :class:`~sqlalchemy.MetaData` (``metadata``),
its core tables (:mod:`.core`), failure handling's (:mod:`.failure`) and security's
(:mod:`.security`). ``from airflow_broker.storage import schema as s; s.message`` reaches any.
"""

from airflow_broker.storage.schema.core import *  # noqa: F403
from airflow_broker.storage.schema.core import (
    NAME,
    NAMING_CONVENTION,
    BigId,
    Timestamp,
    metadata,
)
from airflow_broker.storage.schema.failure import dedupe, lease
from airflow_broker.storage.schema.security import (
    certificate,
    dialog_key,
    inbox,
    inbox_answer,
    permission,
    remote_service_binding,
)

__all__ = [
    "NAME",
    "NAMING_CONVENTION",
    "BigId",
    "Timestamp",
    "certificate",
    "dedupe",
    "dialog_key",
    "inbox",
    "inbox_answer",
    "lease",
    "metadata",
    "permission",
    "remote_service_binding",
]
