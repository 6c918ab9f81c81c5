"""Declarations files: broker objects described in YAML, checked as a whole, applied at once.

``airflow-broker apply FILE`` reads a file in the format documented in ``docs/declarations.md``.
Three steps, each a module of this package (the declared objects and the plan are in
:mod:`.model`):

1. :func:`parse` turns the text into :class:`Declarations`, collecting every structural problem
   (types, unknown keys, missing keys, duplicate names) with the line it is on. It walks the YAML
   node tree (``SafeLoader`` composition) rather than loaded Python values, because only nodes
   keep their marks, and because a plain load silently keeps the last of two equal keys.
2. :func:`plan` compares the declarations with the database's
   :class:`~airflow_broker.messaging.objects.Catalog`: references that resolve neither in the file
   nor in the database, and contracts (or system objects) that exist with another definition,
   which cannot be changed in place, are more problems; everything else becomes a
   :class:`Change` (create, alter with the object's ALTER verb, or unchanged), and each
   ``broker:`` setting a :class:`SettingChange` against the current value, each ``permissions:``
   entry a :class:`PermissionChange` (grant or revoke) against what is granted now.
3. :func:`apply_plan` runs the changes against a ``broker.definitions()`` transaction, in
   dependency order, so that the whole file lands or nothing does.

Nothing here opens a database: the caller hands in the catalog, the broker's settings and the
transaction.
"""

from __future__ import annotations

from airflow_broker.operations.declarations.apply import apply_declarations, apply_plan, granted_now
from airflow_broker.operations.declarations.model import (
    ADDRESS_ENV_PREFIX,
    ADDRESS_KEYWORDS,
    BROKER_ADDRESS,
    BROKER_SETTINGS,
    FORMAT_VERSION,
    KIND,
    MAX_ADDRESS,
    MAX_NAME,
    QUEUE_DEFAULTS,
    SECTIONS,
    SETTING_WORDS,
    Action,
    BindingDecl,
    CertificateDecl,
    Change,
    ContractDecl,
    Decl,
    Declarations,
    DeclarationsInvalid,
    MessageTypeDecl,
    PermissionChange,
    PermissionDecl,
    Plan,
    PriorityDecl,
    Problem,
    QueueDecl,
    Ref,
    RouteDecl,
    ServiceDecl,
    SettingChange,
)
from airflow_broker.operations.declarations.parse import parse
from airflow_broker.operations.declarations.plan import plan

__all__ = [
    "ADDRESS_ENV_PREFIX",
    "ADDRESS_KEYWORDS",
    "BROKER_ADDRESS",
    "BROKER_SETTINGS",
    "FORMAT_VERSION",
    "KIND",
    "MAX_ADDRESS",
    "MAX_NAME",
    "QUEUE_DEFAULTS",
    "SECTIONS",
    "SETTING_WORDS",
    "Action",
    "BindingDecl",
    "CertificateDecl",
    "Change",
    "ContractDecl",
    "Decl",
    "Declarations",
    "DeclarationsInvalid",
    "MessageTypeDecl",
    "PermissionChange",
    "PermissionDecl",
    "Plan",
    "PriorityDecl",
    "Problem",
    "QueueDecl",
    "Ref",
    "RouteDecl",
    "ServiceDecl",
    "SettingChange",
    "apply_declarations",
    "apply_plan",
    "granted_now",
    "parse",
    "plan",
]
