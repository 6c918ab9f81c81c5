"""The transmitter of bench/transmit.py: the one line a user writes."""

from airflow_broker.provider.transmitter import transmitter_dag

transmitter_dag()
