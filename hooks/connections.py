"""Airflow connections as broker addresses.

A route names another broker by a logical name (``broker://west``); inside Airflow that name is
an Airflow connection id. This module turns such a connection into a SQLAlchemy URL. The engine
(``airflow_broker.transport.resolve``) asks it only inside Airflow (a process that has imported
it: a task, the triggerer, the API server) and when neither the broker's own resolver nor
``AIRFLOW_BROKER_ADDRESS_<NAME>`` knows the name. Connections are read
through the Task SDK (``airflow.sdk.BaseHook``), so task code never touches Airflow's ORM.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

from sqlalchemy.engine import URL

log = logging.getLogger("airflow_broker")

#: Seconds a looked-up connection is reused before asking Airflow again.
CACHE_SECONDS = 60.0

_cache: dict[str, tuple[float, str | None]] = {}
_lock = threading.Lock()

#: Airflow connection types that name a PostgreSQL server.
POSTGRES_TYPES = frozenset({"postgres", "postgresql", "broker"})

#: Keys of a postgres (or broker) connection's ``extra`` that are libpq connection parameters:
#: they reach psycopg as query parameters of the URL (``?sslmode=verify-full&sslrootcert=...``).
#: TLS: ``sslmode`` (``disable``, ``prefer``, ``require``, ``verify-ca``, ``verify-full``), the
#: CA that signed the server's certificate (``sslrootcert``), a client certificate and its key
#: (``sslcert``, ``sslkey``, ``sslpassword``), revocation lists, SNI and the TLS versions;
#: then the usual session settings. Other keys (the Airflow postgres provider's ``cursor``,
#: ``iam``, ...) are ignored, with a debug log line.
LIBPQ_EXTRAS = frozenset(
    {
        "sslmode",
        "sslrootcert",
        "sslcert",
        "sslkey",
        "sslpassword",
        "sslcrl",
        "sslcrldir",
        "sslsni",
        "ssl_min_protocol_version",
        "ssl_max_protocol_version",
        "application_name",
        "connect_timeout",
        "options",
        "target_session_attrs",
        "keepalives",
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
        "tcp_user_timeout",
        # not libpq's: bounds on this broker as a far broker (transport.deadlines), which
        # Broker.connect takes off the URL again
        "answer_timeout",
        "patience",
        "gssencmode",
        "channel_binding",
    }
)


def connection_url(conn: Any) -> str:
    """The SQLAlchemy URL of an Airflow connection to a broker database.

    ``extra`` may give the whole URL as ``{"url": "..."}``; otherwise ``sqlite`` connections
    use their host as the file path, and ``postgres`` (or ``broker``) connections are built from
    host, port, schema (the database), login and password, with the psycopg 3 driver; the keys
    of their ``extra`` named in :data:`LIBPQ_EXTRAS` (``sslmode``, ``sslrootcert``, ...) become
    query parameters of the URL, which SQLAlchemy hands to psycopg.
    """
    extra = conn.extra_dejson or {}
    if extra.get("url"):
        return str(extra["url"])
    conn_type = (conn.conn_type or "").lower()
    if conn_type == "sqlite":
        return f"sqlite:///{conn.host}"
    if conn_type in POSTGRES_TYPES:
        return URL.create(
            "postgresql+psycopg",
            username=conn.login or None,
            password=conn.password or None,
            host=conn.host or None,
            port=conn.port or None,
            database=conn.schema or None,
            query=libpq_parameters(conn.conn_id, extra),
        ).render_as_string(hide_password=False)
    raise ValueError(
        f"Airflow connection {conn.conn_id!r} has type {conn.conn_type!r}: a broker address must "
        'be a postgres, sqlite or broker connection, or give the URL in extra as {"url": ...}'
    )


def connection_options(conn: Any) -> dict[str, Any]:
    """``Broker.connect``'s options in an Airflow connection's ``extra``: ``listen_url`` (a
    direct URL for LISTEN behind a pooler) and ``pooled`` (true/false: override finding the
    pooler). Absent keys are left to the broker."""
    extra = conn.extra_dejson or {}
    options: dict[str, Any] = {}
    if extra.get("listen_url"):
        options["listen_url"] = str(extra["listen_url"])
    pooled = extra.get("pooled")
    if pooled is not None and pooled != "":
        if isinstance(pooled, str):
            if pooled.strip().lower() not in ("true", "false", "1", "0"):
                raise ValueError(
                    f"Airflow connection {conn.conn_id!r}: extra 'pooled' must be true or false, "
                    f"not {pooled!r}"
                )
            pooled = pooled.strip().lower() in ("true", "1")
        options["pooled"] = bool(pooled)
    return options


def libpq_parameters(conn_id: str, extra: dict[str, Any]) -> dict[str, str]:
    """The libpq parameters in a connection's ``extra`` (:data:`LIBPQ_EXTRAS`), as the strings a
    URL carries: ``true``/``false`` become ``1``/``0`` (``keepalives``, ``sslsni``), numbers their
    decimal form; empty values are left out. Other keys are ignored (logged at debug level)."""
    params: dict[str, str] = {}
    for key, value in sorted(extra.items()):
        if key not in LIBPQ_EXTRAS:
            log.debug(
                "Airflow connection %r: extra %r is no libpq parameter; ignored", conn_id, key
            )
        elif value is None or value == "":
            continue
        elif isinstance(value, bool):
            params[key] = "1" if value else "0"
        elif isinstance(value, (str, int, float)):
            params[key] = str(value)
        else:
            log.debug(
                "Airflow connection %r: extra %r is a %s, not a value; ignored",
                conn_id,
                key,
                type(value).__name__,
            )
    return params


def airflow_connection_url(conn_id: str) -> str | None:
    """The URL of Airflow connection ``conn_id``, or None outside Airflow (Airflow not imported
    by this process) or when it has no such connection (cached for :data:`CACHE_SECONDS`)."""
    now = time.monotonic()
    with _lock:
        hit = _cache.get(conn_id)
    if hit is not None and now - hit[0] < CACHE_SECONDS:
        return hit[1]
    if "airflow" not in sys.modules:
        # Not running inside Airflow: importing it here would configure Airflow's logging in
        # a plain program that merely has it installed.
        return None
    try:
        # compat: Airflow 3.1's Task SDK has no AirflowNotFoundException of its own
        from airflow_broker.provider.compat import AirflowNotFoundException, BaseHook
    except ImportError:
        return None
    try:
        url: str | None = connection_url(BaseHook.get_connection(conn_id))
    except AirflowNotFoundException:
        url = None
    with _lock:
        _cache[conn_id] = (now, url)
    if url is not None:
        log.debug("broker://%s resolved through the Airflow connection of that id", conn_id)
    return url
