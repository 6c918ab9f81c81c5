"""GRANT and REVOKE of SEND on services and RECEIVE on queues to database roles (seed 004),
inside a :class:`~airflow_broker.messaging.definitions.Definitions` transaction. What a grant
allows, and how PostgreSQL enforces it: :mod:`airflow_broker.security.permissions`.
"""

from __future__ import annotations

from airflow_broker.messaging.definitions_core import DefinitionsCore
from airflow_broker.security import permissions
from airflow_broker.security.permissions import RECEIVE, SEND, Permission


class PermissionDefinitions(DefinitionsCore):
    """Permissions of a :class:`~airflow_broker.messaging.definitions.Definitions` transaction.

    Each verb raises :class:`~airflow_broker.errors.UnknownObject` for a service, queue or
    database role that does not exist, and :class:`~airflow_broker.errors.InvalidDefinition`
    on SQLite (permissions are granted to database roles: they need PostgreSQL)."""

    def grant_send(self, service: str, role: str) -> bool:
        """GRANT SEND ON SERVICE ``service`` TO ``role``: it may begin dialogs to the service
        and SEND on them. False when granted already."""
        return permissions.grant(self._conn, SEND, service, role)

    def grant_receive(self, queue: str, role: str) -> bool:
        """GRANT RECEIVE ON ``queue`` TO ``role``: it may RECEIVE, lease and peek there, and
        answer and end the conversations of the queue. False when granted already."""
        return permissions.grant(self._conn, RECEIVE, queue, role)

    def revoke_send(self, service: str, role: str) -> bool:
        """REVOKE SEND ON SERVICE ``service`` FROM ``role`` (from its next statement on);
        False when it was not granted."""
        return permissions.revoke(self._conn, SEND, service, role)

    def revoke_receive(self, queue: str, role: str) -> bool:
        """REVOKE RECEIVE ON ``queue`` FROM ``role``; False when it was not granted."""
        return permissions.revoke(self._conn, RECEIVE, queue, role)

    def permissions(self) -> list[Permission]:
        """Every grant ([] on SQLite)."""
        return permissions.permissions(self._conn)
