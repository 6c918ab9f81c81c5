"""The Airflow glue: the only subpackage of the engine that imports Airflow.

With ``hooks/``, ``operators/`` and ``sensors/`` (installed as ``airflow_broker.hooks``,
``.operators`` and ``.sensors``) this is the Airflow provider; everything else in
``airflow_broker`` runs without Airflow (an import-linter contract holds it so).

- :mod:`~airflow_broker.provider.info`: the provider's self-description (entry point
  ``apache_airflow_provider``: connection type, hook, triggers, queue scheme, DB manager,
  plugin); imports nothing from Airflow, so importing this package stays cheap;
- :mod:`~airflow_broker.provider.compat`: every Airflow name whose home differs between 3.1 and
  the newest 3.x;
- :mod:`~airflow_broker.provider.dbmanager`: ``airflow db migrate`` migrates the broker tables;
- :mod:`~airflow_broker.provider.stats`: Airflow's Stats (StatsD / OpenTelemetry) as the
  broker's metrics sink;
- :mod:`~airflow_broker.provider.xcom`: messages as XCom-safe dicts;
- :mod:`~airflow_broker.provider.triggers`: the async triggers (activation, conversations, the
  ``broker`` scheme of ``MessageQueueTrigger``);
- :mod:`~airflow_broker.provider.plugin`: the ``/broker`` API and the page in the Airflow UI.

Address resolution through Airflow connections reaches the engine as a resolver registered by
entry point (``airflow_broker.address_resolvers``), never by an import from the engine; so does
dialog security's master key, read from the Airflow Variable / secret
``airflow_broker_master_key`` by :mod:`~airflow_broker.provider.master_key` (entry point
``airflow_broker.master_key_sources``).
"""

from airflow_broker.provider.info import CONNECTION_FORM, get_provider_info

__all__ = ["CONNECTION_FORM", "get_provider_info"]
