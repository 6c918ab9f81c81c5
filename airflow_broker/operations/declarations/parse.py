"""Step 1, :func:`parse`: YAML text to :class:`~.model.Declarations`, every structural problem
collected with its line (walking the node tree, which keeps marks and sees duplicate keys).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import yaml

import airflow_broker.operations.declarations.permissions as permissions
import airflow_broker.operations.declarations.security as security
from airflow_broker.constants import SENT_BY, VALIDATIONS
from airflow_broker.errors import InvalidDefinition
from airflow_broker.messaging.definitions import Activation
from airflow_broker.operations.declarations.model import (
    _D,
    _NULL,
    _STR,
    _URL,
    ADDRESS_ENV_PREFIX,
    ADDRESS_KEYWORDS,
    BROKER_ADDRESS,
    BROKER_SETTINGS,
    FORMAT_VERSION,
    KIND,
    MAX_ADDRESS,
    SECTIONS,
    BindingDecl,
    CertificateDecl,
    ContractDecl,
    Decl,
    Declarations,
    MessageTypeDecl,
    PriorityDecl,
    Problem,
    QueueDecl,
    Ref,
    RouteDecl,
    ServiceDecl,
)
from airflow_broker.operations.declarations.reader import _describe, _line, _Reader


def parse(text: str, *, base_dir: Path | None = None) -> tuple[Declarations, list[Problem]]:
    """Read a declarations file. Returns what it declares and every problem found.

    When the problem list is not empty the declarations are incomplete (entries with problems
    are left out) and must not be applied. Files the declarations name (a certificate's
    ``pem_file``) are read relative to ``base_dir`` (None: the current directory).
    """
    loader = yaml.SafeLoader(text)
    reader = _Reader(loader, base_dir)
    try:
        try:
            root = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            message = " ".join(str(p) for p in (exc.context, exc.problem) if p)
            line = None if mark is None else int(mark.line) + 1
            return Declarations(), [Problem(line, f"not valid YAML: {message}")]
        except yaml.YAMLError as exc:
            return Declarations(), [Problem(None, f"not valid YAML: {exc}")]
        if root is None:  # an empty file (or only comments) declares nothing
            return Declarations(), []
        return _parse_document(reader, root), reader.problems
    finally:
        loader.dispose()


def _parse_document(r: _Reader, root: yaml.Node) -> Declarations:
    top = r.mapping(root, "the file", allowed=("version", "broker", *SECTIONS, "permissions"))
    if "version" in top:
        version = r.integer(top["version"], "version", minimum=FORMAT_VERSION)
        if version != FORMAT_VERSION:
            r.problem(
                top["version"],
                f"version {version} is not supported; this tool reads {FORMAT_VERSION}",
            )
    settings: dict[str, bool] = {}
    setting_lines: dict[str, int] = {}
    node = top.get("broker")
    if node is not None and not (isinstance(node, yaml.ScalarNode) and node.tag == _NULL):
        entries = r.mapping(node, "broker", allowed=BROKER_SETTINGS)
        for key in BROKER_SETTINGS:
            if key in entries:
                before = len(r.problems)
                value = r.boolean(entries[key], f"broker.{key}")
                if len(r.problems) == before:
                    settings[key] = value
                    setting_lines[key] = _line(entries[key])

    parsers: dict[str, Callable[[_Reader, str, str, int, dict[str, yaml.Node]], Decl]] = {
        "message_types": _message_type,
        "contracts": _contract,
        "queues": _queue,
        "services": _service,
        "routes": _route,
        "priorities": _priority,
        "certificates": security.certificate,
        "remote_service_bindings": security.binding,
    }
    sections: dict[str, tuple[Decl, ...]] = {}
    declared: dict[str, frozenset[str]] = {}
    refs: list[tuple[str, str, Ref]] = []
    for section in SECTIONS:
        kind = KIND[section]
        items: list[Decl] = []
        names: dict[str, int] = {}
        for index, item in enumerate(r.sequence(top[section], section) if section in top else []):
            before = len(r.problems)
            peeked = _peek_name(item)
            what = f"{kind} {peeked!r}" if peeked else f"{kind} #{index + 1} of {section}"
            entries = r.mapping(
                item, what, allowed=_KEYS[section], required=("name", *_REQUIRED.get(section, ()))
            )
            if "name" not in entries:
                continue
            name = r.string(entries["name"], f"{kind} name")
            if not name:
                continue
            if name in names:
                r.problem(item, f"{kind} {name!r} is declared twice (first on line {names[name]})")
                continue
            names[name] = _line(item)
            decl = parsers[section](r, what, name, _line(item), entries)
            refs.extend((section, name, ref) for ref in decl.refs)
            if len(r.problems) == before:
                items.append(decl)
        sections[section] = tuple(items)
        declared[section] = frozenset(names)
    return Declarations(
        message_types=_only(sections["message_types"], MessageTypeDecl),
        contracts=_only(sections["contracts"], ContractDecl),
        queues=_only(sections["queues"], QueueDecl),
        services=_only(sections["services"], ServiceDecl),
        routes=_only(sections["routes"], RouteDecl),
        priorities=_only(sections["priorities"], PriorityDecl),
        certificates=_only(sections["certificates"], CertificateDecl),
        remote_service_bindings=_only(sections["remote_service_bindings"], BindingDecl),
        settings=settings,
        setting_lines=setting_lines,
        permissions=permissions.parse_section(r, top.get("permissions")),
        declared=declared,
        refs=tuple(refs),
    )


def _only(items: Sequence[Decl], cls: type[_D]) -> tuple[_D, ...]:
    return tuple(item for item in items if isinstance(item, cls))


def _peek_name(node: yaml.Node) -> str | None:
    """The entry's name, if it has a usable one, so that messages about it can say which it is."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if (
                isinstance(key_node, yaml.ScalarNode)
                and key_node.value == "name"
                and isinstance(value_node, yaml.ScalarNode)
                and value_node.tag == _STR
                and value_node.value
            ):
                return str(value_node.value)
    return None


