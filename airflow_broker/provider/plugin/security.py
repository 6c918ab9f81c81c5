"""Who may use the broker's API: Airflow's own authentication and authorization.

Authentication is Airflow's: the user comes from Airflow's ``get_user`` dependency (a bearer
token from ``POST /auth/token``, else the UI's session cookie), so a request without either is
refused with 401 before anything else happens, and the auth manager of the deployment (simple,
FAB, Keycloak, ...) decides what the user may do:

- **reading** (every ``GET``) needs read access to DAGs (``is_authorized_dag(method="GET")``):
  the broker's queues are drained by reader DAGs and its conversations are the state of DAG
  runs, so whoever may look at DAGs may look at the broker (the simple auth manager's VIEWER
  role and up, FAB's Viewer and up);
- **acting** (every ``POST``: re-enable a queue, retry or drop a transmission, end a
  conversation, send a probe) needs edit access to the Airflow connection of the broker
  (``is_authorized_connection(method="PUT", conn_id=...)``, ``broker_default`` by default).
  That connection *is* the broker database: whoever may repoint or edit it may already change
  what the broker holds, and these actions lose or move messages, which is an operator's call
  rather than a DAG author's (the simple auth manager's OP and ADMIN roles, FAB's Op and
  Admin; auth managers with per-resource policies can grant it per connection id).

Why not a custom view (``is_authorized_custom_view``)? It would name the broker exactly, but
the simple auth manager answers it as a read whatever the method (any viewer could act), and
FAB grants a custom resource to nobody until an administrator creates its permissions, so the
API would be closed by default. The two built-in resources above behave the same way in every
auth manager.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request, status

from airflow_broker.provider.compat import BaseUser, ConnectionDetails, get_auth_manager, get_user

#: The user of the request, authenticated by Airflow (401 without a token or session).
CurrentUser = Annotated[BaseUser, Depends(get_user)]


def _refuse(user: BaseUser, what: str) -> HTTPException:
    return HTTPException(
        status_code=status.HTTP_403_FORBIDDEN,
        detail=f"user {user.get_name()!r} may not {what}",
    )


def require_read(user: CurrentUser) -> BaseUser:
    """The dependency of every read: the user may read DAGs."""
    if not get_auth_manager().is_authorized_dag(method="GET", user=user):
        raise _refuse(user, "read the broker (reading needs read access to DAGs)")
    return user


def require_edit(request: Request, user: CurrentUser) -> BaseUser:
    """The dependency of every action: the user may edit the broker's Airflow connection (the
    app's ``state.broker_conn_id``)."""
    conn_id: str = request.app.state.broker_conn_id
    allowed = get_auth_manager().is_authorized_connection(
        method="PUT", details=ConnectionDetails(conn_id=conn_id), user=user
    )
    if not allowed:
        raise _refuse(
            user, f"change the broker (actions need edit access to connection {conn_id!r})"
        )
    return user


#: A user who may read the broker.
Reader = Annotated[BaseUser, Depends(require_read)]
#: A user who may act on the broker.
Editor = Annotated[BaseUser, Depends(require_edit)]

__all__ = ["CurrentUser", "Editor", "Reader", "require_edit", "require_read"]
