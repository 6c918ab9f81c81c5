"""The Airflow plugin of airflow-broker: the broker's monitoring API and page in the Airflow
API server.

:class:`BrokerPlugin` mounts a FastAPI app at ``/broker`` (its JSON API under ``/broker/api``,
see :mod:`airflow_broker.provider.plugin.api`; the broker page at ``/broker/ui/``, see
:mod:`airflow_broker.provider.plugin.ui`) and lists the page in the Airflow UI's navigation as an
external view (Airflow 3.1+), shown inside the UI's frame at ``/plugin/service-broker``. It is
registered twice over, as Airflow finds plugins: through the ``airflow.plugins`` entry point and
in the provider info (:func:`airflow_broker.provider.get_provider_info`, ``plugins``).

Every Airflow process loads plugins, the task runner included (for macros and listeners), so
this module imports nothing heavy: the FastAPI app, and with it the API server's security
modules, is built the first time something asks for ``fastapi_apps`` (the API server mounting
it, or ``airflow plugins`` listing it), once per process.
"""

from __future__ import annotations

import functools
from typing import Any

from airflow_broker.provider.compat import AirflowPlugin

#: Where the API server mounts the app.
URL_PREFIX = "/broker"
#: The plugin's name (Airflow's plugin list, the provider info).
PLUGIN_NAME = "airflow_broker"
#: The broker page, as the browser asks for it.
UI_HREF = f"{URL_PREFIX}/ui/"

#: The page in the Airflow UI's navigation (``AirflowPlugin.external_views``, Airflow 3.1+;
#: the keys of the API's ``ExternalViewResponse``). With ``url_route`` the UI shows the page in
#: its own frame at ``/plugin/service-broker``; without a ``category`` it is a top-level item.
EXTERNAL_VIEWS: list[dict[str, Any]] = [
    {
        "name": "Service Broker",
        "href": UI_HREF,
        "destination": "nav",
        "url_route": "service-broker",
        "icon": f"{URL_PREFIX}/ui/icon.svg",
    }
]


@functools.cache
def fastapi_apps() -> list[dict[str, Any]]:
    """The plugin's FastAPI apps, as ``AirflowPlugin.fastapi_apps`` lists them (built once)."""
    from airflow_broker.provider.plugin.api import create_app

    return [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "Service Broker"}]


class _BuiltOnFirstUse:
    """A class attribute computed when read, on the class (provider plugins are classes) or on an
    instance (entry-point plugins are instantiated)."""

    def __get__(self, instance: object, owner: type | None = None) -> list[dict[str, Any]]:
        return fastapi_apps()


class BrokerPlugin(AirflowPlugin):
    """Service Broker monitoring in the Airflow API server, under ``/broker``."""

    name = PLUGIN_NAME
    fastapi_apps = _BuiltOnFirstUse()
    # Copies: Airflow's plugin manager removes entries it refuses from the plugin's list.
    external_views = [dict(view) for view in EXTERNAL_VIEWS]


__all__ = ["EXTERNAL_VIEWS", "PLUGIN_NAME", "UI_HREF", "URL_PREFIX", "BrokerPlugin", "fastapi_apps"]
