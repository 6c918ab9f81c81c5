"""The small JSON-path and XPath subsets classifiers use: parsing, checking and evaluating them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from xml.etree import ElementTree

from defusedxml import ElementTree as SafeElementTree

from airflow_broker.constants import (
    ERR_CONTRACT_NOT_SUPPORTED,
    ERR_MESSAGE_INVALID,
)
from airflow_broker.errors import (
    BrokerError,
    InvalidDefinition,
    MessageValidationError,
)

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
