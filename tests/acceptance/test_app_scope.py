"""Two Celery apps with their own brokers (two Redis databases) on one PostgreSQL store, real
processes: two beats of ``proj``, one of ``proj2``, a worker each. Every slot of each app's
entries (a plain task and an ``IdempotentTask``) starts on its own app's worker, on time (no
re-dispatch delay), none lost.

Before schedule groups scoped the firing, any beat claimed any group's due entries and
published them into its own broker: ``proj2``'s worker dropped ``proj``'s triggers as
unregistered tasks (plain slots lost, ``IdempotentTask`` slots a re-dispatch late).
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import runs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
import procs as procs_mod  # tests/apps

EVERY = 2  # seconds between slots
RUN_FOR = 40.0  # seconds of firing observed
LATE = 20.0  # a start this long after its slot is late (re-dispatch is 120 s)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[procs_mod.BeatProcs]:
    manager = procs_mod.BeatProcs(logdir=tmp_path)
    try:
        yield manager
    finally:
        manager.cleanup()


def _worker(procs: procs_mod.BeatProcs, app: str, env: dict[str, str]) -> procs_mod.Beat:
    return procs.start(f"worker-{app}", app="scopeapp", command=[
        "worker", "-l", "info", "-Q", env["RB_QUEUE"], "-P", "solo", "-c", "1",
        "-n", f"{app}-{uuid.uuid4().hex[:6]}@%h", "--without-mingle", "--without-gossip",
    ], **env)


def _beat(procs: procs_mod.BeatProcs, name: str, tmp: Path, env: dict[str, str]
          ) -> procs_mod.Beat:
    return procs.start(name, app="scopeapp", command=[
        "beat", "-l", "info", "--pidfile=", "-s", str(tmp / f"{name}-schedule")], **env)


def test_two_apps_with_their_own_brokers_each_run_their_own_slots(
    pg_store: Store, redis_url: str, second_redis_url: str, procs: procs_mod.BeatProcs,
    tmp_path: Path,
) -> None:
    procs.env["RELIABLE_BEAT_DATABASE_URL"] = pg_store.url
    apps: dict[str, dict[str, str]] = {}
    for app, broker in (("proj", redis_url), ("proj2", second_redis_url)):
        apps[app] = {
            "RB_APP": app, "RB_BROKER_URL": broker, "RB_QUEUE": f"q_{app}",
            "RB_REDISPATCH": "120",
            "RB_SCHEDULE": json.dumps({f"{app}-plain": {"every": EVERY, "task": "plain"},
                                       f"{app}-idem": {"every": EVERY, "task": "idem"}}),
        }
    workers = {app: _worker(procs, app, env) for app, env in apps.items()}
    beats = [_beat(procs, "beat-proj-a", tmp_path, apps["proj"]),
             _beat(procs, "beat-proj-b", tmp_path, apps["proj"]),
             _beat(procs, "beat-proj2", tmp_path, apps["proj2"])]

    def synced() -> bool:
        with pg_store.engine.connect() as conn:
            return len(conn.execute(select(runs.c.entry_name).distinct()).all()) == 4

    procs_mod.wait_for(synced, 120, "every entry to fire once", interval=1.0)
    time.sleep(RUN_FOR)
    for beat in beats:
        assert beat.alive(), beat.output()[-3000:]
    with pg_store.begin() as conn:
        now = pg_store.now(conn)
        rows = conn.execute(
            select(runs.c.entry_name, runs.c.fire_at, runs.c.started_at, runs.c.state)
            .where(runs.c.fire_at <= now - timedelta(seconds=LATE))
            .order_by(runs.c.fire_at)
        ).all()
    by_entry: dict[str, list[float | None]] = {}
    for r in rows:
        delay = (r.started_at - r.fire_at).total_seconds() if r.started_at else None
        by_entry.setdefault(r.entry_name, []).append(delay)
    problems = {
        name: [d for d in delays if d is None or d > LATE]
        for name, delays in by_entry.items()
    }
    problems = {n: p for n, p in problems.items() if p}
    logs = {a: w.output() for a, w in workers.items()}
    assert not problems, (
        f"slots never started (None) or late (s): {problems}\n"
        f"unregistered: {[a for a, o in logs.items() if 'unregistered task' in o]}"
    )
    assert sorted(by_entry) == ["proj-idem", "proj-plain", "proj2-idem", "proj2-plain"]
    least = min(len(d) for d in by_entry.values())
    assert least >= RUN_FOR / EVERY / 3, by_entry  # the grid kept firing (under load)
    for app, out in logs.items():
        assert "unregistered task" not in out, (app, out[-3000:])
    worst = max(d for delays in by_entry.values() for d in delays if d is not None)
    print(f"\n[app scope] slots per entry: { {n: len(d) for n, d in by_entry.items()} }; "
          f"worst start delay {worst:.2f} s")
