"""Sagas and cancellation on SQLite with the in-process driver (tests/apps/wf_driver.py).

Compensations recorded before their steps, run in reverse as keyed activities, each effect
once through a crash at every crash point; a dead-lettered compensation blocks the workflow
and ``compensate`` finishes it from data; the late-success race; cooperative cancel,
terminate, cancel of a finished or blocked workflow.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat.celery.task import IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox
from reliable_beat.workflows import (
    WorkflowCancelled,
    WorkflowConflict,
    WorkflowContext,
    WorkflowFailed,
    WorkflowUsageError,
    cancel,
    compensate,
    engine,
    workflow,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
from wf_driver import CrashPlan, Driver, events

effects = sa.Table(
    "saga_effects", sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("kind", sa.String(20)), sa.Column("key", sa.String(200)),
    sa.Column("label", sa.String(200)),
)
BROKEN: set[str] = set()  # labels whose compensation fails permanently (until removed)


def make_app(app: Celery) -> Celery:
    """Register the module's tasks on ``app`` (the ``wf_celery_app`` fixture's)."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name="saga.do")
    def do(self: IdempotentTask, label: str, fail: bool = False) -> str:
        if fail:
            raise ValueError(f"{label} refused")
        with self.transaction() as tx:
            tx.execute(effects.insert().values(kind="do", key=self.idempotency_key,
                                               label=label))
            self.returns(label)
        return label

    @app.task(shared=False, base=IdempotentTask, bind=True, name="saga.undo")
    def undo(self: IdempotentTask, label: str) -> str:
        """Safe to repeat and tolerant of "nothing to undo": undoes what exists."""
        if label in BROKEN:
            raise ValueError(f"cannot undo {label} now")
        with self.transaction() as tx:
            done = tx.execute(sa.select(sa.func.count()).select_from(effects)
                              .where(effects.c.kind == "do", effects.c.label == label)
                              ).scalar_one()
            tx.execute(effects.insert().values(kind="undo", key=self.idempotency_key,
                                               label=label if done else f"{label}:nothing"))
            self.returns(f"undone {label}" if done else f"nothing to undo for {label}")
        return "ignored"

    return app


def three_steps(ctx: WorkflowContext, order: str) -> str:
    with ctx.saga() as saga:
        saga.compensate("saga.undo", f"{order}:a")
        ctx.activity("saga.do", f"{order}:a")
        saga.compensate("saga.undo", f"{order}:b")
        ctx.activity("saga.do", f"{order}:b")
        saga.compensate("saga.undo", f"{order}:c")
        ctx.activity("saga.do", f"{order}:c", True)  # fails permanently
    return "unreachable"


def sleepy(ctx: WorkflowContext, order: str) -> str:
    with ctx.saga() as saga:
        saga.compensate("saga.undo", f"{order}:a")
        ctx.activity("saga.do", f"{order}:a")
        ctx.sleep(timedelta(hours=24))
        saga.compensate("saga.undo", f"{order}:b")
        ctx.activity("saga.do", f"{order}:b")
    return "done"


def ok_saga(ctx: WorkflowContext, order: str) -> str:
    with ctx.saga() as saga:
        saga.compensate("saga.undo", f"{order}:a")
        ctx.activity("saga.do", f"{order}:a")
    ctx.sleep(timedelta(hours=1))
    return "ok"


@pytest.fixture
def store(wf_dialect_store: Store) -> Store:
    """SQLite, and MariaDB (no UPDATE ... RETURNING there)."""
    effects.create(wf_dialect_store.engine)
    BROKEN.clear()
    workflow(name="t.three")(three_steps)
    workflow(name="t.sleepy")(sleepy)
    workflow(name="t.ok")(ok_saga)
    return wf_dialect_store


@pytest.fixture
def app(store: Store, wf_celery_app: Callable[[str, Store], Celery]) -> Celery:
    return make_app(wf_celery_app("saga", store))


def drain(driver: Driver, limit: int = 500) -> None:
    """Deliver what is due within 5 s (a 24 h timer is left pending, not waited for)."""
    for _ in range(limit):
        row, wait = driver._due()
        if row is None and (wait is None or wait > 5):
            return
        driver.step()
    raise AssertionError("driver did not settle")


def rows(store: Store, kind: str | None = None) -> list[tuple[str, str]]:
    q = sa.select(effects.c.kind, effects.c.label).order_by(effects.c.id)
    if kind:
        q = q.where(effects.c.kind == kind)
    with store.connect() as conn:
        return [(k, lbl) for k, lbl in conn.execute(q).all()]


