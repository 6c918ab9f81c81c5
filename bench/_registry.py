"""The systems ``bench.throughput`` and its siblings measure, by name: each factory imports its
adapter (``bench/_broker_system.py``, ``bench/_peers.py``) only when that system is asked for,
so that a missing client library fails there, where the runner can skip the system."""

from __future__ import annotations

from collections.abc import Callable

from bench._systems import System


def _airflow_broker() -> System:
    import airflow_broker  # noqa: F401  (fail here, where the runner can skip the system)
    from bench._broker_system import AirflowBrokerSystem

    return AirflowBrokerSystem()


def _airflow_broker_pgbouncer() -> System:
    import airflow_broker  # noqa: F401
    from bench._broker_system import PgBouncerBrokerSystem

    return PgBouncerBrokerSystem()


def _airflow_broker_remote() -> System:
    import airflow_broker  # noqa: F401
    from bench._broker_system import RemoteBrokerSystem

    return RemoteBrokerSystem()


def _pgmq() -> System:
    from bench._peers import PgmqSystem

    return PgmqSystem()


def _pgmq_pop() -> System:
    from bench._peers import PgmqPopSystem

    return PgmqPopSystem()


def _pgqueuer() -> System:
    from bench._peers import PgqueuerSystem

    return PgqueuerSystem()


SYSTEMS: dict[str, Callable[[], System]] = {
    "airflow-broker": _airflow_broker,
    # the same, its producer and consumers through PgBouncer (bench.pgbouncer starts it)
    "airflow-broker-pgbouncer": _airflow_broker_pgbouncer,
    # SEND to a service of another broker database on the same server (delivery untimed)
    "airflow-broker-remote": _airflow_broker_remote,
    "pgmq-pop": _pgmq_pop,
    "pgmq": _pgmq,
    "pgqueuer": _pgqueuer,
}


#: What ``python -m bench.throughput`` measures unless ``--systems`` says otherwise (the
#: PgBouncer system runs under ``python -m bench.pgbouncer``, which starts the pooler).
DEFAULT_SYSTEMS = [name for name in SYSTEMS if name != "airflow-broker-pgbouncer"]


def get_system(name: str) -> System:
    """The system called ``name`` (imports its client lazily)."""
    try:
        factory = SYSTEMS[name]
    except KeyError:
        raise SystemExit(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}") from None
    return factory()
