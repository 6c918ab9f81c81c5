"""SparkRoutingOperator: the Spark routing job (:mod:`airflow_broker.spark.job`) from a DAG.

It is a :class:`SparkSubmitOperator` whose application is the job, so everything the Spark
provider offers (the ``spark`` connection's master, ``conf``, ``packages``, ``deploy_mode``...)
works as usual. What it adds is the brokers: the source is the broker connection's database,
and every far broker the source's routes name (``broker://NAME``) is the Airflow connection
``NAME``, as in the Python delivery path. Their URLs (with passwords) reach the job only as
``AIRFLOW_BROKER_ADDRESS_<NAME>`` environment variables of the spark-submit process: never on
its command line, in the rendered template fields or in the task log.

On YARN and Kubernetes the Spark provider turns environment variables into ``--conf``
arguments, which would put the passwords on a command line; there the operator refuses unless
``pass_broker_urls=False`` says the cluster gives the job those variables itself (a Kubernetes
secret, a YARN credential provider).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

from airflow_broker.hooks.broker import BrokerHook
from airflow_broker.hooks.connections import airflow_connection_url
from airflow_broker.routing import BROKER_SCHEME
from airflow_broker.routing.routes import routes_of
from airflow_broker.spark import jdbc, job
from airflow_broker.transport import env_name

if TYPE_CHECKING:
    from airflow.sdk import Context


class SparkRoutingOperator(SparkSubmitOperator):
    """Route and deliver the broker's transmission queue with the Spark job.

    :param broker_conn_id: the broker (source) connection
    :param peers: connection ids of far brokers; default: every ``broker://NAME`` the source's
        routes name
    :param classifier: data-dependent routing of new conversations to ``classify_service``:
        ``sql:EXPR`` over ``body``, ``json:$.path``, ``xpath:/path`` or ``python:module:name``
    :param classify_service: the service whose new conversations the classifier routes
    :param partitions: parallel JDBC reads of the transmission queue (default: the cores)
    :param retry_now: also take messages whose next attempt is not due yet
    :param source_work_mem: ``work_mem`` of the job's reads that group and sort at a PostgreSQL
        source (default ``64MB``, :data:`airflow_broker.spark.jdbc.SOURCE_WORK_MEM`; None keeps
        the server's setting)
    :param pass_broker_urls: give the job the brokers' URLs in its environment (see above)
    :param conn_id: the Spark connection (its host ``local[*]`` runs the job in the worker)
    """

    ui_color = "#f4a460"

    def __init__(
        self,
        *,
        broker_conn_id: str = BrokerHook.default_conn_name,
        peers: Sequence[str] | None = None,
        classifier: str | None = None,
        classify_service: str | None = None,
        partitions: int | None = None,
        retry_now: bool = False,
        source_work_mem: str | None = jdbc.SOURCE_WORK_MEM,
        pass_broker_urls: bool = True,
        conn_id: str = "spark_default",
        name: str = "airflow-broker-routing",
        **kwargs: Any,
    ) -> None:
        if bool(classifier) != bool(classify_service):
            raise ValueError(
                f"{type(self).__name__}: classifier and classify_service go together "
                f"(got classifier={classifier!r}, classify_service={classify_service!r})"
            )
        try:
            jdbc.checked_work_mem(source_work_mem)
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__}: {exc}") from None
        args = ["--source", broker_conn_id]
        if classifier and classify_service:
            args += ["--classifier", classifier, "--classify-service", classify_service]
        if partitions:
            args += ["--partitions", str(partitions)]
        if retry_now:
            args.append("--retry-now")
        if source_work_mem != jdbc.SOURCE_WORK_MEM:
            args += ["--source-work-mem", source_work_mem or "server"]
        if not kwargs.get("jars") and not kwargs.get("packages"):
            found = [j for j in jdbc.DEBIAN_JARS if Path(j).exists()]
            kwargs["jars"] = ",".join(found) if found else None
            if not found:
                kwargs["packages"] = jdbc.MAVEN_PACKAGES
        conf = dict(kwargs.pop("conf", None) or {})
        # The job imports airflow_broker: run it with this Python unless told otherwise.
        conf.setdefault("spark.pyspark.python", sys.executable)
        conf.setdefault("spark.pyspark.driver.python", sys.executable)
        super().__init__(
            application=str(Path(job.__file__).resolve()),
            application_args=args,
            conn_id=conn_id,
            name=name,
            conf=conf,
            **kwargs,
        )
        self.broker_conn_id = broker_conn_id
        self.peers = list(peers) if peers is not None else None
        self.pass_broker_urls = pass_broker_urls

    def broker_urls(self) -> dict[str, str]:
        """``AIRFLOW_BROKER_ADDRESS_<NAME>`` -> URL for the source and every far broker."""
        hook = BrokerHook(self.broker_conn_id)
        urls = {env_name(self.broker_conn_id): hook.broker_url()[0]}
        peers = self.peers
        if peers is None:
            source = hook.get_broker()
            with source.engine.connect() as conn:
                routes = routes_of(source, conn)
            peers = sorted(
                {
                    address[len(BROKER_SCHEME) :]
                    for route in routes
                    for address in (route.address, route.mirror_address)
                    if address and address.startswith(BROKER_SCHEME)
                }
            )
        for name in peers:
            url = airflow_connection_url(name)
            if url is None:
                raise ValueError(
                    f"{type(self).__name__}: far broker {name!r} (named by a route of "
                    f"{self.broker_conn_id!r}) has no Airflow connection of that id"
                )
            urls[env_name(name)] = url
        return urls

    def execute(self, context: Context) -> None:
        if self.pass_broker_urls:
            secrets = self.broker_urls()
            self._hook = None
            hook = self._get_hook()
            if hook._is_yarn or hook._is_kubernetes:
                raise ValueError(
                    f"{type(self).__name__}: on YARN and Kubernetes the Spark provider passes "
                    "environment variables as --conf arguments, which would put the brokers' "
                    "passwords on a command line; give the job AIRFLOW_BROKER_ADDRESS_<NAME> "
                    "through the cluster's secrets and set pass_broker_urls=False"
                )
            # Set after rendering: the URLs never reach the rendered template fields.
            self.env_vars = {**(self.env_vars or {}), **secrets}
            self._hook = None
        super().execute(context)


__all__ = ["SparkRoutingOperator"]