def shape(store: Store, wid: str) -> list[tuple[Any, ...]]:
    return [(e[1], e[3]) for e in events(store, wid)]


EXPECTED_THREE = [("compensation", "completed"), ("activity", "completed"),
                  ("compensation", "completed"), ("activity", "completed"),
                  ("compensation", "completed"), ("activity", "failed")]


def test_failure_runs_compensations_in_reverse_once_and_fails_with_the_error(
    app: Celery, store: Store
) -> None:
    handle = engine.start(store, "t.three", "o1", ["o1"])
    drain(Driver(store, app))
    with pytest.raises(WorkflowFailed) as info:
        handle.result(timeout=1)
    assert info.value.error["type"] == "ActivityError"
    assert "saga.do failed: dead" in info.value.error["message"]
    assert shape(store, "o1") == EXPECTED_THREE
    # c never happened: its undo found nothing (tolerated); then b, then a
    assert rows(store, "undo") == [("undo", "o1:c:nothing"), ("undo", "o1:b"),
                                   ("undo", "o1:a")]
    assert rows(store, "do") == [("do", "o1:a"), ("do", "o1:b")]
    # each compensation ran under the key of its own registration (its seq)
    with store.connect() as conn:
        keys = [k for (k,) in conn.execute(sa.select(effects.c.key)
                                           .where(effects.c.kind == "undo")
                                           .order_by(effects.c.id))]
    assert keys == ["wf:o1/1#5", "wf:o1/1#3", "wf:o1/1#1"]


def test_crash_at_every_hit_gives_the_crash_free_outcome(app: Celery, store: Store) -> None:
    """A simulated SIGKILL (rollback + redelivery + lease expiry) at the n-th crash point
    reached (every hit with RB_WF_EXAMPLES set, else every saga point's hits and the first
    hit of each other point): each compensation's effect once, reverse order, the
    workflow failed with the original error and the crash-free history."""
    hits: list[str] = []
    engine.crash_hook = hits.append
    engine.start(store, "t.three", "ref", ["ref"])
    drain(Driver(store, app))
    engine.crash_hook = None
    total = len(hits)
    assert {"saga.dispatch.in", "saga.between", "saga.dispatch.after"} <= set(hits)
    # every hit of the saga's own points, the first hit of every other point (full: all)
    first = {name: hits.index(name) + 1 for name in hits}
    chosen = (range(1, total + 1) if os.environ.get("RB_WF_EXAMPLES") else
              sorted({n for n in range(1, total + 1) if hits[n - 1].startswith("saga.")}
                     | set(first.values())))
    crashed_at: set[str] = set()
    for n in chosen:
        wid = f"c{n}"
        plan = CrashPlan([n])
        engine.crash_hook = plan
        engine.start(store, "t.three", wid, [wid])
        drain(Driver(store, app))
        engine.crash_hook = None
        crashed_at.update(plan.crashed)
        row = engine.get_workflow(store, wid)
        assert row["state"] == "failed", (n, plan.crashed, row)
        assert "saga.do failed: dead" in row["error"]["message"]
        assert shape(store, wid) == EXPECTED_THREE, (n, plan.crashed)
        undo = [lbl for k, lbl in rows(store, "undo") if lbl.startswith(f"{wid}:")]
        assert undo == [f"{wid}:c:nothing", f"{wid}:b", f"{wid}:a"], (n, plan.crashed)
    assert {"saga.dispatch.in", "saga.between"} <= crashed_at
    print(f"{len(chosen)} of {total} crash-point hits crashed one at a time "
          f"({len(crashed_at)} distinct points): each compensation once, in reverse")


