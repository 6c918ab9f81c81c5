"""The PySpark routing job: where one machine's delivery pass is not enough.

- :mod:`~airflow_broker.spark.transforms`: pure DataFrame transforms (classification,
  forwarding rules, route matching and load balancing by :mod:`airflow_broker.routing`'s rules);
- :mod:`~airflow_broker.spark.jdbc`: JDBC reads of a transmission queue, writes to staging tables;
- :mod:`~airflow_broker.spark.commit`: the exactly-once commit at the far broker and the
  acknowledgment at the source;
- :mod:`~airflow_broker.spark.job`: the ``spark-submit`` entry point and :func:`job.run`.

Nothing here is imported by the engine: PySpark is needed only where the job runs.
"""
