"""The provider's self-description for Airflow (entry point ``apache_airflow_provider``).

Airflow's ProvidersManager reads this without importing the classes it names: the ``broker``
connection type and its form, the hook, the triggers the triggerer may run, the ``broker``
message-queue scheme of ``MessageQueueTrigger`` (common-messaging provider), the DB manager
that ``airflow db migrate`` runs, and the plugin that mounts the monitoring API at ``/broker``.
The keys and their shapes are Airflow's ``provider_info.schema.json``; this module imports
nothing from Airflow.
"""

from __future__ import annotations

from typing import Any

from airflow_broker import __version__

INTEGRATION = "Service Broker"

#: The ``broker`` connection form (Airflow 3.2+ reads it from here without importing the hook;
#: BrokerHook's get_ui_field_behaviour / get_connection_form_widgets say the same to 3.1).
CONNECTION_FORM: dict[str, Any] = {
    "ui-field-behaviour": {
        "hidden-fields": [],
        "relabeling": {"schema": "Database", "host": "PostgreSQL host"},
        "placeholders": {
            "host": "127.0.0.1 (or give the whole URL below)",
            "port": "5432",
            "schema": "airflow",
            "login": "airflow",
            "url": "sqlite:////opt/airflow/broker.db",
        },
    },
    "conn-fields": {
        "url": {
            "label": "Database URL",
            "description": (
                "A SQLAlchemy URL of the broker database (postgresql+psycopg://HOST/DB or "
                "sqlite:///PATH). When set, host, port, database, login and password are "
                "ignored: keep credentials in login and password rather than in this URL."
            ),
            "schema": {"type": ["string", "null"]},
        }
    },
}


def get_provider_info() -> dict[str, Any]:
    """What Airflow's ProvidersManager knows about airflow-broker."""
    return {
        "package-name": "airflow-broker",
        "name": INTEGRATION,
        "description": (
            "SQL Server Service Broker's reliable, conversational messaging for Airflow: "
            "dialogs, conversation groups, activation of reader DAGs, routing between broker "
            "databases, on PostgreSQL or SQLite.\n"
        ),
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": INTEGRATION,
                "external-doc-url": "https://learn.microsoft.com/sql/database-engine/configure-windows/sql-server-service-broker",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": INTEGRATION,
                "python-modules": [
                    "airflow_broker.operators.dialog",
                    "airflow_broker.operators.declarations",
                    "airflow_broker.operators.lease",
                    "airflow_broker.operators.reader",
                    "airflow_broker.operators.routing_service",
                    "airflow_broker.operators.transmit",
                ],
            }
        ],
        "sensors": [
            {
                "integration-name": INTEGRATION,
                "python-modules": [
                    "airflow_broker.sensors.activation",
                    "airflow_broker.sensors.conversation",
                ],
            }
        ],
        "hooks": [
            {
                "integration-name": INTEGRATION,
                "python-modules": ["airflow_broker.hooks.broker"],
            }
        ],
        "triggers": [
            {
                "integration-name": INTEGRATION,
                "python-modules": [
                    "airflow_broker.provider.triggers.activation",
                    "airflow_broker.provider.triggers.alerts",
                    "airflow_broker.provider.triggers.conversation",
                    "airflow_broker.provider.triggers.transmission",
                ],
            }
        ],
        "connection-types": [
            {
                "hook-class-name": "airflow_broker.hooks.broker.BrokerHook",
                "hook-name": "Broker",
                "connection-type": "broker",
                **CONNECTION_FORM,
            }
        ],
        # The monitoring API in the API server (also the `airflow.plugins` entry point).
        "plugins": [
            {
                "name": "airflow_broker",
                "plugin-class": "airflow_broker.provider.plugin.BrokerPlugin",
            }
        ],
        "queues": ["airflow_broker.provider.triggers.queues.BrokerMessageQueueProvider"],
        "db-managers": ["airflow_broker.provider.dbmanager.BrokerDBManager"],
    }


__all__ = ["get_provider_info"]
