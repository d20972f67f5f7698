"""The fault harness's workflow verdict (``Harness._check_workflows``) on hand-made ledgers.

SQLite, no processes: each case writes the rows a run would leave (workflows, their keyed
effect rows, signals, dead letters) and checks the verdict passes a correct ledger and fails,
naming the problem, on each kind of violation the workflow shapes exist to catch. The real
run is ``test_faults_smoke.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, delete, insert, update
from sqlalchemy.engine import Engine

from harness import faultcore
from harness.faultcore import wf_effects, wf_fails
from harness.faults import Harness, Options
from reliable_beat.db import tables as t

T0 = datetime(2026, 12, 1, 22, 0, tzinfo=timezone.utc)


def _ids(failing: bool, n: int) -> list[str]:
    """``n`` saga ids whose fwd3 fails (or not) by the default fraction."""
    out = [f"wfsaga@2026-12-01T22:00:{i:02d}Z" for i in range(200)]
    return [w for w in out if wf_fails(w, Options().wf_fail_every) == failing][:n]


OK_SAGA, = _ids(False, 1)
BAD_SAGA, = _ids(True, 1)
TIMER, SIGNAL, POISON = "wftimer@x", "direct-signal-0", "poison0:wf-unknown"


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    eng = create_engine(f"sqlite:///{tmp_path / 'verdict.sqlite3'}")
    t.metadata.create_all(eng)
    faultcore.metadata.create_all(eng)
    pk = itertools.count(1)
    with eng.begin() as conn:
        def wf(wid: str, name: str, state: str, **kw: Any) -> int:
            n = next(pk)
            conn.execute(insert(t.workflows).values(
                id=n, workflow_id=wid, name=name, run_no=1, state=state, args=[], kwargs={},
                random_seed=0, fence_token=1, wake_seq=1, claimed_wake_seq=1, history_len=0,
                history_bytes=0, advances=1, created_at=T0, updated_at=T0, **kw))
            return n

        wf(OK_SAGA, "faults.saga", "completed", entry_name="wfsaga")
        wf(BAD_SAGA, "faults.saga", "failed", entry_name="wfsaga",
           error={"type": "ActivityError",
                  "message": f"injected permanent failure of {BAD_SAGA} fwd3"})
        wf(TIMER, "faults.timer", "completed", entry_name="wftimer")
        sig = wf(SIGNAL, "faults.signal", "completed")
        wf(POISON, "faults.no_such_workflow", "blocked", block_reason="unknown workflow")
        at = itertools.count()
        for wid, action in [(OK_SAGA, "fwd1"), (OK_SAGA, "fwd2"), (OK_SAGA, "fwd3"),
                            (BAD_SAGA, "fwd1"), (BAD_SAGA, "fwd2"), (BAD_SAGA, "comp3"),
                            (BAD_SAGA, "comp2"), (BAD_SAGA, "comp1"), (TIMER, "before"),
                            (TIMER, "after"), (SIGNAL, "signalled")]:
            # the timer's "after" lands 4 s after its "before" (timer: 3 s)
            conn.execute(insert(wf_effects).values(
                workflow_id=wid, action=action, run_key=f"wf:{wid}/1#{next(at)}",
                fence_token=1, attempt=1, pid=1,
                created_at=T0 + timedelta(seconds=4 * (action == "after"))))
        conn.execute(insert(t.workflow_signals).values(
            workflow_pk=sig, name="go", payload={}, dedup_key=f"go:{SIGNAL}",
            consumed_run_no=1, consumed_seq=0, created_at=T0))
        conn.execute(insert(t.dead_letters).values(
            kind="run", key=f"wf:{BAD_SAGA}/1#5", payload={}, reason="permanent",
            created_at=T0))
    return eng


def _verdict(engine: Engine) -> tuple[list[str], dict[str, Any]]:
    h = Harness(Options())
    h.engine = engine
    h.t_start = T0
    h.wf_poisoned = [POISON]
    h._check_workflows()
    return h.result.failures, h.result.stats["wf"]


def test_a_correct_ledger_passes(engine: Engine) -> None:
    failures, wf = _verdict(engine)
    assert failures == []
    assert (wf["started"], wf["completed"], wf["compensated"], wf["blocked"],
            wf["injected"], wf["duplicated"], wf["missing"]) == (4, 3, 1, 1, 1, 0, 0)


def _dup_fwd2(conn: Any) -> None:
    conn.execute(insert(wf_effects).values(workflow_id=OK_SAGA, action="fwd2", run_key="k",
                                           fence_token=2, attempt=2, pid=2))


def _skip_comp1(conn: Any) -> None:
    conn.execute(delete(wf_effects).where(wf_effects.c.workflow_id == BAD_SAGA,
                                          wf_effects.c.action == "comp1"))


def _comps_in_order(conn: Any) -> None:  # comp1 ran first: not reversed
    conn.execute(delete(wf_effects).where(wf_effects.c.action == "comp1"))
    conn.execute(delete(wf_effects).where(wf_effects.c.action.in_(("comp3", "comp2"))))
    for a in ("comp1", "comp2", "comp3"):
        conn.execute(insert(wf_effects).values(workflow_id=BAD_SAGA, action=a, run_key=a,
                                               fence_token=1, attempt=1, pid=1))


def _left_waiting(conn: Any) -> None:
    conn.execute(update(t.workflows).where(t.workflows.c.workflow_id == TIMER)
                 .values(state="waiting"))


def _blocked_uninjected(conn: Any) -> None:
    conn.execute(update(t.workflows).where(t.workflows.c.workflow_id == OK_SAGA)
                 .values(state="blocked", block_reason="non-determinism"))


def _timer_early(conn: Any) -> None:
    conn.execute(update(wf_effects).where(wf_effects.c.action == "after")
                 .values(created_at=T0 + timedelta(seconds=1)))


def _signal_twice(conn: Any) -> None:
    conn.execute(insert(t.workflow_signals).values(
        workflow_pk=4, name="go", payload={}, dedup_key=None, created_at=T0))


def _saga_not_unwound(conn: Any) -> None:  # the failing one ended completed
    conn.execute(update(t.workflows).where(t.workflows.c.workflow_id == BAD_SAGA)
                 .values(state="completed"))


def _comp_on_completed(conn: Any) -> None:
    conn.execute(insert(wf_effects).values(workflow_id=OK_SAGA, action="comp1", run_key="c",
                                           fence_token=1, attempt=1, pid=1))


def _dead_letter_uninjected(conn: Any) -> None:
    conn.execute(insert(t.dead_letters).values(
        kind="run", key=f"wf:{OK_SAGA}/1#1", payload={}, reason="exhausted", created_at=T0))


@pytest.mark.parametrize(("break_it", "names"), [
    (_dup_fwd2, "workflow effects duplicated"),
    (_skip_comp1, "workflow effects missing"),
    (_comps_in_order, "compensations did not run in reverse order"),
    (_left_waiting, "workflows left pending/running/waiting"),
    (_blocked_uninjected, "workflows blocked where nothing was injected"),
    (_timer_early, "timers that fired early"),
    (_signal_twice, "without exactly one stored, consumed signal"),
    (_saga_not_unwound, "workflows that ended wrong"),
    (_comp_on_completed, "workflow effects that should not exist"),
    (_dead_letter_uninjected, "workflow dead letters where no failure was injected"),
])
def test_each_violation_fails_the_run(engine: Engine, break_it: Callable[[Any], None],
                                      names: str) -> None:
    with engine.begin() as conn:
        break_it(conn)
    failures, _ = _verdict(engine)
    assert any(names in f for f in failures), failures


def test_workflows_of_an_earlier_run_are_not_judged(engine: Engine) -> None:
    """``--postgres-url``: the database may hold an earlier run's workflows (their effect rows
    were dropped with the table); only this run's, created since its start, are judged."""
    with engine.begin() as conn:
        conn.execute(insert(t.workflows).values(
            workflow_id="wfsaga@2026-11-30T00:00:00Z", name="faults.saga", run_no=1,
            state="waiting", args=[], kwargs={}, random_seed=0, fence_token=1, wake_seq=1,
            claimed_wake_seq=1, history_len=0, history_bytes=0, advances=1,
            created_at=T0 - timedelta(days=1), updated_at=T0 - timedelta(days=1)))
    failures, wf = _verdict(engine)
    assert failures == [] and wf["started"] == 4
