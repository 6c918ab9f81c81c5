"""BrokerHook: the broker database of an Airflow connection (type ``broker``).

The hook reads its connection through the Task SDK (``BaseHook.get_connection``), never through
Airflow's ORM, and opens the broker's own SQLAlchemy engine from it: task code may not use
Airflow's database session, and the broker never needs it. Without the connection it falls back
to the embedded store, ``sqlite:///$AIRFLOW_HOME/broker.db``, says so in the log, and migrates
that file (once per process). A PostgreSQL server is connected to at once, so that a server
that refuses the connection (TLS required, a certificate that cannot be verified) is reported
with the connection's id (:class:`BrokerConnectionError`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import OperationalError

from airflow_broker.errors import BrokerError
from airflow_broker.hooks.connections import connection_options, connection_url
from airflow_broker.provider import CONNECTION_FORM
from airflow_broker.provider.compat import AirflowNotFoundException, BaseHook

if TYPE_CHECKING:
    from airflow_broker.broker import Broker

#: The embedded store's file name, in ``$AIRFLOW_HOME``.
FALLBACK_FILE = "broker.db"

_migrated: set[str] = set()
_migrated_lock = threading.Lock()


class BrokerConnectionError(BrokerError, ConnectionError):
    """The server of a broker connection refuses it: the message names the Airflow connection
    and says what was wrong (the server's own words follow in parentheses)."""


#: (words of libpq's message, what to tell the user), the first match wins.
_CONNECT_FAILURES = (
    (
        ("no pg_hba.conf entry", "no encryption"),
        "the server accepts only TLS connections: set sslmode (require, verify-ca or "
        "verify-full) and sslrootcert in the connection's extra",
    ),
    (
        ("certificate verify failed",),
        "the server's certificate cannot be verified (certificate verify failed): set "
        "sslrootcert in the connection's extra to the CA certificate that signed it",
    ),
    (
        ("does not match host name",),
        "the server's certificate does not name the connection's host: use a host name the "
        "certificate gives, or sslmode verify-ca",
    ),
    (
        ("root certificate file",),
        "the CA certificate cannot be read: set sslrootcert in the connection's extra to the "
        "file of the CA that signed the server's certificate",
    ),
)


def connect_failure(conn_id: str, error: BaseException) -> str:
    """What :class:`BrokerConnectionError` says when connection ``conn_id`` cannot connect."""
    detail = " ".join(str(error).split())  # libpq's message spans lines
    what = "cannot connect to the server"
    for words, advice in _CONNECT_FAILURES:
        if all(w in detail.lower() for w in words):
            what = advice
            break
    return f"broker connection {conn_id!r}: {what} ({detail})"


def fallback_url() -> str:
    """The embedded store: ``sqlite:///$AIRFLOW_HOME/broker.db`` (``~/airflow`` when unset, as
    Airflow itself defaults)."""
    home = Path(os.environ.get("AIRFLOW_HOME") or "~/airflow").expanduser()
    return f"sqlite:///{home / FALLBACK_FILE}"


class BrokerHook(BaseHook):
    """The broker database an Airflow connection names.

    Connection types ``broker`` and ``postgres`` are PostgreSQL servers (host, port, schema as
    the database, login, password; psycopg 3); type ``sqlite`` uses its host as the file path;
    any type may give the whole URL in extra as ``{"url": "..."}``.

    Behind PgBouncer in transaction mode the same connection works as it is (the broker finds
    the pooler on its first connection). Two optional keys of ``extra`` are for what it cannot
    tell on its own: ``listen_url``, a URL of the same database that reaches the server
    directly, where waits LISTEN instead of polling; and ``pooled`` (true or false), which
    overrides finding the pooler.

    :param broker_conn_id: the Airflow connection id (default ``broker_default``). When it does
        not exist the hook uses ``sqlite:///$AIRFLOW_HOME/broker.db``, logs that it does, and
        migrates that file once per process.
    """

    conn_name_attr = "broker_conn_id"
    default_conn_name = "broker_default"
    conn_type = "broker"
    hook_name = "Broker"

    def __init__(self, broker_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.broker_conn_id = broker_conn_id
        self._broker: Broker | None = None
        self._lock = threading.Lock()

    # -- the database --------------------------------------------------------------------------
    def broker_url(self) -> tuple[str, bool]:
        """The broker database URL and whether it is the embedded fallback (no connection)."""
        url, fallback, _options = self._connection()
        return url, fallback

    def _connection(self) -> tuple[str, bool, dict[str, Any]]:
        """The URL, whether it is the fallback, and ``Broker.connect``'s options from extra."""
        try:
            conn = self.get_connection(self.broker_conn_id)
        except AirflowNotFoundException:
            return fallback_url(), True, {}
        return connection_url(conn), False, connection_options(conn)

    def get_broker(self) -> Broker:
        """The :class:`~airflow_broker.Broker` of the connection, opened on first use and kept
        by this hook. Other brokers that routes name (``broker://NAME``) resolve through the
        Airflow connection with id ``NAME``."""
        with self._lock:
            if self._broker is None:
                self._broker = self._open()
            return self._broker

    def get_conn(self) -> Broker:
        """The same :class:`~airflow_broker.Broker` as :meth:`get_broker`."""
        return self.get_broker()

    def close(self) -> None:
        """Dispose of the broker's engine; the next :meth:`get_broker` opens a new one."""
        with self._lock:
            broker, self._broker = self._broker, None
        if broker is not None:
            broker.dispose()

    def _open(self) -> Broker:
        from airflow_broker.broker import Broker

        url, fallback, options = self._connection()
        broker = Broker.connect(url, **options)
        if broker.dialect == "postgresql":
            try:
                with broker.engine.connect():
                    pass
            except OperationalError as exc:
                broker.dispose()
                reason = connect_failure(self.broker_conn_id, exc.orig or exc)
                raise BrokerConnectionError(reason) from exc
        if fallback:
            self.log.info(
                "Airflow connection %r does not exist: using the embedded broker database %s "
                "(create a connection of type 'broker' with that id to use another database)",
                self.broker_conn_id,
                url,
            )
            with _migrated_lock:
                if url not in _migrated:
                    # A file nobody set up: create (or upgrade) its tables. Connections name
                    # databases their owner migrates (`airflow-broker migrate`, `airflow db
                    # migrate` with the DB manager).
                    broker.migrate()
                    _migrated.add(url)
        return broker

    def test_connection(self) -> tuple[bool, str]:
        """What the connection form's Test button shows: the broker instance id, or why not."""
        try:
            broker = self.get_broker()
            return True, f"broker instance {broker.instance_id} ({broker!r})"
        except Exception as exc:  # the message is the point: shown in the UI
            return False, f"{type(exc).__name__}: {exc}"
        finally:
            self.close()

    # -- the connection form: Airflow 3.1 asks these; 3.2+ reads the provider info -----------
    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """Field labels and placeholders of the ``broker`` connection form."""
        behaviour = CONNECTION_FORM["ui-field-behaviour"]
        return {
            "hidden_fields": list(behaviour["hidden-fields"]),
            "relabeling": dict(behaviour["relabeling"]),
            "placeholders": dict(behaviour["placeholders"]),
        }

    @classmethod
    def get_connection_form_widgets(cls) -> dict[str, Any]:
        """The extra field of the ``broker`` connection form: the whole database URL."""
        # Imported here, as every provider does: only the connection form needs them (Airflow
        # mocks them when Flask AppBuilder is not installed).
        from flask_appbuilder.fieldwidgets import BS3TextFieldWidget
        from flask_babel import lazy_gettext
        from wtforms import StringField

        url = CONNECTION_FORM["conn-fields"]["url"]
        return {
            "url": StringField(
                lazy_gettext(url["label"]),
                widget=BS3TextFieldWidget(),
                description=url["description"],
            )
        }


__all__ = ["BrokerConnectionError", "BrokerHook", "connect_failure", "fallback_url"]
