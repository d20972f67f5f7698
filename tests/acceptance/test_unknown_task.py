"""A task name no process registers (a typo, a removed task), with real processes: the beat
parks the entry at its start-up sync (ERROR naming the fix; written disabled with the reason,
never fired, so no worker is sent triggers it drops), ``reliable-beat status`` shows it
QUARANTINED and ``--check`` fails, while the entry whose plain task the worker runs stays
clean and fires.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reliable_beat.db.dialects import Store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
import procs as procs_mod  # tests/apps

APPS = Path(__file__).resolve().parents[1] / "apps"
ROOT = APPS.parents[1]
REDISPATCH = 3.0


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[procs_mod.BeatProcs]:
    manager = procs_mod.BeatProcs(logdir=tmp_path)
    try:
        yield manager
    finally:
        manager.cleanup()


def status(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, **env, PYTHONPATH=os.pathsep.join([str(ROOT), str(APPS)]))
    return subprocess.run([sys.executable, "-m", "reliable_beat.cli", "-A", "beatapp",
                           "status", *args], env=full, cwd=str(APPS), capture_output=True,
                          text=True, timeout=120)


def test_unknown_task_is_flagged_by_beat_and_status(
    pg_store: Store, redis_url: str, procs: procs_mod.BeatProcs
) -> None:
    queue = f"rbq_{uuid.uuid4().hex[:10]}"
    env = {"RB_BROKER_URL": redis_url, "RELIABLE_BEAT_DATABASE_URL": pg_store.url,
           "RB_QUEUE": queue, "RB_MAX_LOOP": "1", "RB_REDISPATCH": str(REDISPATCH),
           "RB_ACKS": "1",
           "RB_SCHEDULE": json.dumps({
               "ok": {"every": 1},
               "typo": {"every": 1, "task": "beatapp.tikc"},
           })}
    procs.env.update(env)
    beat = procs.start("beat")
    worker = procs.start("worker", command=[
        "worker", "-l", "info", "-Q", queue, "-P", "solo", "-c", "1",
        "-n", f"w-{uuid.uuid4().hex[:6]}@%h", "--without-mingle", "--without-gossip"])
    procs_mod.wait_for(lambda: "entry 'typo'" in beat.output(), 90, "the beat's sync")

    def flagged() -> Any:
        r = status(env, "--json")
        if r.returncode != 0:
            return None
        info = json.loads(r.stdout)
        started = [e for e in info["entries"] if e["name"] == "ok" and e["last_fire_at"]]
        return info if info.get("quarantined") and started else None

    info = procs_mod.wait_for(flagged, 120, "status to show the parked entry", interval=1.0)
    assert [q["name"] for q in info["quarantined"]] == ["typo"], info["quarantined"]
    assert "task 'beatapp.tikc' is not registered" in info["quarantined"][0]["reason"]
    assert any(p.startswith("QUARANTINED") and "typo" in p for p in info["problems"])
    assert "typo" not in info["unstarted"], info["unstarted"]  # never fired: nothing sent
    typo = next(e for e in info["entries"] if e["name"] == "typo")
    assert typo["status"] == "quarantined" and typo["last_fire_at"] is None, typo
    checked = status(env, "--check")
    assert checked.returncode == 1 and "QUARANTINED" in checked.stdout
    out = beat.output()
    assert "ERROR" in out and "task 'beatapp.tikc' is not registered" in out, out[-3000:]
    assert "beatapp.tikc" not in worker.output()  # no trigger of it ever reached a worker
