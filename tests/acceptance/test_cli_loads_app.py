"""The operator CLI sees what the worker sees: real ``reliable-beat -A proj`` and
``celery -A proj reliable-beat`` processes load the app's task modules (``include=`` and
``autodiscover_tasks``) before they check a task name or describe an entry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reliable_beat.db.dialects import Store

APPS = Path(__file__).resolve().parents[1] / "apps"
ROOT = APPS.parents[1]


def run(url: str, *argv: str, celery: bool = False) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, RELIABLE_BEAT_DATABASE_URL=url,
               PYTHONPATH=os.pathsep.join([str(ROOT), str(APPS)]))
    env.pop("RELIABLE_BEAT_APP", None)
    if celery:  # celery -A proj reliable-beat ARGS
        app, rest = argv[1], argv[2:]
        cmd = [sys.executable, "-m", "celery", "-A", app, "reliable-beat", *rest]
    else:  # reliable-beat -A proj ARGS
        cmd = [sys.executable, "-m", "reliable_beat.cli", *argv]
    return subprocess.run(cmd, env=env, cwd=str(APPS), capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("celery", [False, True], ids=["reliable-beat", "celery-subcommand"])
@pytest.mark.parametrize(("app", "task", "kind"), [
    ("cliproj", "cliproj.tasks.record", "idempotent"),
    ("autoproj", "autoproj.billing.tasks.invoice", "plain"),
])
def test_cli_knows_the_tasks_of_include_and_autodiscover(
    pg_store: Store, app: str, task: str, kind: str, celery: bool
) -> None:
    url = pg_store.url
    added = run(url, "-A", app, "entries", "add", "nightly", "--task", task,
                "--cron", "0 3 * * *", celery=celery)
    assert added.returncode == 0, added.stdout + added.stderr
    described = run(url, "-A", app, "entries", "describe", "nightly", "--json", celery=celery)
    assert described.returncode == 0, described.stdout + described.stderr
    info = json.loads(described.stdout)
    assert info["task"] == task and info["task_kind"] == kind
    # A name no module registers is still refused, naming the entry and the task.
    typo = run(url, "-A", app, "entries", "add", "typo", "--task", task + "x",
               "--cron", "0 3 * * *", celery=celery)
    assert typo.returncode == 2 and "not registered" in typo.stderr and "'typo'" in typo.stderr


def test_version_standalone_and_as_celery_subcommand(pg_store: Store) -> None:
    from reliable_beat import __version__

    for celery in (False, True):
        r = run(pg_store.url, "-A", "cliproj", "--version", celery=celery)
        assert r.returncode == 0 and r.stdout.strip() == f"reliable-beat {__version__}", r


def test_schedule_sync_refuses_an_older_config_unless_forced(pg_store: Store) -> None:
    """A rollback: the old config is older (the beats do not sync it); `schedule sync
    --force` with the rolled-back app makes it current."""
    old = json.dumps({"a": "0 * * * *", "b": "0 * * * *"})
    new = json.dumps({"a": "0 * * * *", "c": "0 * * * *"})

    def sync(schedule: str, *flags: str) -> subprocess.CompletedProcess[str]:
        os.environ["CLIPROJ_SCHEDULE"] = schedule
        try:
            return run(pg_store.url, "-A", "cliproj", "schedule", "sync", *flags)
        finally:
            del os.environ["CLIPROJ_SCHEDULE"]

    assert sync(old).returncode == 0
    assert sync(new).returncode == 0
    refused = sync(old, "--json")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "superseded" in json.loads(refused.stderr)["error"]["message"]
    forced = sync(old, "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    result = json.loads(forced.stdout)
    assert result["outcome"] == "forced" and result["disabled"] == ["c"]
    listed = json.loads(run(pg_store.url, "schedule", "list", "--json").stdout)
    current = [c for c in listed if c["current"]]
    assert len(current) == 1 and current[0]["entries"] == ["a", "b"]
