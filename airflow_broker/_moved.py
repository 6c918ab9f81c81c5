"""Old module paths, kept importing after the engine was split into layers.

Airflow stores trigger classpaths in its database (``airflow_broker.triggers.activation.
QueueActivationTrigger``) and users name ``airflow_broker.dbmanager.BrokerDBManager`` in
``airflow.cfg``; code written against the flat layout imports ``airflow_broker.runner`` and the
like. :data:`MOVED` maps each old path to its home; the finder installed by
``airflow_broker/__init__.py`` makes ``import OLD`` return the module at its new path (the same
module object, so classes stay identical) and warns with a :class:`DeprecationWarning`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

#: old module path -> where it lives now
MOVED: dict[str, str] = {
    "airflow_broker.airflow_metrics": "airflow_broker.provider.stats",
    "airflow_broker.arguments": "airflow_broker.messaging.arguments",
    "airflow_broker.bulk": "airflow_broker.storage.bulk",
    "airflow_broker.compat": "airflow_broker.provider.compat",
    "airflow_broker.dbmanager": "airflow_broker.provider.dbmanager",
    "airflow_broker.ddr": "airflow_broker.transport.routing_service",
    "airflow_broker.declarations": "airflow_broker.operations.declarations",
    "airflow_broker.definitions": "airflow_broker.messaging.definitions",
    "airflow_broker.delivery": "airflow_broker.messaging.delivery",
    "airflow_broker.demo": "airflow_broker.examples.demo",
    "airflow_broker.duework": "airflow_broker.messaging.duework",
    "airflow_broker.dynamic": "airflow_broker.routing.dynamic",
    "airflow_broker.engines": "airflow_broker.storage.adapters",
    "airflow_broker.events": "airflow_broker.messaging.events",
    "airflow_broker.examples.echo": "airflow_broker.operations.echo",
    "airflow_broker.migrations": "airflow_broker.storage.migrations",
    "airflow_broker.monitoring": "airflow_broker.operations.monitoring",
    "airflow_broker.objects": "airflow_broker.messaging.objects",
    "airflow_broker.plugin": "airflow_broker.provider.plugin",
    "airflow_broker.queries": "airflow_broker.storage.queries",
    "airflow_broker.runner": "airflow_broker.activation.runner",
    "airflow_broker.sampling": "airflow_broker.operations.sampling",
    "airflow_broker.schema": "airflow_broker.storage.schema",
    "airflow_broker.transaction": "airflow_broker.messaging.transaction",
    "airflow_broker.triggers": "airflow_broker.provider.triggers",
    "airflow_broker.triggers.activation": "airflow_broker.provider.triggers.activation",
    "airflow_broker.triggers.conversation": "airflow_broker.provider.triggers.conversation",
    "airflow_broker.triggers.queues": "airflow_broker.provider.triggers.queues",
    "airflow_broker.validation": "airflow_broker.messaging.validation",
    "airflow_broker.xcom": "airflow_broker.provider.xcom",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old path of :data:`MOVED` to the module at its new path."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self,
        fullname: str,
        path: object = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=new)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        assert spec.origin is not None
        warnings.warn(
            f"{spec.name} moved to {spec.origin}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(spec.origin)
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system has just pointed the module's __spec__ at the old name: restore it,
        # so that the module stays what it is at its new path.
        module.__spec__ = self._specs[module.__name__]


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
