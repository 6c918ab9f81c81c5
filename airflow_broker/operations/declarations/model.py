"""What a declarations file says: the declared objects, the problems found in it, and the plan
of changes (:class:`Change`, :class:`SettingChange`, :class:`Plan`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal, TypeVar

from airflow_broker.errors import InvalidDefinition

#: The version of the file format this module reads (the optional top-level ``version`` key).
FORMAT_VERSION: Final = 1


#: The sections of a file, in the order their objects are created (each may name the ones before).
SECTIONS: Final = (
    "message_types",
    "contracts",
    "queues",
    "services",
    "routes",
    "priorities",
    "certificates",
    "remote_service_bindings",
)


#: How each section's objects are called in messages.
KIND: Final = {
    "message_types": "message type",
    "contracts": "contract",
    "queues": "queue",
    "services": "service",
    "routes": "route",
    "priorities": "priority",
    "certificates": "certificate",
    "remote_service_bindings": "remote service binding",
}


#: Settings of the broker itself, under the top-level ``broker`` key (``Definitions.configure``):
#: ``forwarding`` passes on messages for services this broker does not host; ``principal: false``
#: makes this database say it is not the principal of a mirrored pair.
BROKER_SETTINGS: Final = ("forwarding", "principal")


#: How a setting's value reads in plans: ``forwarding: off -> on``, ``principal: yes -> no``.
SETTING_WORDS: Final[Mapping[str, tuple[str, str]]] = {
    "forwarding": ("off", "on"),
    "principal": ("no", "yes"),
}


#: Longest object name (``schema.NAME``) and address (``broker_route.address``).
MAX_NAME: Final = 256


MAX_ADDRESS: Final = 512


#: A route's address: LOCAL, TRANSPORT, or another broker database by logical name.
ADDRESS_KEYWORDS: Final = ("LOCAL", "TRANSPORT")


BROKER_ADDRESS: Final = re.compile(r"^broker://[A-Za-z0-9_.\-]+$")


#: Outside Airflow, ``broker://NAME`` resolves through this environment variable (NAME upper-cased,
#: every other character than a letter or digit made ``_``: ``transport.env_name``).
ADDRESS_ENV_PREFIX: Final = "AIRFLOW_BROKER_ADDRESS_"


_URL: Final = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)://(?P<rest>.*)$", re.S)


_STR: Final = "tag:yaml.org,2002:str"


_BOOL: Final = "tag:yaml.org,2002:bool"


_INT: Final = "tag:yaml.org,2002:int"


_NULL: Final = "tag:yaml.org,2002:null"


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a file, and the line it is on (None: the file as a whole)."""

    line: int | None
    message: str

    def format(self, filename: str) -> str:
        where = filename if self.line is None else f"{filename}:{self.line}"
        return f"{where}: {self.message}"


class DeclarationsInvalid(InvalidDefinition):
    """A declarations file has problems; nothing of it was applied."""

    def __init__(self, filename: str, problems: Sequence[Problem]) -> None:
        self.filename = filename
        self.problems = sorted(problems, key=lambda p: (p.line or 0, p.message))
        count = len(self.problems)
        super().__init__(
            f"{filename}: {count} problem{'s' if count != 1 else ''}; nothing was applied"
        )

    def lines(self) -> list[str]:
        """Every problem as ``FILE:LINE: message``, in file order."""
        return [p.format(self.filename) for p in self.problems]


@dataclass(frozen=True, slots=True)
class Ref:
    """A name that must resolve to an object of ``section`` declared in the file or the database."""

    section: str
    name: str
    line: int
    key: str


@dataclass(frozen=True, slots=True)
class MessageTypeDecl:
    name: str
    line: int
    validation: str = "none"
    json_schema: dict[str, Any] | None = None
    xml_schema: str | None = None

    @property
    def refs(self) -> tuple[Ref, ...]:
        return ()


@dataclass(frozen=True, slots=True)
class ContractDecl:
    name: str
    line: int
    #: message type name -> "initiator" | "target" | "any"
    message_types: dict[str, str] = field(default_factory=dict)
    refs: tuple[Ref, ...] = ()