_REQUIRED: Final[Mapping[str, tuple[str, ...]]] = {
    "contracts": ("message_types",),
    "services": ("queue",),
    **security.REQUIRED,
}


_KEYS: Final[Mapping[str, tuple[str, ...]]] = {
    "message_types": ("name", "validation", "json_schema", "xml_schema"),
    "contracts": ("name", "message_types"),
    "queues": (
        "name",
        "status",
        "retention",
        "poison_message_handling",
        "activation",
        "retry_delay",
        "retry_delay_max",
        "max_receives",
        "dead_letter_queue",
    ),
    "services": ("name", "queue", "contracts"),
    "routes": (
        "name",
        "service_name",
        "broker_instance",
        "address",
        "mirror_address",
        "lifetime_seconds",
    ),
    "priorities": ("name", "contract", "local_service", "remote_service", "priority"),
    **security.KEYS,
}


def _message_type(
    r: _Reader, what: str, name: str, line: int, e: dict[str, yaml.Node]
) -> MessageTypeDecl:
    validation = "none"
    if "validation" in e:
        validation = r.choice(e["validation"], f"{what}: validation", VALIDATIONS)
    schema: dict[str, Any] | None = None
    if "json_schema" in e:
        node = e["json_schema"]
        if validation != "json_schema":
            r.problem(node, f"{what}: json_schema is only used with validation: json_schema")
        elif not isinstance(node, yaml.MappingNode):
            r.problem(node, f"{what}: json_schema must be a mapping, not {_describe(node)}")
        else:
            schema = _json_schema(r, node, what)
    elif validation == "json_schema":
        r.problem(e["validation"], f"{what}: validation json_schema needs a json_schema")
    xsd: str | None = None
    if "xml_schema" in e:
        node = e["xml_schema"]
        if validation != "xml_schema":
            r.problem(node, f"{what}: xml_schema is only used with validation: xml_schema")
        else:
            # the text of the schema (a YAML block scalar, `|`), of any length
            xsd = r.string(node, f"{what}: xml_schema", max_length=10**9) or None
            # CREATE MESSAGE TYPE's check, reported with the file's line
            from airflow_broker.messaging.validation import xml_schema_complaint

            complaint = None if xsd is None else xml_schema_complaint(xsd)
            if complaint is not None:
                r.problem(node, f"{what}: xml_schema is not a valid XML Schema: {complaint}")
                xsd = None
    elif validation == "xml_schema":
        r.problem(e["validation"], f"{what}: validation xml_schema needs an xml_schema")
    return MessageTypeDecl(name, line, validation, schema, xsd)


def _json_schema(r: _Reader, node: yaml.Node, what: str) -> dict[str, Any] | None:
    try:
        schema = r.plain(node)
        json.dumps(schema)
    except (yaml.YAMLError, TypeError, ValueError) as exc:
        r.problem(node, f"{what}: json_schema is not plain JSON data: {exc}")
        return None
    import jsonschema  # here: loading it costs time every other command would pay for nothing

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path)
        at = f" at {path}" if path else ""
        r.problem(node, f"{what}: json_schema is not a valid JSON Schema{at}: {exc.message}")
        return None
    return dict(schema)


