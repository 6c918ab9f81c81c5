"""Message types validated against an XML Schema (seed 004: VALIDATION = VALID_XML WITH SCHEMA
COLLECTION): ``validation="xml_schema"`` with the XSD's text.

CREATE and ALTER refuse a schema that is not one; SEND refuses a body the schema does not
accept, naming the message type and the complaint, and writes nothing; the compiled schema is
kept per process but never outlives a changed definition, here or in another process. Also the
far broker's accept, the YAML ``apply`` and migration 0031. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from alembic import command
from helpers import BUYER, SUPPLIER, SUPPLIER_QUEUE, declare_pair, drain, receive, send
from sqlalchemy import create_engine, select, text
from sqlalchemy.pool import NullPool
from transport_procs import INIT_QUEUE, INITIATOR, TARGET, TARGET_QUEUE, Net, drain_all, host, pump

from airflow_broker import ERROR, Broker, InvalidDefinition, MessageValidationError
from airflow_broker.constants import ERR_MESSAGE_INVALID
from airflow_broker.messaging.objects import MessageTypeDef
from airflow_broker.messaging.validation import compiled_xml_schema
from airflow_broker.operations.declarations import DeclarationsInvalid
from airflow_broker.operations.declarations.apply import apply_declarations
from airflow_broker.storage import context
from airflow_broker.storage import schema as s
from airflow_broker.storage.migrations import alembic_config

ORDER_XML = "//x/Order"
CONTRACT_XML = "//x/OrderContract"

ORDER_XSD = """<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema">
  <xs:element name="order">
    <xs:complexType>
      <xs:sequence>
        <xs:element name="sku" type="xs:string"/>
        <xs:element name="qty" type="xs:positiveInteger"/>
      </xs:sequence>
    </xs:complexType>
  </xs:element>
</xs:schema>
"""
#: The next version of the order: a required ``currency`` attribute.
ORDER_XSD_2 = """<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema">
  <xs:element name="order">
    <xs:complexType>
      <xs:sequence>
        <xs:element name="sku" type="xs:string"/>
        <xs:element name="qty" type="xs:positiveInteger"/>
      </xs:sequence>
      <xs:attribute name="currency" type="xs:string" use="required"/>
    </xs:complexType>
  </xs:element>
