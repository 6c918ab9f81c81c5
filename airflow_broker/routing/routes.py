"""A broker's routing table, read from its database as the pure rules see it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.engine import Connection

from airflow_broker.routing import rules as routing
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext


def routes_of(broker: BrokerContext, conn: Connection) -> list[routing.Route]:
    """This broker's routing table, as the pure rules see it (cached briefly)."""

    def load() -> list[routing.Route]:
        return [
            routing.Route(
                r.name,
                r.service_name,
                r.broker_instance,
                r.address,
                r.mirror_address,
                aware(r.expires_at),
            )
            for r in conn.execute(select(s.route).order_by(s.route.c.name))
        ]

    return broker.cached_definition("routes", load)
