"""Runaway workflow code (:mod:`reliable_beat.workflows.runaway`), in-process on SQLite (and
MariaDB, ``-m mariadb``): the code deadline interrupts a loop that never reaches a durable
call and parks the workflow; an advance that cannot be interrupted (blocked inside one C
call) is taken over at most ``max_takeovers`` times, then parked by the claim or the sweep,
which stops re-sending it.

Before: the advance of ``while True: pass`` never returned, and each expiry of its lease
handed the workflow to one more worker (the sweep's wake), with no alarm.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox, workflows
from reliable_beat.outbox import db_now
from reliable_beat.workflows import WorkflowContext, engine, resume, workflow
from reliable_beat.workflows.runaway import CODE_TIMEOUT_SETTING, MAX_TAKEOVERS_SETTING

DEADLINE = timedelta(seconds=0.3)
#: Released at the end of a test: code waiting on it is "stuck in C" (a lock wait).
GATE = threading.Event()


@pytest.fixture
def store(wf_dialect_store: Store) -> Iterator[Store]:
    GATE.clear()
    try:
        yield wf_dialect_store
    finally:
        GATE.set()  # never leave a thread stuck


def _note(conn: sa.Connection, what: str) -> str:
    return what


def _define(name: str, fn: Callable[..., Any]) -> None:
    workflow(name=name)(fn)


def _advance(store: Store, wid: str, **kw: Any) -> str:
    kw.setdefault("code_timeout", DEADLINE)
    return engine.advance(store, wid, owner=kw.pop("owner", "w1"), **kw)


def _timed(store: Store, wid: str) -> tuple[str, float]:
    began = time.monotonic()
    outcome = _advance(store, wid)
    return outcome, time.monotonic() - began


def test_a_loop_without_durable_calls_is_interrupted_and_parked(store: Store) -> None:
    def spin(ctx: WorkflowContext) -> str:
        ctx.transaction(_note, "before", name="before")
        while True:
            pass

    _define("t.spin", spin)
    engine.start(store, "t.spin", "spin")
    outcome, took = _timed(store, "spin")
    assert outcome == "blocked" and took < 10
    row = engine.get_workflow(store, "spin", events=True)
    assert row["state"] == "blocked" and row["leased_by"] is None
    reason = row["block_reason"]
    assert reason.startswith("code_timeout: the workflow code ran 0.")
    assert "after seq 1 without reaching a durable call" in reason
    assert f"{CODE_TIMEOUT_SETTING}=0.3" in reason
    assert "`reliable-beat workflows resume spin`" in reason
    assert [e["name"] for e in row["events"]] == ["before"]
    # the code is fixed and deployed: resume replays it to the end
    _define("t.spin", lambda ctx: ctx.transaction(_note, "before", name="before") + "!")
    resume(store, "spin")
    assert _advance(store, "spin") == "completed"
    assert engine.get_workflow(store, "spin")["result"] == "before!"


def _swallow_and_return(ctx: WorkflowContext) -> str:
    try:
        while True:
            pass
    except BaseException:
        pass
    return "went on"


def _swallow_and_raise(ctx: WorkflowContext) -> str:
    try:
        while True:
            pass
    except BaseException as exc:
        raise ValueError("mine") from exc


def _swallow_then_durable_call(ctx: WorkflowContext) -> str:
    try:
        while True:
            pass
    except BaseException:
        pass
    try:  # noqa: SIM105 - a bare swallow around a durable call is the point
        ctx.transaction(_note, "after", name="after")
    except BaseException:
        pass
    return "went on"


@pytest.mark.parametrize("fn", [_swallow_and_return, _swallow_and_raise,
                                _swallow_then_durable_call])
def test_code_that_swallows_the_interruption_is_parked_all_the_same(
    store: Store, fn: Callable[..., Any]
) -> None:
    """Neither a result, nor a failure, nor a durable call: the deadline passed."""
    _define("t.swallow", fn)
    engine.start(store, "t.swallow", "swallow")
    outcome, took = _timed(store, "swallow")
    assert outcome == "blocked" and took < 10
    row = engine.get_workflow(store, "swallow", events=True)
    assert row["block_reason"].startswith("code_timeout: the workflow code ran")
    assert "from its start" in row["block_reason"]
    assert row["events"] == [] and row["result"] is None and row["error"] is None


def _slow_step() -> str:
    time.sleep(0.5)
    return "slow step"


def _slow_tx(conn: sa.Connection) -> str:
    time.sleep(0.5)
    return "slow transaction"


def test_the_deadline_counts_the_code_between_durable_calls_only(store: Store) -> None:
    """Steps' and transactions' bodies run inside durable calls (not counted), and the clock
    starts again after each call: 1.8 s in all, no gap of the code above 0.15 s."""
    def patient(ctx: WorkflowContext) -> list[str]:
        out = []
        for _ in range(2):
            out.append(ctx.step(_slow_step, name="slow"))
            time.sleep(0.15)
            out.append(ctx.transaction(_slow_tx, name="slow_tx"))
            time.sleep(0.15)
        return out

    _define("t.patient", patient)
    engine.start(store, "t.patient", "patient")
    assert _advance(store, "patient") == "completed"
    assert engine.get_workflow(store, "patient")["result"] == [
        "slow step", "slow transaction"] * 2


def _stuck_in_c(ctx: WorkflowContext) -> str:
    ctx.transaction(_note, "before", name="before")
    GATE.wait(60)  # one C call (a lock wait): the deadline's exception waits for it
    return "released"


def _expired(store: Store, wid: str, fence: int) -> bool:
    row = engine.get_workflow(store, wid)
    with store.connect() as conn:
        now = db_now(conn)
    return bool(row["fence_token"] == fence and row["lease_expires_at"] is not None
                and row["lease_expires_at"] < now)


def _until(what: str, cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _wakes(store: Store, wid: str) -> int:
    with store.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(outbox).where(
            outbox.c.message_id.like(f"%{wid}%"))).scalar_one())


@pytest.mark.parametrize("parked_by", ["sweep", "claim"])
def test_an_advance_that_cannot_be_interrupted_is_parked_after_max_takeovers(
    store: Store, parked_by: str
) -> None:
    _define("t.stuck", _stuck_in_c)
    engine.start(store, "t.stuck", "stuck")
    outcomes: list[str] = []
    limits: dict[str, Any] = {"lease": timedelta(seconds=0.3), "max_takeovers": 1}

    def worker(owner: str) -> threading.Thread:
        t = threading.Thread(target=lambda: outcomes.append(
            _advance(store, "stuck", owner=owner, **limits)), daemon=True)
        t.start()
        return t

    first = worker("w1")
    _until("the first advance's lease expires", lambda: _expired(store, "stuck", 1))
    # one expiry: the sweep hands the workflow to one more worker (the takeover)
    assert engine.redispatch_workflows(store, older_than=timedelta(0), max_takeovers=1) == 1
    second = worker("w2")
    _until("the takeover's lease expires", lambda: _expired(store, "stuck", 2))
    assert engine.get_workflow(store, "stuck")["takeovers"] == 1
    health = engine.workflow_health(store, grace=timedelta(seconds=60), max_takeovers=1)
    assert health["advances_expiring"]["count"] == 1
    alarm, = [p for p in health["problems"] if p.startswith("WORKFLOW ADVANCES EXPIRING")]
    assert "stuck (taken over 1 times, held by w2)" in alarm and MAX_TAKEOVERS_SETTING in alarm

    wakes = _wakes(store, "stuck")
    if parked_by == "sweep":  # the second expiry: parked, no wake, no worker
        assert engine.redispatch_workflows(store, older_than=timedelta(0),
                                           max_takeovers=1) == 0
    else:  # a wake that was on its way (a redelivery): the claim parks it, runs nothing
        assert _advance(store, "stuck", owner="w3", **limits) == "blocked"
    row = engine.get_workflow(store, "stuck", events=True)
    assert row["state"] == "blocked" and row["leased_by"] is None
    reason = row["block_reason"]
    assert reason.startswith("advance_expired: the advance's lease expired 2 times in a row")
    assert "taken over 1 times, last by w2" in reason
    assert f"{MAX_TAKEOVERS_SETTING}=1" in reason and "restart them" in reason
    assert "`reliable-beat workflows resume stuck`" in reason
    assert engine.redispatch_workflows(store, older_than=timedelta(0), max_takeovers=1) == 0
    assert _wakes(store, "stuck") == wakes  # the sweep sends it to nobody
    health = engine.workflow_health(store, grace=timedelta(seconds=60), max_takeovers=1)
    blocked, = [p for p in health["problems"] if p.startswith("BLOCKED WORKFLOWS")]
    assert "runaway code parked (stuck)" in blocked
    assert health["advances_expiring"]["count"] == 0

    # the C call returns at last: the stale advances write nothing (the park bumped the fence)
    GATE.set()
    first.join(10)
    second.join(10)
    assert sorted(outcomes) == ["fenced", "fenced"]
    row = engine.get_workflow(store, "stuck", events=True)
    assert row["state"] == "blocked" and [e["name"] for e in row["events"]] == ["before"]
    # a person fixed the cause and resumes it: the next claim counts from 0 again
    resume(store, "stuck")
    assert _advance(store, "stuck", **limits) == "completed"
    assert engine.get_workflow(store, "stuck")["result"] == "released"
    assert engine.get_workflow(store, "stuck")["takeovers"] == 0


def test_a_finished_advance_resets_the_takeover_count(store: Store) -> None:
    """A takeover that finishes (the worker had died once) is no runaway: the count starts
    again at the next claim, so crashes spread over a long workflow never park it."""
    def two_steps(ctx: WorkflowContext) -> str:
        ctx.transaction(_note, "a", name="a")
        ctx.wait_signal("go")
        return ctx.transaction(_note, "b", name="b")

    _define("t.two", two_steps)
    engine.start(store, "t.two", "two")
    with store.begin() as conn:  # an advance that died holding the lease, twice before
        conn.execute(sa.update(workflows).where(workflows.c.workflow_id == "two").values(
            state="running", takeovers=1, leased_by="dead",
            lease_expires_at=db_now(conn) - timedelta(seconds=5)))
    assert _advance(store, "two", max_takeovers=2) == "waiting"
    assert engine.get_workflow(store, "two")["takeovers"] == 2  # taken over, then released
    engine.signal(store, "two", "go", 1)
    assert _advance(store, "two", max_takeovers=2) == "completed"
    assert engine.get_workflow(store, "two")["takeovers"] == 0


def _swallow_until_released(ctx: WorkflowContext) -> str:
    while not GATE.is_set():
        try:
            while not GATE.is_set():
                pass
        except BaseException:
            pass
    return "released"


def _wait_in_c(ctx: WorkflowContext) -> str:
    GATE.wait()  # a lock wait: the interruption is not delivered until it returns
    return "released"


@pytest.mark.parametrize("fn", [_swallow_until_released, _wait_in_c],
                         ids=["swallows_for_ever", "stuck_in_a_wait"])
def test_code_that_stays_past_its_deadline_is_parked_while_it_still_runs(
    store: Store, fn: Callable[..., Any]
) -> None:
    """The advance never returns on its own: the watchdog parks the workflow itself, fenced,
    long before its lease expires, so the sweep hands it to no other worker (a pool of
    three was all taken by one such workflow while it waited for takeovers)."""
    name = f"t.stuck.{fn.__name__}"
    _define(name, fn)
    wid = f"stuck-{fn.__name__}"
    engine.start(store, name, wid)
    result: list[str] = []
    runner = threading.Thread(target=lambda: result.append(
        _advance(store, wid, lease=timedelta(seconds=120))), daemon=True)
    runner.start()
    deadline = time.monotonic() + 15
    row = engine.get_workflow(store, wid)
    while time.monotonic() < deadline and row["state"] != "blocked":
        time.sleep(0.1)
        row = engine.get_workflow(store, wid)
    assert row["state"] == "blocked", row
    assert runner.is_alive(), "parked while the advance still runs, not after it returned"
    assert row["block_reason"].startswith("code_timeout:")
    assert "interruptions" in row["block_reason"] and f"workflows resume {wid}" in (
        row["block_reason"])
    # the sweep re-sends nothing for it
    with store.engine.connect() as conn:
        wakes_before = conn.execute(sa.select(sa.func.count()).select_from(outbox)).scalar()
    engine.redispatch_workflows(store, older_than=timedelta(0))
    with store.engine.connect() as conn:
        wakes_after = conn.execute(sa.select(sa.func.count()).select_from(outbox)).scalar()
    assert wakes_after == wakes_before
    GATE.set()
    runner.join(10)
    assert not runner.is_alive()
    assert result == ["fenced"], result  # the stuck advance wrote nothing when it returned
    assert engine.get_workflow(store, wid)["state"] == "blocked"
