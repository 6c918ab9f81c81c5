"""Operations: what an operator of a broker reads and does.

- :mod:`~airflow_broker.operations.observation`: the catalog and queue health as value objects
  (``Broker.catalog()``, ``queue_status()``, the transmission queue, events);
- :mod:`~airflow_broker.operations.monitoring`: the monitoring read model behind the UI and its
  API, split by subject, with the operator's actions and probes;
- :mod:`~airflow_broker.operations.sampling`: queue depth history and the age gauges;
- :mod:`~airflow_broker.operations.housekeeping`: retention of events, depth samples and
  closed endpoints, and the purge (``Broker.purge``, ``airflow-broker purge``);
- :mod:`~airflow_broker.operations.declarations`: the YAML declaration format (``apply``);
- :mod:`~airflow_broker.operations.echo`: the echo service that liveness probes talk to.

Metrics go through :mod:`airflow_broker.metrics`, a leaf every layer may call.
"""
