"""The data-dependent routing service (seed 000).

When data is partitioned rather than replicated (sales by region, one database per region),
ordinary routes cannot pick the service that holds the data: the choice depends on what is inside
the message. A routing service does it. It is a service like any other, on a queue of its own,
that accepts every contract; :func:`run_routing_service` drains its queue:

forward mode
    The first message of an inbound conversation (one where the routing service is the target
    and that has no mapping yet) is *classified*: the classifier reads the message body and names
    the target service. The router begins an outbound dialog from itself to that service, with
    the inbound conversation's contract and in the inbound conversation's group, records the
    pair in ``broker_resolved_conversation`` and forwards the message (same message type, same
    body), all in the transaction that received it. Every later message of either half goes to
    the other half without classifying. EndDialog ends the other half, then this one; an Error
    ends the other half WITH ERROR (same code, the description prefixed with where it came
    from), then this one. DialogTimer messages are ignored. The mapping is deleted once the
    router has ended both halves.

redirect mode
    The first message of an inbound conversation is classified and the router answers with the
    :data:`~airflow_broker.constants.REDIRECT` system message, a JSON body
    ``{"to_service": ..., "broker_instance": null}``, then ends the conversation: the initiator
    begins a new dialog with that service itself (end-to-end security is kept; see seed 000).

A message that cannot be classified (the classifier returns nothing or fails, the path finds
nothing) ends the inbound conversation WITH ERROR
:data:`~airflow_broker.constants.ERR_NOT_CLASSIFIED`, naming the routing service and the reason;
nothing else is done for it.

Classifiers, stored as text in ``broker_routing_service.classifier``:

``python:module:qualname``
    A module-level callable ``body (bytes | None) -> service name | None``; a callable passed to
    :func:`create_routing_service` is stored this way, so it must be importable by name from any
    process that runs the router (no lambdas, no nested functions, nothing from ``__main__``).
``json:$.path``
    A JSON path in the grammar of Spark's ``get_json_object`` (see :func:`parse_json_path`),
    so that the Spark routing job classifies with the same path and gets the same answer.
``xpath:/path``
    An absolute path in ElementTree's XPath subset over the body parsed with defusedxml
    (see :func:`parse_xpath`), e.g. seed 000's ``xpath:/message/toServiceName``.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from xml.etree import ElementTree

from defusedxml import DefusedXmlException
from defusedxml import ElementTree as SafeElementTree
from sqlalchemy import delete, exists, insert, or_, select
from sqlalchemy.exc import IntegrityError

from airflow_broker import schema as s
from airflow_broker.arguments import as_name
from airflow_broker.constants import (
    DIALOG_TIMER,
    END_DIALOG,
    ERR_CONTRACT_NOT_SUPPORTED,
    ERR_MESSAGE_INVALID,
    ERR_NOT_CLASSIFIED,
    ERROR,
    REDIRECT,
    SENDABLE_STATES,
)
from airflow_broker.definitions import Definitions
from airflow_broker.engines import utcnow
from airflow_broker.errors import (
    BrokerError,
    ConversationEnded,
    InvalidDefinition,
    MessageValidationError,
    UnknownObject,
)
from airflow_broker.objects import ConversationEndpoint, Message

if TYPE_CHECKING:
    from airflow_broker.broker import Broker
    from airflow_broker.transaction import Transaction

log = logging.getLogger("airflow_broker")

#: The two ways a routing service can route (seed 000).
MODES = ("forward", "redirect")

#: Endpoint states in which the router has ended its side: nothing more to do with it.
ENDED_STATES = frozenset({"DO", "CD"})

#: A classifier as the router calls it: body -> target service, or :class:`NotClassified`.
Classify = Callable[[bytes | None], str]


class NotClassified(Exception):
    """The message names no target service; the text says why."""


# ---------------------------------------------------------------------------------------------
# Classifiers
# ---------------------------------------------------------------------------------------------


def classifier_spec(classifier: Any) -> str:
    """The stored text form of ``classifier``, checked: a callable becomes
    ``python:module:qualname``; a string must be a valid ``python:``, ``json:`` or ``xpath:``
    classifier. Raises :class:`InvalidDefinition` saying what is wrong."""
    if isinstance(classifier, str):
        compile_classifier(classifier)
        return classifier
    if not callable(classifier):
        raise InvalidDefinition(
            f"classifier must be a callable or a string ('python:module:qualname', "
            f"'json:$.path' or 'xpath:/path'), not {type(classifier).__name__}"
        )
    module = getattr(classifier, "__module__", None)
    qualname = getattr(classifier, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise InvalidDefinition(
            f"classifier {classifier!r} has no module and qualified name: pass a module-level "
            "function (the router stores it by name and imports it wherever it runs)"
        )
    if "<lambda>" in qualname:
        raise InvalidDefinition(
            f"classifier {module}.{qualname} is a lambda: the router stores its classifier by "
            "name and imports it wherever it runs; define a module-level function instead"
        )
    if "<locals>" in qualname:
        raise InvalidDefinition(
            f"classifier {module}.{qualname} is defined inside a function: the router stores "
            "its classifier by name and imports it wherever it runs; define it at module level"
        )
    spec = f"python:{module}:{qualname}"
    resolved = _import_callable(spec, module, qualname)
    if resolved is not classifier and resolved != classifier:
        raise InvalidDefinition(
            f"classifier {module}.{qualname} is not what importing {module!r} and looking up "
            f"{qualname!r} gives: pass the module-level function itself"
        )
    return spec


def compile_classifier(spec: str) -> Classify:
    """The classifier a stored text names, ready to call. Raises :class:`InvalidDefinition`."""
    if not isinstance(spec, str):
        raise InvalidDefinition(f"classifier must be a string here, not {type(spec).__name__}")
    kind, sep, rest = spec.partition(":")
    if not sep or kind not in ("python", "json", "xpath"):
        raise InvalidDefinition(
            f"classifier {spec!r} must start with 'python:', 'json:' or 'xpath:' "
            "(or be a module-level callable)"
        )
    if kind == "python":
        module, sep, qualname = rest.partition(":")
        if not sep or not module or not qualname:
            raise InvalidDefinition(
                f"classifier {spec!r} must be 'python:module:qualname' (e.g. "
                "'python:myapp.routing:classify')"
            )
        return _python_classifier(spec, _import_callable(spec, module, qualname))
    if kind == "json":
        return _json_classifier(rest, parse_json_path(rest))
    return _xpath_classifier(rest, parse_xpath(rest))


def _import_callable(spec: str, module: str, qualname: str) -> Callable[..., Any]:
    if module == "__main__":
        raise InvalidDefinition(
            f"classifier {spec!r} lives in __main__, which no other process can import: "
            "move it into a module"
        )
    try:
        obj: Any = importlib.import_module(module)
    except Exception as exc:
        raise InvalidDefinition(
            f"classifier {spec!r}: module {module!r} cannot be imported: {exc}"
        ) from exc
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise InvalidDefinition(
                f"classifier {spec!r}: module {module!r} has no {qualname!r}"
            ) from None
    if not callable(obj):
        raise InvalidDefinition(f"classifier {spec!r} names {type(obj).__name__}, not a callable")
    result: Callable[..., Any] = obj
    return result


def _target_name(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise NotClassified(f"{what} gave {type(value).__name__} {value!r}, not a service name")
    if not value.strip():
        raise NotClassified(f"{what} gave an empty service name")
    if len(value) > 256:
        raise NotClassified(f"{what} gave a service name longer than 256 characters")
    return value


def _python_classifier(spec: str, fn: Callable[..., Any]) -> Classify:
    def classify(body: bytes | None) -> str:
        try:
            value = fn(body)
        except Exception as exc:
            raise NotClassified(f"classifier {spec} raised {type(exc).__name__}: {exc}") from exc
        if value is None:
            raise NotClassified(f"classifier {spec} returned no service name")
        return _target_name(value, f"classifier {spec}")

    return classify


# -- JSON paths (the grammar of Spark's get_json_object) ---------------------------------------

_DOT_NAME = re.compile(r"[^.\[]+")
_BRACKET_NAME = re.compile(r"\['([^'?]+)'\]")
_INDEX = re.compile(r"\[(\d+)\]")
#: Spark parses indexes as a Long; far beyond any array a message body holds.
_MAX_INDEX = 10**9


def parse_json_path(path: str) -> tuple[str | int, ...]:
    """Parse a JSON path into its steps (names and array indexes).

    The grammar is the part of Spark's ``get_json_object`` path grammar that selects one value,
    and every path accepted here is read the same way by Spark:

    - ``$`` is the whole document, and must come first;
    - ``.name``: a member of an object; ``name`` is one or more characters other than ``.`` and
      ``[`` (so ``$.a b`` names the member ``"a b"``);
    - ``['name']``: the same, for names with ``.`` or ``[`` in them; ``name`` has no ``'`` and
      no ``?``;
    - ``[n]``: element ``n`` (from 0) of an array.

    Refused, with the reason: wildcards (``.*``, ``['*']``, ``[*]``), which select several
    values; whitespace outside names and names that begin or end with whitespace (Spark's parser
    skips whitespace between tokens, so ``$. a`` would quietly mean ``$.a`` there); anything
    else Spark's parser would not read.
    """
    if not isinstance(path, str) or not path.startswith("$"):
        raise InvalidDefinition(f"JSON path {path!r} must start with '$' (e.g. '$.region')")
    steps: list[str | int] = []
    i = 1
    while i < len(path):
        if path[i] == ".":
            m = _DOT_NAME.match(path, i + 1)
            if m is None:
                raise InvalidDefinition(
                    f"JSON path {path!r}: a name must follow the '.' at position {i}"
                )
            name = m.group()
            if name.startswith("*"):
                raise InvalidDefinition(
                    f"JSON path {path!r}: wildcards (.*) select several values; a classifier "
                    "path must select one"
                )
            _check_name(path, name)
            steps.append(name)
            i = m.end()
        elif path.startswith("['", i):
            m = _BRACKET_NAME.match(path, i)
            if m is None:
                raise InvalidDefinition(
                    f"JSON path {path!r}: at position {i}, ['name'] needs a closing '] and a "
                    "name without ' or ?"
                )
            name = m.group(1)
            if name == "*":
                raise InvalidDefinition(
                    f"JSON path {path!r}: wildcards (['*']) select several values; a "
                    "classifier path must select one"
                )
            _check_name(path, name)
            steps.append(name)
            i = m.end()
        elif path[i] == "[":
            m = _INDEX.match(path, i)
            if m is None:
                if path.startswith("[*]", i):
                    raise InvalidDefinition(
                        f"JSON path {path!r}: wildcards ([*]) select several values; a "
                        "classifier path must select one"
                    )
                raise InvalidDefinition(
                    f"JSON path {path!r}: at position {i}, expected [n] (an array index) or "
                    "['name']"
                )
            index = int(m.group(1))
            if index > _MAX_INDEX:
                raise InvalidDefinition(f"JSON path {path!r}: array index {index} is too large")
            steps.append(index)
            i = m.end()
        else:
            raise InvalidDefinition(
                f"JSON path {path!r}: unexpected {path[i]!r} at position {i}; expected .name, "
                "['name'] or [n]"
            )
    return tuple(steps)


def _error_code(exc: BrokerError) -> int:
    """The Error code that tells the initiator why the router could not pass a message on."""
    return (
        ERR_MESSAGE_INVALID
        if isinstance(exc, MessageValidationError)
        else (ERR_CONTRACT_NOT_SUPPORTED)
    )


def _check_name(path: str, name: str) -> None:
    if name != name.strip():
        raise InvalidDefinition(
            f"JSON path {path!r}: name {name!r} begins or ends with whitespace, which Spark's "
            "get_json_object does not read the same way"
        )


class _Members(list[tuple[str, Any]]):
    """A JSON object as the (name, value) pairs it was written with, duplicates included."""


def json_path_value(document: Any, steps: tuple[str | int, ...]) -> Any:
    """The value ``steps`` select in a document parsed with :func:`load_json`, or None.

    As Spark's ``get_json_object``: a member whose value is null does not match; when an object
    has a name more than once, the first member the rest of the path matches in wins.
    """
    if not steps:
        return document
    step, rest = steps[0], steps[1:]
    if isinstance(step, int):
        if (
            isinstance(document, list)
            and not isinstance(document, _Members)
            and step < len(document)
        ):
            return json_path_value(document[step], rest)
        return None
    if isinstance(document, _Members):
        for name, value in document:
            if name == step and value is not None:
                found = json_path_value(value, rest)
                if found is not None:
                    return found
    return None


def load_json(body: bytes) -> Any:
    """Parse a JSON body keeping every member of every object, in order (see :class:`_Members`)."""
    return json.loads(body, object_pairs_hook=_Members)


def _json_classifier(path: str, steps: tuple[str | int, ...]) -> Classify:
    def classify(body: bytes | None) -> str:
        if body is None:
            raise NotClassified(f"JSON path {path}: the message has no body")
        try:
            document = load_json(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise NotClassified(f"JSON path {path}: the body is not JSON ({exc})") from exc
        value = json_path_value(document, steps)
        if value is None:
            raise NotClassified(f"JSON path {path} finds nothing in the body")
        if not isinstance(value, str):
            kind = (
                "an object"
                if isinstance(value, _Members)
                else "an array"
                if isinstance(value, list)
                else f"the {type(value).__name__} {value!r}"
            )
            raise NotClassified(f"JSON path {path} finds {kind}, not a string")
        return _target_name(value, f"JSON path {path}")

    return classify


# -- XPath (ElementTree's subset) --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class XPath:
    """A parsed classifier XPath: an ElementTree path from the document, and what to read."""

    text: str
    #: the ElementTree path, relative to a wrapper element holding the root element
    element_path: str
    #: read this attribute of the element found (a trailing ``/@name``), else its text
    attribute: str | None


_TRAILING_ATTRIBUTE = re.compile(r"/@([^/\[\]@=\s]+)$")


def parse_xpath(path: str) -> XPath:
    """Parse a classifier XPath.

    An absolute path in the subset of XPath that ElementTree understands (child steps, ``*``,
    ``//``, ``..``, ``[@attr]``, ``[@attr='v']``, ``[tag]``, ``[tag='v']``, ``[n]``,
    ``[last()]``; namespaced names as ``{uri}name``), read from the document: ``/message``
    matches the root element only if it is ``<message>``; ``//name`` is any element so named,
    the root included. It may end in ``/@attr`` (the value of an attribute) or ``/text()`` (the
    element's text, which is also what a path to an element gives). The first element found
    counts; its text is stripped of surrounding whitespace.
    """
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidDefinition(
            f"XPath {path!r} must be absolute, starting with '/' or '//' (e.g. "
            "'/message/toServiceName')"
        )
    element_path = path
    attribute: str | None = None
    if element_path.endswith("/text()"):
        element_path = element_path[: -len("/text()")]
    else:
        m = _TRAILING_ATTRIBUTE.search(element_path)
        if m is not None:
            attribute = m.group(1)
            element_path = element_path[: m.start()]
    if element_path in ("", "/", "//") or element_path.endswith("/"):
        raise InvalidDefinition(f"XPath {path!r} must name an element (e.g. '/message/to')")
    if "@" in re.sub(r"\[[^\]]*\]", "", element_path):
        raise InvalidDefinition(f"XPath {path!r}: an attribute can only be the last step (/@name)")
    element_path = "." + element_path
    try:
        # ElementTree compiles a path the first time it is used: this checks it.
        ElementTree.Element("document").find(element_path)
    except (SyntaxError, KeyError, TypeError, ValueError) as exc:
        raise InvalidDefinition(
            f"XPath {path!r} is not in ElementTree's XPath subset: {exc or type(exc).__name__}"
        ) from exc
    return XPath(path, element_path, attribute)


def xpath_value(body: bytes, xpath: XPath) -> str | None:
    """The text (or attribute) the path selects in an XML body, or None if it selects nothing.
    The body is parsed with defusedxml (no DTD entities, no external references)."""
    root = SafeElementTree.fromstring(body)
    document = ElementTree.Element("document")
    document.append(root)
    element = document.find(xpath.element_path)
    if element is None:
        return None
    if xpath.attribute is not None:
        return element.get(xpath.attribute)
    return "".join(element.itertext()).strip()


def _xpath_classifier(path: str, xpath: XPath) -> Classify:
    def classify(body: bytes | None) -> str:
        if body is None:
            raise NotClassified(f"XPath {path}: the message has no body")
        try:
            value = xpath_value(body, xpath)
        except (ElementTree.ParseError, DefusedXmlException, ValueError) as exc:
            raise NotClassified(
                f"XPath {path}: the body is not well-formed, safe XML ({exc})"
            ) from exc
        if value is None:
            raise NotClassified(f"XPath {path} finds nothing in the body")
        if not value:
            raise NotClassified(f"XPath {path} finds an empty value")
        return _target_name(value, f"XPath {path}")

    return classify


# ---------------------------------------------------------------------------------------------
# Definition
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoutingService:
    """A routing service as stored: its service, queue, mode and classifier text."""

    name: str
    queue: str
    mode: str
    classifier: str


def create_routing_service(
    broker: Broker, name: str, queue: str, classifier: Any, mode: str = "forward"
) -> None:
    """Create service ``name`` on ``queue`` and make it a data-dependent routing service.

    All or nothing, in one transaction. The queue must exist and serve no other service (the
    router RECEIVEs everything on it); the name must be free; ``mode`` is ``"forward"`` or
    ``"redirect"``; the classifier is checked (see the module docstring) and stored as text.
    """
    as_name(name, "routing service")
    if mode not in MODES:
        raise InvalidDefinition(
            f"routing service {name!r}: mode {mode!r} must be 'forward' or 'redirect'"
        )
    spec = classifier_spec(classifier)
    try:
        with broker.engine.begin() as conn:
            d = Definitions(broker, conn)
            d.create_service(name, queue=queue)
            others = sorted(
                conn.execute(
                    select(s.service.c.name)
                    .join(s.queue, s.queue.c.queue_id == s.service.c.queue_id)
                    .where(s.queue.c.name == queue, s.service.c.name != name)
                ).scalars()
            )
            if others:
                raise InvalidDefinition(
                    f"routing service {name!r}: queue {queue!r} already serves "
                    f"{', '.join(others)}; a routing service RECEIVEs everything on its queue, "
                    "so it needs a queue of its own"
                )
            conn.execute(
                insert(s.routing_service).values(
                    name=name, mode=mode, classifier=spec, created_at=utcnow()
                )
            )
    except IntegrityError as exc:
        raise InvalidDefinition(
            f"routing service {name!r} refused by the database: {exc.orig}"
        ) from exc
    finally:
        broker.invalidate_definitions()
    log.info(
        "routing service %r created on queue %r (%s mode, classifier %s)", name, queue, mode, spec
    )


def routing_service(broker: Broker, name: str) -> RoutingService:
    """The stored definition of routing service ``name`` (:class:`UnknownObject` if none)."""
    rs = s.routing_service
    with broker.engine.connect() as conn:
        row = conn.execute(
            select(rs.c.name, rs.c.mode, rs.c.classifier, s.queue.c.name.label("queue"))
            .join(s.service, s.service.c.name == rs.c.name)
            .join(s.queue, s.queue.c.queue_id == s.service.c.queue_id)
            .where(rs.c.name == name)
        ).first()
        if row is None:
            raise UnknownObject(f"routing service {name!r} does not exist in this broker")
        others = sorted(
            conn.execute(
                select(s.service.c.name)
                .join(s.queue, s.queue.c.queue_id == s.service.c.queue_id)
                .where(s.queue.c.name == row.queue, s.service.c.name != name)
            ).scalars()
        )
    if others:
        raise InvalidDefinition(
            f"routing service {name!r}: its queue {row.queue!r} also serves "
            f"{', '.join(others)}; the router would take their messages, so it does not run"
        )
    return RoutingService(row.name, row.queue, row.mode, row.classifier)


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


def run_routing_service(broker: Broker, name: str, max_messages: int | None = None) -> int:
    """One pass of routing service ``name``: RECEIVE from its queue, a conversation group per
    transaction, and route every message, until the queue is empty or ``max_messages`` were
    handled. Returns how many messages were handled (DialogTimers and ignored ones included)."""
    if max_messages is not None and (
        not isinstance(max_messages, int) or isinstance(max_messages, bool) or max_messages < 1
    ):
        raise InvalidDefinition(f"max_messages must be a whole number >= 1, not {max_messages!r}")
    svc = routing_service(broker, name)
    classify = compile_classifier(svc.classifier)
    handled = 0
    while max_messages is None or handled < max_messages:
        top = None if max_messages is None else max_messages - handled
        with broker.transaction() as tx:
            messages = tx.receive(svc.queue, top=top)
            router = _Router(tx, svc, classify)
            for m in messages:
                router.handle(m)
        if not messages:
            break
        handled += len(messages)
    swept = sweep_mappings(broker, name)
    if handled or swept:
        log.info(
            "routing service %r handled %d message(s)%s",
            name,
            handled,
            f", forgot {swept} finished mapping(s)" if swept else "",
        )
    return handled


def sweep_mappings(broker: Broker, name: str) -> int:
    """Delete the mappings of routing service ``name`` whose two halves the router has ended
    (or that no longer exist): the ones a far side closed without a message to the router."""
    r = s.resolved_conversation
    e = s.conversation_endpoint
    live = (
        select(e.c.conversation_handle)
        .where(
            e.c.conversation_handle.in_([r.c.inbound_handle, r.c.outbound_handle]),
            e.c.state.not_in(sorted(ENDED_STATES)),
        )
        .correlate(r)
    )
    with broker.engine.begin() as conn:
        result = conn.execute(delete(r).where(r.c.routing_service == name, ~exists(live)))
    return int(result.rowcount or 0)


@dataclass(frozen=True, slots=True)
class _Pair:
    """The other half of a mapped conversation."""

    other: uuid.UUID
    #: whether the conversation the message came on is the inbound half
    inbound: bool
    target_service: str


class _Router:
    """Routes the messages of one RECEIVE, inside its transaction."""

    def __init__(self, tx: Transaction, svc: RoutingService, classify: Classify) -> None:
        self.tx = tx
        self.svc = svc
        self.classify = classify

    # -- lookups -------------------------------------------------------------------------------
    def _endpoint(self, handle: uuid.UUID) -> ConversationEndpoint | None:
        try:
            return self.tx.conversation(handle)
        except UnknownObject:
            return None

    def _pair(self, handle: uuid.UUID) -> _Pair | None:
        r = s.resolved_conversation
        row = self.tx.connection.execute(
            select(r.c.inbound_handle, r.c.outbound_handle, r.c.target_service).where(
                or_(r.c.inbound_handle == handle, r.c.outbound_handle == handle)
            )
        ).first()
        if row is None:
            return None
        if row.inbound_handle == handle:
            return _Pair(row.outbound_handle, True, row.target_service)
        return _Pair(row.inbound_handle, False, row.target_service)

    # -- dispatch ------------------------------------------------------------------------------
    def handle(self, m: Message) -> None:
        h = m.conversation_handle
        ep = self._endpoint(h)
        if ep is None:
            log.info("routing service %r: conversation %s is gone; message dropped", self.name, h)
            return
        mt = m.message_type_name
        if mt == DIALOG_TIMER:
            log.debug("routing service %r: DialogTimer on %s ignored", self.name, h)
            return
        pair = self._pair(h)
        if mt == END_DIALOG:
            self._end_dialog(ep, pair)
        elif mt == ERROR:
            self._error(m, ep, pair)
        elif ep.state in ENDED_STATES:
            log.info(
                "routing service %r: %s on conversation %s, which the router has ended; dropped",
                self.name,
                mt,
                h,
            )
        elif pair is not None:
            self._relay(m, ep, pair)
        elif ep.is_initiator:
            # Only the router begins dialogs from its service, and always with a mapping.
            self._end(
                h,
                (
                    ERR_NOT_CLASSIFIED,
                    f"routing service {self.name!r} began no conversation {h} that it knows of",
                ),
            )
            log.warning(
                "routing service %r: message on conversation %s, which it began but has no "
                "mapping for; ended with an error",
                self.name,
                h,
            )
        elif self.svc.mode == "redirect":
            self._redirect(m, ep)
        else:
            self._forward_first(m, ep)

    @property
    def name(self) -> str:
        return self.svc.name

    # -- first message of an inbound conversation -----------------------------------------------
    def _target(self, m: Message) -> str | None:
        """Classify; on failure end the inbound conversation WITH ERROR and return None."""
        try:
            target = self.classify(m.message_body)
            if target == self.name:
                raise NotClassified(
                    f"the classifier named the routing service {self.name!r} itself"
                )
        except NotClassified as exc:
            reason = str(exc)
            self._end(
                m.conversation_handle,
                (
                    ERR_NOT_CLASSIFIED,
                    f"routing service {self.name!r} could not classify message "
                    f"{m.message_sequence_number} ({m.message_type_name}) of this "
                    f"conversation: {reason}",
                ),
            )
            log.warning(
                "routing service %r: conversation %s not classified (%s); ended with error %d",
                self.name,
                m.conversation_handle,
                reason,
                ERR_NOT_CLASSIFIED,
            )
            return None
        return target

    def _forward_first(self, m: Message, ep: ConversationEndpoint) -> None:
        target = self._target(m)
        if target is None:
            return
        tx = self.tx
        inbound = m.conversation_handle
        lifetime: int | None = None
        if ep.lifetime is not None:
            # The outbound half lives no longer than the inbound one.
            lifetime = max(1, math.ceil((ep.lifetime - utcnow()).total_seconds()))
        savepoint = tx.connection.begin_nested()
        try:
            outbound = tx.begin_dialog(
                self.name,
                target,
                contract=ep.contract_name,
                lifetime_seconds=lifetime,
                related_conversation=inbound,
            )
            tx.connection.execute(
                insert(s.resolved_conversation).values(
                    inbound_handle=inbound,
                    outbound_handle=outbound,
                    routing_service=self.name,
                    target_service=target,
                    created_at=utcnow(),
                )
            )
            tx.send(outbound, m.message_type_name, m.message_body)
        except BrokerError as exc:
            # The router's broker cannot carry this message on (a contract or message type it
            # lacks, a body its message type refuses): nothing of the pair remains.
            savepoint.rollback()
            code = _error_code(exc)
            self._end(
                inbound,
                (
                    code,
                    f"routing service {self.name!r} could not forward message "
                    f"{m.message_sequence_number} ({m.message_type_name}) to {target!r}: {exc}",
                ),
            )
            log.warning(
                "routing service %r: conversation %s classified to %r but not forwarded: %s",
                self.name,
                inbound,
                target,
                exc,
            )
            return
        savepoint.commit()
        log.info(
            "routing service %r: conversation %s (from %r, contract %r) routed to %r on %s",
            self.name,
            inbound,
            ep.far_service,
            ep.contract_name,
            target,
            outbound,
        )

    def _redirect(self, m: Message, ep: ConversationEndpoint) -> None:
        target = self._target(m)
        if target is None:
            return
        h = m.conversation_handle
        body = json.dumps({"to_service": target, "broker_instance": None}).encode("utf-8")
        tx = self.tx
        tx._system_send(tx._endpoint_row(h), REDIRECT, body, utcnow())
        self._end(h)
        log.info(
            "routing service %r: conversation %s (from %r) redirected to %r",
            self.name,
            h,
            ep.far_service,
            target,
        )

    # -- later messages --------------------------------------------------------------------------
    def _relay(self, m: Message, ep: ConversationEndpoint, pair: _Pair) -> None:
        other = self._endpoint(pair.other)
        if other is None or other.state not in SENDABLE_STATES:
            state = "gone" if other is None else other.state
            log.info(
                "routing service %r: %s on %s not relayed: the other half %s is %s",
                self.name,
                m.message_type_name,
                m.conversation_handle,
                pair.other,
                state,
            )
            return
        tx = self.tx
        if m.message_type_name == REDIRECT:
            # The target is itself a redirecting router: its answer is for the initiator.
            tx._system_send(tx._endpoint_row(pair.other), REDIRECT, m.message_body, utcnow())
            log.info(
                "routing service %r: Redirect from %r passed on to %s",
                self.name,
                ep.far_service,
                pair.other,
            )
            return
        try:
            tx.send(pair.other, m.message_type_name, m.message_body)
        except ConversationEnded as exc:
            log.info(
                "routing service %r: %s on %s not relayed: %s",
                self.name,
                m.message_type_name,
                m.conversation_handle,
                exc,
            )
            return
        except BrokerError as exc:
            # The message type or body is not acceptable here (the router's broker defines the
            # message types differently): the pair cannot go on.
            code = _error_code(exc)
            description = (
                f"routing service {self.name!r} could not pass on message "
                f"{m.message_sequence_number} ({m.message_type_name}): {exc}"
            )
            self._end(pair.other, (code, description))
            self._end(m.conversation_handle, (code, description))
            self._forget(m.conversation_handle, pair)
            log.warning("routing service %r: %s", self.name, description)
            return
        log.debug(
            "routing service %r: %s relayed %s -> %s",
            self.name,
            m.message_type_name,
            m.conversation_handle,
            pair.other,
        )

    def _end_dialog(self, ep: ConversationEndpoint, pair: _Pair | None) -> None:
        h = ep.conversation_handle
        if pair is not None:
            self._end(pair.other)
        self._end(h)
        if pair is not None:
            self._forget(h, pair)
        log.info(
            "routing service %r: EndDialog on %s%s",
            self.name,
            h,
            f"; ended it and {pair.other}" if pair is not None else "; ended it",
        )

    def _error(self, m: Message, ep: ConversationEndpoint, pair: _Pair | None) -> None:
        h = ep.conversation_handle
        code, description = m.error or (0, "")
        if pair is not None:
            where = (
                f"from service {ep.far_service!r}"
                + (
                    ""
                    if ep.far_broker_instance in (None, self.tx.broker.instance_id)
                    else f" at broker instance {ep.far_broker_instance}"
                )
                + f" via routing service {self.name!r}"
            )
            self._end(pair.other, (code, f"[{where}] {description}"))
        self._end(h)
        if pair is not None:
            self._forget(h, pair)
        log.info(
            "routing service %r: Error %d on %s (%s)%s",
            self.name,
            code,
            h,
            description,
            f"; passed on to {pair.other}" if pair is not None else "",
        )

    # -- ending ----------------------------------------------------------------------------------
    def _end(self, handle: uuid.UUID, error: tuple[int, str] | None = None) -> None:
        """END CONVERSATION (WITH ERROR if ``error``) unless the router has ended it already."""
        ep = self._endpoint(handle)
        if ep is None or ep.state in ENDED_STATES:
            return
        if error is None:
            self.tx.end_conversation(handle)
        else:
            self.tx.end_conversation(handle, error_code=error[0], error_description=error[1])

    def _forget(self, handle: uuid.UUID, pair: _Pair) -> None:
        """Delete the mapping once the router has ended both halves."""
        for h in (handle, pair.other):
            ep = self._endpoint(h)
            if ep is not None and ep.state not in ENDED_STATES:
                return
        r = s.resolved_conversation
        inbound = handle if pair.inbound else pair.other
        self.tx.connection.execute(delete(r).where(r.c.inbound_handle == inbound))


__all__ = [
    "MODES",
    "NotClassified",
    "RoutingService",
    "XPath",
    "classifier_spec",
    "compile_classifier",
    "create_routing_service",
    "json_path_value",
    "load_json",
    "parse_json_path",
    "parse_xpath",
    "routing_service",
    "run_routing_service",
    "sweep_mappings",
    "xpath_value",
]
