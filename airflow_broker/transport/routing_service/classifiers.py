"""Classifiers: what reads a message body and names the target service (a Python callable, a
JSON path or an XPath, as a routing service's declaration says).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any
from xml.etree import ElementTree

from defusedxml import DefusedXmlException

from airflow_broker.errors import (
    InvalidDefinition,
)
from airflow_broker.transport.routing_service.paths import (
    XPath,
    _Members,
    json_path_value,
    load_json,
    parse_json_path,
    parse_xpath,
    xpath_value,
)

#: A classifier as the router calls it: body -> target service, or :class:`NotClassified`.
Classify = Callable[[bytes | None], str]


class NotClassified(Exception):
    """The message names no target service; the text says why."""


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
