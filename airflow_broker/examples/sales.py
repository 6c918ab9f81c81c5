"""Seed 000's sales by region, at volume: the example of the Spark routing job.

Headquarters (the source broker) hosts ``//sales/Client``, which files sales requests as
conversations to ``//sales/Request``: a name no broker hosts. The Spark routing job classifies
each new conversation by the ``region`` of its first message and routes it to
``//sales/<Region>``, hosted by that region's own broker database (``broker://sales_<region>``).

Live traffic takes the other road of seed 000: requests filed to ``//sales/Router``
(:func:`file_live_requests`), a data-dependent routing service at headquarters with the same
classifier, which Airflow activates when its queue fills (``routing_service_dag``); what it
forwards leaves through the transmitter.

:func:`region_service` is the classifier as a Python function (the job runs it as a UDF);
:data:`REGION_SQL` is the same as a Spark SQL expression (evaluated natively, faster).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from airflow_broker import Broker

REGIONS = ("east", "west", "north")
CLIENT = "//sales/Client"
CLIENT_QUEUE = "sales_client_queue"
REQUEST = "//sales/Request"
REQUEST_TYPE = "//sales/SalesRequest"
CONTRACT = "//sales/SalesContract"
ROUTER = "//sales/Router"
ROUTER_QUEUE = "sales_router_queue"

#: The classifier as Spark SQL over the message ``body``.
REGION_SQL = "sql:concat('//sales/', initcap(get_json_object(CAST(body AS STRING), '$.region')))"


def service_of(region: str) -> str:
    return f"//sales/{region.capitalize()}"


def queue_of(region: str) -> str:
    return f"sales_{region}_queue"


def address_of(region: str) -> str:
    return f"broker://sales_{region}"


def region_service(body: bytes | None) -> str | None:
    """The classifier as Python: ``//sales/<Region>`` from the JSON body's ``region``."""
    try:
        region = json.loads(body or b"null")["region"]
    except (ValueError, TypeError, KeyError):
        return None
    return service_of(region) if isinstance(region, str) and region else None


def _exists(broker: Broker, table: Any, name: str) -> bool:
    from sqlalchemy import select

    with broker.engine.connect() as conn:
        return conn.execute(select(table.c.name).where(table.c.name == name)).first() is not None


def _common(broker: Broker) -> None:
    from airflow_broker.storage import schema as s

    if not _exists(broker, s.message_type, REQUEST_TYPE):
        with broker.definitions() as d:
            d.create_message_type(REQUEST_TYPE, validation="none")
            d.create_contract(CONTRACT, {REQUEST_TYPE: "initiator"})


def declare(hq: Broker, regions: Mapping[str, Broker]) -> None:
    """Headquarters and every regional broker (idempotent)."""
    from airflow_broker.storage import schema as s

    _common(hq)
    if not _exists(hq, s.queue, CLIENT_QUEUE):
        with hq.definitions() as d:
            d.create_queue(CLIENT_QUEUE)
            d.create_service(CLIENT, queue=CLIENT_QUEUE, contracts=[CONTRACT])
            for region in REGIONS:
                d.create_route(f"to_{region}", service_of(region), None, address_of(region))
    if not _exists(hq, s.queue, ROUTER_QUEUE):
        hq.create_queue(ROUTER_QUEUE)
        hq.create_routing_service(ROUTER, queue=ROUTER_QUEUE, classifier=region_service)
    for region, broker in regions.items():
        _common(broker)
        if not _exists(broker, s.queue, queue_of(region)):
            with broker.definitions() as d:
                d.create_queue(queue_of(region))
                d.create_service(service_of(region), queue=queue_of(region), contracts=[CONTRACT])


def file_requests(hq: Broker, count: int, *, per_conversation: int = 1, seed: int = 0) -> list[Any]:
    """``count`` sales requests in conversations of ``per_conversation`` messages, each
    conversation about one region (at random); returns the conversation handles."""
    rng = random.Random(seed)
    handles: list[Any] = []
    batch = 500
    for start in range(0, count, batch * per_conversation):
        n = min(batch, (count - start) // per_conversation)
        with hq.transaction() as tx:
            # The demo's regions are databases without dialog security: encryption off (it
            # would seal them if security were configured; docs/security.md).
            new = [
                tx.begin_dialog(CLIENT, REQUEST, contract=CONTRACT, encryption=False)
                for _ in range(n)
            ]
            regions = [rng.choice(REGIONS) for _ in new]
            for seq in range(per_conversation):
                for h, region in zip(new, regions, strict=True):
                    body = {"region": region, "quarter": "2026Q3", "n": seq}
                    tx.send(h, message_type=REQUEST_TYPE, body=body)
        handles += new
    return handles


def file_live_requests(hq: Broker, count: int, *, seed: int = 0) -> list[Any]:
    """``count`` sales requests to the routing service, one conversation each (a region at
    random), in one transaction; returns the conversation handles."""
    rng = random.Random(seed)
    with hq.transaction() as tx:
        handles = [
            tx.begin_dialog(CLIENT, ROUTER, contract=CONTRACT, encryption=False)
            for _ in range(count)
        ]
        for h in handles:
            body = {"region": rng.choice(REGIONS), "quarter": "2026Q4", "n": 0}
            tx.send(h, message_type=REQUEST_TYPE, body=body)
    return handles


def depths(regions: Mapping[str, Broker]) -> dict[str, int]:
    """Messages waiting in each region's queue."""
    from sqlalchemy import func, select

    from airflow_broker.storage import schema as s

    out = {}
    for region, broker in regions.items():
        with broker.engine.connect() as conn:
            out[region] = conn.execute(
                select(func.count())
                .select_from(s.message)
                .join(s.queue, s.queue.c.queue_id == s.message.c.queue_id)
                .where(s.queue.c.name == queue_of(region))
            ).scalar_one()
    return out


__all__: Sequence[str] = [
    "CLIENT",
    "REGIONS",
    "REGION_SQL",
    "REQUEST",
    "declare",
    "depths",
    "file_requests",
    "region_service",
]