@dataclass(frozen=True, slots=True)
class QueueDecl:
    name: str
    line: int
    #: Only the settings the file gives (an existing queue keeps the others as they are);
    #: ``activation`` is normalized to ``Activation.to_dict()`` or None.
    settings: dict[str, Any] = field(default_factory=dict)
    #: its dead_letter_queue, when the file names one
    refs: tuple[Ref, ...] = ()

    def create_settings(self) -> dict[str, Any]:
        """The settings of a new queue: the file's, over the defaults of ``create_queue``."""
        return {**QUEUE_DEFAULTS, **self.settings}


QUEUE_DEFAULTS: Final[Mapping[str, Any]] = {
    "status": True,
    "retention": False,
    "poison_message_handling": True,
    "activation": None,
    "retry_delay": None,
    "retry_delay_max": None,
    "max_receives": None,
    "dead_letter_queue": None,
}

#: Queue settings that name another queue (applied once every queue of the file exists).
QUEUE_LATE_SETTINGS: Final = ("max_receives", "dead_letter_queue")


@dataclass(frozen=True, slots=True)
class ServiceDecl:
    name: str
    line: int
    queue: str
    contracts: tuple[str, ...] = ()
    refs: tuple[Ref, ...] = ()


@dataclass(frozen=True, slots=True)
class RouteDecl:
    name: str
    line: int
    service_name: str | None = None
    broker_instance: str | None = None
    address: str = "LOCAL"
    mirror_address: str | None = None
    lifetime_seconds: int | None = None

    @property
    def refs(self) -> tuple[Ref, ...]:
        return ()


@dataclass(frozen=True, slots=True)
class PriorityDecl:
    name: str
    line: int
    contract: str | None = None
    local_service: str | None = None
    remote_service: str | None = None
    priority: int = 5
    refs: tuple[Ref, ...] = ()


@dataclass(frozen=True, slots=True)
class CertificateDecl:
    """A certificate: created (a new key pair) when the file gives no ``pem``, else imported.
    The private key's text is never shown (``repr`` leaves it out; plans never name it)."""

    name: str
    line: int
    owner: str
    subject: str | None = None
    expires_at: datetime | None = None
    #: the certificate of an import (from ``pem`` or ``pem_file``), and its fingerprint
    pem: str | None = None
    fingerprint: str | None = None
    private_key_pem: str | None = field(default=None, repr=False)

    @property
    def refs(self) -> tuple[Ref, ...]:
        return ()


@dataclass(frozen=True, slots=True)
class BindingDecl:
    """A remote service binding: far ``service`` is reached with ``certificate``."""

    name: str
    line: int
    service: str
    certificate: str
    anonymous: bool = False
    refs: tuple[Ref, ...] = ()


Decl = (
    MessageTypeDecl
    | ContractDecl
    | QueueDecl
    | ServiceDecl
    | RouteDecl
    | PriorityDecl
    | CertificateDecl
    | BindingDecl
)


_D = TypeVar(
    "_D",
    MessageTypeDecl,
    ContractDecl,
    QueueDecl,
    ServiceDecl,
    RouteDecl,
    PriorityDecl,
    CertificateDecl,
    BindingDecl,
)


@dataclass(frozen=True, slots=True)
class PermissionDecl:
    """One entry of ``permissions:`` for one role: ``{send: SERVICE, to: ROLE}`` grants SEND on a
    service, ``{receive: QUEUE, to: ROLE}`` RECEIVE on a queue; ``from:`` instead of ``to:``
    revokes it (:mod:`.permissions`)."""

    #: "SEND" or "RECEIVE"
    permission: str
    object_name: str
    role: str
    grant: bool
    line: int

    def describe(self) -> str:
        kind = "service" if self.permission == "SEND" else "queue"
        way = "to" if self.grant else "from"
        return f"permission {self.permission} on {kind} {self.object_name} {way} role {self.role}"


@dataclass(frozen=True, slots=True)
class PermissionChange:
    """What applying one permission entry does: grant or revoke it, or nothing."""

    decl: PermissionDecl
    changed: bool

    def describe(self) -> str:
        if not self.changed:
            held = "granted already" if self.decl.grant else "not granted"
            return f"= {self.decl.describe()}: unchanged ({held})"
        if self.decl.grant:
            return f"+ {self.decl.describe()}: granted"
        return f"- {self.decl.describe()}: revoked"