def test_dead_compensation_blocks_and_compensate_finishes_from_data(
    app: Celery, store: Store
) -> None:
    BROKEN.add("o2:b")
    handle = engine.start(store, "t.three", "o2", ["o2"])
    driver = Driver(store, app)
    drain(driver)
    row = handle.status()
    assert row["state"] == "blocked"
    assert row["block_reason"].startswith("compensation_failed: compensation saga.undo (seq 3")
    assert "workflows compensate o2" in row["block_reason"]
    # status's advice for it is `compensate`, not only `resume` (which re-blocks it)
    problems = engine.workflow_health(store, grace=timedelta(minutes=5))["problems"]
    assert "failed compensation (o2): fix it, then `reliable-beat workflows compensate ID`" in \
        problems[0], problems
    assert rows(store, "undo") == [("undo", "o2:c:nothing")]  # a is not run past b
    with pytest.raises(WorkflowConflict, match=r"not blocked: .* use `workflows cancel ID`"):
        _compensate_live(store, app)
    BROKEN.clear()  # the cause is fixed
    engine.register(engine.WorkflowDefinition(name="t.three", fn=lambda ctx, o: 1 / 0))
    out = compensate(store, "o2")  # no code runs: the new code would not even replay
    assert [p["seq"] for p in out["pending"]] == [3, 1]
    assert out["requeued"] == ["wf:o2/1#3"]
    drain(driver)
    row = handle.status()
    assert row["state"] == "failed", (row, events(store, "o2"))
    assert "saga.do failed: dead" in row["error"]["message"]  # the original error kept
    assert rows(store, "undo") == [("undo", "o2:c:nothing"), ("undo", "o2:b"),
                                   ("undo", "o2:a")]
    workflow(name="t.three")(three_steps)


def _compensate_live(store: Store, app: Celery) -> None:
    engine.start(store, "t.sleepy", "live", ["live"])
    drain(Driver(store, app))
    compensate(store, "live")


def test_successful_block_releases_its_compensations(app: Celery, store: Store) -> None:
    engine.start(store, "t.ok", "ok1", ["ok1"])
    drain(Driver(store, app))
    assert shape(store, "ok1") == [("compensation", "released"), ("activity", "completed"),
                                   ("timer", "scheduled")]
    out = cancel(store, "ok1")  # cooperative: no open saga, nothing to undo
    assert out["changed"]
    drain(Driver(store, app))
    row = engine.get_workflow(store, "ok1")
    assert row["state"] == "cancelled" and row["error"]["type"] == "WorkflowCancelled"
    assert rows(store, "undo") == []  # a released compensation never runs


def test_cancel_interrupts_a_wait_and_the_saga_unwinds(app: Celery, store: Store) -> None:
    handle = engine.start(store, "t.sleepy", "s1", ["s1"])
    driver = Driver(store, app)
    drain(driver)  # parked on the 24 h timer
    assert handle.status()["state"] == "waiting"
    out = cancel(store, "s1")
    assert out["changed"] and "WorkflowCancelled" in out["message"]
    drain(driver)
    with pytest.raises(WorkflowFailed) as info:
        handle.result(timeout=1)
    assert info.value.state == "cancelled"
    assert shape(store, "s1") == [("compensation", "completed"), ("activity", "completed"),
                                  ("timer", "scheduled"), ("cancel", "completed")]
    assert rows(store, "undo") == [("undo", "s1:a")]
    again = cancel(store, "s1")
    assert not again["changed"] and "already ended cancelled" in again["message"]


def test_late_success_race_the_effect_ends_undone(app: Celery, store: Store) -> None:
    """The cancel lands while the authorization is still in flight (its message not yet
    run): the unwind waits for it to settle, then its compensation undoes it."""
    handle = engine.start(store, "t.sleepy", "r1", ["r1"])
    driver = Driver(store, app)
    with store.connect() as conn:  # the start wake
        wake = conn.execute(sa.select(outbox).where(outbox.c.state == "pending")).one()
    driver.deliver(wake)
    _sent(store, wake.id)
    cancel(store, "r1")
    with store.connect() as conn:
        pending = conn.execute(sa.select(outbox).where(outbox.c.state == "pending")
                               .order_by(outbox.c.id)).all()
    act = next(r for r in pending if r.payload["task"] == "saga.do")
    for r in pending:  # every advance first: the authorization has not landed yet
        if r.payload["task"] == engine.ADVANCE_TASK:
            driver.deliver(r)
            _sent(store, r.id)
    assert rows(store) == []  # nothing undone before the step it undoes has landed
    assert handle.status()["state"] == "waiting"
    driver.deliver(act)  # the late success
    _sent(store, act.id)
    drain(driver)
    assert rows(store) == [("do", "r1:a"), ("undo", "r1:a")]
    assert handle.status()["state"] == "cancelled"


def _sent(store: Store, outbox_id: int) -> None:
    with store.begin() as conn:
        conn.execute(sa.update(outbox).where(outbox.c.id == outbox_id)
                     .values(state="sent", sent_at=sa.func.current_timestamp()))


