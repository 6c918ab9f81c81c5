"""Activation: when a queue's monitor starts readers.

This module holds the queue's activation settings and the monitor's decision, as pure code shared
by the Airflow trigger, the deferrable sensor and the in-process runner.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from airflow_broker.errors import InvalidDefinition


@dataclass(frozen=True, slots=True)
class Activation:
    """A queue's activation settings (Service Broker's ``ACTIVATION (...)`` clause).

    :param status: whether the monitor starts readers at all.
    :param max_readers: the most readers that may run at once on the queue.
    :param reader: what a reader is: an Airflow DAG id (in Airflow) or ``"module:function"``
        (the in-process runner); None leaves it to whoever runs the monitor.
    """

    status: bool = True
    max_readers: int = 1
    reader: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_readers, int) or self.max_readers < 1:
            raise InvalidDefinition(
                f"activation max_readers must be a whole number >= 1, not {self.max_readers!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_value(cls, value: Activation | dict[str, Any] | None) -> Activation | None:
        if value is None or isinstance(value, Activation):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"status", "max_readers", "reader"}
            if unknown:
                raise InvalidDefinition(
                    f"activation has unknown settings {sorted(unknown)}; "
                    "known: status, max_readers, reader"
                )
            return cls(**value)
        raise InvalidDefinition(f"activation must be an Activation or a dict, not {value!r}")


def readers_to_start(
    *, running: int, groups_ready: int, depth: int, previous_depth: int | None, max_readers: int
) -> int:
    """How many more readers the monitor should start now.

    One reader when messages are waiting and none runs; one more while the queue keeps growing;
    never more than ``max_readers`` in all, nor more than there are conversation groups with
    messages (a group is read by one reader at a time, so extra readers would only wait).
    """
    if depth <= 0:
        return 0
    ceiling = min(max_readers, groups_ready)
    if running >= ceiling:
        return 0
    if running == 0:
        return 1
    growing = previous_depth is not None and depth > previous_depth
    return 1 if growing else 0
