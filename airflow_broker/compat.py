"""Everything that differs between Airflow 3.x releases, in one place.

The rest of the package imports Airflow names from here only. Supported: Airflow 3.1 and newer
(tested on the newest 3.x). 3.1 moved ``BaseHook`` into the Task SDK (``airflow.sdk``); 3.0 had
it in ``airflow.hooks.base``. Triggers still live in ``airflow.triggers.base``.

Importing this module imports Airflow: the engine (``airflow_broker`` outside ``hooks``,
``operators``, ``sensors``, ``triggers`` and ``plugin``) never does.
"""

from __future__ import annotations

from importlib.metadata import version as _dist_version

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

__all__ = [
    "AIRFLOW_VERSION",
    "OLDEST_SUPPORTED",
    "AirflowNotFoundException",
    "Asset",
    "AssetWatcher",
    "BaseEventTrigger",
    "BaseHook",
    "BaseOperator",
    "BaseSensorOperator",
    "BaseTrigger",
    "Context",
    "PokeReturnValue",
    "TriggerEvent",
]
