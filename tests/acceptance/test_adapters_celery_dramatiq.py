"""The same guarantees, the same assertions, both adapters: one ``adapter`` fixture
parametrized over ``celery`` and ``dramatiq`` (issue 14 §3).

* ``celery``: real ``celery -A rb_task_app worker --pool solo`` and ``celery beat``
  (``ReliableScheduler``) processes;
* ``dramatiq``: real ``dramatiq dq_app -p 1 -t 1`` workers and ``reliable-beat dramatiq
  beat`` processes.

Both apps write to the same tables (``test_effects``: no unique constraint, so only the key
and the fence keep an effect single; ``test_progress``: committed at once, so a test sees a
body started) on the real PostgreSQL, through the broker of ``--broker`` (Redis, or the
session's RabbitMQ node). Every subprocess runs in its own session and is SIGKILLed by the
finalizer; waits poll the database with generous deadlines (the machine is shared).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox
from reliable_beat.db.tables import runs as runs_table
from tests.apps.adapter_rig import Rig, running

BIN = Path(sys.executable).parent
FRAMEWORKS = ["celery", "dramatiq"]
pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(300)]


class Adapter(Rig):
    """Processes and queries of one framework; subclasses say how to start and send."""

    #: the periodic task's / actor's name, as runs record it
    tick_task = ""
    #: the outbox destination of its beats' triggers
    trigger_destination = ""

    def framework_env(self) -> dict[str, str]:
        return {"RELIABLE_BEAT_DATABASE_URL": self.pg_url}

    def worker(self, name: str = "worker") -> subprocess.Popen[bytes]:
        raise NotImplementedError

    def beat(self, name: str = "beat") -> subprocess.Popen[bytes]:
        raise NotImplementedError

    def send_effect(self, name: str, sleep_first_attempt: float = 0.0) -> None:
        """Send ``write_effect(name)`` (key ``effect:<name>``, derived from the argument)."""
        raise NotImplementedError


class CeleryAdapter(Adapter):
    framework = "celery"
    tick_task = "rb.tick"
    trigger_destination = "celery"

    def worker(self, name: str = "worker") -> subprocess.Popen[bytes]:
        return self._start(name, [str(BIN / "celery"), "-A", "rb_task_app", "worker",
                                  "--pool", "solo", "-c", "1", "-Q", self.queue,
                                  "-n", f"{name}-{self.tag}@%h", "--without-gossip",
                                  "--without-mingle", "--without-heartbeat", "-l", "INFO"])

    def beat(self, name: str = "beat") -> subprocess.Popen[bytes]:
        return self._start(name, [str(BIN / "celery"), "-A", "rb_task_app", "beat", "-l",
                                  "INFO", "-s", str(self.tmp / f"{name}.schedule")])

    def send_effect(self, name: str, sleep_first_attempt: float = 0.0) -> None:
        code = ("import sys, json; from celery import Celery; "
                "c = Celery('client', broker=sys.argv[1]); "
                "c.conf.broker_connection_retry_on_startup = True; "
                "c.send_task('rb.write_effect', args=[sys.argv[2]], queue=sys.argv[3], "
                "kwargs={'sleep_first_attempt': float(sys.argv[4])}); c.close()")
        subprocess.run([sys.executable, "-c", code, self.broker_url, name, self.queue,
                        str(sleep_first_attempt)], env=self.env, cwd=self.tmp, check=True,
                       timeout=60)


class DramatiqAdapter(Adapter):
    framework = "dramatiq"
    tick_task = "tick"
    trigger_destination = "dramatiq"

    def worker(self, name: str = "worker") -> subprocess.Popen[bytes]:
        return self._start(name, [str(BIN / "dramatiq"), "dq_app", "-p", "1", "-t", "1",
                                  "-Q", self.queue])

    def beat(self, name: str = "beat") -> subprocess.Popen[bytes]:
        return self._start(name, [sys.executable, "-m", "reliable_beat.cli", "dramatiq",
                                  "beat", "--broker", "dq_app:broker"])

    def send_effect(self, name: str, sleep_first_attempt: float = 0.0) -> None:
        code = ("import sys, json; import dq_app; "
                "dq_app.broker.get_actor('write_effect').send("
                "sys.argv[1], sleep_first_attempt=float(sys.argv[2]))")
        subprocess.run([sys.executable, "-c", code, name, str(sleep_first_attempt)],
                       env=self.env, cwd=self.tmp, check=True, timeout=60)


@pytest.fixture(params=FRAMEWORKS)
def adapter(request: pytest.FixtureRequest, pg_url: str, broker_url: str, pg_store: Store,
            tmp_path: Path) -> Iterator[Adapter]:
    """Each test once per adapter, on the broker of ``--broker``."""
    if request.param == "dramatiq":
        pytest.importorskip("dramatiq")
    cls = CeleryAdapter if request.param == "celery" else DramatiqAdapter
    with running(cls(pg_url, broker_url, pg_store, tmp_path)) as a:
        yield a


def outcomes(rows: list[dict[str, Any]]) -> list[str]:
    return [r["outcome"] for r in rows]


def test_sigkill_mid_body_takeover_makes_one_effect(adapter: Adapter) -> None:
    """A worker SIGKILLed inside the body (effect uncommitted): the redelivered message is
    taken over by another worker after the lease (fence 2); the killed try is closed as
    ``failed`` (lease expired); exactly one effect, written under fence 2."""
    a = adapter.worker("worker-a")
    key = "effect:killed"
    adapter.send_effect("killed", sleep_first_attempt=60)
    adapter.wait("body of attempt 1 started", lambda: adapter.progress(key), 120)
    adapter.killpg(a)
    a.wait(timeout=20)
    adapter.worker("worker-b")
    adapter.wait("run succeeded after the takeover", lambda: adapter.state(key) == "succeeded",
                 120)
    rows = adapter.attempts(key)
    fences = [r["fence_token"] for r in rows if r["outcome"] in ("failed", "succeeded")]
    assert fences == [1, 2], rows
    assert rows[0]["outcome"] == "failed" and "expired" in (rows[0]["error"] or ""), rows
    assert outcomes(rows).count("succeeded") == 1, rows
    eff = adapter.effects(key)
    assert len(eff) == 1 and eff[0]["fence"] == 2, (eff, rows)


def test_two_beats_one_trigger_per_slot_one_effect_per_slot(adapter: Adapter) -> None:
    """Two beats of the framework on one store, a 1 s entry, a worker: every slot has one
    trigger row (of the framework's destination), one run and one effect."""
    adapter.extra["RB_PERIOD"] = "1"
    adapter.worker()
    beats = [adapter.beat("beat-a"), adapter.beat("beat-b")]
    adapter.wait("6 slots run", lambda: len(adapter.rows(sa.select(runs_table).where(
        runs_table.c.entry_name == "tick", runs_table.c.state == "succeeded"))) >= 6, 150)
    for proc in beats:
        assert proc.poll() is None, adapter.logs()  # both beats still running
        adapter.killpg(proc, signal.SIGTERM)
        proc.wait(timeout=30)
    triggers = adapter.rows(sa.select(outbox.c.message_id, outbox.c.destination)
                            .where(outbox.c.message_id.like("trigger:tick@%")))
    keys = [t["message_id"] for t in triggers]
    assert len(keys) == len(set(keys)) >= 6, triggers
    assert {t["destination"] for t in triggers} == {adapter.trigger_destination}
    time.sleep(3)  # let the worker finish what is in flight
    all_runs = adapter.rows(sa.select(runs_table).where(runs_table.c.entry_name == "tick"))
    assert len({r["fire_at"] for r in all_runs}) == len(all_runs)  # one run per slot
    per_key = [e["key"] for e in adapter.rows(sa.text("SELECT key FROM test_effects"))]
    assert len(per_key) == len(set(per_key)) >= 6, per_key  # one effect per slot
    succeeded = {r["idempotency_key"] for r in all_runs if r["state"] == "succeeded"}
    assert len(succeeded) >= 6 and succeeded <= set(per_key)
    assert {r["task"] for r in all_runs} == {adapter.tick_task}
    print(f"[{adapter.framework}] slots run {len(succeeded)}, triggers {len(keys)}, "
          f"effects {len(per_key)}, duplicates 0")
