"""A real ``celery worker`` whose Redis restarts: it keeps running tasks, or says why it stops.

Celery 5.7 / kombu 5.7 stop a worker (``Unrecoverable error``, exit code 1) when Redis
restarts while the worker holds an unacknowledged message (a countdown or ETA task: every
``IdempotentTask`` retry): closing the lost connection raises
``AttributeError: 'NoneType' object has no attribute 'hostname'`` in kombu's Redis
transport. Not reliable_beat's code, but a worker that silently disappears is a silent edge:
the worker must then log ``worker_broker_loss: ...`` (cause and fix: a supervisor) before it
exits, and a restarted worker gets the held message back (nothing lost). A Celery that
survives the restarts passes too, by running a task after each one. Idle (nothing held),
the worker must survive Redis restarts and run a task after each.

One solo worker of ``tests/apps/rb_task_app.py`` on a private Redis with an AOF (restarted
on its own port, keeping its data, as a production Redis does) and the session's
PostgreSQL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from harness.faults import DurableRedis
from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import upgrade

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"
sys.path.insert(0, str(APPS))
from rb_task_app import effects, meta  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(120)]

IDLE_RESTARTS = 2
RESTARTS = 3


def restart(redis: DurableRedis) -> None:
    """Stop and start Redis on the same port (its AOF keeps queues and unacked messages)."""
    redis.stop()
    time.sleep(0.5)
    redis.start()


class Rig:
    def __init__(self, pg_url: str, redis: DurableRedis, store: Store, tmp: Path) -> None:
        self.pg_url, self.redis, self.store, self.tmp = pg_url, redis, store, tmp
        self.workers: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.client = Celery("rb_client", broker=redis.url, set_as_current=False)
        self.client.conf.broker_connection_retry_on_startup = True
        self.client.conf.task_ignore_result = True

    def worker(self) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.tmp / f"worker-{len(self.workers)}.log"
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{APPS}",
               "RB_BROKER_URL": self.redis.url, "RB_DATABASE_URL": self.pg_url,
               "PYTHONUNBUFFERED": "1"}
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "rb_task_app", "worker", "--pool",
                 "solo", "-n", f"w{len(self.workers)}@%h", "--without-gossip",
                 "--without-mingle", "--without-heartbeat", "-l", "INFO"],
                env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=self.tmp,
                start_new_session=True)
        self.workers.append((proc, log))
        return proc, log

    def send(self, name: str, task_id: str | None = None, **options: Any) -> None:
        self.client.send_task("rb.write_effect", args=[name], task_id=task_id, **options)

    def effect_count(self, name: str) -> int:
        with self.store.engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(effects).where(
                effects.c.key == f"effect:{name}")).scalar_one())

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-6000:]}"
                         for _, log in self.workers)

    def kill_all(self) -> None:
        for proc, _ in self.workers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def ran_or_exited(rig: Rig, proc: subprocess.Popen[bytes], name: str) -> bool:
    """The call ``name`` left its effect, or the worker exited."""
    return proc.poll() is not None or rig.effect_count(name) > 0


def wait(rig: Rig, what: str, cond: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{rig.logs()}")


@pytest.fixture
def rig(pg_url: str, tmp_path: Path) -> Iterator[Rig]:
    store = Store.from_url(pg_url, role="cli")
    upgrade(store)
    meta.create_all(store.engine)
    redis = DurableRedis()  # an AOF: a restart keeps queued and unacked messages
    with redis:
        r = Rig(pg_url, redis, store, tmp_path)
        try:
            yield r
        finally:
            r.kill_all()
            r.client.close()
            store.dispose()


def test_worker_survives_redis_restarts_or_says_why_it_stops(rig: Rig) -> None:
    proc, log = rig.worker()
    wait(rig, "the worker ready", lambda: " ready." in log.read_text(errors="replace"))
    # Idle (nothing held): the worker must reconnect and run the next call each time; our
    # worker hooks (prompt acks, the connection-loss guard) must not break a reconnect.
    for i in range(IDLE_RESTARTS + 1):
        if i:
            restart(rig.redis)
        name = f"idle-{i}"
        rig.send(name)
        wait(rig, f"IdempotentTask call {name} run (after {i} idle restarts)",
             partial(ran_or_exited, rig, proc, name))
        assert proc.poll() is None, f"worker exited on an idle Redis restart\n{rig.logs()}"
    # Held unacknowledged by the worker until its ETA, as an IdempotentTask retry is.
    held = f"held-{uuid.uuid4().hex[:8]}"
    rig.send("held", task_id=held, countdown=3600)
    wait(rig, "the countdown task received (held)",
         lambda: f"[{held}] received" in log.read_text(errors="replace"))

    for i in range(RESTARTS):
        restart(rig.redis)
        name = f"after-{i}"
        rig.send(name)
        wait(rig, f"the worker to run a task after Redis restart {i + 1}, or to exit",
             partial(ran_or_exited, rig, proc, name))
        if proc.poll() is not None:
            break

    if proc.poll() is None:
        return  # this Celery keeps its worker through the restarts, and it ran each task
    out = log.read_text(errors="replace")
    # Celery stopped it: never silently. Our ERROR comes before Celery's own CRITICAL.
    assert "worker_broker_loss: Celery's consumer failed while closing the lost broker " \
           "connection" in out, rig.logs()
    assert "under a supervisor that restarts it" in out, rig.logs()
    assert out.index("worker_broker_loss:") < out.index("Unrecoverable error"), rig.logs()
    assert proc.returncode == 1, rig.logs()
    # What a supervisor does: start it again. Nothing was lost: the held message comes
    # back (visibility_timeout, 5 s here) and the new worker runs new calls.
    _, log2 = rig.worker()
    rig.send("restarted")
    wait(rig, "the restarted worker's task", lambda: rig.effect_count("restarted"))
    wait(rig, "the held message redelivered to the restarted worker",
         lambda: f"[{held}] received" in log2.read_text(errors="replace"))