def _contract(r: _Reader, what: str, name: str, line: int, e: dict[str, yaml.Node]) -> ContractDecl:
    types: dict[str, str] = {}
    refs: list[Ref] = []
    if "message_types" not in e:  # reported by the section's required keys
        return ContractDecl(name, line)
    node = e["message_types"]
    if not isinstance(node, yaml.MappingNode) or not node.value:
        r.problem(
            node,
            f"{what}: message_types must be a mapping of message type names to who sends them "
            f"({', '.join(SENT_BY)}), not {_describe(node)}",
        )
        return ContractDecl(name, line)
    for key_node, value_node in node.value:
        type_name = r.string(key_node, f"{what}: message type name")
        if not type_name:
            continue
        if type_name in types:
            r.problem(key_node, f"{what}: message type {type_name!r} is listed twice")
            continue
        types[type_name] = r.choice(value_node, f"{what}: {type_name!r} is sent by", SENT_BY)
        refs.append(Ref("message_types", type_name, _line(key_node), "message type"))
    if types and not any(s in ("initiator", "any") for s in types.values()):
        r.problem(
            e["name"],
            f"{what}: no message type may be sent by the initiator, so no dialog could ever start; "
            "mark at least one 'initiator' or 'any'",
        )
    return ContractDecl(name, line, types, tuple(refs))


def _activation(r: _Reader, node: yaml.Node, what: str) -> dict[str, Any] | None:
    if isinstance(node, yaml.ScalarNode) and node.tag == _NULL:
        return None
    e = r.mapping(node, f"{what}: activation", allowed=("status", "max_readers", "reader"))
    values: dict[str, Any] = {}
    if "status" in e:
        values["status"] = r.boolean(e["status"], f"{what}: activation status")
    if "max_readers" in e:
        values["max_readers"] = r.integer(
            e["max_readers"], f"{what}: activation max_readers", minimum=1
        )
    if "reader" in e:
        values["reader"] = r.optional_string(e["reader"], f"{what}: activation reader")
    try:
        return Activation(**values).to_dict()
    except InvalidDefinition as exc:  # pragma: no cover - the checks above catch what it checks
        r.problem(node, f"{what}: {exc}")
        return None


def _queue(r: _Reader, what: str, name: str, line: int, e: dict[str, yaml.Node]) -> QueueDecl:
    settings: dict[str, Any] = {}
    for key in ("status", "retention", "poison_message_handling"):
        if key in e:
            settings[key] = r.boolean(e[key], f"{what}: {key}")
    if "activation" in e:
        settings["activation"] = _activation(r, e["activation"], what)
    for key in ("retry_delay", "retry_delay_max"):
        if key in e:
            settings[key] = _seconds(r, e[key], f"{what}: {key}")
    if "max_receives" in e:
        node = e["max_receives"]
        null = isinstance(node, yaml.ScalarNode) and node.tag == _NULL
        settings["max_receives"] = (
            None if null else r.integer(node, f"{what}: max_receives", minimum=1)
        )
    refs: list[Ref] = []
    if "dead_letter_queue" in e:
        dlq = r.optional_string(e["dead_letter_queue"], f"{what}: dead_letter_queue")
        settings["dead_letter_queue"] = dlq
        if dlq:
            refs.append(Ref("queues", dlq, _line(e["dead_letter_queue"]), "dead_letter_queue"))
    return QueueDecl(name, line, settings, tuple(refs))


def _seconds(r: _Reader, node: yaml.Node, what: str) -> float | None:
    """A number of seconds >= 0 (or null: off)."""
    if isinstance(node, yaml.ScalarNode) and node.tag == _NULL:
        return None
    value = r.loader.construct_object(node) if isinstance(node, yaml.ScalarNode) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        r.problem(node, f"{what} must be a number of seconds >= 0, not {_describe(node)}")
        return None
    return float(value)


def _service(r: _Reader, what: str, name: str, line: int, e: dict[str, yaml.Node]) -> ServiceDecl:
    queue_name = ""  # a missing queue is reported by the section's required keys
    refs: list[Ref] = []
    if "queue" in e:
        queue_name = r.string(e["queue"], f"{what}: queue")
        if queue_name:
            refs.append(Ref("queues", queue_name, _line(e["queue"]), "queue"))
    contracts: list[str] = []
    for item in r.sequence(e["contracts"], f"{what}: contracts") if "contracts" in e else []:
        contract = r.string(item, f"{what}: contract name")
        if not contract:
            continue
        if contract in contracts:
            r.problem(item, f"{what}: contract {contract!r} is listed twice")
            continue
        contracts.append(contract)
        refs.append(Ref("contracts", contract, _line(item), "contract"))
    return ServiceDecl(name, line, queue_name, tuple(contracts), tuple(refs))


