"""Runaway workflow code on real processes does not take every worker, and says so.

Three solo ``celery worker`` processes, a ``reliable-beat relay``, PostgreSQL and Redis
(tests/apps/wf_app.py), with short guards: ``reliable_beat_workflow_code_timeout_seconds``
1, ``reliable_beat_workflow_max_takeovers`` 1, lease 2 s, re-dispatch after 1 s.

* ``wfa.forever`` (a transaction, then ``while True: pass``) is interrupted by the code
  deadline and parked ``blocked``, its reason naming the setting and the fix;
* ``wfa.hung`` (a transaction, then a step that never returns: step bodies are not timed by
  the code deadline) lets its lease expire; one more worker takes it over (max_takeovers 1), and
  the second expiry parks it ``blocked`` naming ``reliable_beat_workflow_max_takeovers``,
  not re-sent to the third worker;
* a workflow started after both were parked completes on the worker left;
* a workflow whose queue no worker consumes is named by WORKFLOWS NOT STARTED;
* ``status --check`` exits 1 naming the parked workflows and the settings.

Before: the loop's advance never returned, its lease expired, the sweep re-sent its wake and
each re-send took one more worker; after ~10 s all three spun, a workflow started later
stayed ``pending``, ``status`` had no line and ``workflows show`` said ``running``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reliable_beat.db.dialects import Store
from reliable_beat.workflows import engine
from reliable_beat.workflows.runaway import CODE_TIMEOUT_SETTING, MAX_TAKEOVERS_SETTING

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "apps"))
sys.path.insert(0, str(ROOT / "tests" / "acceptance"))
from test_workflow_crashes import Rig, wait  # noqa: E402
from wf_app import meta  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(240)]


@pytest.fixture
def rig(pg_url: str, redis_url: str, pg_store: Store, tmp_path: Path) -> Iterator[Rig]:
    meta.create_all(pg_store.engine)
    r = Rig(pg_url, redis_url, pg_store, tmp_path)
    try:
        yield r
    finally:
        r.kill_all()


def test_runaway_workflows_are_parked_and_leave_workers_to_the_others(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in {"RB_WF_CODE_TIMEOUT": "1", "RB_WF_MAX_TAKEOVERS": "1",
                       "RB_REDISPATCH_SECONDS": "1", "RB_WF_PENDING_ALARM": "2"}.items():
        monkeypatch.setenv(key, value)  # every process of the rig (and its CLI) reads them
    began = time.monotonic()
    for _ in range(3):
        rig.worker()
    rig.relay()
    store = rig.store
    engine.start(store, "wfa.forever", "forever", ["forever"], queue=rig.queue)
    engine.start(store, "wfa.hung", "hung", ["hung"], queue=rig.queue)
    orphan_queue = f"nobody-{rig.tag}"
    engine.start(store, "wfa.linear", "orphan", ["orphan"], queue=orphan_queue)

    def state(wid: str) -> str:
        return str(engine.get_workflow(store, wid)["state"])

    wait("the loop parked by the code deadline", lambda: state("forever") == "blocked", rig,
         timeout=60)
    row = engine.get_workflow(store, "forever", events=True)
    reason = row["block_reason"]
    assert reason.startswith("code_timeout:"), reason
    assert f"{CODE_TIMEOUT_SETTING}=1" in reason and "after seq 1" in reason
    assert "`reliable-beat workflows resume forever`" in reason
    assert [e["name"] for e in row["events"]] == ["before"]  # the code wrote nothing more
    assert row["takeovers"] == 0  # stopped inside its first advance: no worker was added

    wait("the hung advance parked after one takeover", lambda: state("hung") == "blocked",
         rig, timeout=60)
    row = engine.get_workflow(store, "hung")
    reason = row["block_reason"]
    assert reason.startswith("advance_expired:"), reason
    assert f"{MAX_TAKEOVERS_SETTING}=1" in reason and "taken over 1 times" in reason
    assert "`reliable-beat workflows resume hung`" in reason
    assert row["takeovers"] == 1 and row["leased_by"] is None

    # two workers still sit in hung's step; the third takes a workflow started now
    engine.start(store, "wfa.linear", "later", ["later"], queue=rig.queue)
    wait("a workflow started after the runaways completes",
         lambda: state("later") == "completed", rig, timeout=60)
    assert state("hung") == "blocked"  # the sweep did not hand it to the free worker

    out = rig.cli("status", "--check")
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout
    assert "!! BLOCKED WORKFLOWS: 2 workflows" in text and "forever" in text, text
    assert "runaway code parked (" in text and CODE_TIMEOUT_SETTING in text
    assert MAX_TAKEOVERS_SETTING in text
    assert "!! WORKFLOWS NOT STARTED: 1 workflows are pending more than 2 s" in text
    assert f"{orphan_queue}: 1" in text and "orphan" in text
    assert "workflows: 2 blocked, 1 completed, 1 pending" in text
    print(f"runaway acceptance: {time.monotonic() - began:.1f} s")
