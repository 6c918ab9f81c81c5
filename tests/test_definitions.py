"""DDL: message types, contracts, queues, services, routes and priorities.

Each verb is checked for what it stores (read back through ``broker.catalog()``), for the error it
raises on a taken name (ObjectExists), a missing referenced object (UnknownObject) and a malformed
definition (InvalidDefinition), for error messages that name the object, and for atomicity: a
failing verb or ``broker.definitions()`` block leaves nothing behind.

Each test covers one kind of object and one concern (create / refusals / drop), so that the suite
stays fast while every path is still asserted on both engines.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from airflow_broker import (
    DEFAULT,
    Activation,
    Broker,
    BrokerError,
    InvalidDefinition,
    ObjectExists,
    UnknownObject,
)
from airflow_broker.constants import AUTO_CREATED_LOCAL
from airflow_broker.messaging.objects import (
    ContractDef,
    MessageTypeDef,
    PriorityDef,
    QueueDef,
    RouteDef,
    ServiceDef,
)
from airflow_broker.routing.dynamic import BROKER_CONFIGURATION_NOTICE, MISSING_ROUTE

ORDER_SCHEMA = {
    "type": "object",
    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
    "required": ["sku", "qty"],
}


def names(broker: Broker) -> dict[str, set[str]]:
    """The names of every declared object, by kind."""
    cat = broker.catalog()
    return {
        "message_types": set(cat.message_types),
        "contracts": set(cat.contracts),
        "queues": set(cat.queues),
        "services": set(cat.services),
        "routes": set(cat.routes),
        "priorities": set(cat.priorities),
    }


def named(name: str) -> str:
    """A ``pytest.raises(match=...)`` pattern: the error message names ``name``."""
    return re.escape(name)


# --------------------------------------------------------------------------- defaults


def test_migrate_creates_default_message_type_contract_and_local_route(broker: Broker) -> None:
    cat = broker.catalog()
    assert cat.message_types[DEFAULT] == MessageTypeDef("DEFAULT", "none", None)
    assert cat.contracts[DEFAULT] == ContractDef("DEFAULT", {"DEFAULT": "any"})
    assert cat.routes[AUTO_CREATED_LOCAL] == RouteDef(
        name="AutoCreatedLocal",
        service_name=None,
        broker_instance=None,
        address="LOCAL",
        mirror_address=None,
        expires_at=None,
    )
    assert (cat.queues, cat.services, cat.priorities) == ({}, {}, {})


# --------------------------------------------------------------------------- message types


def test_create_message_types(broker: Broker) -> None:
    kinds = ["none", "empty", "json", "well_formed_xml"]
    for kind in kinds:
        broker.create_message_type(f"//t/{kind}", validation=kind)
    broker.create_message_type("//t/Plain")
    broker.create_message_type("//t/Order", validation="json_schema", json_schema=ORDER_SCHEMA)
    stored = broker.catalog().message_types
    assert [stored[f"//t/{kind}"] for kind in kinds] == [
        MessageTypeDef(f"//t/{kind}", kind, None) for kind in kinds
    ]
    assert stored["//t/Plain"] == MessageTypeDef("//t/Plain", "none", None)
    assert stored["//t/Order"] == MessageTypeDef("//t/Order", "json_schema", ORDER_SCHEMA)


def test_message_type_refusals(broker: Broker) -> None:
    with pytest.raises(InvalidDefinition, match=named("//t/Bad")):
        broker.create_message_type("//t/Bad", validation="xml_schema_collection")
    with pytest.raises(InvalidDefinition, match=named("//t/NoSchema")):
        broker.create_message_type("//t/NoSchema", validation="json_schema")
    with pytest.raises(InvalidDefinition, match=named("//t/BadSchema")):
        broker.create_message_type(
            "//t/BadSchema", validation="json_schema", json_schema={"type": 12}
        )
    assert set(broker.catalog().message_types) == {DEFAULT, MISSING_ROUTE}  # the system's

    broker.create_message_type("//t/M", validation="json")
    with pytest.raises(ObjectExists, match=named("//t/M")):
        broker.create_message_type("//t/M", validation="empty")
    with pytest.raises(ObjectExists, match=named(DEFAULT)):
        broker.create_message_type(DEFAULT)
    # The first definitions stand.
    assert broker.catalog().message_types["//t/M"].validation == "json"
    assert broker.catalog().message_types[DEFAULT].validation == "none"


def test_drop_message_type(broker: Broker) -> None:
    broker.create_message_type("//t/M")
    broker.drop_message_type("//t/M")
    assert "//t/M" not in broker.catalog().message_types
    # The name is free again.
    broker.create_message_type("//t/M", validation="empty")
    assert broker.catalog().message_types["//t/M"].validation == "empty"

    with pytest.raises(UnknownObject, match=named("//t/Nope")):
        broker.drop_message_type("//t/Nope")

    broker.create_contract("//t/C", {"//t/M": "initiator"})
    with pytest.raises(BrokerError, match=named("//t/M")):
        broker.drop_message_type("//t/M")
    assert "//t/M" in broker.catalog().message_types
    assert broker.catalog().contracts["//t/C"].message_types == {"//t/M": "initiator"}


# --------------------------------------------------------------------------- contracts


def test_create_contracts(broker: Broker) -> None:
    for name in ("//t/Req", "//t/Resp", "//t/Note"):
        broker.create_message_type(name)
    broker.create_contract(
        "//t/C", {"//t/Req": "initiator", "//t/Resp": "target", "//t/Note": "any"}
    )
    broker.create_contract("//t/AnyOnly", {"//t/Note": "any"})
    contracts = broker.catalog().contracts
    assert contracts["//t/C"] == ContractDef(
        "//t/C", {"//t/Req": "initiator", "//t/Resp": "target", "//t/Note": "any"}
    )
    assert contracts["//t/AnyOnly"] == ContractDef("//t/AnyOnly", {"//t/Note": "any"})


def test_contract_refusals(broker: Broker) -> None:
    for name in ("//t/Req", "//t/Resp", "//t/Resp2"):
        broker.create_message_type(name)
    # A contract must let the initiator send something.
    with pytest.raises(InvalidDefinition, match=named("//t/TargetOnly")):
        broker.create_contract("//t/TargetOnly", {"//t/Resp": "target", "//t/Resp2": "target"})
    with pytest.raises(InvalidDefinition, match=named("//t/Empty")):
        broker.create_contract("//t/Empty", {})
    with pytest.raises(InvalidDefinition, match=named("//t/Both")):
        broker.create_contract("//t/Both", {"//t/Req": "both"})
    with pytest.raises(UnknownObject, match=named("//t/Missing")):
        broker.create_contract("//t/C", {"//t/Req": "initiator", "//t/Missing": "target"})
    assert set(broker.catalog().contracts) == {DEFAULT, BROKER_CONFIGURATION_NOTICE}

    # Nothing of the refused contracts was left behind: the names can be created cleanly.
    broker.create_contract("//t/C", {"//t/Req": "initiator"})
    assert broker.catalog().contracts["//t/C"].message_types == {"//t/Req": "initiator"}
    with pytest.raises(ObjectExists, match=named("//t/C")):
        broker.create_contract("//t/C", {"//t/Req": "any"})
    assert broker.catalog().contracts["//t/C"].message_types == {"//t/Req": "initiator"}


def test_drop_contract(broker: Broker) -> None:
    broker.create_message_type("//t/Req")
    broker.create_contract("//t/C", {"//t/Req": "initiator"})
    broker.create_contract("//t/Used", {"//t/Req": "any"})
    broker.drop_contract("//t/C")
    assert "//t/C" not in broker.catalog().contracts
    # Its message type is not dropped with it.
    assert "//t/Req" in broker.catalog().message_types

    with pytest.raises(UnknownObject, match=named("//t/Nope")):
        broker.drop_contract("//t/Nope")

    broker.create_queue("q")
    broker.create_service("//t/S", queue="q", contracts=["//t/Used"])
    with pytest.raises(BrokerError, match=named("//t/Used")):
        broker.drop_contract("//t/Used")
    assert "//t/Used" in broker.catalog().contracts
    assert broker.catalog().services["//t/S"].contracts == ("//t/Used",)


# --------------------------------------------------------------------------- queues


def test_create_queues(broker: Broker) -> None:
    broker.create_queue("plain")
    broker.create_queue(
        "tuned",
        status=False,
        retention=True,
        poison_message_handling=False,
        activation=Activation(max_readers=3, reader="pkg.mod:read"),
    )
    broker.create_queue("as_dict", activation={"max_readers": 2})
    queues = broker.catalog().queues
    assert queues["plain"] == QueueDef(
        name="plain", status=True, retention=False, poison_message_handling=True, activation=None
    )
    assert queues["tuned"] == QueueDef(
        name="tuned",
        status=False,
        retention=True,
        poison_message_handling=False,
        activation={"status": True, "max_readers": 3, "reader": "pkg.mod:read"},
    )
    assert queues["as_dict"].activation == {"status": True, "max_readers": 2, "reader": None}
    status = {s.name: s for s in broker.queue_status()}
    assert sorted(status) == ["as_dict", "plain", "tuned"]
    plain = status["plain"]
    assert (plain.status, plain.depth, plain.groups_ready, plain.rollback_count) == (
        True,
        0,
        0,
        0,
    )
    assert (plain.oldest_enqueued_at, plain.oldest_age_seconds) == (None, None)
    assert status["tuned"].status is False


def test_queue_refusals(broker: Broker) -> None:
    with pytest.raises(InvalidDefinition):
        broker.create_queue("q", activation={"max_readers": 0})
    with pytest.raises(InvalidDefinition):
        broker.create_queue("q", activation={"max_reader": 2})
    assert broker.catalog().queues == {}

    broker.create_queue("orders_queue")
    with pytest.raises(ObjectExists, match=named("orders_queue")):
        broker.create_queue("orders_queue", retention=True)
    assert broker.catalog().queues["orders_queue"].retention is False
    with pytest.raises(UnknownObject, match=named("nope_queue")):
        broker.alter_queue("nope_queue", status=False)


def test_alter_queue_changes_only_what_is_given(broker: Broker) -> None:
    broker.create_queue("q", activation=Activation(max_readers=2))
    broker.alter_queue("q", retention=True)
    assert broker.catalog().queues["q"] == QueueDef(
        name="q",
        status=True,
        retention=True,
        poison_message_handling=True,
        activation={"status": True, "max_readers": 2, "reader": None},
    )
    broker.alter_queue("q", status=False, poison_message_handling=False)
    broker.alter_queue("q", activation=Activation(status=False, max_readers=5, reader="m:f"))
    assert broker.catalog().queues["q"] == QueueDef(
        name="q",
        status=False,
        retention=True,
        poison_message_handling=False,
        activation={"status": False, "max_readers": 5, "reader": "m:f"},
    )
    broker.alter_queue("q", status=True)
    assert broker.catalog().queues["q"].status is True


def test_drop_queue(broker: Broker) -> None:
    broker.create_queue("q")
    broker.drop_queue("q")
    assert "q" not in broker.catalog().queues
    assert broker.queue_status() == []

    with pytest.raises(UnknownObject, match=named("nope_queue")):
        broker.drop_queue("nope_queue")

    broker.create_queue("orders_queue")
    broker.create_service("//t/S", queue="orders_queue")
    with pytest.raises(BrokerError, match=named("orders_queue")):
        broker.drop_queue("orders_queue")
    assert "orders_queue" in broker.catalog().queues


# --------------------------------------------------------------------------- services


def test_create_services(broker: Broker) -> None:
    broker.create_message_type("//t/Req")
    broker.create_contract("//t/C1", {"//t/Req": "initiator"})
    broker.create_contract("//t/C2", {"//t/Req": "any"})
    broker.create_queue("q")
    broker.create_service("//t/S", queue="q", contracts=["//t/C1", "//t/C2", DEFAULT])
    broker.create_service("//t/Initiator", queue="q")
    services = broker.catalog().services
    assert (services["//t/S"].name, services["//t/S"].queue) == ("//t/S", "q")
    assert sorted(services["//t/S"].contracts) == ["//t/C1", "//t/C2", "DEFAULT"]
    assert services["//t/Initiator"] == ServiceDef("//t/Initiator", "q", ())


def test_service_refusals(broker: Broker) -> None:
    with pytest.raises(UnknownObject, match=named("nope_queue")):
        broker.create_service("//t/S", queue="nope_queue")
    broker.create_queue("q1")
    with pytest.raises(UnknownObject, match=named("//t/NoContract")):
        broker.create_service("//t/S", queue="q1", contracts=[DEFAULT, "//t/NoContract"])
    assert broker.catalog().services == {}

    # Nothing of the refused service was left behind.
    broker.create_service("//t/S", queue="q1", contracts=[DEFAULT])
    assert broker.catalog().services["//t/S"] == ServiceDef("//t/S", "q1", ("DEFAULT",))
    broker.create_queue("q2")
    with pytest.raises(ObjectExists, match=named("//t/S")):
        broker.create_service("//t/S", queue="q2")
    assert broker.catalog().services["//t/S"].queue == "q1"


def test_drop_service(broker: Broker) -> None:
    broker.create_queue("q")
    broker.create_service("//t/S", queue="q", contracts=[DEFAULT])
    broker.drop_service("//t/S")
    assert "//t/S" not in broker.catalog().services
    # The queue and the contract stay, and the queue can now be dropped.
    assert DEFAULT in broker.catalog().contracts
    broker.drop_queue("q")
    assert "q" not in broker.catalog().queues
    with pytest.raises(UnknownObject, match=named("//t/Nope")):
        broker.drop_service("//t/Nope")


# --------------------------------------------------------------------------- routes


def test_create_routes(broker: Broker) -> None:
    broker.create_route(
        "to_west",
        service_name="//po/Supplier",
        broker_instance="2f1e8a5c-4d7b-4e0e-9a44-9a0e5f7c1b11",
        address="broker://west",
        mirror_address="broker://west2",
    )
    broker.create_route("wildcard")
    before = datetime.now(UTC)
    broker.create_route(
        "short_lived", service_name="//t/S", address="TRANSPORT", lifetime_seconds=3600
    )
    after = datetime.now(UTC)
    routes = broker.catalog().routes
    assert routes["to_west"] == RouteDef(
        name="to_west",
        service_name="//po/Supplier",
        broker_instance="2f1e8a5c-4d7b-4e0e-9a44-9a0e5f7c1b11",
        address="broker://west",
        mirror_address="broker://west2",
        expires_at=None,
    )
    assert routes["wildcard"] == RouteDef("wildcard", None, None, "LOCAL", None, None)
    expires_at = routes["short_lived"].expires_at
    assert expires_at is not None
    assert expires_at.tzinfo is not None
    assert before + timedelta(seconds=3599) <= expires_at <= after + timedelta(seconds=3601)


def test_route_refusals_and_drop(broker: Broker) -> None:
    broker.create_route("to_west", service_name="//t/S", address="broker://west")
    with pytest.raises(ObjectExists, match=named("to_west")):
        broker.create_route("to_west", service_name="//t/Other", address="broker://east")
    assert broker.catalog().routes["to_west"].service_name == "//t/S"

    broker.drop_route("to_west")
    assert set(broker.catalog().routes) == {AUTO_CREATED_LOCAL}
    with pytest.raises(UnknownObject, match=named("nope_route")):
        broker.drop_route("nope_route")


# --------------------------------------------------------------------------- priorities


def test_create_priorities(broker: Broker) -> None:
    broker.create_queue("q")
    broker.create_service("//t/L", queue="q")
    # The remote service is only a name (it lives in another broker): it need not exist here.
    broker.create_priority(
        "rush", contract=DEFAULT, local_service="//t/L", remote_service="//t/R", priority=9
    )
    broker.create_priority("any_five")
    broker.create_priority("low", priority=1)
    broker.create_priority("high", priority=10)
    priorities = broker.catalog().priorities
    assert priorities["rush"] == PriorityDef(
        name="rush", contract=DEFAULT, local_service="//t/L", remote_service="//t/R", priority=9
    )
    assert priorities["any_five"] == PriorityDef("any_five", None, None, None, 5)
    assert [priorities[n].priority for n in ("low", "high")] == [1, 10]


def test_priority_refusals_and_drop(broker: Broker) -> None:
    for level in (0, 11, -1):
        with pytest.raises(InvalidDefinition, match=named("bad_priority")):
            broker.create_priority("bad_priority", priority=level)
    with pytest.raises(UnknownObject, match=named("//t/NoContract")):
        broker.create_priority("rush", contract="//t/NoContract", priority=9)
    with pytest.raises(UnknownObject, match=named("//t/NoService")):
        broker.create_priority("rush", local_service="//t/NoService", priority=9)
    assert broker.catalog().priorities == {}

    broker.create_priority("rush", priority=2)
    with pytest.raises(ObjectExists, match=named("rush")):
        broker.create_priority("rush", priority=7)
    assert broker.catalog().priorities["rush"].priority == 2

    broker.drop_priority("rush")
    assert broker.catalog().priorities == {}
    with pytest.raises(UnknownObject, match=named("nope_priority")):
        broker.drop_priority("nope_priority")


# --------------------------------------------------------------------------- definitions blocks


def test_definitions_block_commits_everything_together(broker: Broker) -> None:
    with broker.definitions() as d:
        d.create_message_type("//t/Req", validation="json")
        d.create_contract("//t/C", {"//t/Req": "initiator"})
        d.create_queue("q")
        # Objects created earlier in the block are visible to later verbs of the same block.
        d.create_service("//t/S", queue="q", contracts=["//t/C"])
        d.create_route("r", service_name="//t/S", address="LOCAL")
        d.create_priority("p", contract="//t/C", priority=7)
        d.alter_queue("q", retention=True)
    cat = broker.catalog()
    assert cat.message_types["//t/Req"].validation == "json"
    assert cat.contracts["//t/C"].message_types == {"//t/Req": "initiator"}
    assert cat.queues["q"].retention is True
    assert cat.services["//t/S"] == ServiceDef("//t/S", "q", ("//t/C",))
    assert cat.routes["r"].service_name == "//t/S"
    assert cat.priorities["p"].priority == 7


def test_failing_definitions_block_leaves_nothing_behind(broker: Broker) -> None:
    before = names(broker)
    with pytest.raises(UnknownObject, match=named("//t/NoSuchContract")), broker.definitions() as d:
        d.create_message_type("//t/Req", validation="json")
        d.create_contract("//t/C", {"//t/Req": "initiator"})
        d.create_queue("q")
        d.create_service("//t/S", queue="q", contracts=["//t/C"])
        d.create_route("r", service_name="//t/S")
        d.create_priority("p", priority=3)
        d.create_service("//t/S2", queue="q", contracts=["//t/NoSuchContract"])
    assert names(broker) == before
    # The same declarations then succeed: no leftover row makes them collide.
    with broker.definitions() as d:
        d.create_message_type("//t/Req", validation="json")
        d.create_contract("//t/C", {"//t/Req": "initiator"})
        d.create_queue("q")
        d.create_service("//t/S", queue="q", contracts=["//t/C"])
    assert broker.catalog().services["//t/S"].contracts == ("//t/C",)


def test_definitions_block_with_object_exists_leaves_nothing_behind(broker: Broker) -> None:
    broker.create_queue("taken")
    before = names(broker)
    with pytest.raises(ObjectExists, match=named("taken")), broker.definitions() as d:
        d.create_queue("fresh")
        d.create_service("//t/S", queue="fresh")
        d.create_queue("taken")
    assert names(broker) == before


def test_definitions_block_rolls_back_on_any_exception(broker: Broker) -> None:
    broker.create_queue("q")
    before = names(broker)
    with pytest.raises(RuntimeError, match="changed my mind"), broker.definitions() as d:
        d.create_message_type("//t/Req")
        d.alter_queue("q", status=False, retention=True)
        d.drop_route(AUTO_CREATED_LOCAL)
        raise RuntimeError("changed my mind")
    assert names(broker) == before
    assert broker.catalog().queues["q"] == QueueDef("q", True, False, True, None)


def test_definitions_block_can_drop_and_recreate(broker: Broker) -> None:
    broker.create_queue("q", retention=False)
    with broker.definitions() as d:
        d.drop_queue("q")
        d.create_queue("q", retention=True)
    assert broker.catalog().queues["q"].retention is True


def test_drop_service_and_queue_take_their_messages_with_them(broker: Broker) -> None:
    """broker_message has no foreign keys (hot-path cost): the drops must remove what was queued."""
    from sqlalchemy import func, select

    from airflow_broker.storage.schema import message

    with broker.definitions() as d:
        d.create_queue("drop_in")
        d.create_queue("drop_out")
        d.create_service("//drop/in", queue="drop_in", contracts=["DEFAULT"])
        d.create_service("//drop/out", queue="drop_out")
    with broker.transaction() as tx:
        for _ in range(3):
            tx.send(tx.begin_dialog("//drop/out", "//drop/in"), body=b"x")

    def queued() -> int:
        with broker.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(message)).scalar_one())

    assert queued() == 3
    broker.drop_service("//drop/in")
    assert queued() == 3  # the orders went; each sender got an Error instead (tests/test_alter.py)
    with broker.transaction() as tx:
        h = tx.begin_dialog("//drop/out", "//drop/out")
        tx.begin_conversation_timer(h, 0)
    broker.run_due()
    assert queued() == 4  # and the DialogTimer, on drop_out
    broker.drop_service("//drop/out")
    assert queued() == 0
    broker.drop_queue("drop_out")
    assert "drop_out" not in broker.catalog().queues
