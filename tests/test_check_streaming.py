"""``check()`` streams (issue 46): each check's rows come from a server-side cursor a batch at
a time, it reports its progress while it works, and says how long it took; streamed in
batches of 2 rows it still finds every problem. ``every=0`` reports after each check.
"""

from __future__ import annotations

import json
import logging

import pytest
from helpers import ORDER, begin, declare_pair, send
from test_check import CASES, _kinds
from test_cli import Run, run  # noqa: F401  (run: a fixture)

from airflow_broker import Broker
from airflow_broker.operations import check as consistency
from airflow_broker.operations.check import KINDS, Progress

DIALOGS = 7


@pytest.fixture
def busy(broker: Broker) -> Broker:
    """The buyer/supplier pair with a few dialogs: an initiator and a target endpoint each."""
    declare_pair(broker)
    for n in range(DIALOGS):
        send(broker, begin(broker), ORDER, {"order": n})
    return broker


def _count(broker: Broker) -> int:
    from sqlalchemy import func, select

    from airflow_broker.storage import schema as s

    with broker.engine.connect() as conn:
        return int(
            conn.execute(select(func.count()).select_from(s.conversation_endpoint)).scalar_one()
        )


def test_check_reports_its_progress_check_by_check_and_how_long_it_took(
    busy: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    total = _count(busy)
    assert total >= 2 * DIALOGS - 1
    seen: list[Progress] = []
    with caplog.at_level(logging.INFO, logger="airflow_broker"):
        report = consistency.run(busy, progress=seen.append, batch=3, every=0)
    assert report.problems == []
    assert report.endpoints == total
    assert report.seconds > 0
    assert str(report) == f"checked {total:,} conversation endpoints in {report.seconds:.1f} s"
    # One report after each check, the last one marked done.
    assert [p.step for p in seen] == list(range(1, seen[0].steps + 1)) and seen[0].steps >= 9
    assert [p.done for p in seen] == [False] * (len(seen) - 1) + [True]
    assert all(p.endpoints == total and not p.estimated for p in seen)
    seconds = [p.seconds for p in seen]
    assert seconds == sorted(seconds)
    assert str(seen[0]).startswith(f"1 of {seen[0].steps} checks done (")
    assert str(seen[0]).endswith(f"0 problems so far; {total} conversation endpoints")
    logged = [r.getMessage() for r in caplog.records if "consistency check" in r.getMessage()]
    assert any("checks done" in m for m in logged), logged
    assert any(f"checked {total:,} conversation endpoints in" in m for m in logged), logged


def test_progress_is_reported_at_most_every_so_often(busy: Broker) -> None:
    seen: list[Progress] = []
    consistency.run(busy, progress=seen.append, batch=1, every=3600)
    assert [p.done for p in seen] == [True], "only the last report within the hour"


@pytest.mark.parametrize("kind", sorted(CASES))
def test_streamed_the_check_still_finds_every_kind(busy: Broker, kind: str) -> None:
    """Rows fetched 2 at a time from the server-side cursor, or all at once: same problems."""
    CASES[kind](busy)
    whole = consistency.run(busy, record=False, batch=10**6).problems
    batched = consistency.run(busy, record=False, batch=2).problems
    assert kind in _kinds(batched), batched
    assert sorted(map(str, batched)) == sorted(map(str, whole))


def test_the_listed_problems_of_a_kind_stay_bounded(
    busy: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(consistency, "MAX_LISTED", 1)
    CASES["impossible_state"](busy)  # every endpoint
    found = consistency.run(busy, record=False, batch=2).problems
    mine = [p for p in found if p.kind == "impossible_state"]
    assert len(mine) == 2 and mine[1].object == f"{_count(busy) - 1} more", mine
    assert set(_kinds(found)) <= set(KINDS)


def test_the_cli_prints_progress_to_stderr_and_the_time_it_took(broker_url: str, run: Run) -> None:  # noqa: F811
    b = Broker.connect(broker_url)
    try:
        declare_pair(b)
        for n in range(3):
            send(b, begin(b), ORDER, {"order": n})
    finally:
        b.dispose()
    code, out, err = run("--url", broker_url, "check", "--progress-every", "0")
    assert code == 0, (out, err)
    lines = out.splitlines()
    assert lines[-1] == "no problems"
    assert any(
        line.startswith("checked ") and "conversation endpoints in" in line and line.endswith(" s")
        for line in lines
    ), out
    assert "checking: " in err and "checks done" in err, err

    code, out, err = run("--url", broker_url, "check", "--quiet")
    assert code == 0 and "checking: " not in err

    code, out, _ = run("--url", broker_url, "check", "--json", "--progress-every", "0")
    doc = json.loads(out)
    assert code == 0 and doc["summary"] == "no problems"
    assert doc["endpoints_checked"] >= 5 and doc["seconds"] >= 0