def test_terminate_runs_nothing_and_fences_the_running_advance(app: Celery,
                                                               store: Store) -> None:
    engine.start(store, "t.sleepy", "t1", ["t1"])
    driver = Driver(store, app)
    drain(driver)
    before = engine.get_workflow(store, "t1")
    out = cancel(store, "t1", compensate=False)
    assert out["changed"] and out["state"] == "cancelled"
    row = engine.get_workflow(store, "t1")
    assert row["state"] == "cancelled" and row["error"]["type"] == "WorkflowTerminated"
    assert row["fence_token"] == before["fence_token"] + 1
    drain(driver)
    assert rows(store, "undo") == []
    with pytest.raises(engine.WorkflowNotFound):
        cancel(store, "nope")


def test_cancel_of_a_blocked_workflow_compensates_from_data(app: Celery,
                                                            store: Store) -> None:
    engine.start(store, "t.sleepy", "b1", ["b1"])
    driver = Driver(store, app)
    drain(driver)
    engine.register(engine.WorkflowDefinition(name="t.sleepy", fn=lambda ctx, o: ctx.now()))
    with store.begin() as conn:  # wake it: the reordered code blocks it
        engine.add_wake(conn, "b1", None, "poke")
    drain(driver)
    assert engine.get_workflow(store, "b1")["state"] == "blocked"
    out = cancel(store, "b1")
    assert "from data" in out["message"]
    assert "from data" in cancel(store, "b1")["message"]  # again: still from data
    drain(driver)
    row = engine.get_workflow(store, "b1")
    assert row["state"] == "cancelled", row
    assert rows(store, "undo") == [("undo", "b1:a")]
    workflow(name="t.sleepy")(sleepy)


def test_control_flow_passes_through_the_saga_and_misuse_is_refused(app: Celery,
                                                                    store: Store) -> None:
    seen: list[str] = []

    def outside(ctx: WorkflowContext) -> None:
        with ctx.saga() as saga:
            pass
        try:
            saga.compensate("saga.undo", "x")
        except WorkflowUsageError as exc:
            seen.append(str(exc))
        try:
            with ctx.saga() as s2:
                s2.compensate(len, "x")
        except WorkflowUsageError as exc:
            seen.append(str(exc))
        with ctx.saga() as s3:  # Suspend (a BaseException) leaves the block: no unwind
            s3.compensate("saga.undo", "y")
            ctx.sleep(timedelta(hours=1))

    workflow(name="t.outside")(outside)
    engine.start(store, "t.outside", "u1")
    drain(Driver(store, app))
    assert "outside its `with ctx.saga()` block" in seen[0]
    assert "not an IdempotentTask" in seen[1]
    assert shape(store, "u1") == [("compensation", "registered"), ("timer", "scheduled")]
    assert rows(store) == []


def test_cancelled_is_raised_into_the_code_once(app: Celery, store: Store) -> None:
    def catches(ctx: WorkflowContext) -> str:
        try:
            ctx.sleep(timedelta(hours=1))
        except WorkflowCancelled:
            ctx.activity("saga.do", "cleanup")  # more durable calls are fine
            return "cleaned up"
        return "slept"

    workflow(name="t.catches")(catches)
    h = engine.start(store, "t.catches", "k1")
    driver = Driver(store, app)
    drain(driver)
    cancel(store, "k1")
    drain(driver)
    assert h.result(timeout=1) == "cleaned up"
    assert shape(store, "k1") == [("timer", "scheduled"), ("cancel", "completed"),
                                  ("activity", "completed")]


def test_cli_cancel_and_compensate(app: Celery, store: Store) -> None:
    from click.testing import CliRunner

    from reliable_beat.celery.commands import reliable_beat

    def cli(*args: str) -> Any:
        return CliRunner().invoke(reliable_beat, ["--database-url", store.url, *args])

    engine.start(store, "t.sleepy", "cli1", ["cli1"])
    engine.start(store, "t.sleepy", "cli2", ["cli2"])
    drain(Driver(store, app))
    out = cli("workflows", "compensate", "cli1")
    assert out.exit_code == 1 and "is waiting, not blocked" in out.output
    out = cli("workflows", "cancel", "cli1")
    assert out.exit_code == 0, out.output
    assert "cli1: cancel requested" in out.output
    out = cli("workflows", "cancel", "cli2", "--no-compensate", "--json")
    assert out.exit_code == 0 and '"state": "cancelled"' in out.output
    drain(Driver(store, app))
    out = cli("workflows", "cancel", "cli1")
    assert out.exit_code == 0
    assert "already ended cancelled: nothing to cancel, nothing changed" in out.output
    out = cli("workflows", "list", "--state", "cancelled", "--json")
    assert "cli1" in out.output and "cli2" in out.output
    assert rows(store, "undo") == [("undo", "cli1:a")]
    out = cli("workflows", "cancel", "nope")
    assert out.exit_code == 1 and "no workflow 'nope'" in out.output
    # a listing cut at --limit says how many there are (a fresh user missed the one blocked
    # workflow of 1,002 in the default 50)
    out = cli("workflows", "list", "--limit", "1")
    assert "showing 1 of 2 (newest first; --limit N for more)" in out.output, out.output
    out = cli("workflows", "list")
    assert "showing" not in out.output, out.output


