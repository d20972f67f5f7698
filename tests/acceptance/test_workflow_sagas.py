"""Sagas on real processes: a compensation's undo survives SIGKILL (real ``celery worker``
solo pools, a real ``reliable-beat relay``, PostgreSQL, Redis; tests/apps/wf_app.py).

``wfa.saga``: three forward activities, the third fails permanently. The worker SIGKILLs
itself (a) inside the second compensation after its effect committed and before the ack,
(b) between two compensations, (c) inside the transaction of the advance that dispatches the
first compensation; a new worker is started after each kill (at most three kills). Each
compensation's effect exactly once, in reverse order; the workflow ``failed`` with the
original error.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.workflows import engine

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "apps"))
sys.path.insert(0, str(ROOT / "tests" / "acceptance"))
from test_workflow_crashes import Rig  # noqa: E402
from wf_app import meta, wf_effects  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(600)]

POINTS = {
    "a": "undo.after_commit.b",  # inside the second compensation, effect committed, no ack
    "b": "saga.between",  # a compensation completed, the next not yet dispatched
    "c": "saga.dispatch.in",  # the advance dispatching the first compensation (uncommitted)
}


@pytest.fixture
def saga_rig(pg_url: str, redis_url: str, pg_store: Store, tmp_path: Path) -> Iterator[Rig]:
    meta.create_all(pg_store.engine)
    r = Rig(pg_url, redis_url, pg_store, tmp_path)
    try:
        yield r
    finally:
        r.kill_all()


def undo_order(store: Store, order: str) -> list[str]:
    with store.engine.connect() as conn:
        return [k.rsplit(":", 1)[1] for (k,) in conn.execute(
            sa.select(wf_effects.c.key).where(wf_effects.c.kind == "undo",
                                              wf_effects.c.key.like(f"{order}:%"))
            .order_by(wf_effects.c.id))]


@pytest.mark.parametrize("case", sorted(POINTS))
def test_saga_undo_survives_sigkill(saga_rig: Rig, case: str) -> None:
    rig, point = saga_rig, POINTS[case]
    rig.relay()
    order = f"saga-{case}-{uuid.uuid4().hex[:6]}"
    engine.start(rig.store, "wfa.saga", order, [order], queue=rig.queue)
    kills = 0

    def worker() -> object:
        marker = rig.tmp / f"kill-{kills}"
        extra = ({"RB_WF_KILL_AT": point, "RB_WF_KILL_FILE": str(marker)} if kills < 3
                 else {})
        return rig.worker(**extra)

    proc = worker()
    deadline = time.monotonic() + 300
    state = ""
    while time.monotonic() < deadline:
        state = engine.get_workflow(rig.store, order)["state"]
        if state in ("completed", "failed", "cancelled", "blocked"):
            break
        if proc.poll() is not None:  # type: ignore[attr-defined]
            kills += 1
            proc = worker()
        time.sleep(0.2)
    else:
        raise AssertionError(f"{case}: not finished ({state})\n{rig.logs()}")
    row = engine.get_workflow(rig.store, order, events=True)
    assert row["state"] == "failed", (case, row, rig.logs())
    assert row["error"]["type"] == "ActivityError"
    assert "wfa.forward failed: dead" in row["error"]["message"]
    assert "step c refused (permanent)" in row["error"]["message"]
    kinds = [(e["kind"], e["name"], e["state"]) for e in row["events"]]
    assert kinds == [("compensation", "wfa.undo", "completed"),
                     ("activity", "wfa.forward", "completed")] * 2 + [
                    ("compensation", "wfa.undo", "completed"),
                    ("activity", "wfa.forward", "failed")], case
    assert undo_order(rig.store, order) == ["c", "b", "a"], case  # each once, reversed
    eff = rig.effects()
    assert eff[("forward", f"{order}:a")] == 1 and eff[("forward", f"{order}:b")] == 1
    assert ("forward", f"{order}:c") not in eff
    kills = len(list(rig.tmp.glob("kill-*")))
    print(f"SAGA {case} ({point}): {kills} SIGKILLs, undo c, b, a once each, failed with "
          "the original error")
    assert kills >= 1, f"{point} was never reached\n{rig.logs()}"


def test_dead_compensation_blocks_then_cli_compensate_finishes(saga_rig: Rig) -> None:
    """The second compensation dead-letters: the workflow is parked ``blocked`` with the
    first compensation done and the third not run; after the fix (a worker without the
    fault), ``reliable-beat workflows compensate ID`` runs the rest from data: undo c, b, a
    once each, the workflow ``failed`` with the original error."""
    rig = saga_rig
    rig.relay()
    order = f"saga-dead-{uuid.uuid4().hex[:6]}"
    engine.start(rig.store, "wfa.saga", order, [order], queue=rig.queue)
    broken = rig.worker(RB_WF_UNDO_FAIL="b")

    def state() -> str:
        return str(engine.get_workflow(rig.store, order)["state"])

    deadline = time.monotonic() + 180
    while state() != "blocked":
        assert time.monotonic() < deadline, rig.logs()
        time.sleep(0.3)
    row = engine.get_workflow(rig.store, order)
    assert row["block_reason"].startswith("compensation_failed: compensation wfa.undo")
    assert "undo b refused (permanent)" in row["block_reason"]
    assert undo_order(rig.store, order) == ["c"]
    broken.kill()
    broken.wait(timeout=10)
    rig.worker()  # the fix is deployed
    out = rig.cli("workflows", "compensate", order)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 compensations to run" in out.stdout and "requeued 1" in out.stdout
    deadline = time.monotonic() + 180
    while state() != "failed":
        assert time.monotonic() < deadline, rig.logs()
        time.sleep(0.3)
    row = engine.get_workflow(rig.store, order)
    assert "step c refused (permanent)" in row["error"]["message"]  # the original error
    assert undo_order(rig.store, order) == ["c", "b", "a"]


def test_cli_cancel_unwinds_a_parked_saga_and_terminate_runs_nothing(saga_rig: Rig) -> None:
    """Two sagas parked on a 24 h timer: `workflows cancel` interrupts the wait, the saga
    undoes its one forward step and the workflow ends cancelled; `--no-compensate` ends the
    other at once with nothing undone; cancelling an ended workflow is a no-op message."""
    rig = saga_rig
    rig.relay()
    rig.worker()
    coop, term = (f"hold-{k}-{uuid.uuid4().hex[:6]}" for k in ("coop", "term"))
    for wid in (coop, term):
        engine.start(rig.store, "wfa.saga_hold", wid, [wid], queue=rig.queue)
    deadline = time.monotonic() + 120
    while not all(len(engine.get_workflow(rig.store, w, events=True)["events"]) == 3
                  and engine.get_workflow(rig.store, w)["state"] == "waiting"
                  for w in (coop, term)):
        assert time.monotonic() < deadline, rig.logs()
        time.sleep(0.3)
    out = rig.cli("workflows", "cancel", coop)
    assert out.returncode == 0 and "cancel requested" in out.stdout, out.stdout + out.stderr
    out = rig.cli("workflows", "cancel", term, "--no-compensate")
    assert out.returncode == 0 and "terminated" in out.stdout, out.stdout + out.stderr
    deadline = time.monotonic() + 120
    while engine.get_workflow(rig.store, coop)["state"] != "cancelled":
        assert time.monotonic() < deadline, rig.logs()
        time.sleep(0.3)
    row = engine.get_workflow(rig.store, coop, events=True)
    assert [(e["kind"], e["state"]) for e in row["events"]] == [
        ("compensation", "completed"), ("activity", "completed"), ("timer", "scheduled"),
        ("cancel", "completed")]
    assert undo_order(rig.store, coop) == ["a"]
    time.sleep(2)  # the terminated one: nothing runs for it, now or later
    assert engine.get_workflow(rig.store, term)["state"] == "cancelled"
    assert undo_order(rig.store, term) == []
    out = rig.cli("workflows", "cancel", coop)
    assert out.returncode == 0 and "already ended cancelled" in out.stdout
