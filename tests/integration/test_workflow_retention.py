"""Workflow retention on SQLite and PostgreSQL: ended workflows past the cutoff go with their
events and signals, in bounded batches, and continued runs' histories go; pending, running,
waiting and blocked workflows, the current run's history and unconsumed signals stay, however
old; ``workflows purge --dry-run`` counts the same rows; a relay's pass (retention.purge)
includes them."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner

from reliable_beat.celery.commands import reliable_beat as cli
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import workflow_events, workflow_signals, workflows
from reliable_beat.retention import purge
from reliable_beat.settings import Settings
from reliable_beat.workflows import WorkflowContext, engine, signal, workflow
from reliable_beat.workflows.retention import purge_workflows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
from wf_driver import Driver


def ends(ctx: WorkflowContext, fail: bool) -> str:
    ctx.wait_signal("go")
    if fail:
        raise ValueError("failed on purpose")
    return "done"


def looping(ctx: WorkflowContext, i: int) -> Any:
    ctx.wait_signal("go")  # each run consumes one signal, then continues
    if i < 2:
        ctx.continue_as_new(i + 1)
    return ctx.wait_signal("never")


def _seed(store: Store) -> dict[str, list[str]]:
    app = Celery("wfret", set_as_current=False)
    app.conf.update(broker_url="memory://")
    workflow(name="t.ends")(ends)
    workflow(name="t.looping")(looping)
    ids: dict[str, list[str]] = {"old_ended": [], "new_ended": [], "live": []}
    for i in range(5):
        for group in ("old_ended", "new_ended"):
            wid = f"{group}/{i}"
            engine.start(store, "t.ends", wid, [i % 2 == 1])
            signal(store, wid, "go", i)
            ids[group].append(wid)
    for wid in ("live/waiting", "live/blocked", "live/running", "live/pending"):
        engine.start(store, "t.ends", wid, [False])
        ids["live"].append(wid)
    for wid in ("loop/waiting", "loop/blocked"):
        engine.start(store, "t.looping", wid, [0])
        for n in range(3):
            signal(store, wid, "go", n)
    signal(store, "live/waiting", "unrelated", 1)  # never consumed: stays
    Driver(store, app).run()
    with store.begin() as conn:
        now = store.now(conn)
        old = now - timedelta(days=40)
        conn.execute(sa.update(workflows).where(workflows.c.workflow_id.like("old_ended/%"))
                     .values(finished_at=old))
        conn.execute(sa.update(workflows).where(workflows.c.workflow_id.in_(
            ["live/blocked", "loop/blocked"])).values(state="blocked", block_reason="test"))
        conn.execute(sa.update(workflows).where(workflows.c.workflow_id == "live/running")
                     .values(state="running"))
        conn.execute(sa.update(workflows).where(workflows.c.workflow_id == "live/pending")
                     .values(state="pending"))
        # everything else is old too: only the state may protect it
        conn.execute(sa.update(workflows).where(~workflows.c.workflow_id.like("new_ended/%"))
                     .values(created_at=old, updated_at=old))
        new_pks = sa.select(workflows.c.id).where(workflows.c.workflow_id.like("new_ended/%"))
        conn.execute(sa.update(workflow_events).where(workflow_events.c.workflow_pk.not_in(
            new_pks)).values(created_at=old))
        conn.execute(sa.update(workflow_signals).where(workflow_signals.c.workflow_pk.not_in(
            new_pks)).values(created_at=old))
    return ids


def _snapshot(store: Store) -> dict[str, Any]:
    with store.connect() as conn:
        wfs = {r.workflow_id: (r.id, r.state, r.run_no) for r in conn.execute(
            sa.select(workflows.c.workflow_id, workflows.c.id, workflows.c.state,
                      workflows.c.run_no))}
        evs = conn.execute(sa.select(workflow_events.c.workflow_pk, workflow_events.c.run_no,
                                     workflow_events.c.seq)).all()
        sigs = conn.execute(sa.select(workflow_signals.c.workflow_pk,
                                      workflow_signals.c.consumed_run_no)).all()
    return {"workflows": wfs, "events": [tuple(e) for e in evs],
            "signals": [tuple(s) for s in sigs]}


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_purge_deletes_only_ended_and_continued_history(request: pytest.FixtureRequest,
                                                        dialect: str) -> None:
    store: Store = request.getfixturevalue("sqlite_store" if dialect == "sqlite" else "pg_store")
    ids = _seed(store)
    before = _snapshot(store)
    wfs = before["workflows"]
    assert {wfs[w][1] for w in ids["old_ended"]} == {"completed", "failed"}
    assert wfs["loop/waiting"][1:] == ("waiting", 3) and wfs["loop/blocked"][1:] == ("blocked", 3)
    url = store.engine.url.render_as_string(False)
    runner = CliRunner()
    out = runner.invoke(cli, ["--database-url", url, "workflows", "purge", "--older-than",
                              "30d", "--dry-run", "--json"])
    assert out.exit_code == 0, out.output
    dry = json.loads(out.output)
    assert _snapshot(store) == before  # a dry run deletes nothing
    with store.connect() as conn:
        cutoff = store.now(conn) - timedelta(days=30)
    result = purge_workflows(store, before=cutoff, batch_size=2)
    after = _snapshot(store)
    assert result.workflows == 5 and result.batches >= 3  # 5 ended in batches of 2
    gone = {w for w in wfs if w not in after["workflows"]}
    assert gone == set(ids["old_ended"])
    for w in ids["new_ended"] + ids["live"] + ["loop/waiting", "loop/blocked"]:
        assert after["workflows"][w] == wfs[w], w  # untouched, state and run
    loop_pk, blocked_pk = wfs["loop/waiting"][0], wfs["loop/blocked"][0]
    kept_events = set(after["events"])
    for pk, run_no, seq in before["events"]:
        owner = next(w for w, v in wfs.items() if v[0] == pk)
        expect_gone = owner in ids["old_ended"] or (pk == loop_pk and run_no < 3)
        assert ((pk, run_no, seq) not in kept_events) == expect_gone, (owner, run_no, seq)
    assert {(pk, r) for pk, r, _ in after["events"] if pk == blocked_pk} == {
        (blocked_pk, 1), (blocked_pk, 2), (blocked_pk, 3)}  # blocked: every run kept
    assert result.events == len(before["events"]) - len(after["events"])
    assert result.signals == len(before["signals"]) - len(after["signals"])
    unconsumed = [s for s in after["signals"] if s[1] is None]
    assert len(unconsumed) == len([s for s in before["signals"] if s[1] is None]) == 1
    assert (dry["workflows"], dry["events"], dry["signals"]) == (
        result.workflows, result.events, result.signals)
    # a second pass finds nothing; a relay's retention pass includes workflows
    assert purge_workflows(store, before=cutoff).as_dict()["workflows"] == 0
    res = purge(store, Settings(database_url="unused://", workflow_retention_seconds=0))
    assert res.workflows == 5  # the recent ended ones, with a retention of 0
    assert "workflows" in res.cutoffs and res.as_dict()["workflows"] == 5
    assert set(_snapshot(store)["workflows"]) == set(ids["live"]) | {"loop/waiting",
                                                                    "loop/blocked"}


def test_cli_purge_rejects_a_bad_age(sqlite_store: Store) -> None:
    url = sqlite_store.engine.url.render_as_string(False)
    out = CliRunner().invoke(cli, ["--database-url", url, "workflows", "purge",
                                   "--older-than", "thirty days"])
    assert out.exit_code == 2 and "--older-than" in out.output and "30d" in out.output


def test_a_purge_batch_chosen_as_deadlock_victim_is_tried_again(
        sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two purgers on MariaDB deadlock now and then (InnoDB locks every row a DELETE scans;
    seen in CI: `(1213, 'Deadlock found ...')` from test_workflow_purge_concurrency). The
    server rolls the victim back whole; the batch is selected and deleted again, counted
    once. Fails on the old code: the OperationalError ended the purge."""
    from sqlalchemy.exc import OperationalError

    from reliable_beat.workflows import retention

    ids = _seed(sqlite_store)
    real = retention._delete_ended
    raised: list[int] = []

    def once_a_victim(*args: Any, **kwargs: Any) -> int:
        n = real(*args, **kwargs)  # deletes (in the transaction), then the server says no
        if not raised:
            raised.append(n)
            raise OperationalError("DELETE ...", {}, Exception(
                1213, "Deadlock found when trying to get lock; try restarting transaction"))
        return n

    monkeypatch.setattr(retention, "_delete_ended", once_a_victim)
    with sqlite_store.connect() as conn:
        cutoff = sqlite_store.now(conn) - timedelta(days=30)
    result = purge_workflows(sqlite_store, before=cutoff, batch_size=2)
    assert raised == [2]  # the first batch was rolled back once
    assert result.workflows == len(ids["old_ended"]) == 5  # each counted once
    left = set(_snapshot(sqlite_store)["workflows"])
    assert not left & set(ids["old_ended"])
