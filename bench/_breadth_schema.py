"""The objects of ``bench.breadth``'s scratch databases, shared with
``bench/_breadth_activation.py``: two services for the round trip and N tenant queues."""

from __future__ import annotations

from bench._scratch import Database

INITIATOR, TARGET = "//breadth/Initiator", "//breadth/Target"
INITIATOR_QUEUE, TARGET_QUEUE = "breadth_initiator_q", "breadth_target_q"


def define(db: Database, queues: int) -> None:
    from airflow_broker import DEFAULT, Broker

    broker = Broker.connect(db.sqlalchemy_url)
    try:
        broker.migrate()
        with broker.definitions() as d:
            d.create_queue(INITIATOR_QUEUE)
            d.create_service(INITIATOR, queue=INITIATOR_QUEUE, contracts=[DEFAULT])
            d.create_queue(TARGET_QUEUE)
            d.create_service(TARGET, queue=TARGET_QUEUE, contracts=[DEFAULT])
        for first in range(0, queues, 200):
            with broker.definitions() as d:
                for i in range(first, min(first + 200, queues)):
                    d.create_queue(f"breadth_tenant_{i}_q")
                    d.create_service(
                        f"//breadth/Tenant{i}", queue=f"breadth_tenant_{i}_q", contracts=[DEFAULT]
                    )
    finally:
        broker.dispose()
