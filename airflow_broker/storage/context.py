"""The one object every layer below the facade takes: a broker database and its process state.

:class:`BrokerContext` holds what the transaction verbs, delivery, activation and operations need
of "the broker" and nothing else: the SQLAlchemy engine and its dialect adapter, the resolver that
names other brokers, this database's instance id, a short-lived cache of definitions and the due
clock that tells RECEIVE when due work is next needed. :class:`airflow_broker.Broker` is a
``BrokerContext`` with the public verbs on top, so code below the facade never imports it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Self, TypeVar

from sqlalchemy import create_engine, select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError, ProgrammingError
from sqlalchemy.pool import StaticPool

from airflow_broker.errors import BrokerError, PermissionDenied
from airflow_broker.storage import schema as s
from airflow_broker.storage.adapters import (
    PostgresAdapter,
    SqliteAdapter,
    adapter_for,
    broker_url,
)
from airflow_broker.storage.clock import utcnow
from airflow_broker.storage.sqlite_adapter import READ_ONLY

T = TypeVar("T")

#: Turns the NAME of a route address ``broker://NAME`` into a URL or a broker: a mapping, or a
#: callable returning None for names it does not know (then AIRFLOW_BROKER_ADDRESS_<NAME>).
Resolver = Mapping[str, "str | BrokerContext"] | Callable[[str], "str | BrokerContext | None"]

#: How long cached definitions (contract rules, priorities, routes) may be used before re-reading.
DEFINITION_CACHE_SECONDS = 1.0


class BrokerContext:
    """One broker database as the layers below the facade see it.

    :param engine: a SQLAlchemy engine on PostgreSQL (psycopg 3) or SQLite.
    :param resolver: logical broker name -> URL or broker (a mapping or a callable), used to reach
        other brokers named by routes (``broker://NAME``).
    :param pooled: PostgreSQL: whether a connection pooler in transaction mode sits between the
        engine and the server; None (the default) finds out on the first connection
        (:mod:`~airflow_broker.storage.pooler`).
    :param listen_url: PostgreSQL: a URL of the same database that reaches the server directly,
        for what needs a session of its own behind a pooler (LISTEN wake-ups); None: the
        engine's own URL where there is no pooler, polling where there is one.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        resolver: Resolver | None = None,
        pooled: bool | None = None,
        listen_url: str | None = None,
    ) -> None:
        self.engine = engine
        self.dialect: str = engine.dialect.name
        self.adapter: PostgresAdapter | SqliteAdapter = adapter_for(
            engine, pooled=pooled, listen_url=listen_url
        )
        #: logical broker name -> URL or broker (a mapping or a callable); see transport.resolver
        self.resolver: Resolver | None = resolver
        self._instance_id: str | None = None
        self._instance_id_read_at = 0.0
        self._cache: dict[Any, tuple[float, Any]] = {}
        self._cache_lock = threading.Lock()
        #: monotonic time of the next due-work step RECEIVE should take (see Transaction)
        self.next_due_work = 0.0
        #: monotonic time of this process's next queue-depth sampling look (see sampling)
        self.next_depth_sample = 0.0
        #: monotonic time of this process's next purge (see operations.housekeeping)
        self.next_housekeeping = 0.0

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        resolver: Resolver | None = None,
        pooled: bool | None = None,
        listen_url: str | None = None,
        **engine_kwargs: Any,
    ) -> Self:
        """Open the broker database at ``url`` (``sqlite:///broker.db``,
        ``postgresql+psycopg://user@host/db``; ``postgresql://`` means psycopg 3). The same URL
        works through PgBouncer in transaction mode; ``pooled`` and ``listen_url`` are for the
        rare set-up the engine cannot tell apart on its own (see :class:`BrokerContext`)."""
        parsed = broker_url(url)
        if parsed.get_backend_name() == "sqlite":
            if parsed.database in (None, "", ":memory:"):
                engine_kwargs.setdefault("poolclass", StaticPool)
                engine_kwargs.setdefault("connect_args", {"check_same_thread": False})
            else:
                engine_kwargs.setdefault("pool_size", 8)
                engine_kwargs.setdefault("max_overflow", 16)
        else:
            engine_kwargs.setdefault("pool_size", 5)
            engine_kwargs.setdefault("max_overflow", 10)
            # psycopg prepares nothing on its own: after a ROLLBACK it would DEALLOCATE ALL,
            # the hot statements' too (storage.direct prepares and tracks those itself).
            connect_args = dict(engine_kwargs.get("connect_args") or {})
            connect_args.setdefault("prepare_threshold", None)
            engine_kwargs["connect_args"] = connect_args
        return cls(
            create_engine(parsed, **engine_kwargs),
            resolver=resolver,
            pooled=pooled,
            listen_url=listen_url,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.engine.url.render_as_string(hide_password=True)!r})"

    @property
    def client_role(self) -> str | None:
        """PostgreSQL: the database role this broker connects as, when it is a client role (one
        granted SEND and RECEIVE, working through the views of :mod:`~airflow_broker.storage.roles`)
        rather than the owner; None for the owner and on SQLite. Known once a connection opened."""
        return self.adapter.client_role

    def read_connection(self) -> Connection:
        """A connection for work that only reads (peek, queue status, the monitoring views):
        ``with broker.read_connection() as conn: ...``. On SQLite its transactions begin
        DEFERRED and read the last committed state without waiting for a writer (a RECEIVE
        holding its messages holds the database's write lock until it commits); a write on it
        may fail at once, so nothing that writes uses it. On PostgreSQL it is a plain
        connection (readers never wait for writers there)."""
        return self.engine.connect().execution_options(**{READ_ONLY: True})

    def dispose(self) -> None:
        """Close every connection this broker holds."""
        self.adapter.dispose()
        self.engine.dispose()

    # -- identity ------------------------------------------------------------------------------
    @property
    def instance_id(self) -> str:
        """This broker database's id (a UUID string), stable for the life of the database
        (``reset-identity --new-broker`` gives a copy a new one). Read once, and again when the
        transaction verbs re-read it (:meth:`instance_id_on`)."""
        if self._instance_id is None:
            with self.read_connection() as conn:
                self.instance_id_on(conn)
        assert self._instance_id is not None
        return self._instance_id

    def instance_id_on(self, conn: Connection) -> str:
        """The instance id, read on ``conn`` (inside a SQLite write transaction a second
        connection would wait for this one's lock) when the one read before is older than
        :data:`DEFINITION_CACHE_SECONDS`: a ``reset-identity`` in another process is noticed
        within that second."""
        now = time.monotonic()
        if self._instance_id is None or now - self._instance_id_read_at >= DEFINITION_CACHE_SECONDS:
            try:
                value = conn.execute(select(s.broker_instance.c.instance_id)).scalar()
            except (OperationalError, ProgrammingError) as exc:
                if "broker_instance" not in str(exc.orig):
                    raise
                if getattr(exc.orig, "sqlstate", None) == "42501":  # insufficient_privilege
                    raise PermissionDenied(
                        f"role {self.client_role!r} holds no permission in {self!r} (neither "
                        "SEND on a service nor RECEIVE on a queue: grant_send, grant_receive)"
                    ) from exc
                raise BrokerError(
                    f"{self!r} has no broker tables: run Broker.migrate() "
                    "(or `airflow-broker migrate`)"
                ) from exc
            if value is None:
                raise BrokerError(f"{self!r} is not migrated: run Broker.migrate()")
            self._instance_id = str(value)
            self._instance_id_read_at = now
        return self._instance_id

    def invalidate_identity(self) -> None:
        """Forget the instance id and the identity status read before (after reset-identity)."""
        self._instance_id = None
        self.invalidate_definitions()

    # -- definition cache ----------------------------------------------------------------------
    def invalidate_definitions(self) -> None:
        """Forget cached definitions (done after every definition change through this broker)."""
        with self._cache_lock:
            self._cache.clear()

    def cached_definition(self, key: Any, load: Callable[[], T]) -> T:
        """``load()``'s value for ``key``, re-read after :data:`DEFINITION_CACHE_SECONDS`."""
        now = time.monotonic()
        with self._cache_lock:
            hit = self._cache.get(key)
        if hit is not None and now - hit[0] < DEFINITION_CACHE_SECONDS:
            return hit[1]
        value = load()
        with self._cache_lock:
            self._cache[key] = (now, value)
        return value

    def peek_definition(self, key: Any) -> Any:
        """What :meth:`cached_definition` holds for ``key`` while it is fresh, else None; reads
        nothing."""
        with self._cache_lock:
            hit = self._cache.get(key)
        if hit is not None and time.monotonic() - hit[0] < DEFINITION_CACHE_SECONDS:
            return hit[1]
        return None

    # -- due clock -----------------------------------------------------------------------------
    def note_due(self, at: datetime) -> None:
        """Something falls due at ``at`` (a timer, a lifetime, a retry): make sure RECEIVE's
        due-work step in this process runs by then."""
        delay = max((at - utcnow()).total_seconds(), 0.0)
        self.next_due_work = min(self.next_due_work, time.monotonic() + delay)


__all__ = ["DEFINITION_CACHE_SECONDS", "BrokerContext", "Resolver"]
