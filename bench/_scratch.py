"""Scratch databases on the benchmark's PostgreSQL server: created per workload, always dropped.

A system's schema is installed once into a template database; each workload then gets a clone
(``CREATE DATABASE ... TEMPLATE``), so no measured run inherits another one's dead tuples.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from psycopg import sql
from sqlalchemy import make_url

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


@dataclass(frozen=True, slots=True)
class Database:
    """One database, spelled for SQLAlchemy (airflow-broker) and for libpq (the peers)."""

    name: str
    sqlalchemy_url: str
    conninfo: str


def server_url() -> str:
    """The server's URL from ``BROKER_BENCH_POSTGRES_URL`` (SQLAlchemy spelling)."""
    return os.environ.get("BROKER_BENCH_POSTGRES_URL", DEFAULT_URL)


def database(name: str, url: str | None = None) -> Database:
    """``name`` on the server of ``url`` (default: :func:`server_url`)."""
    base = make_url(url or server_url())
    if base.drivername in ("postgresql", "postgres"):
        base = base.set(drivername="postgresql+psycopg")
    on_db = base.set(database=name)
    conninfo = on_db.set(drivername="postgresql").render_as_string(hide_password=False)
    return Database(name, on_db.render_as_string(hide_password=False), conninfo)


def far_name(name: str) -> str:
    """The name of the far broker's database a system creates beside database ``name``."""
    return name[:59] + "_far"


class ScratchServer:
    """Creates, clones, vacuums and drops the benchmark's databases; remembers what to drop."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url or server_url()
        self.admin = database(make_url(self.url).database or "postgres", self.url)
        self.tag = f"{os.getpid()}"
        self._created: list[str] = []
        self._templates: dict[str, str] = {}
        self._version: int | None = None

    def _admin_execute(self, statement: sql.Composed) -> None:
        with psycopg.connect(self.admin.conninfo, autocommit=True) as conn:
            conn.execute(statement)

    def check(self) -> None:
        """Fail early, with the URL in the message, when the server does not answer."""
        try:
            with psycopg.connect(self.admin.conninfo, autocommit=True, connect_timeout=5) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error as exc:
            raise SystemExit(
                f"PostgreSQL did not answer at {make_url(self.url).render_as_string()}: {exc}. "
                f"Start it, or set BROKER_BENCH_POSTGRES_URL."
            ) from exc

    def _name(self, *parts: str) -> str:
        raw = "_".join(["bench", *parts, self.tag])
        return re.sub(r"[^a-z0-9_]", "_", raw.lower())[:63]

    def _drop(self, name: str) -> None:
        self._admin_execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )

    def template(self, system: str, install: Callable[[Database], None]) -> str:
        """The template database of ``system``, installing its schema on first use."""
        if system not in self._templates:
            name = self._name("tpl", system)
            self._drop(name)
            self._admin_execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            self._created.append(name)
            install(database(name, self.url))
            self._templates[system] = name
        return self._templates[system]

    def _server_version(self) -> int:
        if self._version is None:
            with psycopg.connect(self.admin.conninfo, autocommit=True) as conn:
                self._version = conn.info.server_version
        return self._version

    def create(self, template: str, *parts: str, file_copy: bool = False) -> Database:
        """A fresh clone of ``template`` named after ``parts``.

        ``file_copy``: clone by copying the files (after a checkpoint), not through the WAL
        (PostgreSQL 15's default): much faster for a large template, such as a loaded backlog.
        """
        name = self._name(*parts)
        self._drop(name)
        statement = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template)
        )
        if file_copy and self._server_version() >= 150000:
            statement = sql.SQL("{} STRATEGY FILE_COPY").format(statement)
        self._admin_execute(statement)
        self._created.append(name)
        return database(name, self.url)

    def drop(self, db: Database) -> None:
        """Drop one scratch database now, with the far broker a system made beside it
        (``airflow-broker-remote``: :func:`far_name`)."""
        self._drop(db.name)
        self._drop(far_name(db.name))
        if db.name in self._created:
            self._created.remove(db.name)

    def drop_all(self) -> None:
        """Drop every database this server object created (templates included)."""
        for name in reversed(self._created):
            self._drop(name)
            self._drop(far_name(name))
        self._created.clear()
        self._templates.clear()


def vacuum(db: Database) -> None:
    """``VACUUM ANALYZE`` the database, so every round starts from the same table state."""
    with psycopg.connect(db.conninfo, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


def quiesce(*dbs: Database) -> None:
    """VACUUM ANALYZE each database, then one CHECKPOINT: every timed part starts alike, and
    none pays for the writes of the one before it (or of building its data)."""
    for db in dbs:
        vacuum(db)
    if dbs:
        with psycopg.connect(dbs[0].conninfo, autocommit=True) as conn:
            conn.execute("CHECKPOINT")


def run_part(url: str | None, measure: Callable[[ScratchServer], list[str]]) -> int:
    """Run one part of a bench on its own (``python -m bench._part``): its scratch databases
    on the server at ``url``, dropped afterwards, and the lines it prints."""
    server = ScratchServer(url)
    server.check()
    try:
        lines = measure(server)
    finally:
        server.drop_all()
    for line in lines:
        print(line)
    return 0
