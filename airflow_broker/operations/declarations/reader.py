"""The YAML node walker of :func:`~.parse.parse`: values out of nodes, each problem recorded with
its line (:class:`_Reader`), and how nodes and names read in messages.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from airflow_broker.operations.declarations.model import _BOOL, _INT, _NULL, _STR, MAX_NAME, Problem


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def _describe(node: yaml.Node) -> str:
    """How a node reads in a message: ``a list``, ``the string 'x'``, ``the number 3``..."""
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if node.tag == _NULL:
        return "nothing (null)"
    if node.tag == _STR:
        return f"the string {node.value!r}"
    if node.tag == _BOOL:
        return f"the boolean {node.value}"
    if node.tag in (_INT, "tag:yaml.org,2002:float"):
        return f"the number {node.value}"
    return f"{node.value!r}"


def _suggest(word: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


class _Reader:
    """Walks the node tree, turning nodes into values and recording what is wrong with them.

    Every getter records its own problem and returns a harmless fallback, so that one walk finds
    every problem; callers compare ``len(problems)`` before and after an entry to know whether
    the entry itself is usable.
    """

    def __init__(self, loader: yaml.SafeLoader, base_dir: Path | None = None) -> None:
        self.loader = loader
        self.problems: list[Problem] = []
        #: where files the declarations name (``pem_file``) are read from (None: the current
        #: directory)
        self.base_dir = base_dir

    def problem(self, node: yaml.Node | None, message: str) -> None:
        self.problems.append(Problem(None if node is None else _line(node), message))

    def mapping(
        self,
        node: yaml.Node,
        what: str,
        *,
        allowed: Sequence[str],
        required: Sequence[str] = (),
    ) -> dict[str, yaml.Node]:
        """The entries of a mapping node by key; unknown, repeated and missing keys are problems."""
        if not isinstance(node, yaml.MappingNode):
            self.problem(
                node, f"{what} must be a mapping (key: value lines), not {_describe(node)}"
            )
            return {}
        seen: dict[str, yaml.Node] = {}
        entries: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != _STR:
                self.problem(key_node, f"{what}: keys must be names, not {_describe(key_node)}")
                continue
            key = str(key_node.value)
            if key in seen:
                self.problem(
                    key_node, f"{what}: '{key}' is given twice (first on line {_line(seen[key])})"
                )
            elif key not in allowed:
                self.problem(
                    key_node,
                    f"{what}: unknown key '{key}'{_suggest(key, allowed)}; "
                    f"known keys: {', '.join(allowed)}",
                )
            else:
                seen[key] = key_node
                entries[key] = value_node
        for key in required:
            if key not in entries:
                self.problem(node, f"{what}: '{key}' is required")
        return entries

    def sequence(self, node: yaml.Node, what: str) -> list[yaml.Node]:
        if isinstance(node, yaml.ScalarNode) and node.tag == _NULL:
            return []
        if not isinstance(node, yaml.SequenceNode):
            self.problem(
                node, f"{what} must be a list (lines starting with '- '), not {_describe(node)}"
            )
            return []
        return list(node.value)

    def string(self, node: yaml.Node, what: str, *, max_length: int = MAX_NAME) -> str:
        if not isinstance(node, yaml.ScalarNode) or node.tag != _STR:
            hint = " (quote it)" if isinstance(node, yaml.ScalarNode) and node.tag != _NULL else ""
            self.problem(node, f"{what} must be a string, not {_describe(node)}{hint}")
            return ""
        value = str(node.value)
        if not value.strip():
            self.problem(node, f"{what} must not be empty")
        elif len(value) > max_length:
            self.problem(node, f"{what} is {len(value)} characters long; the limit is {max_length}")
        return value

    def optional_string(
        self, node: yaml.Node | None, what: str, *, max_length: int = MAX_NAME
    ) -> str | None:
        if node is None or (isinstance(node, yaml.ScalarNode) and node.tag == _NULL):
            return None
        return self.string(node, what, max_length=max_length)

    def boolean(self, node: yaml.Node, what: str) -> bool:
        if not isinstance(node, yaml.ScalarNode) or node.tag != _BOOL:
            self.problem(node, f"{what} must be true or false, not {_describe(node)}")
            return False
        return bool(self.loader.construct_object(node))

    def integer(
        self, node: yaml.Node, what: str, *, minimum: int, maximum: int | None = None
    ) -> int:
        if not isinstance(node, yaml.ScalarNode) or node.tag != _INT:
            self.problem(node, f"{what} must be a whole number, not {_describe(node)}")
            return minimum
        value = int(self.loader.construct_object(node))
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
            self.problem(node, f"{what} must be {bounds}, not {value}")
            return minimum
        return value

    def choice(self, node: yaml.Node, what: str, choices: Sequence[str]) -> str:
        value = self.string(node, what)
        if value and value not in choices:
            self.problem(
                node,
                f"{what} must be one of {', '.join(choices)}, "
                f"not {value!r}{_suggest(value, choices)}",
            )
        return value

    def plain(self, node: yaml.Node) -> Any:
        """The Python value of a whole subtree (a JSON schema, say)."""
        return self.loader.construct_object(node, deep=True)
