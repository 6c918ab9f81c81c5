"""Activation: when a queue's monitor starts readers, how readers register, and the runner.

Seed 004's activation, made testable: a queue's monitor starts a reader when messages arrive and
none is running, starts more while the queue keeps growing, never more than ``max_readers`` and
never more than there are conversation groups with messages; each reader drains the queue and
exits.

The same code serves the three monitors (the Airflow trigger, the deferrable sensor and the
in-process :class:`ActivationRunner`) and the two kinds of reader (the Airflow
``DrainQueueOperator`` and the runner's threads), so that they all behave alike:

- :mod:`~airflow_broker.activation.decision`: the decisions, pure;
- :mod:`~airflow_broker.activation.monitor`: one monitor of one queue (:class:`Monitor`) and the
  due work every monitor does as it polls (:func:`due_step`);
- :mod:`~airflow_broker.activation.readers`: reader registration, heartbeat and the reader's loop
  (:func:`drain`);
- :mod:`~airflow_broker.activation.ledger`: the bookkeeping tables they share;
- :mod:`~airflow_broker.activation.runner`: monitor and readers in one process, outside Airflow.
- :mod:`~airflow_broker.activation.transmitter`: the transmitter, activated like a reader: a
  run delivers between databases until nothing is due, does due work and housekeeping,
  and hands large backlogs to the Spark job (:func:`~.transmitter.transmit`).

Everything runs without Airflow, against either engine.
"""

from airflow_broker.activation.decision import (
    ACTIVATION_KEY,
    ADVISORY_CLASS,
    FINISHED_RETENTION,
    HEARTBEAT_SECONDS,
    MODES,
    READER_TIMEOUT_SECONDS,
    START_TIMEOUT_SECONDS,
    Decision,
    Mode,
    MonitorState,
    QueueObservation,
    check_mode,
    decide,
    readers_to_start,
)
from airflow_broker.activation.monitor import Fire, Monitor, due_step
from airflow_broker.activation.readers import (
    DrainReport,
    Handler,
    ReaderRow,
    ReaderSlot,
    drain,
    finish_reader,
    heartbeat_reader,
    readers,
    register_reader,
    release_fires,
    resolve_handler,
)
from airflow_broker.activation.runner import ActivationRunner
from airflow_broker.messaging.definitions import Activation

__all__ = [
    "ACTIVATION_KEY",
    "ADVISORY_CLASS",
    "FINISHED_RETENTION",
    "HEARTBEAT_SECONDS",
    "MODES",
    "READER_TIMEOUT_SECONDS",
    "START_TIMEOUT_SECONDS",
    "Activation",
    "ActivationRunner",
    "Decision",
    "DrainReport",
    "Fire",
    "Handler",
    "Mode",
    "Monitor",
    "MonitorState",
    "QueueObservation",
    "ReaderRow",
    "ReaderSlot",
    "check_mode",
    "decide",
    "drain",
    "due_step",
    "finish_reader",
    "heartbeat_reader",
    "readers",
    "readers_to_start",
    "register_reader",
    "release_fires",
    "resolve_handler",
]
