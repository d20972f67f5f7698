"""Changing a workflow with runs in flight, on real processes (PostgreSQL, Redis, ``celery
worker``, ``reliable-beat relay``; tests/apps/wf_app.py ``wfa.roll``).

v1 workers park runs on a durable timer (one activity done, the timer scheduled); the workers
are rolled to a reordered v2 without a patch: as the timers fire every run is ``blocked``,
with zero new events and zero activities dispatched, and ``workflows replay`` under v2 exits
1 naming each. Rolled again to v2 behind ``ctx.patched``: replay passes, ``workflows resume``
completes every parked run on the old path, and a run started now takes the new path.

CI size 20 runs; the full size is ``RB_WF_ROLL=100``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.workflows import engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_workflow_crashes import Rig, events, wait
from wf_app import meta

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(900)]

RUNS = int(os.environ.get("RB_WF_ROLL", "20"))


@pytest.fixture
def rig(pg_url: str, redis_url: str, pg_store: Store, tmp_path: Path) -> Iterator[Rig]:
    meta.create_all(pg_store.engine)
    r = Rig(pg_url, redis_url, pg_store, tmp_path)
    try:
        yield r
    finally:
        r.kill_all()


def _activity_messages(rig: Rig) -> int:
    """Activity messages dispatched by workflow code (``act:<key>``), not counting the
    sweep's re-sends of the same activity (``act:<key>:r<window>``, same key) under load."""
    with rig.store.engine.connect() as conn:
        return int(conn.execute(sa.text(
            "SELECT count(*) FROM reliable_beat_outbox WHERE message_id LIKE 'act:%' "
            "AND message_id NOT LIKE :resent"), {"resent": "act:%#%:r%"}).scalar_one())


def test_reordered_deploy_blocks_parked_runs_and_a_patched_one_completes_them(rig: Rig
                                                                               ) -> None:
    rig.relay()
    v1 = rig.worker(concurrency=2)
    # long enough to park them all under v1 first, on a loaded CI machine: the wait below
    # fails at 80% of it. The run then waits for the timers: the rest of it is idle.
    timer = 20.0 + RUNS * 1.0
    wids = [f"roll/{i}" for i in range(RUNS)]
    started = time.monotonic()
    for i, wid in enumerate(wids):
        engine.start(rig.store, "wfa.roll", wid, [f"o{i}", timer], queue=rig.queue)
    wait(f"{RUNS} parked on the timer", lambda: all(
        [e[1:4] for e in events(rig.store, w)] == [("activity", "wfa.label", "completed"),
                                                   ("timer", None, "scheduled")]
        for w in wids), rig, timeout=timer * 0.8)
    parked_in = time.monotonic() - started
    before = {w: events(rig.store, w) for w in wids}
    assert _activity_messages(rig) == RUNS
    v1.kill()
    v1.wait(timeout=10)
    rig.worker(concurrency=2, RB_WF_VERSION="2")  # the reordered deploy, no patch
    wait("every run blocked as its timer fires", lambda: all(
        engine.get_workflow(rig.store, w)["state"] == "blocked" for w in wids), rig,
        timeout=timer + 120)
    for w in wids:
        row = engine.get_workflow(rig.store, w)
        assert row["block_reason"].startswith("non-determinism: seq 1: code did activity "
                                              "wfa.label"), row["block_reason"]
        assert events(rig.store, w) == before[w], w  # zero new events
    assert _activity_messages(rig) == RUNS  # zero activities dispatched by v2
    out = rig.cli("workflows", "replay", "--json", RB_WF_VERSION="2")
    assert out.returncode == 1, out.stdout + out.stderr
    named = {m["workflow_id"] for m in json.loads(out.stdout)["mismatches"]}
    assert named == set(wids)
    # roll to v2 behind ctx.patched: the deploy gate passes, resume completes them
    rig.kill_all()
    out = rig.cli("workflows", "replay", RB_WF_VERSION="2p")
    assert out.returncode == 0, out.stdout + out.stderr
    rig.relay()
    rig.worker(concurrency=2, RB_WF_VERSION="2p")
    resumed_at = time.monotonic()
    out = rig.cli("workflows", "resume", *wids, RB_WF_VERSION="2p")
    assert out.returncode == 0, out.stdout + out.stderr
    engine.start(rig.store, "wfa.roll", "roll/new", ["new", 1.0], queue=rig.queue)
    wait("all completed", lambda: all(
        engine.get_workflow(rig.store, w)["state"] == "completed" for w in [*wids, "roll/new"]
    ), rig, timeout=120 + RUNS)
    took = time.monotonic() - resumed_at
    for i, w in enumerate(wids):  # the old path: label 1, timer, label 2; no marker
        assert engine.get_workflow(rig.store, w)["result"] == ["v1", f"label-o{i}-1",
                                                               f"label-o{i}-2"]
        assert [e[1] for e in events(rig.store, w)] == ["activity", "timer", "activity"]
    new = engine.get_workflow(rig.store, "roll/new")
    assert new["result"] == ["v2", "label-new-2", "label-new-1"]
    assert events(rig.store, "roll/new")[0][1:3] == ("patch", "labels-swapped")
    assert _activity_messages(rig) == 2 * RUNS + 2
    print(f"VERSION ROLL: {RUNS} runs parked under v1 in {parked_in:.1f} s; reordered v2: "
          f"{RUNS} blocked, 0 new events, 0 activities dispatched, replay exit 1 naming "
          f"{len(named)}; patched v2: resumed and completed in {took:.1f} s on the old path, "
          "a new run on the new path")
