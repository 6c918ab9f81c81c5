"""Indexes of the monitoring API's lists (migration 0027): the conversation list reads a page,
newest first, of every queue or of one, through an index instead of sorting every endpoint.

Neither indexed column changes after BEGIN DIALOG, so updates of an endpoint's sequence numbers
stay heap-only; new endpoints land at the right end of each index.
"""

from sqlalchemy import Index

from airflow_broker.storage.schema.core import conversation_endpoint as _e

#: Endpoints newest first (``ORDER BY created_at DESC, conversation_handle DESC``).
endpoint_by_creation = Index(
    "ix_broker_conversation_endpoint_created_at", _e.c.created_at, _e.c.conversation_handle
)

#: One queue's endpoints newest first.
endpoint_by_queue_and_creation = Index(
    "ix_broker_conversation_endpoint_queue_id_created_at",
    _e.c.queue_id,
    _e.c.created_at,
    _e.c.conversation_handle,
)

__all__ = ["endpoint_by_creation", "endpoint_by_queue_and_creation"]
