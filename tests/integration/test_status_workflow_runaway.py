"""``status`` (text, ``--check``, ``--json``) and the metrics name workflows whose advance's
lease keeps expiring (WORKFLOW ADVANCES EXPIRING) and workflows ``pending`` past
``reliable_beat_workflow_pending_alarm_seconds`` (WORKFLOWS NOT STARTED).

Before: a workflow whose advance spun on a worker and one whose queue no worker consumes
were both silent: ``status --check`` exited 0, its text had no workflow line, the outbox
said "empty". Real PostgreSQL; the rows are seeded on the store's clock.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from click.testing import CliRunner
from sqlalchemy import update

from reliable_beat.celery.commands import reliable_beat
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import workflows
from reliable_beat.metrics import make_registry
from reliable_beat.workflows import engine


def _seed(store: Store, wid: str, queue: str | None, **values: Any) -> None:
    """Start ``wid`` (no code runs: nothing advances it here), then set ``values``; a
    ``*_ago`` value is that many seconds before the store's now."""
    engine.start(store, "t.never_registered", wid, [], queue=queue)
    with store.begin() as conn:
        now = store.now(conn)
        for key in [k for k in values if k.endswith("_ago")]:
            values[key[:-4]] = now - timedelta(seconds=values.pop(key))
        if values:
                conn.execute(update(workflows).where(workflows.c.workflow_id == wid)
                         .values(**values))


def _cli(store: Store, *args: str) -> Any:
    return CliRunner().invoke(reliable_beat, ["--database-url", store.url, "status", *args],
                              catch_exceptions=False)


def _metric(store: Store, name: str, **kw: Any) -> float | None:
    value = make_registry(store, **kw).get_sample_value(name)
    return None if value is None else float(value)


def test_pending_workflows_past_the_threshold_are_an_alarm(pg_store: Store) -> None:
    _seed(pg_store, "orphan-1", "nobody", updated_at_ago=600)
    _seed(pg_store, "orphan-2", "nobody", updated_at_ago=400)
    _seed(pg_store, "default-q", None, updated_at_ago=900)
    _seed(pg_store, "just-started", "nobody")  # younger than the threshold
    _seed(pg_store, "advanced", "busy", state="waiting", updated_at_ago=900)
    info = collect_status(pg_store, workflow_pending_alarm_seconds=300)
    late = info["workflows"]["pending_late"]
    assert late == {"count": 3, "queues": {"nobody": 2, "(default)": 1},
                    "workflow_ids": ["default-q", "orphan-1", "orphan-2"]}
    alarm, = [p for p in info["problems"] if p.startswith("WORKFLOWS NOT STARTED")]
    assert alarm.startswith("WORKFLOWS NOT STARTED: 3 workflows are pending more than 300 s "
                            "(reliable_beat_workflow_pending_alarm_seconds) by queue "
                            "((default): 1, nobody: 2; default-q, orphan-1, orphan-2)")
    assert "-Q QUEUE" in alarm and not info["ok"]
    # a lower threshold names the young one too; a higher one none
    assert collect_status(pg_store, workflow_pending_alarm_seconds=0.001)[
        "workflows"]["pending_late"]["count"] == 4
    quiet = collect_status(pg_store, workflow_pending_alarm_seconds=3600)
    assert quiet["workflows"]["pending_late"]["count"] == 0
    assert not [p for p in quiet["problems"] if "NOT STARTED" in p]

    checked = _cli(pg_store, "--check")  # the default threshold (300 s)
    assert checked.exit_code == 1
    assert "!! WORKFLOWS NOT STARTED: 3 workflows are pending" in checked.output
    assert "workflows: 4 pending, 1 waiting" in checked.output
    body = json.loads(_cli(pg_store, "--json").output)
    assert body["workflows"]["pending_late"]["count"] == 3

    assert _metric(pg_store, "reliable_beat_workflows_pending_late") == 3.0
    assert _metric(pg_store, "reliable_beat_workflows_pending_late",
                   pending_alarm_seconds=3600) == 0.0
    assert make_registry(pg_store).get_sample_value(
        "reliable_beat_workflows", {"state": "pending"}) == 4.0


def test_advances_whose_lease_keeps_expiring_are_an_alarm(pg_store: Store) -> None:
    running = {"state": "running", "leased_by": "host-a:42"}
    _seed(pg_store, "again", "q", takeovers=1, lease_expires_at_ago=30, **running)
    _seed(pg_store, "twice", "q", takeovers=2, lease_expires_at_ago=-30, **running)
    _seed(pg_store, "once-live", "q", takeovers=1, lease_expires_at_ago=-30, **running)
    _seed(pg_store, "first-expiry", "q", takeovers=0, lease_expires_at_ago=30, **running)
    _seed(pg_store, "released", "q", takeovers=3, state="waiting")
    info = collect_status(pg_store, workflow_max_takeovers=4)
    expiring = info["workflows"]["advances_expiring"]
    assert expiring["count"] == 2
    assert [w["workflow_id"] for w in expiring["workflows"]] == ["twice", "again"]
    alarm, = [p for p in info["problems"] if p.startswith("WORKFLOW ADVANCES EXPIRING")]
    assert ("2 workflows' advances let their lease expire again and again without "
            "finishing (twice (taken over 2 times, held by host-a:42), again (taken over 1 "
            "times, held by host-a:42))") in alarm
    assert "after 4 (reliable_beat_workflow_max_takeovers)" in alarm
    assert "once-live" not in alarm and "first-expiry" not in alarm and not info["ok"]

    checked = _cli(pg_store, "--check")
    assert checked.exit_code == 1
    assert "!! WORKFLOW ADVANCES EXPIRING: 2 workflows" in checked.output
    assert "after 3 (reliable_beat_workflow_max_takeovers)" in checked.output  # the default
    assert _metric(pg_store, "reliable_beat_workflows_advances_expiring") == 2.0
