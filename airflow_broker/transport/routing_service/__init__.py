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

Modules: :mod:`.service` (create, look up, run, sweep), :mod:`.router` (the record and the
router), :mod:`.classifiers`, :mod:`.paths` (JSON path and XPath subsets).
"""

from __future__ import annotations

from airflow_broker.transport.routing_service.classifiers import (
    Classify,
    NotClassified,
    classifier_spec,
    compile_classifier,
)
from airflow_broker.transport.routing_service.paths import (
    XPath,
    json_path_value,
    load_json,
    parse_json_path,
    parse_xpath,
    xpath_value,
)
from airflow_broker.transport.routing_service.router import ENDED_STATES, MODES, RoutingService
from airflow_broker.transport.routing_service.service import (
    create_routing_service,
    routing_handler,
    routing_service,
    run_routing_service,
    sweep_mappings,
)

__all__ = [
    "ENDED_STATES",
    "MODES",
    "Classify",
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
    "routing_handler",
    "routing_service",
    "run_routing_service",
    "sweep_mappings",
    "xpath_value",
]