def test_cancel_and_unwind_survive_a_crash_at_every_hit(app: Celery, store: Store) -> None:
    """A saga parked on its 24 h timer is cancelled; a simulated SIGKILL at the n-th crash
    point hit after the cancel, for every n: it ends cancelled, the cancel recorded once,
    the one forward step undone once."""

    def park(wid: str) -> Driver:
        engine.start(store, "t.sleepy", wid, [wid])
        driver = Driver(store, app)
        drain(driver)
        cancel(store, wid)
        return driver

    hits: list[str] = []
    driver = park("cref")
    engine.crash_hook = hits.append
    drain(driver)
    engine.crash_hook = None
    assert shape(store, "cref")[-1] == ("cancel", "completed")
    crashed: set[str] = set()
    for n in range(1, len(hits) + 1):
        wid = f"cc{n}"
        driver = park(wid)
        plan = CrashPlan([n])
        engine.crash_hook = plan
        drain(driver)
        engine.crash_hook = None
        crashed.update(plan.crashed)
        row = engine.get_workflow(store, wid)
        assert row["state"] == "cancelled", (n, plan.crashed, row)
        assert shape(store, wid) == [("compensation", "completed"), ("activity", "completed"),
                                     ("timer", "scheduled"), ("cancel", "completed")], n
        assert [lbl for _, lbl in rows(store, "undo") if lbl.startswith(f"{wid}:")] == [
            f"{wid}:a"], (n, plan.crashed)
    assert {"record.cancel.in", "saga.dispatch.in"} <= crashed
    print(f"cancel + unwind: {len(hits)} crash-point hits crashed one at a time "
          f"({len(crashed)} distinct points), same outcome each time")


def test_compensate_after_a_hand_requeue_does_not_repeat_the_compensation(
    app: Celery, store: Store
) -> None:
    """The dead compensation was requeued by hand (`dead-letters requeue`) and ran: the
    history still says failed; `compensate` records it completed instead of running it
    again, then runs the rest."""
    from reliable_beat import runs
    from reliable_beat.db.tables import dead_letters

    BROKEN.add("o3:b")
    engine.start(store, "t.three", "o3", ["o3"])
    driver = Driver(store, app)
    drain(driver)
    assert engine.get_workflow(store, "o3")["state"] == "blocked"
    BROKEN.clear()
    with store.connect() as conn:
        dl = conn.execute(sa.select(dead_letters.c.id).order_by(dead_letters.c.id.desc())
                          ).scalars().first()
    runs.requeue_dead_letter(store, int(dl), by="a person")
    app.tasks["saga.undo"].apply(("o3:b",), headers={"reliable_beat_key": "wf:o3/1#3"})
    assert rows(store, "undo") == [("undo", "o3:c:nothing"), ("undo", "o3:b")]
    out = compensate(store, "o3")
    assert out["requeued"] == []
    drain(driver)
    assert engine.get_workflow(store, "o3")["state"] == "failed"
    assert rows(store, "undo") == [("undo", "o3:c:nothing"), ("undo", "o3:b"),
                                   ("undo", "o3:a")]


def _lose_activity_messages(store: Store) -> None:
    """The broker loses every activity message sent so far (worker killed before the ack on
    a broker that drops it, or the publish never happened)."""
    with store.begin() as conn:
        conn.execute(sa.update(outbox).where(outbox.c.message_id.like("act:%"))
                     .values(state="sent"))


