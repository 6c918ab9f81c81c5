"""What every CREATE / ALTER / DROP shares: the definitions transaction and the look-ups that name
the object in their errors.

:class:`DefinitionsCore` is the base of :class:`~airflow_broker.messaging.definitions.Definitions`;
the verbs live in mixins over it (services in
:mod:`~airflow_broker.messaging.service_definitions`, routes and priorities in
:mod:`~airflow_broker.messaging.route_definitions`), as the transaction's verbs do over
:class:`~airflow_broker.messaging.tx_core.TransactionCore`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import Row, select
from sqlalchemy.engine import Connection

from airflow_broker.errors import InvalidDefinition, ObjectExists, UnknownObject
from airflow_broker.storage import schema as s

if TYPE_CHECKING:
    from airflow_broker.storage.context import BrokerContext


class DefinitionsCore:
    """The connection of one definitions transaction, and the checks every verb makes."""

    def __init__(self, broker: BrokerContext, conn: Connection) -> None:
        self._broker = broker
        self._conn = conn

    @property
    def connection(self) -> Connection:
        """The connection of this definitions transaction."""
        return self._conn

    def _exists(self, table: Any, column: Any, value: Any) -> bool:
        return self._conn.execute(select(column).where(column == value)).first() is not None

    def _require(self, table: Any, column: Any, value: str, what: str) -> None:
        if not self._exists(table, column, value):
            raise UnknownObject(f"{what} {value!r} does not exist in this broker")

    def _refuse_existing(self, table: Any, column: Any, value: str, what: str) -> None:
        if self._exists(table, column, value):
            raise ObjectExists(f"{what} {value!r} already exists")

    def _refuse_if_used(self, what: str, users: Any, kind: str) -> None:
        """DROP refuses an object that others still use, and names them."""
        names = sorted(self._conn.execute(users).scalars())
        if names:
            raise InvalidDefinition(
                f"{what} is used by {kind} {', '.join(names)}; drop or alter those first"
            )

    def _queue_row(self, name: str) -> Row[Any]:
        row = self._conn.execute(select(s.queue).where(s.queue.c.name == name)).first()
        if row is None:
            raise UnknownObject(f"queue {name!r} does not exist in this broker")
        return row

    def _missing(self, table: Any, column: Any, names: list[str]) -> list[str]:
        """Those of ``names`` that do not exist, in the order given."""
        known = set(self._conn.execute(select(column).where(column.in_(names))).scalars())
        return [n for n in names if n not in known]
