"""A delivery pass's first look, on PostgreSQL: which of its steps have work, in one round trip.

Besides its due messages, a pass looks at four things that are nearly always empty: the inbox
(batches pushed by peers that may only deliver), the causes of waiting that fall due, a
forwarder's held packets, and the answers of the dynamic routing service. Each look was a
transaction of its own (a connection from the pool, BEGIN, the SELECT, ROLLBACK), together
about a fifth of a pass that delivers one message. :func:`survey` asks all five in one
statement that runs outside any transaction, and the pass skips the steps with nothing to do:
a pass with nothing to do is that one round trip.

What arrives after the look waits for the next pass, as it would have if it had arrived just
after the step's own look: an inbox batch, a cause falling due, a held packet or an answer each
also wakes the transmitter (or a worker polling it) for that next pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

from sqlalchemy.exc import DBAPIError

from airflow_broker.routing.dynamic import REQUESTER_QUEUE
from airflow_broker.storage import direct
from airflow_broker.storage.context import BrokerContext


@lru_cache(maxsize=2)
def _statement(retry_now: bool) -> direct.Prepared:
    """The survey; with ``retry_now``, every row and held packet counts as due (two forms, so
    that each is planned with the index on ``next_attempt_at`` where it has a bound)."""
    due = "true" if retry_now else "next_attempt_at <= $1"
    return direct.Prepared(
        f"SELECT EXISTS (SELECT 1 FROM broker_transmission_queue WHERE {due}), "
        "EXISTS (SELECT 1 FROM broker_inbox), "
        "EXISTS (SELECT 1 FROM broker_transmission_wait w WHERE w.next_attempt_at <= $1 "
        "AND EXISTS (SELECT 1 FROM broker_transmission_queue t WHERE t.wait_id = w.id)), "
        f"EXISTS (SELECT 1 FROM broker_transit WHERE {due}), "
        "EXISTS (SELECT 1 FROM broker_message m JOIN broker_queue q ON q.queue_id = m.queue_id "
        "WHERE q.name = $2)",
        ("timestamptz", "varchar"),
    )


@dataclass(frozen=True, slots=True)
class Survey:
    """Which steps of a pass have work."""

    #: messages in the transmission queue are due (all of them, when the pass retries now)
    due: bool = True
    #: batches wait in the inbox
    inbox: bool = True
    #: a cause of waiting falls due (and rows still wait for it)
    causes: bool = True
    #: a forwarder's held packets are due (all of them, when the pass retries now)
    transit: bool = True
    #: the dynamic routing service answered a route request
    route_answers: bool = True


#: Every step: what a pass does where no survey is made.
EVERYTHING = Survey()


def survey(b: BrokerContext, now: datetime, retry_now: bool) -> Survey:
    """The side steps with work now (PostgreSQL, as the broker's owner); :data:`EVERYTHING`
    elsewhere (a client role may not read these tables; SQLite's looks cost no round trip)."""
    if b.dialect != "postgresql" or b.client_role is not None:
        return EVERYTHING
    fairy = b.engine.raw_connection()
    try:
        statement = _statement(retry_now)
        row = direct.execute_committed(fairy, b.engine, statement, [now, REQUESTER_QUEUE])
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) == _INSUFFICIENT_PRIVILEGE:
            return EVERYTHING  # a client role, before its first connection said so
        raise
    finally:
        fairy.close()
    return Survey(*(bool(v) for v in row[0]))


_INSUFFICIENT_PRIVILEGE = "42501"


__all__ = ["EVERYTHING", "Survey", "survey"]
