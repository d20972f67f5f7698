"""IdempotentTask with real ``celery worker`` processes, real Redis and real PostgreSQL.

``--broker rabbitmq`` runs the same tests on the session's RabbitMQ node (there a SIGKILLed
worker's unacknowledged message comes back at once, with no visibility timeout).

Each worker is ``celery -A rb_task_app worker --pool solo -c 1`` on its own queue (unique
per test, so leftovers in the shared Redis never leak between tests). Waits poll the
database with a deadline; every subprocess is killed by a finalizer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat import runs
from reliable_beat.celery.task import KEY_HEADER
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, dead_letters

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"
sys.path.insert(0, str(APPS))
from rb_task_app import effects, meta, progress  # noqa: E402

CELERY = Path(sys.executable).parent / "celery"
pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(180)]


class Env:
    def __init__(self, pg_url: str, redis_url: str, store: Store, tmp: Path) -> None:
        self.pg_url, self.redis_url, self.store, self.tmp = pg_url, redis_url, store, tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.client = Celery("rb_client", broker=redis_url, set_as_current=False)
        self.client.conf.broker_connection_retry_on_startup = True
        self.client.conf.task_ignore_result = True
        self.tag = uuid.uuid4().hex[:8]

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{APPS}",
            "RB_BROKER_URL": self.redis_url,
            "RB_DATABASE_URL": self.pg_url,
            "RB_LEASE_SECONDS": "2",
        }

    def queue(self, name: str) -> str:
        return f"q-{self.tag}-{name}"

    def worker(self, name: str, pool: str = "solo", concurrency: int = 1
               ) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"worker-{name}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [str(CELERY), "-A", "rb_task_app", "worker", "--pool", pool, "-c", str(concurrency),
             "-Q", self.queue(name), "-n", f"{name}-{self.tag}@%h", "--without-gossip",
             "--without-mingle", "--without-heartbeat", "-l", "INFO"],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
        )
        self.procs.append(proc)
        return proc

    def send(self, task: str, args: list[Any], queue: str, key: str | None = None,
             headers: dict[str, Any] | None = None, task_id: str | None = None,
             **kwargs: Any) -> None:
        headers = {**({KEY_HEADER: key} if key else {}), **(headers or {})}
        self.client.send_task(task, args=args, kwargs=kwargs, queue=self.queue(queue),
                              headers=headers, task_id=task_id)

    def cli(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "reliable_beat.cli", "-A", "rb_task_app", *args],
            env=self.env, cwd=self.tmp, capture_output=True, text=True, timeout=60,
            input=input,
        )

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.tmp.glob("worker-*.log"))
        )

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
                except ProcessLookupError:
                    pass
            proc.wait(timeout=10)

    # ------------------------------------------------------------------ queries ----
    def scalar(self, stmt: Any) -> Any:
        with self.store.engine.connect() as conn:
            return conn.execute(stmt).scalar()

    def effects(self, key: str) -> list[dict[str, Any]]:
        with self.store.engine.connect() as conn:
            return [dict(r) for r in conn.execute(
                sa.select(effects).where(effects.c.key == key)).mappings()]

    def progress(self, key: str) -> list[dict[str, Any]]:
        with self.store.engine.connect() as conn:
            return [dict(r) for r in conn.execute(
                sa.select(progress).where(progress.c.key == key).order_by(progress.c.id)
            ).mappings()]

    def attempts(self, key: str) -> list[dict[str, Any]]:
        try:
            run = runs.get_run(self.store, key)
        except runs.RunNotFound:
            return []
        return runs.list_attempts(self.store, run["id"])

    def state(self, key: str) -> str | None:
        try:
            return str(runs.get_run(self.store, key)["state"])
        except runs.RunNotFound:
            return None

    def wait(self, what: str, cond: Callable[[], Any], timeout: float = 40.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            for proc in self.procs:
                if proc.poll() not in (None, -signal.SIGKILL):
                    pytest.fail(f"worker exited with {proc.returncode}\n{self.logs()}")
            time.sleep(0.1)
        pytest.fail(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")


@pytest.fixture
def env(server_url: str, broker_url: str, server_store: Store, tmp_path: Path) -> Iterator[Env]:
    """Workers on PostgreSQL and on MariaDB (``server_url``)."""
    meta.create_all(server_store.engine)
    e = Env(server_url, broker_url, server_store, tmp_path)
    try:
        yield e
    finally:
        e.kill_all()
        e.client.close()


def outcomes(rows: list[dict[str, Any]]) -> list[str]:
    return [r["outcome"] for r in rows]


def test_two_concurrent_invocations_same_key_one_effect(env: Env) -> None:
    env.worker("a")
    env.worker("b")
    key = "effect:concurrent"
    # Same work, two deliberate invocations, on two workers at once; the key is derived by
    # idempotency_key_for() from the arguments (no header).
    env.send("rb.write_effect", ["concurrent"], "a", sleep_first_attempt=1.5, sleep=1.5)
    env.send("rb.write_effect", ["concurrent"], "b", sleep_first_attempt=1.5, sleep=1.5)
    env.wait("succeeded + a second attempt that deduplicated",
             lambda: "succeeded" in outcomes(env.attempts(key))
             and "deduplicated" in outcomes(env.attempts(key)))
    time.sleep(1.0)  # let anything else that might happen, happen
    got = outcomes(env.attempts(key))
    assert got.count("succeeded") == 1, got
    assert got.count("deduplicated") + got.count("busy") >= 1, got
    assert len(env.effects(key)) == 1
    assert env.state(key) == "succeeded"


def test_sigkill_mid_body_redelivers_and_makes_one_effect(env: Env) -> None:
    a = env.worker("k")
    key = "effect:killed"
    env.send("rb.write_effect", ["killed"], "k", key=key, sleep_first_attempt=60)
    env.wait("body of attempt 1 started", lambda: env.progress(key))
    assert env.progress(key)[0]["pid"] == a.pid
    os.kill(a.pid, signal.SIGKILL)
    a.wait(timeout=10)
    env.worker("k")  # same queue: gets the message back after the visibility timeout
    env.wait("run succeeded after redelivery", lambda: env.state(key) == "succeeded", 60)
    rows = env.attempts(key)
    fences = [r["fence_token"] for r in rows if r["outcome"] in ("failed", "succeeded")]
    assert fences == [1, 2], rows
    assert rows[0]["outcome"] == "failed"  # the killed try, closed by the takeover
    assert "expired" in rows[0]["error"]
    eff = env.effects(key)
    assert len(eff) == 1 and eff[0]["fence"] == 2


def test_sigstop_past_lease_is_fenced_out_on_wake(env: Env) -> None:
    a = env.worker("stop-a")
    env.worker("stop-b")
    key = "effect:paused"
    env.send("rb.write_effect", ["paused"], "stop-a", key=key, sleep_first_attempt=1.0)
    env.wait("A inside its body", lambda: env.progress(key))
    os.kill(a.pid, signal.SIGSTOP)
    try:
        # A's uncommitted effect row exists; its lease (2 s) runs out while it is stopped.
        clock = ("clock_timestamp()" if env.store.dialect == "postgresql"
                 else "UTC_TIMESTAMP(6)")  # the store's clock, as the claim reads it
        env.wait("A's lease expired", lambda: env.scalar(
            sa.text(f"SELECT lease_expires_at < {clock} FROM reliable_beat_runs "
                    "WHERE idempotency_key = :k").bindparams(k=key)), 20)
        env.send("rb.write_effect", ["paused"], "stop-b", key=key)  # a duplicate trigger
        env.wait("B committed", lambda: env.state(key) == "succeeded", 30)
        assert [e["fence"] for e in env.effects(key)] == [2]
    finally:
        os.kill(a.pid, signal.SIGCONT)
    env.wait("A fenced out", lambda: "fenced_out" in outcomes(env.attempts(key)), 30)
    rows = env.attempts(key)
    by_fence = {r["fence_token"]: r["outcome"] for r in rows
                if r["outcome"] in ("fenced_out", "succeeded")}
    assert by_fence == {1: "fenced_out", 2: "succeeded"}, rows
    time.sleep(0.5)
    eff = env.effects(key)
    assert len(eff) == 1 and eff[0]["fence"] == 2  # A's write was rolled back
    assert runs.get_run(env.store, key)["fence_token"] == 2
    # the fenced-out end is expected: no ERROR "raised unexpected" with a traceback
    # (IdempotentTask.throws; a fresh user's finding)
    log = env.tmp / "worker-stop-a.log"
    env.wait("A's task end logged", lambda: "StaleFenceToken(" in log.read_text(
        errors="replace"), 15)
    logs = log.read_text(errors="replace")
    assert "raised unexpected" not in logs, logs[-3000:]


def test_transient_failures_then_success(env: Env) -> None:
    env.worker("flaky")
    key = "effect:flaky"
    env.send("rb.flaky", ["flaky", 2], "flaky")
    env.wait("success", lambda: env.state(key) == "succeeded", 40)
    rows = env.attempts(key)
    assert outcomes(rows) == ["retrying", "retrying", "succeeded"]
    assert [r["attempt"] for r in rows] == [1, 2, 3]
    assert [r["fence_token"] for r in rows] == [1, 2, 3]
    # Full jitter, base 1 s: retry k waits uniform(0, min(60, 2**k)) - the countdowns.
    assert 0 <= rows[0]["retry_in_seconds"] <= 1
    assert 0 <= rows[1]["retry_in_seconds"] <= 2
    assert "ConnectionError" in (rows[0]["error"] or "")
    assert len(env.effects(key)) == 1
    assert env.scalar(sa.select(sa.func.count()).select_from(dead_letters)) == 0


def test_permanent_failure_dead_letter_then_cli_requeue(env: Env) -> None:
    env.worker("perm")
    key = "effect:perm"
    flag = env.tmp / "fail.flag"
    flag.write_text("x")
    env.send("rb.permanent_unless_file_gone", ["perm", str(flag)], "perm")
    env.wait("dead", lambda: env.state(key) == "dead")
    time.sleep(2.0)  # a retry would show up within this (max countdown of k=0 is 1 s)
    assert outcomes(env.attempts(key)) == ["dead"]
    [dl] = runs.list_dead_letters(env.store)
    assert dl["reason"] == "permanent" and dl["key"] == key and dl["attempts"] == 1
    assert "PermanentError" in (dl["error"] or "")
    assert len(env.progress(key)) == 1

    listed = env.cli("dead-letters", "list")
    assert listed.returncode == 0 and key in listed.stdout, listed.stderr
    refused = env.cli("dead-letters", "requeue", str(dl["id"]), input="n\n")
    assert refused.returncode != 0 and env.state(key) == "dead"

    flag.unlink()
    done = env.cli("dead-letters", "requeue", str(dl["id"]), "--yes", "--by", "tester")
    assert done.returncode == 0, done.stderr
    env.wait("requeued run succeeded", lambda: env.state(key) == "succeeded")
    assert outcomes(env.attempts(key)) == ["dead", "succeeded"]
    assert len(env.effects(key)) == 1
    assert runs.get_dead_letter(env.store, dl["id"])["requeued_by"] == "tester"
    shown = env.cli("runs", "show", key)
    assert shown.returncode == 0 and "succeeded" in shown.stdout and "dead" in shown.stdout


def test_replay_of_completed_key_only_adds_a_deduplicated_attempt(env: Env) -> None:
    env.worker("replay")
    key = "effect:replay"
    env.send("rb.write_effect", ["replay"], "replay")
    # the body completes the run in its own transaction; the value it returns is stored just
    # after (runs.set_result): wait for both, or the replay's comparison races it
    env.wait("first run", lambda: env.state(key) == "succeeded"
             and runs.get_run(env.store, key)["result"] is not None)
    run_before = runs.get_run(env.store, key)
    eff_before = env.effects(key)
    n_attempts = env.scalar(sa.select(sa.func.count()).select_from(attempts))
    n_progress = len(env.progress(key))
    env.send("rb.write_effect", ["replay"], "replay", key=key)
    env.wait("deduplicated attempt", lambda: "deduplicated" in outcomes(env.attempts(key)))
    time.sleep(0.5)
    assert runs.get_run(env.store, key) == run_before
    assert env.effects(key) == eff_before
    assert len(env.progress(key)) == n_progress  # the body did not run
    assert env.scalar(sa.select(sa.func.count()).select_from(attempts)) == n_attempts + 1
    assert outcomes(env.attempts(key)) == ["succeeded", "deduplicated"]


def test_prefork_children_each_get_their_own_store(env: Env) -> None:
    env.worker("fork", pool="prefork", concurrency=2)
    names = [f"fork{i}" for i in range(6)]
    for name in names:
        env.send("rb.write_effect", [name], "fork", sleep_first_attempt=0.3)
    env.send("rb.write_effect", ["fork0"], "fork")  # a duplicate of the first
    env.wait("all succeeded", lambda: all(env.state(f"effect:{n}") == "succeeded"
                                          for n in names), 60)
    pids = {e["pid"] for n in names for e in env.effects(f"effect:{n}")}
    assert len(pids) == 2  # both children did work, each through its own engine
    env.wait("duplicate handled", lambda: len(env.attempts("effect:fork0")) >= 2, 20)
    assert all(len(env.effects(f"effect:{n}")) == 1 for n in names)


def test_scheduled_run_from_the_beat_headers(env: Env) -> None:
    """A run row as the beat writes it + a message as it publishes it: the row is reused."""
    from datetime import datetime, timezone

    from reliable_beat.beat import task_id_for
    from reliable_beat.db.tables import runs as runs_t

    env.worker("beat")
    fire_at = datetime(2026, 1, 10, 12, 0, tzinfo=timezone.utc)
    key = "nightly@2026-01-10T12:00:00Z"
    with env.store.begin() as conn:
        now = env.store.now(conn)
        conn.execute(runs_t.insert().values(
            idempotency_key=key, entry_name="nightly", fire_at=fire_at, trigger="catch_up",
            task="rb.write_effect", args=["nightly"], kwargs={}, state="dispatched",
            created_at=now, updated_at=now, dispatched_at=now))
    headers = {"reliable_beat_key": key, "reliable_beat_entry": "nightly",
               "reliable_beat_fire_at": "2026-01-10T12:00:00Z",
               "reliable_beat_trigger": "catch_up"}
    for _ in range(2):  # at-least-once trigger delivery: the same message twice
        env.send("rb.write_effect", ["nightly"], "beat", headers=headers,
                 task_id=task_id_for(key))
    env.wait("succeeded + deduplicated", lambda: sorted(outcomes(env.attempts(key)))
             == ["deduplicated", "succeeded"])
    [run] = runs.list_runs(env.store, entry="nightly")
    assert run["idempotency_key"] == key and run["fire_at"] == fire_at
    assert run["trigger"] == "catch_up" and run["dispatched_at"] is not None
    assert [a["task_id"] for a in env.attempts(key)] == [task_id_for(key)] * 2
    assert len(env.effects(key)) == 1
    assert not env.effects("effect:nightly")  # the header key wins over idempotency_key_for



def test_countdown_retries_do_not_stall_the_worker(env: Env) -> None:
    """A retry (``self.retry(countdown=...)``: an ETA message, run from the worker's timers)
    is acknowledged at once, so the worker goes on consuming. Celery queued that ack with
    ``hub.call_soon``, which waits for the hub's next timer or socket event (up to 10 s):
    with ``acks_late`` and prefetch 1 the worker sat idle, RabbitMQ's window full of
    executed but unacknowledged messages (the RabbitMQ fault run's backlog; see
    reliable_beat.celery.prompt_acks). 12 retried tasks and 12 plain ones, one solo worker:
    about 3 s acked at once; 71-132 s with the deferred acks."""
    env.worker("burst")
    n = 12
    t0 = time.monotonic()
    for i in range(n):
        env.send("rb.flaky", [f"b{i}"], "burst", fail_times=1)
        env.send("rb.write_effect", [f"w{i}"], "burst")
    env.wait("every retried and every plain task done", lambda: all(
        env.state(f"effect:b{i}") == "succeeded" and env.effects(f"effect:w{i}")
        for i in range(n)), 60)
    took = time.monotonic() - t0
    # 30 s is load slack (3 s measured); a deferred ack held the worker 10 s at a time.
    assert took < 30.0, f"{n} retried + {n} plain tasks took {took:.1f} s\n{env.logs()}"
    for i in range(n):
        assert outcomes(env.attempts(f"effect:b{i}")) == ["retrying", "succeeded"]
        assert len(env.effects(f"effect:b{i}")) == 1