</xs:schema>
"""
GOOD = b"<order><sku>A-1</sku><qty>2</qty></order>"
GOOD_2 = b'<order currency="EUR"><sku>A-1</sku><qty>2</qty></order>'
ZERO_QTY = b"<order><sku>A-1</sku><qty>0</qty></order>"
NOT_A_SCHEMA = (
    '<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema">'
    '<xs:element name="order" type="xs:nosuchtype"/></xs:schema>'
)

Network = Callable[..., Net]


@pytest.fixture
def pair(broker: Broker) -> Broker:
    """The buyer/supplier pair, and an order type validated by ``ORDER_XSD`` on a contract of
    its own that both services accept."""
    declare_pair(broker)
    with broker.definitions() as d:
        d.create_message_type(ORDER_XML, validation="xml_schema", xml_schema=ORDER_XSD)
        d.create_contract(CONTRACT_XML, {ORDER_XML: "initiator"})
    broker.alter_service(SUPPLIER, add_contracts=[CONTRACT_XML])
    return broker


def begin_xml(broker: Broker) -> uuid.UUID:
    with broker.transaction() as tx:
        return tx.begin_dialog(BUYER, SUPPLIER, contract=CONTRACT_XML)


def send_sequence(broker: Broker, handle: uuid.UUID) -> int:
    with broker.transaction() as tx:
        return tx.conversation(handle).send_sequence


# ---------------------------------------------------------------------------------------------
# CREATE / ALTER
# ---------------------------------------------------------------------------------------------


def test_create_stores_the_schema_text(pair: Broker) -> None:
    assert pair.catalog().message_types[ORDER_XML] == MessageTypeDef(
        ORDER_XML, "xml_schema", None, ORDER_XSD
    )


def test_an_invalid_schema_is_refused_at_create_and_at_alter(pair: Broker) -> None:
    before = pair.catalog()
    with pytest.raises(InvalidDefinition) as caught:
        pair.create_message_type("//x/Bad", validation="xml_schema", xml_schema=NOT_A_SCHEMA)
    assert "'//x/Bad'" in str(caught.value)
    assert "xs:nosuchtype" in str(caught.value)  # the library's complaint
    with pytest.raises(InvalidDefinition, match=r"'//x/Bad'.*not a valid XML Schema"):
        pair.create_message_type("//x/Bad", validation="xml_schema", xml_schema="<xs:schema")
    with pytest.raises(InvalidDefinition, match=rf"'{ORDER_XML}'.*xs:nosuchtype"):
        pair.alter_message_type(ORDER_XML, validation="xml_schema", xml_schema=NOT_A_SCHEMA)
    # A file name or URL is not a schema; a schema that would read another document is refused.
    with pytest.raises(InvalidDefinition, match="not XML text"):
        pair.alter_message_type(ORDER_XML, validation="xml_schema", xml_schema="order.xsd")
    including = (
        '<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema">'
        '<xs:include schemaLocation="other.xsd"/></xs:schema>'
    )
    with pytest.raises(InvalidDefinition, match="reads no other document"):
        pair.alter_message_type(ORDER_XML, validation="xml_schema", xml_schema=including)
    with pytest.raises(InvalidDefinition, match="needs xml_schema"):
        pair.alter_message_type(ORDER_XML, validation="xml_schema")
    assert pair.catalog() == before


def test_xml_schema_goes_with_validation_xml_schema_only(pair: Broker) -> None:
    for validation in ("none", "json", "well_formed_xml", "json_schema"):
        with pytest.raises(InvalidDefinition, match="only allowed with validation 'xml_schema'"):
            pair.create_message_type(
                "//x/Other",
                validation=validation,
                json_schema={"type": "object"} if validation == "json_schema" else None,
                xml_schema=ORDER_XSD,
            )
        with pytest.raises(InvalidDefinition, match="only allowed with validation 'xml_schema'"):
            pair.alter_message_type(
                ORDER_XML,
                validation=validation,
                json_schema={"type": "object"} if validation == "json_schema" else None,
                xml_schema=ORDER_XSD,
            )
    with pytest.raises(InvalidDefinition, match="json_schema is only allowed"):
        pair.alter_message_type(
            ORDER_XML, validation="xml_schema", xml_schema=ORDER_XSD, json_schema={}
        )
    assert "//x/Other" not in pair.catalog().message_types


# ---------------------------------------------------------------------------------------------
# SEND
# ---------------------------------------------------------------------------------------------


def test_a_valid_body_is_sent_and_received(pair: Broker) -> None:
    h = begin_xml(pair)
    send(pair, h, ORDER_XML, GOOD, GOOD.decode())
    got = receive(pair, SUPPLIER_QUEUE)
    assert [(m.message_type_name, m.message_body, m.validation) for m in got] == [
        (ORDER_XML, GOOD, "V"),
        (ORDER_XML, GOOD, "V"),
    ]


def test_an_invalid_body_is_refused_and_nothing_is_written(pair: Broker) -> None:
    h = begin_xml(pair)
    send(pair, h, ORDER_XML, GOOD)
    before = send_sequence(pair, h)
    refusals = [
        (ZERO_QTY, "/order/qty: value must be positive"),
        (b"<order><sku>A-1</sku></order>", "/order: The content of element 'order'"),
        (b"<invoice/>", "/invoice: 'invoice' is not an element of the schema"),
        (b"<order><sku>A-1</order>", "needs well-formed XML: mismatched tag: line 1"),
    ]
    for body, complaint in refusals:
        with pytest.raises(MessageValidationError) as caught:
            send(pair, h, ORDER_XML, body)
        assert f"message type '{ORDER_XML}'" in str(caught.value)
        assert complaint in str(caught.value)
    with pytest.raises(MessageValidationError, match="no body"):
        send(pair, h, ORDER_XML, None)
    assert send_sequence(pair, h) == before
    assert pair.transmission_queue() == []
    # Refused inside a transaction, the SEND wrote nothing: the transaction goes on.
    with pair.transaction() as tx:
        with pytest.raises(MessageValidationError, match="value must be positive"):
            tx.send(h, message_type=ORDER_XML, body=ZERO_QTY)
        tx.send(h, message_type=ORDER_XML, body=GOOD.replace(b"2", b"3"))
    got = drain(pair, SUPPLIER_QUEUE)
    assert [m.message_body for m in got] == [GOOD, GOOD.replace(b"2", b"3")]
    first, second = (m.message_sequence_number for m in got)
    assert second == first + 1
    assert send_sequence(pair, h) == before + 1


def test_the_schema_is_compiled_once_per_process_not_per_send(pair: Broker) -> None:
    compiled_xml_schema.cache_clear()
    h = begin_xml(pair)
    for _ in range(5):
        send(pair, h, ORDER_XML, GOOD)
    with pytest.raises(MessageValidationError):
        send(pair, h, ORDER_XML, ZERO_QTY)
    assert compiled_xml_schema.cache_info().misses == 1
    assert len(receive(pair, SUPPLIER_QUEUE, top=10)) == 5


# ---------------------------------------------------------------------------------------------
# ALTER MESSAGE TYPE
# ---------------------------------------------------------------------------------------------


def test_validation_none_lets_a_refused_body_through_and_back(pair: Broker) -> None:
    h = begin_xml(pair)
    with pytest.raises(MessageValidationError):
        send(pair, h, ORDER_XML, ZERO_QTY)
    pair.alter_message_type(ORDER_XML, validation="none")  # off in production (seed 004)
    assert pair.catalog().message_types[ORDER_XML] == MessageTypeDef(ORDER_XML, "none")
    send(pair, h, ORDER_XML, ZERO_QTY)
    pair.alter_message_type(ORDER_XML, validation="xml_schema", xml_schema=ORDER_XSD)
    with pytest.raises(MessageValidationError, match="value must be positive"):
        send(pair, h, ORDER_XML, ZERO_QTY)
    send(pair, h, ORDER_XML, GOOD)
    got = drain(pair, SUPPLIER_QUEUE)
    assert [(m.message_body, m.validation) for m in got] == [(ZERO_QTY, "N"), (GOOD, "V")]


def test_a_new_schema_applies_to_the_next_send(pair: Broker) -> None:
    h = begin_xml(pair)
    send(pair, h, ORDER_XML, GOOD)  # compiled and cached under ORDER_XSD
    pair.alter_message_type(ORDER_XML, validation="xml_schema", xml_schema=ORDER_XSD_2)
    with pytest.raises(MessageValidationError, match="currency"):
        send(pair, h, ORDER_XML, GOOD)
    send(pair, h, ORDER_XML, GOOD_2)
    pair.alter_message_type(ORDER_XML, validation="xml_schema", xml_schema=ORDER_XSD)
    with pytest.raises(MessageValidationError, match="currency"):
        send(pair, h, ORDER_XML, GOOD_2)  # ORDER_XSD knows no attribute
    send(pair, h, ORDER_XML, GOOD)
    assert [m.message_body for m in drain(pair, SUPPLIER_QUEUE)] == [GOOD, GOOD_2, GOOD]


def test_a_schema_altered_by_another_broker_is_honoured(pair: Broker, broker_url: str) -> None:
    """Another Broker on the same database (another process, as far as caches go) alters the
    schema: this one honours it once its definitions are read again, at most
    DEFINITION_CACHE_SECONDS later, as for every other definition."""
    h = begin_xml(pair)
    send(pair, h, ORDER_XML, GOOD)  # pair's definitions and the compiled schema are warm
    other = Broker.connect(broker_url)
    try:
        other.alter_message_type(ORDER_XML, validation="xml_schema", xml_schema=ORDER_XSD_2)
        time.sleep(context.DEFINITION_CACHE_SECONDS + 0.2)
        with pytest.raises(MessageValidationError, match="currency"):
            send(pair, h, ORDER_XML, GOOD)
        send(pair, h, ORDER_XML, GOOD_2)
        # And back: the schema compiled first is not taken for the one stored now.
        send(other, h, ORDER_XML, GOOD_2)
        pair.alter_message_type(ORDER_XML, validation="xml_schema", xml_schema=ORDER_XSD)
        time.sleep(context.DEFINITION_CACHE_SECONDS + 0.2)
        with pytest.raises(MessageValidationError, match="currency"):
            send(other, h, ORDER_XML, GOOD_2)
        send(other, h, ORDER_XML, GOOD)
    finally:
        other.dispose()
    assert [m.message_body for m in drain(pair, SUPPLIER_QUEUE)] == [GOOD, GOOD_2, GOOD_2, GOOD]


# ---------------------------------------------------------------------------------------------
# the far broker's accept
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_the_far_broker_validates_against_its_own_schema(network: Network) -> None:
    """The sender's type takes any body, the target's has the schema: valid orders arrive (the
    first on a new dialog, the second on one the far broker knows), the invalid one is
    discarded there and the sender gets an Error naming the type and the complaint."""
    net = network("a", "b")
    a, b = net["a"], net["b"]
    for x, validation, xsd in ((a, "none", None), (b, "xml_schema", ORDER_XSD)):
        with x.definitions() as d:
            d.create_message_type(ORDER_XML, validation=validation, xml_schema=xsd)
            d.create_contract(CONTRACT_XML, {ORDER_XML: "initiator"})
    host(a, INITIATOR, INIT_QUEUE, [CONTRACT_XML])
    host(b, TARGET, TARGET_QUEUE, [CONTRACT_XML])
    a.create_route("ToTarget", TARGET, None, "broker://b")
    b.create_route("ReturnRoute", INITIATOR, net.id("a"), "broker://a")
    with a.transaction() as tx:
        h = tx.begin_dialog(INITIATOR, TARGET, contract=CONTRACT_XML, encryption=False)
        tx.send(h, ORDER_XML, GOOD)
    pump([a, b])
    with a.transaction() as tx:
        tx.send(h, ORDER_XML, GOOD)
        tx.send(h, ORDER_XML, GOOD_2)  # an attribute ORDER_XSD does not allow
    pump([a, b])
    at_b = drain_all(b, TARGET_QUEUE)
    assert [(m.message_body, m.validation) for m in at_b if m.message_type_name != ERROR] == [
        (GOOD, "V"),
        (GOOD, "V"),
    ]
    [error] = drain_all(a, INIT_QUEUE)
    assert error.error is not None
    code, description = error.error
    assert code == ERR_MESSAGE_INVALID
    assert ORDER_XML in description and "currency" in description
    assert error.conversation_handle == h


# ---------------------------------------------------------------------------------------------
# declarations (airflow-broker apply)
# ---------------------------------------------------------------------------------------------


def declarations(xsd: str, validation: str = "xml_schema") -> str:
    indented = "".join(f"      {line}\n" for line in xsd.splitlines())
    return f"message_types:\n  - name: {ORDER_XML}\n    validation: {validation}\n" + (
        f"    xml_schema: |\n{indented}" if xsd else ""
    )


def test_apply_declares_and_alters_the_schema(broker: Broker) -> None:
    assert apply_declarations(broker, declarations(ORDER_XSD), "types.yaml") == [
        f"+ message type {ORDER_XML}: created"
    ]
    assert broker.catalog().message_types[ORDER_XML] == MessageTypeDef(
        ORDER_XML, "xml_schema", None, ORDER_XSD
    )
    assert apply_declarations(broker, declarations(ORDER_XSD), "types.yaml") == []
    [change] = apply_declarations(broker, declarations(ORDER_XSD_2), "types.yaml")
    # One line of the plan, the schemas with their whitespace folded.
    assert change.startswith(f"~ message type {ORDER_XML}: altered (xml_schema: <xs:schema ")
    assert "\n" not in change and 'use="required"/>' in change
    assert broker.catalog().message_types[ORDER_XML].xml_schema == ORDER_XSD_2
    apply_declarations(broker, declarations("", validation="none"), "off.yaml")
    assert broker.catalog().message_types[ORDER_XML] == MessageTypeDef(ORDER_XML, "none")


def test_apply_reports_a_bad_schema_with_its_line(broker: Broker) -> None:
    with pytest.raises(DeclarationsInvalid) as caught:
        apply_declarations(broker, declarations(NOT_A_SCHEMA), "bad.yaml")
    [line] = caught.value.lines()
    assert line.startswith("bad.yaml:4:") and "xs:nosuchtype" in line, line
    with pytest.raises(DeclarationsInvalid) as caught:
        apply_declarations(broker, declarations(ORDER_XSD, validation="json"), "bad.yaml")
    assert caught.value.lines() == [
        f"bad.yaml:4: message type '{ORDER_XML}': xml_schema is only used with validation: "
        "xml_schema"
    ]
    with pytest.raises(DeclarationsInvalid) as caught:
        apply_declarations(broker, declarations(""), "bad.yaml")
    assert caught.value.lines() == [
        f"bad.yaml:3: message type '{ORDER_XML}': validation xml_schema needs an xml_schema"
    ]
    assert ORDER_XML not in broker.catalog().message_types


# ---------------------------------------------------------------------------------------------
# migration 0031
# ---------------------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database (no broker tables) on each engine."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'old.db'}"
    make: Callable[..., str] = request.getfixturevalue("make_pg_database")
    return make(migrated=False)


def test_upgrade_from_0030_keeps_message_types_and_adds_the_column(empty_url: str) -> None:
    engine = create_engine(empty_url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            command.upgrade(alembic_config(conn), "0030")
            conn.execute(
                text(
                    "INSERT INTO broker_message_type (name, validation, json_schema, created_at) "
                    "VALUES ('//old/Order', 'json_schema', :schema, CURRENT_TIMESTAMP)"
                ),
                {"schema": '{"type": "object"}'},
            )
    finally:
        engine.dispose()
    b = Broker.connect(empty_url)
    try:
        b.migrate()  # 0030 -> head
        assert b.catalog().message_types["//old/Order"] == MessageTypeDef(
            "//old/Order", "json_schema", {"type": "object"}, None
        )
        b.alter_message_type("//old/Order", validation="xml_schema", xml_schema=ORDER_XSD)
        with b.engine.connect() as conn:
            stored = conn.execute(
                select(s.message_type.c.validation, s.message_type.c.xml_schema).where(
                    s.message_type.c.name == "//old/Order"
                )
            ).one()
        assert tuple(stored) == ("xml_schema", ORDER_XSD)
    finally:
        b.dispose()
    # Downgraded, the type keeps the check revision 0030 knows.
    engine = create_engine(empty_url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            command.downgrade(alembic_config(conn), "0030")
            row = conn.execute(
                text("SELECT validation FROM broker_message_type WHERE name = '//old/Order'")
            ).one()
        assert row.validation == "well_formed_xml"
    finally:
        engine.dispose()
