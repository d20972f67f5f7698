"""Versioning (``ctx.patched`` / ``ctx.deprecate_patch`` / the version guard) and
continue-as-new, on SQLite with the in-process driver (tests/apps/wf_driver.py)."""

from __future__ import annotations

import re
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
from reliable_beat.workflows import (
    WorkflowContext,
    engine,
    resume,
    signal,
    workflow,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
from wf_driver import Crash, Driver, events

CALLS: list[str] = []


def make_app(app: Celery) -> Celery:
    """Register the module's tasks on ``app`` (the ``wf_celery_app`` fixture's)."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name="wfv.act")
    def act(self: IdempotentTask, what: str) -> str:
        CALLS.append(what)
        return what

    return app


@pytest.fixture
def wf_store(wf_dialect_store: Store) -> Store:
    """SQLite, and MariaDB (no UPDATE ... RETURNING: children, continue-as-new and versions
    go through the dialect layer there)."""
    CALLS.clear()
    return wf_dialect_store


@pytest.fixture
def app(wf_store: Store, wf_celery_app: Callable[[str, Store], Celery]) -> Celery:
    return make_app(wf_celery_app("wfv", wf_store))


def kinds(store: Store, wid: str) -> list[tuple[str, str | None]]:
    return [(e[1], e[2]) for e in events(store, wid)]


# ------------------------------------------------------------------ patched truth table ----


def v1(ctx: WorkflowContext) -> str:
    ctx.activity("wfv.act", "a")
    ctx.wait_signal("go")
    ctx.activity("wfv.act", "b")
    ctx.wait_signal("end")
    return "old"


def v2(ctx: WorkflowContext) -> str:
    """v1 with activity c instead of b, behind a patch."""
    ctx.activity("wfv.act", "a")
    ctx.wait_signal("go")
    if ctx.patched("c-not-b"):
        assert ctx.patched("c-not-b")  # memoized: takes no second position
        ctx.activity("wfv.act", "c")
        ctx.wait_signal("end")
        return "new"
    assert not ctx.patched("c-not-b")
    ctx.activity("wfv.act", "b")
    ctx.wait_signal("end")
    return "old"


def v3(ctx: WorkflowContext) -> str:
    """The patch deprecated: only the new path, the marker accepted with or without."""
    ctx.activity("wfv.act", "a")
    ctx.wait_signal("go")
    ctx.deprecate_patch("c-not-b")
    ctx.activity("wfv.act", "c")
    ctx.wait_signal("end")
    return "new"


NEW = [("activity", "wfv.act"), ("signal", "go"), ("patch", "c-not-b"),
       ("activity", "wfv.act"), ("signal", "end")]
OLD = [("activity", "wfv.act"), ("signal", "go"), ("activity", "wfv.act"), ("signal", "end")]


def test_patched_truth_table(app: Celery, wf_store: Store) -> None:
    driver = Driver(wf_store, app)
    workflow(name="t.p")(v1)
    engine.start(wf_store, "t.p", "passed")  # will pass the changed point under v1
    engine.start(wf_store, "t.p", "before")  # parked before the changed point under v1
    driver.run()
    signal(wf_store, "passed", "go", 1)
    driver.run()
    assert kinds(wf_store, "passed") == OLD
    workflow(name="t.p")(v2)  # deploy the patched code
    engine.start(wf_store, "t.p", "new")
    for w in ("passed", "before", "new"):
        signal(wf_store, w, "go", 1)
        signal(wf_store, w, "end", 1)
    driver.run()
    # replay with another event at the position: False, the old path, no marker written
    assert engine.get_workflow(wf_store, "passed")["result"] == "old"
    assert kinds(wf_store, "passed") == OLD
    # not replaying (the frontier): True, the marker recorded; for a new run and for one
    # parked before the point alike (the code past it never ran)
    for w in ("before", "new"):
        assert engine.get_workflow(wf_store, w)["result"] == "new", w
        assert kinds(wf_store, w) == NEW
    # replay with the marker: True (consumed); without it: False; nothing to report
    for w in ("passed", "before", "new"):
        assert engine.replay_check(wf_store, w) is None
    # deprecate_patch: accepts a history with the marker and one without it at that point,
    # and records none on new runs
    workflow(name="t.p")(v3)
    assert engine.replay_check(wf_store, "new") is None
    engine.start(wf_store, "t.p", "newer")
    signal(wf_store, "newer", "go", 1)
    signal(wf_store, "newer", "end", 1)
    driver.run()
    assert engine.get_workflow(wf_store, "newer")["result"] == "new"
    assert kinds(wf_store, "newer") == [k for k in NEW if k[0] != "patch"]
    assert engine.replay_check(wf_store, "newer") is None
    # a run that took the old path cannot replay on v3 (its activity b, not the patch, is
    # named): deprecate only once no such run is in flight
    problem = engine.replay_check(wf_store, "passed")
    assert problem is not None and "seq 3" in problem and "patch" not in problem
    assert len(CALLS) == 2 * 4  # a and b|c, once each, for each of the four runs


def test_reordered_v2_blocks_and_patched_v2_resumes(app: Celery, wf_store: Store) -> None:
    """The unit form of the acceptance roll: v1 parked on a timer, reordered v2 blocks
    writing nothing, patched v2 completes them on the old path, new runs on the new one."""

    def park(ctx: WorkflowContext) -> list[str]:
        a = ctx.activity("wfv.act", "first")
        ctx.wait_signal("go")
        b = ctx.activity("wfv.act", "second")
        return [a, b]

    def reordered(ctx: WorkflowContext) -> list[str]:
        b = ctx.activity("wfv.act", "second")
        ctx.wait_signal("go")
        a = ctx.activity("wfv.act", "first")
        return [b, a]

    def patched(ctx: WorkflowContext) -> list[str]:
        if ctx.patched("reorder"):
            return reordered(ctx)
        return park(ctx)

    driver = Driver(wf_store, app)
    workflow(name="t.roll")(park)
    wids = [f"roll{i}" for i in range(5)]
    for w in wids:
        engine.start(wf_store, "t.roll", w)
    driver.run()
    before = {w: events(wf_store, w) for w in wids}
    workflow(name="t.roll")(reordered)
    for w in wids:
        signal(wf_store, w, "go", 1)
    driver.run()
    for w in wids:
        row = engine.get_workflow(wf_store, w)
        assert row["state"] == "blocked", row
        assert events(wf_store, w) == before[w]
    workflow(name="t.roll")(patched)
    for w in wids:
        assert engine.replay_check(wf_store, w) is None
        resume(wf_store, w)
    engine.start(wf_store, "t.roll", "fresh")
    driver.run()
    signal(wf_store, "fresh", "go", 1)
    driver.run()
    for w in wids:
        assert engine.get_workflow(wf_store, w)["result"] == ["first", "second"]
    assert engine.get_workflow(wf_store, "fresh")["result"] == ["second", "first"]
    assert kinds(wf_store, "fresh")[0] == ("patch", "reorder")


def test_patched_inside_a_step_is_refused(app: Celery, wf_store: Store) -> None:
    seen: list[str] = []

    def flow(ctx: WorkflowContext) -> None:
        try:
            ctx.step(lambda: ctx.patched("x"), name="s")
        except Exception as exc:  # ActivityError wrapping the usage error
            seen.append(str(exc))

    workflow(name="t.pstep")(flow)
    engine.start(wf_store, "t.pstep", "ps")
    Driver(wf_store, app).run()
    assert seen and "cannot be nested" in seen[0]


# ------------------------------------------------------------------ version guard ----


def test_min_supported_version_blocks_old_runs_writing_nothing(app: Celery, wf_store: Store
                                                              ) -> None:
    def flow(ctx: WorkflowContext) -> str:
        ctx.wait_signal("go")
        return ctx.info.version or "none"

    driver = Driver(wf_store, app)
    workflow(name="t.ver", version="1")(flow)
    engine.start(wf_store, "t.ver", "r1")
    workflow(name="t.ver")(flow)  # unversioned code
    engine.start(wf_store, "t.ver", "r0")
    driver.run()
    assert engine.get_workflow(wf_store, "r1")["version"] == "1"
    assert engine.get_workflow(wf_store, "r0")["version"] is None
    workflow(name="t.ver", version="2", min_supported_version="2")(flow)
    engine.start(wf_store, "t.ver", "r2")
    for w in ("r0", "r1", "r2"):
        signal(wf_store, w, "go", 1)
    driver.run()
    for w, recorded in (("r0", "(none)"), ("r1", "1")):
        row = engine.get_workflow(wf_store, w)
        assert row["state"] == "blocked"
        assert f"started under version {recorded}" in row["block_reason"]
        assert "min_supported_version 2" in row["block_reason"]
        assert [e[1] for e in events(wf_store, w)] == ["signal"]  # nothing new written
        assert "min_supported_version" in str(engine.replay_check(wf_store, w))
    assert engine.get_workflow(wf_store, "r2")["result"] == "2"
    # the minimum lowered again (code that still replays v1): resume completes r1
    workflow(name="t.ver", version="2", min_supported_version="1")(flow)
    resume(wf_store, "r1")
    driver.run()
    assert engine.get_workflow(wf_store, "r1")["state"] == "completed"


def test_bad_versions_are_refused_at_decoration() -> None:
    with pytest.raises(ValueError, match="dot-separated integers"):
        workflow(name="t.bad", version="v2")(lambda ctx: None)
    with pytest.raises(ValueError, match="needs a version at least as high"):
        workflow(name="t.bad", version="1", min_supported_version="2")(lambda ctx: None)
    with pytest.raises(ValueError, match="continue_as_new_after"):
        workflow(name="t.bad", history_limit=10, continue_as_new_after=10)(lambda ctx: None)


# ------------------------------------------------------------------ continue-as-new ----


def counter(ctx: WorkflowContext, i: int, total: int, got: list[Any]) -> Any:
    while i < total:
        ctx.step(str, i, name="tick")
        i += 1
        if ctx.info.continue_as_new_suggested:
            ctx.continue_as_new(i, total, got)
    return {"i": i, "run": ctx.info.run_no}


def test_continue_as_new_starts_a_fresh_run(app: Celery, wf_store: Store) -> None:
    workflow(name="t.can", history_limit=10, continue_as_new_after=4)(counter)
    handle = engine.start(wf_store, "t.can", "can", [0, 10, []])
    Driver(wf_store, app).run()
    assert handle.result(timeout=1) == {"i": 10, "run": 3}
    row = engine.get_workflow(wf_store, "can", events=True)
    assert row["run_no"] == 3 and row["args"] == [8, 10, []]
    assert len(row["events"]) == 2  # only the last run's history
    with wf_store.connect() as conn:
        per_run = dict(conn.execute(sa.text(
            "SELECT run_no, count(*) FROM reliable_beat_workflow_events GROUP BY run_no"
        )).all())
    assert per_run == {1: 4, 2: 4, 3: 2}


def test_continue_as_new_with_an_open_activity_is_refused(app: Celery, wf_store: Store
                                                          ) -> None:
    def flow(ctx: WorkflowContext) -> None:
        ctx.start_activity("wfv.act", "x")
        ctx.continue_as_new()

    workflow(name="t.canopen")(flow)
    engine.start(wf_store, "t.canopen", "open")
    Driver(wf_store, app).run()
    row = engine.get_workflow(wf_store, "open")
    assert row["state"] == "blocked" and row["run_no"] == 1
    assert "continue_as_new refused" in row["block_reason"]
    assert "activity wfv.act at seq 1" in row["block_reason"]


def test_all_settled_lets_the_code_wait_first(app: Celery, wf_store: Store) -> None:
    def flow(ctx: WorkflowContext, n: int) -> Any:
        if n == 2:
            return "done"
        h = ctx.start_activity("wfv.act", f"x{n}")
        if not ctx.all_settled():
            ctx.wait(h)
        assert ctx.all_settled()
        ctx.continue_as_new(n + 1)

    workflow(name="t.settle")(flow)
    handle = engine.start(wf_store, "t.settle", "settle", [0])
    Driver(wf_store, app).run()
    assert handle.result(timeout=1) == "done"
    assert sorted(CALLS) == ["x0", "x1"]


# ------------------------------------------------------------------ arguments per run ----


def test_code_that_mutates_its_arguments_replays_them_fresh(app: Celery, wf_store: Store
                                                            ) -> None:
    """A wake during an advance runs the code again in the same advance: it must get its
    arguments as stored, not as the previous pass left them (found by the continue-as-new
    loop, whose carried state is a list the code appends to)."""
    sent: list[int] = []

    def hook(name: str) -> None:
        if name == "advance.before_release" and not sent:
            sent.append(1)
            signal(wf_store, "mut", "x", "payload")

    def flow(ctx: WorkflowContext, items: list[str]) -> Any:
        items.append("a")
        if len(items) > 1:  # only if the arguments were mutated by an earlier pass
            ctx.step(str, 1, name="diverged")
        return [ctx.wait_signal("x"), items]

    workflow(name="t.mut")(flow)
    handle = engine.start(wf_store, "t.mut", "mut", [[]])
    engine.crash_hook = hook
    Driver(wf_store, app).run()
    assert sent
    assert handle.result(timeout=1) == ["payload", ["a"]]
    assert handle.status()["args"] == [[]]


# ------------------------------------------------------------------ children ----


def kid(ctx: WorkflowContext, n: int) -> int:
    got = ctx.wait_signal("go")
    if got == "fail":
        raise ValueError(f"child {n} failed")
    return int(ctx.transaction(_kid_effect, n, name="kid_effect"))


KID_EFFECTS: list[int] = []


def _kid_effect(conn: sa.Connection, n: int) -> int:
    conn.execute(sa.text("SELECT 1"))
    KID_EFFECTS.append(n)  # in-process: counts how often the transaction's body ran
    return n * 10


def parent(ctx: WorkflowContext) -> Any:
    h1 = ctx.start_child("t.kid", 1)
    h2 = ctx.start_child("t.kid", 2, workflow_id="kid-two")
    out: list[Any] = [ctx.wait_child(h1)]
    try:
        out.append(ctx.wait_child(h2))
    except Exception as exc:  # ActivityError(kind="child")
        out.append(f"{getattr(exc, 'kind', '')}:{getattr(exc, 'type', '')}")
    return out


def _parent_event(store: Store, seq: int) -> tuple[str, Any]:
    from reliable_beat.db.tables import workflow_events, workflows

    with store.connect() as conn:  # through the tables: JSON decoded on every dialect
        row = conn.execute(
            sa.select(workflow_events.c.state, workflow_events.c.result)
            .join(workflows, workflows.c.id == workflow_events.c.workflow_pk)
            .where(workflows.c.workflow_id == "par", workflow_events.c.seq == seq)).one()
    return row.state, row.result


@pytest.mark.parametrize("trouble", ["none", "crash_in_child_finish", "parent_wake_lost"])
def test_child_end_wakes_its_parent_in_the_same_transaction(app: Celery, wf_store: Store,
                                                            trouble: str) -> None:
    KID_EFFECTS.clear()
    workflow(name="t.kid")(kid)
    workflow(name="t.par")(parent)
    handle = engine.start(wf_store, "t.par", "par")
    driver = Driver(wf_store, app)
    driver.run()
    assert handle.status()["state"] == "waiting"
    assert kinds(wf_store, "par") == [("child", "t.kid"), ("child", "t.kid")]
    assert engine.get_workflow(wf_store, "par/child1.1")["state"] == "waiting"
    crashed: list[str] = []

    def hook(name: str) -> None:
        if name == "child.notify.in" and not crashed:
            crashed.append(name)  # after the parent's event and wake, before the commit
            raise Crash(name)

    if trouble == "crash_in_child_finish":
        engine.crash_hook = hook
    signal(wf_store, "par/child1.1", "go", "ok")
    # deliver only the child's wake: the parent must be told by the child's own transaction
    row, _ = driver._due()
    assert row.payload["args"] == ["par/child1.1"]
    driver.step()
    if trouble == "crash_in_child_finish":
        assert crashed and driver.crashes == 1, driver.failures
        # rolled back together: the child is not over and the parent was not told
        assert engine.get_workflow(wf_store, "par/child1.1")["state"] != "completed"
        assert _parent_event(wf_store, 1)[0] == "scheduled"
        driver.step()  # the redelivered advance
    assert engine.get_workflow(wf_store, "par/child1.1")["state"] == "completed"
    assert _parent_event(wf_store, 1) == ("completed", 10)
    with wf_store.connect() as conn:
        wakes = conn.execute(sa.text(
            "SELECT count(*) FROM reliable_beat_outbox WHERE message_id = 'wake:par:1c1' "
            "AND state = 'pending'")).scalar_one()
    assert wakes == 1
    if trouble == "parent_wake_lost":
        with wf_store.begin() as conn:  # the broker lost the parent's wake
            conn.execute(sa.text("UPDATE reliable_beat_outbox SET state = 'sent' WHERE "
                                 "message_id = 'wake:par:1c1'"))
        driver.run()
        assert handle.status()["state"] == "waiting"
        assert engine.redispatch_workflows(wf_store, older_than=timedelta(0)) >= 1
    signal(wf_store, "kid-two", "go", "fail")
    driver.run()
    assert handle.result(timeout=1) == [10, "child:ValueError"]
    assert KID_EFFECTS == [1]  # the child's transaction ran once, even when crashed around


def test_continue_as_new_with_a_running_child_is_refused(app: Celery, wf_store: Store
                                                         ) -> None:
    workflow(name="t.kid")(kid)

    def flow(ctx: WorkflowContext) -> None:
        ctx.start_child("t.kid", 5)
        ctx.continue_as_new()

    workflow(name="t.canchild")(flow)
    engine.start(wf_store, "t.canchild", "cc")
    Driver(wf_store, app).run()
    row = engine.get_workflow(wf_store, "cc")
    assert row["state"] == "blocked" and "child workflow cc/child1.1 at seq 1" in \
        row["block_reason"]


def test_a_run_started_by_name_elsewhere_gets_the_version_of_its_first_advance(
    app: Celery, wf_store: Store
) -> None:
    def flow(ctx: WorkflowContext) -> str:
        return str(ctx.info.version)

    workflow(name="t.byname", version="3", min_supported_version="3")(flow)
    registered = engine._registry.pop("t.byname")  # a web process that only knows the name
    try:
        engine.start(wf_store, "t.byname", "bn")
    finally:
        engine.register(registered)
    assert engine.get_workflow(wf_store, "bn")["version"] is None
    Driver(wf_store, app).run()
    row = engine.get_workflow(wf_store, "bn")
    assert (row["state"], row["version"], row["result"]) == ("completed", "3", "3")


def test_continue_as_new_inside_an_open_saga_is_refused(app: Celery, wf_store: Store) -> None:
    """The saga block keeps ctx.open_sagas; continue-as-new inside one must be refused, not
    drop the recorded compensations (the merge of sagas and continue-as-new once read a
    counter name the saga code does not keep)."""

    def flow(ctx: WorkflowContext) -> None:
        with ctx.saga() as saga:
            saga.compensate("t.undo", "x")
            ctx.continue_as_new()

    workflow(name="t.cansaga")(flow)
    engine.start(wf_store, "t.cansaga", "cs")
    Driver(wf_store, app).run()
    row = engine.get_workflow(wf_store, "cs")
    assert row["state"] == "blocked" and "saga" in row["block_reason"], row["block_reason"]


def test_a_terminated_child_wakes_its_parent(app: Celery, wf_store: Store) -> None:
    """`workflows cancel --no-compensate` of a child ends it without `_finish`: its parent must
    still be told (ActivityError kind child) in the same transaction, not wait forever."""
    from reliable_beat.workflows import saga as rb_saga

    KID_EFFECTS.clear()
    workflow(name="t.kid")(kid)
    workflow(name="t.par")(parent)
    handle = engine.start(wf_store, "t.par", "par")
    driver = Driver(wf_store, app)
    driver.run()
    out = rb_saga.cancel(wf_store, "par/child1.1", compensate=False)
    assert out["state"] == "cancelled"
    assert _parent_event(wf_store, 1)[0] == "failed"
    driver.run()
    # the parent's first wait_child raises ActivityError(kind="child"): it ends failed
    assert handle.status()["state"] == "failed"


def test_the_dashboard_shows_the_replay_check_verdict(
        app: Celery, wf_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workflow page says what `reliable-beat workflows replay` would: the history
    replays on this process's code, or the first mismatch, or that the code is not loaded."""
    import warnings

    from reliable_beat.web import app as web_app
    from reliable_beat.web.auth import AuthConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    driver = Driver(wf_store, app)
    workflow(name="t.replay")(v1)
    engine.start(wf_store, "t.replay", "shown")
    driver.run()
    client = TestClient(web_app.create_app(wf_store, auth=AuthConfig()),
                        client=("127.0.0.1", 50000), base_url="http://127.0.0.1:8000")

    def verdict(live: bool = False) -> str:
        page = client.get("/workflows/shown", params={"replay": "1"},
                          headers={"x-rb-live": "1"} if live else {})
        assert page.status_code == 200
        return page.text.split('id="replay"', 1)[1].split("</p>", 1)[0]

    # it runs the workflow's code: only when asked, never on the page's live refresh
    plain = client.get("/workflows/shown").text
    assert "?replay=1" in plain and "without a mismatch" not in plain
    assert 'data-live="off"' not in plain  # the page refreshes itself, without the check
    assert 'data-live="off"' in client.get("/workflows/shown", params={"replay": "1"}).text
    assert "without a mismatch" not in verdict(live=True)
    assert "without a mismatch" in verdict()

    def reordered(ctx: WorkflowContext) -> str:
        ctx.wait_signal("go")
        ctx.activity("wfv.act", "a")
        return "x"

    workflow(name="t.replay")(reordered)
    shown = verdict()
    assert "MISMATCH" in shown and "seq 1" in shown, shown
    monkeypatch.setattr(web_app, "get_definition", lambda name: None)
    assert "not registered in this process" in verdict()
    # one at a time: a check still running (a workflow's code that blocks) is said, not joined
    slot = next(r.endpoint.__self__.cfg.replay_slot for r in client.app.routes
                if getattr(r, "path", "") == "/workflows/{wid:path}")
    with slot:
        assert "another replay check is still running" in verdict()


# ------------------------------------------------------------------ changed arguments ----


@pytest.fixture(params=["sqlite", pytest.param("pg", marks=pytest.mark.postgres),
                        pytest.param("mariadb", marks=pytest.mark.mariadb)])
def any_store(request: pytest.FixtureRequest) -> Store:
    """SQLite, PostgreSQL (the history read and the claim on the driver connection) and
    MariaDB."""
    CALLS.clear()
    store: Store = request.getfixturevalue(f"{request.param}_store")
    return store


def _shout(text: str) -> str:
    return text.upper()


@pytest.mark.parametrize("kind", ["activity", "step"])
@pytest.mark.parametrize("changed_at", [1, 3])
def test_a_replayed_call_with_a_changed_argument_is_non_determinism(
        any_store: Store, wf_celery_app: Callable[[str, Store], Celery], kind: str,
        changed_at: int) -> None:
    """A replay answers a recorded call only if the call is the recorded one: the same kind
    and name with other arguments (and a matching call replayed before it, at seq 3) blocks
    the run as non-deterministic, naming both digests, and writes nothing; the replayed calls
    skip the re-validation of their arguments, never the comparison."""
    store = any_store
    app = make_app(wf_celery_app("wfv", store))

    def call(ctx: WorkflowContext, arg: str) -> str:
        if kind == "activity":
            return str(ctx.activity("wfv.act", arg))
        return str(ctx.step(_shout, arg, name="shout"))

    def flow(first: str, second: str) -> Callable[[WorkflowContext], list[str]]:
        def run(ctx: WorkflowContext) -> list[str]:
            a = call(ctx, first)
            ctx.wait_signal("go")
            b = call(ctx, second)
            ctx.wait_signal("end")
            return [a, b]
        return run

    driver = Driver(store, app)
    workflow(name="t.changed")(flow("a", "b"))
    engine.start(store, "t.changed", "changed")
    driver.run()
    signal(store, "changed", "go", 1)
    driver.run()  # parked at seq 4; seq 1 and 3 recorded with "a" and "b"
    before = events(store, "changed")
    assert [e[1] for e in before] == [kind, "signal", kind, "signal"], before
    workflow(name="t.changed")(flow("a2", "b") if changed_at == 1 else flow("a", "b2"))
    problem = engine.replay_check(store, "changed")
    assert problem is not None and f"seq {changed_at}: code did {kind}" in problem, problem
    signal(store, "changed", "end", 1)
    driver.run()
    row = engine.get_workflow(store, "changed")
    assert row["state"] == "blocked", row
    reason = row["block_reason"]
    name = "wfv.act" if kind == "activity" else "shout"
    assert reason.startswith(f"non-determinism: seq {changed_at}: code did {kind} {name} "
                             "(args digest "), reason
    code_digest, history_digest = re.findall(r"args digest ([0-9a-f]{16})", reason)
    assert code_digest != history_digest, reason
    assert events(store, "changed") == before  # nothing recorded past the mismatch
    if kind == "activity":
        assert CALLS == ["a", "b"]  # the changed call dispatched nothing
