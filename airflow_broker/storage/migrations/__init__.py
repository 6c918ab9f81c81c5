"""Alembic migrations of the broker tables (version table ``alembic_version_broker``)."""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config
from sqlalchemy.engine import Connection

VERSION_TABLE = "alembic_version_broker"
MIGRATIONS_DIR = Path(__file__).resolve().parent


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config for the broker's migrations, bound to ``connection`` when given."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        config.attributes["connection"] = connection
    return config
