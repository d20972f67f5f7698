"""The handed case ``full-jitter-at-cap`` (tests/cases/handed.json).

``delay_k ~ Uniform[0, min(cap, base * 2**k)]``, base 1 s, cap 60 s, max_retries 5 (= 6
attempts, then one dead letter). The draws are pure; the always-failing task runs eagerly
(Celery's ``apply`` replays retries inline) against a real SQLite store.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat import runs
from reliable_beat.celery.task import KEY_HEADER, IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, dead_letters
from reliable_beat.policies import backoff_delay

CASES = Path(__file__).resolve().parents[1] / "cases" / "handed.json"


def _case() -> dict[str, Any]:
    for case in json.loads(CASES.read_text()):
        if case["id"] == "full-jitter-at-cap":
            return case  # type: ignore[no-any-return]
    raise AssertionError(f"case 'full-jitter-at-cap' missing from {CASES}")


CASE = _case()
POLICY = CASE["schedule"]["retry_policy"]
EXPECTED = CASE["expected"]
BASE, CAP = float(POLICY["base_seconds"]), float(POLICY["cap_seconds"])


def draw(k: int, rng: random.Random) -> float:
    return backoff_delay(k, base=BASE, cap=CAP, rng=rng)


@pytest.mark.parametrize(("k", "bounds"), [
    (0, EXPECTED["k0_range"]),
    (3, EXPECTED["k3_range"]),
    (6, EXPECTED["k6_and_above_range"]),
    (7, EXPECTED["k6_and_above_range"]),
    (20, EXPECTED["k6_and_above_range"]),
    (2000, EXPECTED["k6_and_above_range"]),
])
def test_delay_bounds(k: int, bounds: list[float]) -> None:
    rng = random.Random(k)
    values = [draw(k, rng) for _ in range(2000)]
    assert min(values) >= bounds[0]
    assert max(values) <= bounds[1]
    # Full jitter: the draws fill the whole range, not just its top.
    assert max(values) > 0.9 * bounds[1]
    assert min(values) < 0.1 * bounds[1]


def test_k20_distribution() -> None:
    want = EXPECTED["k20_10000_draws"]
    rng = random.Random(20)
    values = [draw(20, rng) for _ in range(10_000)]
    assert min(values) <= want["min_at_most"]
    assert max(values) >= want["max_at_least"]
    lo, hi = want["mean_between"]
    assert lo <= statistics.fmean(values) <= hi
    assert len(set(values)) >= want["distinct_values_at_least"]


def test_k2000_does_not_overflow() -> None:
    value = backoff_delay(2000, base=BASE, cap=CAP)
    assert 0 <= value <= CAP
    assert 0 <= backoff_delay(10**6, base=BASE, cap=CAP) <= CAP


# ----------------------------------------------------------- always-failing task ----

calls: list[int] = []


@pytest.fixture
def failing_app(sqlite_store: Store) -> Iterator[tuple[Celery, Any]]:
    app = Celery("backoff_case", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        reliable_beat_database_url=str(sqlite_store.engine.url),
        reliable_beat_retry_max_attempts=int(POLICY["max_retries"]) + 1,
        reliable_beat_retry_base_seconds=BASE,
        reliable_beat_retry_cap_seconds=CAP,
        reliable_beat_lease_seconds=30,
    )

    @app.task(shared=False, base=IdempotentTask, bind=True, name="case.always_fails")
    def always_fails(self: IdempotentTask) -> None:
        calls.append(self.attempt)
        raise ConnectionError("upstream refused")

    calls.clear()
    yield app, always_fails


def test_always_failing_task_is_dead_lettered_after_six_attempts(
    failing_app: tuple[Celery, Any], sqlite_store: Store
) -> None:
    want = EXPECTED["always_failing_task"]
    _app, task = failing_app
    result = task.apply(headers={KEY_HEADER: "case:always-fails"})
    assert isinstance(result.result, ConnectionError)
    assert calls == list(range(1, want["attempts"] + 1))
    run = runs.get_run(sqlite_store, "case:always-fails")
    assert run["state"] == "dead" and run["attempts"] == want["attempts"]
    rows = runs.list_attempts(sqlite_store, run["id"])
    assert [r["outcome"] for r in rows] == ["retrying"] * (want["attempts"] - 1) + ["dead"]
    assert [r["fence_token"] for r in rows] == list(range(1, want["attempts"] + 1))
    for k, row in enumerate(rows[:-1]):  # the countdowns, not the wall time
        assert 0 <= row["retry_in_seconds"] <= min(CAP, BASE * 2**k)
    with sqlite_store.engine.connect() as conn:
        dls = conn.execute(sa.select(dead_letters)).mappings().all()
    assert len(dls) == want["dead_letter_rows"]
    assert dls[0]["reason"] == "exhausted" and dls[0]["attempts"] == want["attempts"]
    assert dls[0]["payload"]["key"] == "case:always-fails"

    # Not retried after the dead letter: a redelivery of the message does not run the body.
    task.apply(headers={KEY_HEADER: "case:always-fails"})
    assert len(calls) == want["attempts"]
    assert want["retried_after_dead_letter"] is False
    with sqlite_store.engine.connect() as conn:
        n_dl = conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar_one()
        last = conn.execute(
            sa.select(attempts.c.outcome).order_by(attempts.c.id.desc()).limit(1)
        ).scalar_one()
    assert n_dl == 1 and last == "deduplicated"