@dataclass(frozen=True, slots=True)
class Declarations:
    """Everything one file declares, section by section, in file order."""

    message_types: tuple[MessageTypeDecl, ...] = ()
    contracts: tuple[ContractDecl, ...] = ()
    queues: tuple[QueueDecl, ...] = ()
    services: tuple[ServiceDecl, ...] = ()
    routes: tuple[RouteDecl, ...] = ()
    priorities: tuple[PriorityDecl, ...] = ()
    certificates: tuple[CertificateDecl, ...] = ()
    remote_service_bindings: tuple[BindingDecl, ...] = ()
    #: ``broker: {forwarding: ..., principal: ...}``: the settings the file gives, and their lines.
    settings: dict[str, bool] = field(default_factory=dict)
    setting_lines: dict[str, int] = field(default_factory=dict)
    #: ``permissions:``: grants and revokes, one per role, in file order.
    permissions: tuple[PermissionDecl, ...] = ()
    #: Names declared per section, even by entries that had other problems: a reference to such a
    #: name is not reported again as unknown.
    declared: dict[str, frozenset[str]] = field(default_factory=dict)
    #: Every reference made by an entry, ``(section, entry name, ref)``, including entries that
    #: had other problems, so that a bad reference is reported along with them.
    refs: tuple[tuple[str, str, Ref], ...] = ()

    def section(self, name: str) -> tuple[Decl, ...]:
        items: tuple[Decl, ...] = getattr(self, name)
        return items


Action = Literal["create", "alter", "unchanged"]


@dataclass(frozen=True, slots=True)
class Change:
    """What applying one declared object does: create it, alter it (its ALTER verb), or
    nothing."""

    section: str
    decl: Decl
    action: Action
    #: For alter: what differs, ``key: old -> new``.
    differences: tuple[str, ...] = ()
    #: For alter of a message type, service, route or priority: the keyword arguments of its
    #: ALTER verb, only what changes (a queue is altered in the keys its declaration gives).
    arguments: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.decl.name

    def describe(self) -> str:
        kind = KIND[self.section]
        if self.action == "create":
            return f"+ {kind} {self.name}: created"
        if self.action == "unchanged":
            return f"= {kind} {self.name}: unchanged"
        return f"~ {kind} {self.name}: altered ({'; '.join(self.differences)})"


@dataclass(frozen=True, slots=True)
class SettingChange:
    """What applying one ``broker:`` setting does: change it, or nothing."""

    name: str
    #: The database's value; None when it could not be read (shown as ``unknown``).
    old: bool | None
    new: bool

    @property
    def changed(self) -> bool:
        return self.old is not self.new

    def describe(self) -> str:
        if not self.changed:
            return f"= broker setting {self.name}: unchanged ({_setting_word(self.name, self.new)})"
        return (
            f"~ broker setting {self.name}: {_setting_word(self.name, self.old)} -> "
            f"{_setting_word(self.name, self.new)}"
        )


def _setting_word(name: str, value: bool | None) -> str:
    if value is None:
        return "unknown"
    return SETTING_WORDS[name][1 if value else 0]


@dataclass(frozen=True, slots=True)
class Plan:
    """The changes a file makes, in the order they are applied (broker settings last)."""

    changes: tuple[Change, ...]
    settings: tuple[SettingChange, ...] = ()
    #: grants and revokes, applied after every object
    permissions: tuple[PermissionChange, ...] = ()

    @property
    def has_changes(self) -> bool:
        return (
            any(c.action != "unchanged" for c in self.changes)
            or any(s.changed for s in self.settings)
            or any(p.changed for p in self.permissions)
        )

    def counts(self) -> dict[str, dict[str, int]]:
        """Per section: how many objects are created, altered and unchanged."""
        out = {s: {"created": 0, "altered": 0, "unchanged": 0} for s in SECTIONS}
        for change in self.changes:
            bucket = {"create": "created", "unchanged": "unchanged"}.get(change.action, "altered")
            out[change.section][bucket] += 1
        return out
