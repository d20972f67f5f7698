"""Django-style settings (``config_from_object("django.conf:settings", namespace="CELERY")``)
with real ``celery beat`` and ``celery worker`` processes on PostgreSQL and Redis.

The settings are ``CELERY_RELIABLE_BEAT_DATABASE_URL`` & co. in a real settings module
(tests/apps/dj_settings.py). Before settings were read with Celery's namespace, every process
ignored them and used its own ``sqlite:///reliable_beat.sqlite3``: nothing reached
PostgreSQL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import runs

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"
CELERY = Path(sys.executable).parent / "celery"
pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(240)]


class Procs:
    def __init__(self, tmp: Path, pg_url: str, redis_url: str) -> None:
        self.tmp, self.pg_url, self.redis_url = tmp, pg_url, redis_url
        self.queue = f"dj-{uuid.uuid4().hex[:8]}"
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, *args: str, **extra: str) -> tuple[subprocess.Popen[bytes], Path]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RELIABLE_BEAT_", "CELERY_", "DJANGO_"))}
        env.update({"PYTHONPATH": f"{ROOT}{os.pathsep}{APPS}", "PYTHONUNBUFFERED": "1",
                    "RB_BROKER_URL": self.redis_url, "RB_DATABASE_URL": self.pg_url,
                    "RB_QUEUE": self.queue, **extra})
        log = self.tmp / f"{args[0]}-{len(self.procs)}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen([str(CELERY), "-A", "dj_celery", *args], cwd=self.tmp,
                                    env=env, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append((proc, log))
        return proc, log

    def cleanup(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def procs(tmp_path: Path, pg_url: str, redis_url: str) -> Iterator[Procs]:
    p = Procs(tmp_path, pg_url, redis_url)
    yield p
    p.cleanup()


def _logs(procs: Procs) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
                     for _, log in procs.procs)


def test_namespaced_django_settings_reach_postgres(procs: Procs, pg_url: str) -> None:
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE dj_effects (id serial PRIMARY KEY, "
                             "key varchar(200) NOT NULL, pid integer NOT NULL)"))
    beat, _ = procs.start("beat", "-l", "info", "--pidfile=", "-s",
                          str(procs.tmp / "celerybeat-schedule"))
    worker, _ = procs.start("worker", "--pool", "solo", "-c", "1", "-Q", procs.queue,
                            "-n", f"dj-{procs.queue}@%h", "--without-gossip",
                            "--without-mingle", "--without-heartbeat", "-l", "INFO")
    deadline = time.monotonic() + 120
    done = 0
    while time.monotonic() < deadline:
        assert beat.poll() is None and worker.poll() is None, _logs(procs)
        try:
            with engine.connect() as conn:
                done = conn.execute(
                    sa.select(sa.func.count()).select_from(runs).where(
                        runs.c.entry_name == "dj-tick", runs.c.state == "succeeded")
                ).scalar_one()
        except sa.exc.ProgrammingError:  # the beat has not created the schema yet
            done = 0
        if done >= 3:
            break
        time.sleep(0.5)
    assert done >= 3, f"no runs in PostgreSQL after 120 s\n{_logs(procs)}"
    with engine.connect() as conn:
        effects = conn.execute(sa.text(
            "SELECT key, count(*) FROM dj_effects GROUP BY key")).all()
    engine.dispose()
    assert effects and all(n == 1 for _, n in effects), effects
    # Nothing fell back to the embedded default store, and no process warned about it.
    assert not (procs.tmp / "reliable_beat.sqlite3").exists()
    assert "embedded default store" not in _logs(procs)


def test_namespaced_typo_stops_the_beat_naming_the_key(procs: Procs) -> None:
    beat, log = procs.start("beat", "-l", "info", "--pidfile=", "-s",
                            str(procs.tmp / "celerybeat-schedule"), RB_TYPO="1")
    try:
        beat.wait(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the beat ran with a misspelt setting\n{_logs(procs)}")
    text = log.read_text(errors="replace")
    assert beat.returncode != 0
    assert "CELERY_RELIABLE_BEAT_LEASE_SECOND " in text, text[-3000:]
    assert "CELERY_RELIABLE_BEAT_LEASE_SECONDS" in text, text[-3000:]


def test_default_store_warns_and_a_mixed_deployment_is_refused(
        procs: Procs, pg_store: Store) -> None:
    """The issue's setup: the beat lands on the embedded default store (its settings did
    not reach it) while the worker uses PostgreSQL. The beat says so at WARNING; the worker
    refuses its triggers at CRITICAL instead of running them against the wrong store."""
    beat, beat_log = procs.start("beat", "-l", "info", "--pidfile=", "-s",
                                 str(procs.tmp / "celerybeat-schedule"), RB_DATABASE_URL="")
    worker, worker_log = procs.start(
        "worker", "--pool", "solo", "-c", "1", "-Q", procs.queue, "-n",
        f"dj-{procs.queue}@%h", "--without-gossip", "--without-mingle",
        "--without-heartbeat", "-l", "INFO")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert beat.poll() is None and worker.poll() is None, _logs(procs)
        if "refused" in worker_log.read_text(errors="replace"):
            break
        time.sleep(0.5)
    beat_text, worker_text = (beat_log.read_text(errors="replace"),
                              worker_log.read_text(errors="replace"))
    assert "WARNING" in beat_text and "embedded default store" in beat_text, beat_text[-3000:]
    assert "CELERY_RELIABLE_BEAT_DATABASE_URL" in beat_text
    assert (procs.tmp / "reliable_beat.sqlite3").exists()
    refused = [ln for ln in worker_text.splitlines() if "refused" in ln]
    assert refused and "CRITICAL" in refused[0] and "dj-tick@" in refused[0], worker_text[-3000:]
    with pg_store.engine.connect() as conn:  # nothing ran against the worker's store
        assert conn.execute(sa.select(sa.func.count()).select_from(runs)).scalar_one() == 0
    # ... and `status --check` on the worker's store sees the refusals (dead letters).
    check = subprocess.run(
        [str(Path(sys.executable).parent / "reliable-beat"), "--database-url", pg_store.url,
         "status", "--check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "dead letters" in check.stdout
