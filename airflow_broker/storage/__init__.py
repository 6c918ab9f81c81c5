"""Storage: the broker's tables and everything that knows which database holds them.

- :mod:`~airflow_broker.storage.schema`: SQLAlchemy Core tables (one MetaData, a naming
  convention); :mod:`~airflow_broker.storage.migrations`: their Alembic history (version table
  ``alembic_version_broker``); :mod:`~airflow_broker.storage.migrate`: migrate and seed a database.
- :mod:`~airflow_broker.storage.adapters`: what differs per engine (BEGIN IMMEDIATE on SQLite,
  BEGIN DEFERRED for read-only connections, LISTEN/NOTIFY or ``PRAGMA data_version`` for waits,
  receive leases).
- :mod:`~airflow_broker.storage.queries`: the hot-path SQL (RECEIVE's one-statement claim);
  :mod:`~airflow_broker.storage.bulk`: set-based writes of a batch.
- :mod:`~airflow_broker.storage.context`: :class:`BrokerContext`, the one object every layer
  above takes (engine, adapter, resolver, instance id, definition cache, due clock, and
  ``read_connection()`` for work that only reads);
  :mod:`~airflow_broker.storage.clock`: time as stored (aware UTC).

Nothing here knows about dialogs; every other layer builds on it.
"""
