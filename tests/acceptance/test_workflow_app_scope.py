"""Two Celery apps with their own brokers (two Redis databases) on one PostgreSQL store, each
with its own worker, relay and beat (real processes), each running its own workflows: every
workflow (started by the app, its children, and the scheduled ones of its beat entry with
overlap policy ``skip``) completes in its own app; none is blocked, no worker receives the
other app's messages.

Before workflows recorded their schedule group, each app's relay published the other app's
workflow messages (wakes, activity messages, timer wakes) into its own broker: its worker
blocked the other app's workflows (``unknown workflow 'proj2.flow'``) or dropped their
activities as unregistered tasks, and a scheduled entry with overlap policy ``skip`` then
skipped every later slot.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import select

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox, workflows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
import procs as procs_mod  # tests/apps

STARTED = 4  # workflows each app starts (each has a child: 8 workflows per app)
EVERY = 4  # seconds between the slots of each app's scheduled-workflow entry
APPS = ("proj", "proj2")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[procs_mod.BeatProcs]:
    manager = procs_mod.BeatProcs(logdir=tmp_path)
    try:
        yield manager
    finally:
        manager.cleanup()


def _start(procs: procs_mod.BeatProcs, kind: str, app: str, env: dict[str, str],
           tmp: Path) -> procs_mod.Beat:
    command = {
        "worker": ["worker", "-l", "info", "-Q", env["RB_QUEUE"], "-P", "solo", "-c", "1",
                   "-n", f"{app}-{uuid.uuid4().hex[:6]}@%h", "--without-mingle",
                   "--without-gossip"],
        "relay": ["reliable-beat", "relay"],
        "beat": ["beat", "-l", "info", "--pidfile=", "-s", str(tmp / f"{app}-schedule")],
    }[kind]
    return procs.start(f"{kind}-{app}", app="wfscopeapp", command=command, **env)


def test_two_apps_with_their_own_brokers_each_run_their_own_workflows(
    pg_store: Store, redis_url: str, second_redis_url: str, procs: procs_mod.BeatProcs,
    tmp_path: Path,
) -> None:
    procs.env["RELIABLE_BEAT_DATABASE_URL"] = pg_store.url
    # one queue name in both brokers (as two apps' default queues are): a message published
    # into the wrong broker reaches the other app's worker, not an unconsumed queue
    envs = {app: {"RB_APP": app, "RB_BROKER_URL": broker, "RB_QUEUE": "celery",
                  "RB_SCHEDULE": str(EVERY)}
            for app, broker in (("proj", redis_url), ("proj2", second_redis_url))}
    started = {app: [_start(procs, kind, app, env, tmp_path)
                     for kind in ("worker", "relay", "beat")]
               for app, env in envs.items()}
    for app, env in envs.items():  # each app starts its workflows (a task of its own)
        client = Celery(app, broker=env["RB_BROKER_URL"])
        try:
            client.send_task(f"{app}.kick", args=[STARTED, f"{app}-wf"],
                             queue=env["RB_QUEUE"])
        finally:
            client.close()

    def state() -> list[tuple[str, str, str, str | None]]:
        with pg_store.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(  # type: ignore[misc]
                select(workflows.c.workflow_id, workflows.c.name, workflows.c.state,
                       workflows.c.schedule_group)).all()]

    def done() -> bool:
        rows = state()
        blocked = [r for r in rows if r[2] in ("blocked", "failed")]
        assert not blocked, (blocked, {a: p[0].output()[-3000:] for a, p in started.items()})
        for app in APPS:
            mine = [r for r in rows if r[1].startswith(f"{app}.")]
            kicked = [r for r in mine if r[0].startswith(f"{app}-wf-")]
            scheduled = [r for r in mine if r[1] == f"{app}.flow"
                         and not r[0].startswith(f"{app}-wf-")]
            completed = [r for r in mine if r[2] == "completed"]
            # the kicked workflows, their children, two scheduled slots and their children
            if len(kicked) < 2 * STARTED or len(scheduled) < 2 or len(completed) < len(kicked) + 4:
                return False
        return True

    try:
        procs_mod.wait_for(done, 240, "every app's workflows to complete", interval=1.0)
    except AssertionError as exc:
        logs = {p.name: p.output()[-2500:] for ps in started.values() for p in ps}
        raise AssertionError(f"{exc}; workflows: {state()}; logs: {logs}") from None
    rows = state()
    for app in APPS:
        mine = [r for r in rows if r[1].startswith(f"{app}.")]
        # started by the app, a child (its parent's), a scheduled slot (its entry's): all
        # recorded in the app's own schedule group
        assert {r[3] for r in mine} == {app}, mine
        kicked = [r for r in mine if r[0].startswith(f"{app}-wf-")]
        assert all(r[2] == "completed" for r in kicked), kicked
    assert not [r for r in rows if r[2] in ("blocked", "failed")], rows
    with pg_store.engine.connect() as conn:
        groups = set(conn.execute(select(outbox.c.schedule_group).distinct()).scalars())
    assert {"proj", "proj2"} <= groups, groups  # the workflow messages carried the group
    for app, processes in started.items():
        for p in processes:
            assert p.alive(), (app, p.name, p.output()[-3000:])
        worker_log = processes[0].output()
        for bad in ("unknown workflow", "unregistered task"):
            assert bad not in worker_log, (app, bad, worker_log[-4000:])