def test_requeued_compensation_whose_message_is_lost_is_sent_again(
    app: Celery, store: Store
) -> None:
    """`workflows compensate` requeues the dead compensation (its run back to `scheduled`)
    and the advance sends it; the broker loses that message. The workflow sweep re-sends it
    (on main it only re-sent activities with no run row or an expired lease, so the
    workflow waited for ever), and each compensation's effect still happens once."""
    BROKEN.add("o4:b")
    handle = engine.start(store, "t.three", "o4", ["o4"])
    driver = Driver(store, app)
    drain(driver)
    assert handle.status()["state"] == "blocked"
    BROKEN.clear()
    compensate(store, "o4")
    row, _ = driver._due()
    assert row.payload["task"] == engine.ADVANCE_TASK
    assert driver.step()  # the advance dispatches the requeued compensation (seq 3)
    _lose_activity_messages(store)
    drain(driver)
    assert handle.status()["state"] == "waiting"
    with store.connect() as conn:
        run_state = conn.execute(sa.text(
            "SELECT state FROM reliable_beat_runs WHERE idempotency_key = 'wf:o4/1#3'")
        ).scalar_one()
    assert run_state == "scheduled"  # requeued, never claimed: its message is gone
    assert engine.redispatch_workflows(store, older_than=timedelta(0)) == 1
    drain(driver)
    # the next compensation (a) is sent by the advance; lose it too: it has no run row yet
    if handle.status()["state"] != "failed":
        _lose_activity_messages(store)
        engine.redispatch_workflows(store, older_than=timedelta(0))
        drain(driver)
    row = handle.status()
    assert row["state"] == "failed", (row, events(store, "o4"))
    assert rows(store, "undo") == [("undo", "o4:c:nothing"), ("undo", "o4:b"),
                                   ("undo", "o4:a")]


def test_retrying_activity_whose_retry_message_is_lost_is_sent_again(
    app: Celery, store: Store
) -> None:
    """An activity run left `retrying` (a transient failure whose retry message the broker
    lost, or a lease cleared by a person with `reliable-beat lease clear`) and no message
    left for it: the workflow sweep re-sends it once the retry backoff cap has passed (on
    main neither sweep did: the run sweep only re-sends runs with a trigger row). Its
    effect happens once."""
    from wf_driver import Crash

    from reliable_beat import runs

    killed: list[str] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="saga.killed_once")
    def killed_once(self: IdempotentTask, label: str) -> str:
        if not killed:
            killed.append(self.idempotency_key)
            raise Crash("SIGKILL inside the activity body")
        with self.transaction() as tx:
            tx.execute(effects.insert().values(kind="do", key=self.idempotency_key,
                                               label=label))
            self.returns(label)
        return "ignored"

    workflow(name="t.killed")(lambda ctx: ctx.activity("saga.killed_once", "k"))
    handle = engine.start(store, "t.killed", "r1")
    driver = Driver(store, app)
    assert driver.step()  # the advance: records the activity and its message
    assert driver.step()  # the activity starts and the worker dies in its body
    assert killed == ["wf:r1/1#1"]
    _lose_activity_messages(store)
    runs.clear_lease(store, killed[0])  # a person frees the lease: the run is `retrying`
    drain(driver)
    assert handle.status()["state"] == "waiting"
    # within the retry backoff cap a retry message may still be on its way: not yet
    assert engine.redispatch_workflows(store, older_than=timedelta(0),
                                       retrying_after=timedelta(hours=1)) == 0
    assert engine.redispatch_workflows(store, older_than=timedelta(0),
                                       ) == 1
    drain(driver)
    assert handle.result(timeout=1) == "k"
    assert rows(store, "do") == [("do", "k")]


def _three_with(**knobs: bool) -> Any:
    def flow(ctx: WorkflowContext, order: str) -> str:
        with ctx.saga(**knobs) as saga:
            saga.compensate("saga.undo", f"{order}:a")
            ctx.activity("saga.do", f"{order}:a")
            saga.compensate("saga.undo", f"{order}:b")
            ctx.activity("saga.do", f"{order}:b")
            saga.compensate("saga.undo", f"{order}:c")
            ctx.activity("saga.do", f"{order}:c", True)  # fails permanently
        return "unreachable"

    return flow


def _most_compensations_in_flight(store: Store, driver: Driver, wid: str) -> int:
    """Drain, returning the most compensation messages of ``wid`` pending at once."""
    most = 0
    for _ in range(500):
        with store.connect() as conn:
            pending = conn.execute(sa.select(sa.func.count()).select_from(outbox).where(
                outbox.c.state == "pending",
                outbox.c.message_id.like(f"act:wf:{wid}/1#%"))).scalar_one()
        most = max(most, int(pending))
        if not driver.step():
            return most
    raise AssertionError("driver did not settle")


