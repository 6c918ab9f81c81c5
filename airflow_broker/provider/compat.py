"""Everything that differs between Airflow 3.x releases, in one place.

The rest of the package imports Airflow names from here only. Supported: Airflow 3.1 and newer
(tested on the newest 3.x). 3.1 moved ``BaseHook`` into the Task SDK (``airflow.sdk``); 3.0 had
it in ``airflow.hooks.base``. Triggers still live in ``airflow.triggers.base``.

Importing this module installs Airflow's Stats as the sink of the broker's metrics (when
Airflow's metrics are on: :mod:`airflow_broker.provider.stats`).

Importing this module imports Airflow: the engine (``airflow_broker`` outside ``hooks``,
``operators``, ``sensors``, ``triggers`` and ``plugin``) never does.
"""

from __future__ import annotations

import importlib
from importlib.metadata import version as _dist_version
from typing import TYPE_CHECKING, Any

from packaging.version import Version

AIRFLOW_VERSION = Version(_dist_version("apache-airflow"))
#: The oldest Airflow this package supports.
OLDEST_SUPPORTED = Version("3.1.0")

if AIRFLOW_VERSION.major < 3:  # pragma: no cover - refused early, with the reason
    raise ImportError(
        f"airflow-broker needs Airflow 3 (>= {OLDEST_SUPPORTED}); this is Airflow {AIRFLOW_VERSION}"
    )

from airflow.sdk import (  # noqa: E402
    Asset,
    AssetWatcher,
    BaseOperator,
    BaseSensorOperator,
    Context,
    PokeReturnValue,
)
from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent  # noqa: E402

try:
    from airflow.sdk import BaseHook
except ImportError:  # pragma: no cover - Airflow 3.0
    from airflow.hooks.base import BaseHook  # type: ignore[no-redef,attr-defined,unused-ignore]

try:
    from airflow.sdk.exceptions import AirflowNotFoundException
except ImportError:  # pragma: no cover - Airflow 3.0
    from airflow.exceptions import AirflowNotFoundException  # type: ignore[no-redef,unused-ignore]

try:
    from airflow.sdk.exceptions import AirflowFailException
except ImportError:  # pragma: no cover - before the Task SDK had it
    from airflow.exceptions import AirflowFailException  # type: ignore[no-redef,unused-ignore]

# -- the API server: the plugin's FastAPI app -------------------------------------------------
# Imported on first use (PEP 562), never by task code: ``airflow.api_fastapi`` pulls in Airflow's
# ORM models. ``from airflow_broker.provider.compat import get_user`` triggers the import.
if TYPE_CHECKING:
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.base_auth_manager import BaseAuthManager
    from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
    from airflow.api_fastapi.auth.managers.models.resource_details import (
        ConnectionDetails,
        DagDetails,
    )
    from airflow.api_fastapi.core_api.security import get_user
    from airflow.plugins_manager import AirflowPlugin

#: name -> (module, attribute), same in 3.1 and the newest 3.x.
_API_SERVER_NAMES: dict[str, tuple[str, str]] = {
    "AirflowPlugin": ("airflow.plugins_manager", "AirflowPlugin"),
    "BaseAuthManager": ("airflow.api_fastapi.auth.managers.base_auth_manager", "BaseAuthManager"),
    "BaseUser": ("airflow.api_fastapi.auth.managers.models.base_user", "BaseUser"),
    "ConnectionDetails": (
        "airflow.api_fastapi.auth.managers.models.resource_details",
        "ConnectionDetails",
    ),
    "DagDetails": ("airflow.api_fastapi.auth.managers.models.resource_details", "DagDetails"),
    "get_auth_manager": ("airflow.api_fastapi.app", "get_auth_manager"),
    # The dependency behind Airflow's own GetUserDep: a bearer token, else the UI's cookie.
    "get_user": ("airflow.api_fastapi.core_api.security", "get_user"),
}


# -- metrics: the engine's metrics go to Airflow's Stats when Airflow's metrics are on --------
# (every Airflow-facing module imports this one; see airflow_broker.provider.stats)
from airflow_broker.provider import stats as airflow_metrics  # noqa: E402

airflow_metrics.install()


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _API_SERVER_NAMES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


__all__ = [
    "AIRFLOW_VERSION",
    "OLDEST_SUPPORTED",
    "AirflowFailException",
    "AirflowNotFoundException",
    "AirflowPlugin",
    "Asset",
    "AssetWatcher",
    "BaseAuthManager",
    "BaseEventTrigger",
    "BaseHook",
    "BaseOperator",
    "BaseSensorOperator",
    "BaseTrigger",
    "BaseUser",
    "ConnectionDetails",
    "Context",
    "DagDetails",
    "PokeReturnValue",
    "TriggerEvent",
    "get_auth_manager",
    "get_user",
]