def _masked(value: str) -> str:
    """An address as it may be shown in a message: user, password and query replaced by ***."""
    match = _URL.match(value)
    scheme, rest = (f"{match['scheme']}://", match["rest"]) if match else ("", value)
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    if "?" in rest:
        rest = rest.partition("?")[0] + "?***"
    # A libpq-style "host=db password=x" has no URL form to lean on.
    return scheme + re.sub(r"(?i)(password\s*=\s*)\S*", r"\1***", rest)


def _address(r: _Reader, node: yaml.Node, what: str, *, keywords: bool) -> str:
    value = r.string(node, what, max_length=MAX_ADDRESS)
    if not value:
        return value
    if keywords and value.upper() in ADDRESS_KEYWORDS:
        return value.upper()
    if BROKER_ADDRESS.match(value):
        return value
    forms = "LOCAL, TRANSPORT or broker://NAME" if keywords else "broker://NAME"
    match = _URL.match(value)
    credentials = "@" in value or re.search(r"(?i)password\s*=", value) is not None
    if not credentials and (match is None or match["scheme"].lower() == "broker"):
        r.problem(
            node,
            f"{what} must be {forms} (NAME: a logical broker name of letters, digits, _ . -), "
            f"not {value!r}",
        )
        return value
    # A URL or credentials where a logical name belongs. Never echo a password back: messages
    # end up in terminals, CI logs and tickets.
    host = (value if match is None else match["rest"]).rpartition("@")[2]
    name = host if match is not None and match["scheme"].lower() == "broker" else ""
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        name = ""
    what_it_is = "an address with credentials" if credentials else "a URL"
    write = f"broker://{name}" if name else "broker://NAME"
    if name:
        from airflow_broker.transport import env_name  # the resolver's own rule for the name

        env = env_name(name)
    else:
        env = f"{ADDRESS_ENV_PREFIX}<NAME>"
    r.problem(
        node,
        f"{what} must be {forms}, not {what_it_is} ({_masked(value)!r}): routes take logical "
        f"names, never URLs or credentials. Write {write} and give that name's database URL "
        f"(with its credentials) to the resolver: in Airflow the connection whose id is "
        f"{name or 'NAME'}, outside Airflow the environment variable {env} (or the resolver "
        "passed to Broker.connect)",
    )
    return value


def _route(r: _Reader, what: str, name: str, line: int, e: dict[str, yaml.Node]) -> RouteDecl:
    service_name = r.optional_string(e.get("service_name"), f"{what}: service_name")
    broker_instance = r.optional_string(e.get("broker_instance"), f"{what}: broker_instance")
    if broker_instance is not None and broker_instance:
        try:
            uuid.UUID(broker_instance)
        except ValueError:
            r.problem(
                e["broker_instance"],
                f"{what}: broker_instance must be a broker instance id (a UUID), "
                f"not {broker_instance!r}",
            )
    address = "LOCAL"
    if "address" in e:
        address = _address(r, e["address"], f"{what}: address", keywords=True)
    mirror: str | None = None
    node = e.get("mirror_address")
    if node is not None and not (isinstance(node, yaml.ScalarNode) and node.tag == _NULL):
        mirror = _address(r, node, f"{what}: mirror_address", keywords=False)
        if broker_instance is None:
            r.problem(
                node, f"{what}: mirror_address needs a broker_instance (the mirrored pair's id)"
            )
        if address in ADDRESS_KEYWORDS:
            r.problem(
                node,
                f"{what}: mirror_address needs an address of the form broker://NAME, not {address}",
            )
    lifetime: int | None = None
    node = e.get("lifetime_seconds")
    if node is not None and not (isinstance(node, yaml.ScalarNode) and node.tag == _NULL):
        lifetime = r.integer(node, f"{what}: lifetime_seconds", minimum=1)
    return RouteDecl(name, line, service_name, broker_instance, address, mirror, lifetime)


def _priority(r: _Reader, what: str, name: str, line: int, e: dict[str, yaml.Node]) -> PriorityDecl:
    refs: list[Ref] = []
    contract = r.optional_string(e.get("contract"), f"{what}: contract")
    if contract:
        refs.append(Ref("contracts", contract, _line(e["contract"]), "contract"))
    local_service = r.optional_string(e.get("local_service"), f"{what}: local_service")
    if local_service:
        refs.append(Ref("services", local_service, _line(e["local_service"]), "local_service"))
    remote_service = r.optional_string(e.get("remote_service"), f"{what}: remote_service")
    priority = 5
    if "priority" in e:
        priority = r.integer(e["priority"], f"{what}: priority", minimum=1, maximum=10)
    return PriorityDecl(name, line, contract, local_service, remote_service, priority, tuple(refs))