@pytest.mark.parametrize("parallel", [False, True])
def test_parallel_saga_sends_all_compensations_at_once(app: Celery, store: Store,
                                                        parallel: bool) -> None:
    workflow(name="t.knobs")(_three_with(parallel=parallel))
    wid = f"par{int(parallel)}"
    handle = engine.start(store, "t.knobs", wid, [wid])
    most = _most_compensations_in_flight(store, Driver(store, app), wid)
    assert most == (3 if parallel else 1)
    row = handle.status()
    assert row["state"] == "failed", row
    assert "saga.do failed: dead" in row["error"]["message"]  # the original error
    assert shape(store, wid) == EXPECTED_THREE
    assert sorted(lbl for _, lbl in rows(store, "undo")) == [
        f"{wid}:a", f"{wid}:b", f"{wid}:c:nothing"]  # each undo once


def test_continue_on_error_runs_the_rest_then_blocks_naming_the_dead_one(
    app: Celery, store: Store
) -> None:
    workflow(name="t.coe")(_three_with(continue_on_error=True))
    BROKEN.add("e1:b")
    handle = engine.start(store, "t.coe", "e1", ["e1"])
    driver = Driver(store, app)
    drain(driver)
    row = handle.status()
    assert row["state"] == "blocked", row
    reason = row["block_reason"]
    assert reason.startswith("compensation_failed: compensation saga.undo (seq 3, key "
                             "wf:e1/1#3) dead-lettered: ValueError: cannot undo e1:b now;")
    assert "other compensations ran" in reason and "workflows compensate e1" in reason
    # b's failure did not stop a (the default stops there: see the test above)
    assert rows(store, "undo") == [("undo", "e1:c:nothing"), ("undo", "e1:a")]
    BROKEN.clear()
    out = compensate(store, "e1")
    assert out["requeued"] == ["wf:e1/1#3"]
    drain(driver)
    row = handle.status()
    assert row["state"] == "failed", row
    assert "saga.do failed: dead" in row["error"]["message"]
    assert rows(store, "undo") == [("undo", "e1:c:nothing"), ("undo", "e1:a"),
                                   ("undo", "e1:b")]


def test_parallel_saga_with_two_dead_compensations_blocks_naming_both(
    app: Celery, store: Store
) -> None:
    workflow(name="t.par2")(_three_with(parallel=True, continue_on_error=True))
    BROKEN.update({"p2:a", "p2:b"})
    handle = engine.start(store, "t.par2", "p2", ["p2"])
    driver = Driver(store, app)
    drain(driver)
    row = handle.status()
    assert row["state"] == "blocked", row
    reason = row["block_reason"]
    assert reason.startswith("compensation_failed: 2 compensations dead-lettered: ")
    assert "(seq 3, key wf:p2/1#3)" in reason and "(seq 1, key wf:p2/1#1)" in reason
    assert rows(store, "undo") == [("undo", "p2:c:nothing")]
    BROKEN.clear()
    out = compensate(store, "p2")
    assert sorted(out["requeued"]) == ["wf:p2/1#1", "wf:p2/1#3"]
    drain(driver)
    assert handle.status()["state"] == "failed"
    assert sorted(lbl for _, lbl in rows(store, "undo")) == ["p2:a", "p2:b", "p2:c:nothing"]


def _dead_letter_alarms(store: Store) -> tuple[int, list[str]]:
    """(dead letters `status --check` counts, the problems naming dead letters)."""
    from reliable_beat.cli.status import collect_status

    info = collect_status(store)
    return info["dead_letters"], [p for p in info["problems"] if "dead letters" in p]


def test_a_compensated_step_is_a_handled_dead_letter_that_does_not_page(
    app: Celery, store: Store
) -> None:
    """The saga's third step is refused (a declined order) and every compensation runs: the
    step's dead letter stays (listed, with who handled it) but `status --check` and the
    dead-letter metric stay green. A compensation that itself dead-letters still pages."""
    from click.testing import CliRunner

    from reliable_beat import runs
    from reliable_beat.cli import reliable_beat as rb_cli
    from reliable_beat.metrics import StoreCollector

    engine.start(store, "t.three", "declined", ["declined"])
    drain(Driver(store, app))
    assert engine.get_workflow(store, "declined")["state"] == "failed"
    everything = runs.list_dead_letters(store)
    assert [(d["key"], d["reason"]) for d in everything] == [("wf:declined/1#6", "permanent")]
    assert everything[0]["handled_by"] == ("saga of workflow declined (run 1): its "
                                           "compensations completed")
    assert everything[0]["handled_at"] is not None
    assert _dead_letter_alarms(store) == (0, [])
    assert [d["key"] for d in runs.list_dead_letters(store, handled=True)] == [
        "wf:declined/1#6"]
    assert runs.list_dead_letters(store, handled=False) == []
    families = {f.name: f for f in StoreCollector(store).collect()}
    assert [s.value for s in families["reliable_beat_dead_letters"].samples] == [0.0, 0.0]
    assert families["reliable_beat_dead_letters_handled"].samples[0].value == 1.0
    out = CliRunner().invoke(rb_cli, ["--database-url", store.url, "dead-letters", "list",
                                      "--handled"])
    assert out.exit_code == 0 and "wf:declined/1#6" in out.output, out.output
    assert "saga of workflow declined" in out.output

    # unhandled: the compensation of b dead-letters -> blocked; both dead letters page
    BROKEN.add("broken:b")
    engine.start(store, "t.three", "broken", ["broken"])
    drain(Driver(store, app))
    assert engine.get_workflow(store, "broken")["state"] == "blocked"
    count, problems = _dead_letter_alarms(store)
    assert count == 2 and problems, problems  # the step c and the compensation of b
    assert sorted(d["key"] for d in runs.list_dead_letters(store, handled=False)) == [
        "wf:broken/1#3", "wf:broken/1#6"]


