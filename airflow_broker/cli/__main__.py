"""``python -m airflow_broker.cli``: the same as the ``airflow-broker`` command."""

import sys

from airflow_broker.cli.parser import main

sys.exit(main())
