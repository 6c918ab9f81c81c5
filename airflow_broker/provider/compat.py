"""Everything that differs between Airflow 3.x releases, in one place.

The rest of the package imports Airflow names from here only. Supported: Airflow 3.1 and newer;
the Airflow-facing end-to-end tests run on 3.1.0 and on the newest 3.x (docs/airflow.md). 3.1's
Task SDK has ``BaseHook`` but not yet ``AirflowNotFoundException`` nor ``AirflowFailException``
(``airflow.exceptions`` has them). Triggers still live in ``airflow.triggers.base``.

Importing this module installs Airflow's Stats as the sink of the broker's metrics (when
Airflow's metrics are on: :mod:`airflow_broker.provider.stats`).

Importing this module imports Airflow: the engine (``airflow_broker`` outside ``hooks``,
``operators``, ``sensors``, ``triggers`` and ``plugin``) never does.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version as _dist_version
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from packaging.version import Version

_P = ParamSpec("_P")
_R = TypeVar("_R")

AIRFLOW_VERSION = Version(_dist_version("apache-airflow"))
#: The oldest Airflow this package supports: pyproject.toml's lower bound, and what ``make test``
#: runs the Airflow-facing end-to-end tests on besides the newest (``.venv-oldest``, pinned by
#: tests/support/oldest-airflow.txt). Airflow 3.0 cannot be: it requires SQLAlchemy < 2.
OLDEST_SUPPORTED = Version("3.1.0")
#: Airflow 3.2 runs the DB managers that providers register (``db-managers`` in the provider
#: info) on ``airflow db migrate``; 3.1 runs only those named in ``[database]
#: external_db_managers``.
PROVIDER_DB_MANAGERS = Version("3.2.0") <= AIRFLOW_VERSION
#: Airflow 3.2.2 made the trigger runner's channel to the triggerer safe from any thread. Before,
#: a Task SDK call (a connection, a variable) from a plain thread ran on an event loop of its own
#: and read the loop's answers out of order: the trigger runner died ("Response read out of
#: order!"). :func:`to_thread` works on both.
THREADSAFE_TRIGGER_COMMS = Version("3.2.2") <= AIRFLOW_VERSION

if AIRFLOW_VERSION.release < OLDEST_SUPPORTED.release:  # pragma: no cover - refused, with why
    raise ImportError(
        f"airflow-broker needs Airflow >= {OLDEST_SUPPORTED}; this is Airflow {AIRFLOW_VERSION}"
    )

from airflow.sdk import (  # noqa: E402
    Asset,
    AssetWatcher,
    BaseHook,
    BaseOperator,
    BaseSensorOperator,
    Context,
    PokeReturnValue,
)
from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent  # noqa: E402

try:
    from airflow.sdk.exceptions import AirflowNotFoundException
except ImportError:  # Airflow 3.1
    from airflow.exceptions import AirflowNotFoundException  # type: ignore[no-redef,unused-ignore]

try:
    from airflow.sdk.exceptions import AirflowFailException
except ImportError:  # Airflow 3.1
    from airflow.exceptions import AirflowFailException  # type: ignore[no-redef,unused-ignore]

try:
    from airflow.sdk.exceptions import AirflowSkipException
except ImportError:  # Airflow 3.1
    from airflow.exceptions import AirflowSkipException  # type: ignore[no-redef,unused-ignore]

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


async def to_thread(func: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """``asyncio.to_thread`` for a trigger's blocking work, which may make Task SDK calls (the
    broker connection, ``broker://`` routes): before Airflow 3.2.2 through asgiref's
    ``sync_to_async``, whose threads send those calls back to the trigger runner's event loop
    (:data:`THREADSAFE_TRIGGER_COMMS`)."""
    if THREADSAFE_TRIGGER_COMMS:
        return await asyncio.to_thread(func, *args, **kwargs)
    from asgiref.sync import sync_to_async

    return await sync_to_async(func, thread_sensitive=False)(*args, **kwargs)


async def to_thread_in(executor: ThreadPoolExecutor, func: Callable[..., _R], /, *args: Any) -> _R:
    """:func:`to_thread` in the threads of ``executor`` (not the event loop's default ones)."""
    if THREADSAFE_TRIGGER_COMMS:
        call = functools.partial(contextvars.copy_context().run, func, *args)
        return await asyncio.get_running_loop().run_in_executor(executor, call)
    from asgiref.sync import sync_to_async

    return await sync_to_async(func, thread_sensitive=False, executor=executor)(*args)


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
    "PROVIDER_DB_MANAGERS",
    "THREADSAFE_TRIGGER_COMMS",
    "AirflowFailException",
    "AirflowNotFoundException",
    "AirflowPlugin",
    "AirflowSkipException",
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
    "to_thread",
    "to_thread_in",
]
