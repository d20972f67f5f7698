"""Continue-as-new on SQLite and PostgreSQL: a loop of 10,000 iterations under a history cap
of 1,000 (``RB_WF_LOOP`` sets the size) runs as a chain of runs, none above the cap, while
another thread sends signals, in bursts whenever it sees a run switch: every signal is
consumed exactly once, by whichever run was current."""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat.db.dialects import Store
from reliable_beat.workflows import WorkflowContext, engine, signal, workflow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
from wf_driver import Driver

ITERATIONS = int(os.environ.get("RB_WF_LOOP", "10000"))
CAP = 1000
SUGGEST = 900
SIGNALS = 60
POLL_EVERY = 25  # iterations between non-blocking signal polls


def _tick(i: int) -> int:
    return i


def looper(ctx: WorkflowContext, i: int, total: int, expected: int, got: list[Any]) -> Any:
    """The loop pattern: work, poll the inbox now and then, continue-as-new when told."""
    while i < total:
        ctx.step(_tick, i, name="tick")
        i += 1
        if i % POLL_EVERY == 0:
            value = ctx.wait_signal("sig", timeout=timedelta(0))  # a poll: None if empty
            if value is not None:
                got.append(value)
        if ctx.info.continue_as_new_suggested:
            ctx.continue_as_new(i, total, expected, got)
    while len(got) < expected:  # the loop is done: drain what is still to come
        got.append(ctx.wait_signal("sig"))
        if ctx.info.continue_as_new_suggested:
            ctx.continue_as_new(i, total, expected, got)
    return {"i": i, "got": got, "run": ctx.info.run_no}


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
@pytest.mark.timeout(900)
def test_a_long_loop_continues_as_new_under_the_cap_and_loses_no_signal(
    request: pytest.FixtureRequest, dialect: str
) -> None:
    store: Store = request.getfixturevalue("sqlite_store" if dialect == "sqlite" else "pg_store")
    app = Celery("wfcan", set_as_current=False)
    app.conf.update(broker_url="memory://", reliable_beat_database_url=str(store.engine.url))
    workflow(name="t.loop", history_limit=CAP, continue_as_new_after=SUGGEST)(looper)
    handle = engine.start(store, "t.loop", "loop", [0, ITERATIONS, SIGNALS, []])

    sent: list[int] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def sender() -> None:
        """A burst of three each time a new run shows up (around the switch), one every
        2 s meanwhile, and the rest quickly once the loop is over and the run waits."""
        try:
            seen_run = 1
            last = time.monotonic()
            while len(sent) < SIGNALS and not stop.is_set():
                row = engine.get_workflow(store, "loop")
                burst = 3 if row["run_no"] != seen_run else 0
                seen_run = row["run_no"]
                gap = 0.02 if row["state"] == "waiting" else 2.0
                if not burst and time.monotonic() - last >= gap:
                    burst = 1
                for _ in range(min(burst, SIGNALS - len(sent))):
                    n = len(sent)
                    assert signal(store, "loop", "sig", n, key=f"sig:{n}")
                    sent.append(n)
                    last = time.monotonic()
                time.sleep(0.02)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=sender, daemon=True)
    started = time.monotonic()
    thread.start()
    driver = Driver(store, app)
    try:
        deadline = time.monotonic() + 800
        while handle.status()["state"] != "completed":
            assert handle.status()["state"] in ("pending", "running", "waiting"), \
                handle.status()
            assert time.monotonic() < deadline, handle.status()
            driver.run(limit=100_000)
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(timeout=30)
    took = time.monotonic() - started
    assert not errors, errors
    result = handle.result(timeout=1)
    assert result["i"] == ITERATIONS
    assert sorted(result["got"]) == list(range(SIGNALS))  # each signal once, none lost
    with store.connect() as conn:
        per_run = conn.execute(sa.text(
            "SELECT e.run_no, count(*), max(e.seq) FROM reliable_beat_workflow_events e "
            "GROUP BY e.run_no ORDER BY e.run_no")).all()
        consumed = conn.execute(sa.text(
            "SELECT consumed_run_no, consumed_seq FROM reliable_beat_workflow_signals")).all()
    runs = len(per_run)
    assert runs == result["run"]
    assert runs >= ITERATIONS // CAP, per_run
    assert max(n for _, n, _ in per_run) <= CAP and max(s for _, _, s in per_run) <= CAP
    assert len(consumed) == SIGNALS and all(r is not None for r, _ in consumed)
    assert len(set(consumed)) == SIGNALS  # one event per signal
    switched = {r for r, _ in consumed}
    # the signals were consumed across the chain, not all by one run. How many runs get some
    # depends on how fast the loop runs against the sender on a loaded machine (5 of 12 in one
    # CI run), so this only asks for three: the exactly-once checks above are the property
    assert len(switched) >= min(3, runs), consumed
    print(f"CONTINUE-AS-NEW {dialect}: {ITERATIONS} iterations in {runs} runs, largest run "
          f"{max(n for _, n, _ in per_run)} events (cap {CAP}), {SIGNALS} signals consumed "
          f"once each across {len(switched)} runs, {took:.1f} s")
