"""Indexes of the due work (migration 0026): old closed endpoints are found by when they
closed, not by a scan of every endpoint (``DueWork.purge_closed`` and ``duework.IDLE_PROBE``).
"""

from sqlalchemy import Index, text

from airflow_broker.storage.schema.core import conversation_endpoint as _e

#: Closed (CD) endpoints by ``closed_at``: the purge's candidates.
endpoint_closed_at = Index(
    "ix_broker_conversation_endpoint_closed_at",
    _e.c.closed_at,
    postgresql_where=text("state = 'CD'"),
    sqlite_where=text("state = 'CD'"),
)

__all__ = ["endpoint_closed_at"]
