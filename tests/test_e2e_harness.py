"""The end-to-end harness itself: a DAG run through the real scheduler and LocalExecutor."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.airflow_stack import airflow_stack

DAGS = Path(__file__).parent / "dags" / "e2e"

pytestmark = pytest.mark.xdist_group("airflow_e2e")


def test_a_triggered_run_succeeds_through_the_real_scheduler(tmp_path: Path) -> None:
    with airflow_stack(
        tmp_path, DAGS, components=("api-server", "scheduler", "dag-processor")
    ) as af:
        af.wait_for_dags("hello_e2e")
        af.airflow("dags", "trigger", "hello_e2e")
        states = af.wait_for(
            "the run to finish",
            lambda: [r.state for r in af.runs("hello_e2e") if r.state in ("success", "failed")],
        )
        assert states == ["success"]
