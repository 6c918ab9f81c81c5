"""The transmitter of the broker_default database: delivery between broker databases starts by
itself when messages are due to leave (see airflow_broker.provider.transmitter)."""

from airflow_broker.provider.transmitter import transmitter_dag

transmitter_dag()