def test_requeue_of_a_settled_activity_dead_letter_is_refused(app: Celery, store: Store) -> None:
    """`dead-letters requeue` (and the dashboard's and the admin's, through
    ``ops.requeue.plan_requeue``) refuses a workflow activity's dead letter once the history
    recorded its failure: the saga compensated, so a re-run's effect (a card captured) would
    land outside the history. A dead compensation of a blocked workflow is sent to
    `workflows compensate`. Nothing is changed by a refusal."""
    from click.testing import CliRunner

    from reliable_beat import runs
    from reliable_beat.cli import reliable_beat as rb_cli
    from reliable_beat.ops.requeue import RequeueRefused, plan_requeue

    engine.start(store, "t.three", "declined", ["declined"])
    drain(Driver(store, app))
    assert engine.get_workflow(store, "declined")["state"] == "failed"
    [dl] = runs.list_dead_letters(store)
    with pytest.raises(RequeueRefused, match="outside its history"):
        plan_requeue(store, int(dl["id"]))
    out = CliRunner().invoke(rb_cli, ["--database-url", store.url, "dead-letters", "requeue",
                                      str(dl["id"]), "--yes"])
    assert out.exit_code != 0 and "outside its history" in out.output, out.output
    assert runs.get_dead_letter(store, int(dl["id"])).get("requeued_at") is None
    # the same activity's message dropped by a worker (e.g. the task not yet registered
    # there): a `message` dead letter with the activity's key is refused alike
    dropped = runs.record_refused_message(
        store, key="wf:declined/1#6", task="saga.do",
        payload={"task": "saga.do", "task_id": "tid-6", "args": ["declined:c"]},
        error="unregistered", reason="unregistered")
    with pytest.raises(RequeueRefused, match="outside its history"):
        plan_requeue(store, dropped)

    BROKEN.add("o4:b")
    engine.start(store, "t.three", "o4", ["o4"])
    drain(Driver(store, app))
    assert engine.get_workflow(store, "o4")["state"] == "blocked"
    dead = {d["key"]: int(d["id"]) for d in runs.list_dead_letters(store)}
    with pytest.raises(RequeueRefused, match="workflows compensate o4"):
        plan_requeue(store, dead["wf:o4/1#3"])  # the dead compensation
    with pytest.raises(RequeueRefused, match="outside its history"):
        plan_requeue(store, dead["wf:o4/1#6"])  # the refused step


def test_cancel_of_a_workflow_already_compensating_says_it_ends_failed(
        app: Celery, store: Store) -> None:
    """Fails on the old code: the cancel of a workflow whose saga was already unwinding
    said "...then it ends cancelled", and it ended failed with its original error."""
    handle = engine.start(store, "t.three", "c1", ["c1"])
    driver = Driver(store, app)
    for _ in range(200):  # up to the first compensation dispatched (the saga unwinding)
        if ("compensation", "scheduled") in shape(store, "c1"):
            break
        driver.step()
    else:
        raise AssertionError("the saga never started compensating")
    out = cancel(store, "c1")
    assert out["changed"] and "already compensating" in out["message"]
    assert "ends failed" in out["message"] and "ends cancelled" not in out["message"]
    drain(driver)
    with pytest.raises(WorkflowFailed) as info:
        handle.result(timeout=1)
    assert info.value.state == "failed" and info.value.error["type"] == "ActivityError"
