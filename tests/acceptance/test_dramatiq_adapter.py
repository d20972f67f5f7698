"""The Dramatiq adapter with real ``dramatiq`` worker processes and real
``reliable-beat dramatiq beat`` processes, on the real Redis and PostgreSQL the tests start.

Each test gets its own Redis namespace and queue (no leftovers between tests) and its own
database; every subprocess runs in its own session and is SIGKILLed by the finalizer.
Waits poll the database with generous deadlines (the machine is shared).
"""

from __future__ import annotations

import contextlib
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

pytest.importorskip("dramatiq")

from reliable_beat import runs
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import dead_letters, outbox
from reliable_beat.db.tables import runs as runs_table

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"
DRAMATIQ = Path(sys.executable).parent / "dramatiq"
pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(240)]


class DqEnv:
    def __init__(self, pg_url: str, redis_url: str, store: Store, tmp: Path) -> None:
        self.pg_url, self.redis_url, self.store, self.tmp = pg_url, redis_url, store, tmp
        self.tag = uuid.uuid4().hex[:8]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.extra: dict[str, str] = {}

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{APPS}",
                "PYTHONUNBUFFERED": "1", "RB_BROKER_URL": self.redis_url,
                "RB_DATABASE_URL": self.pg_url, "RB_NAMESPACE": f"dq-{self.tag}",
                "RB_QUEUE": f"q-{self.tag}", "RB_LEASE_SECONDS": "2", **self.extra}

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                cwd=self.tmp, start_new_session=True)
        self.procs.append(proc)
        return proc

    def worker(self, name: str = "worker") -> subprocess.Popen[bytes]:
        """``dramatiq dq_app -p 1 -t 1 -Q <queue>``: one process, one thread."""
        return self._start(name, [str(DRAMATIQ), "dq_app", "-p", "1", "-t", "1",
                                  "-Q", f"q-{self.tag}"])

    def beat(self, name: str = "beat") -> subprocess.Popen[bytes]:
        return self._start(name, [sys.executable, "-m", "reliable_beat.cli", "dramatiq", "beat",
                                  "--broker", "dq_app:broker"])

    def relay(self, name: str = "relay") -> subprocess.Popen[bytes]:
        return self._start(name, [sys.executable, "-m", "reliable_beat.cli", "dramatiq",
                                  "relay", "--broker", "dq_app:broker"])

    def send(self, actor: str, *args: Any, key: str | None = None, **kwargs: Any) -> None:
        """Send a message through the app's broker, from a separate process (like a client)."""
        code = ("import sys, json; import dq_app; a = dq_app.broker.get_actor(sys.argv[1]); "
                "args, kwargs, key = json.loads(sys.argv[2]); "
                "(a.send_with_key(key, *args, **kwargs) if key else a.send(*args, **kwargs))")
        import json

        subprocess.run([sys.executable, "-c", code, actor, json.dumps([args, kwargs, key])],
                       env=self.env, cwd=self.tmp, check=True, timeout=60)

    def killpg(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.killpg(proc, signal.SIGCONT)
                self.killpg(proc)
            proc.wait(timeout=20)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.tmp.glob("*.log")))

    def rows(self, stmt: Any) -> list[dict[str, Any]]:
        with self.store.engine.connect() as conn:
            return [dict(r) for r in conn.execute(stmt).mappings()]

    def effects(self, key: str) -> list[dict[str, Any]]:
        return self.rows(sa.text("SELECT * FROM test_effects WHERE key = :k").bindparams(k=key))

    def attempts(self, key: str) -> list[dict[str, Any]]:
        try:
            return runs.list_attempts(self.store, runs.get_run(self.store, key)["id"])
        except runs.RunNotFound:
            return []

    def state(self, key: str) -> str | None:
        try:
            return str(runs.get_run(self.store, key)["state"])
        except runs.RunNotFound:
            return None

    def wait(self, what: str, cond: Callable[[], Any], timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            time.sleep(0.2)
        pytest.fail(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")


@pytest.fixture
def dq(pg_url: str, redis_url: str, pg_store: Store, tmp_path: Path) -> Iterator[DqEnv]:
    sys.path.insert(0, str(APPS))
    try:
        from dq_app import meta
    finally:
        sys.path.remove(str(APPS))
    meta.create_all(pg_store.engine)
    e = DqEnv(pg_url, redis_url, pg_store, tmp_path)
    try:
        yield e
    finally:
        e.kill_all()


def outcomes(rows: list[dict[str, Any]]) -> list[str]:
    return [r["outcome"] for r in rows]


def test_two_beats_one_trigger_per_slot_one_effect_per_slot(dq: DqEnv) -> None:
    dq.extra["RB_PERIOD"] = "1"
    dq.worker()
    dq.beat("beat-a")
    dq.beat("beat-b")
    dq.wait("6 slots run", lambda: len(dq.rows(sa.select(runs_table).where(
        runs_table.c.state == "succeeded"))) >= 6, 120)
    for proc in dq.procs[1:]:
        assert proc.poll() is None, dq.logs()  # both beats still running
        dq.killpg(proc, signal.SIGTERM)
        proc.wait(timeout=30)
    triggers = dq.rows(sa.select(outbox.c.message_id, outbox.c.destination, outbox.c.claimed_by)
                       .where(outbox.c.message_id.like("trigger:tick@%")))
    keys = [t["message_id"] for t in triggers]
    assert len(keys) == len(set(keys)) >= 6, triggers
    assert {t["destination"] for t in triggers} == {"dramatiq"}
    time.sleep(3)  # let the worker finish what is in flight
    all_runs = dq.rows(sa.select(runs_table).where(runs_table.c.entry_name == "tick"))
    assert len({r["fire_at"] for r in all_runs}) == len(all_runs)  # one run per slot
    effects = dq.rows(sa.text("SELECT key FROM test_effects"))
    per_key = [e["key"] for e in effects]
    assert len(per_key) == len(set(per_key)) >= 6, per_key  # one effect per slot
    succeeded = {r["idempotency_key"] for r in all_runs if r["state"] == "succeeded"}
    assert len(succeeded) >= 6 and succeeded <= set(per_key)
    assert {r["task"] for r in all_runs} == {"tick"}


def test_sigkill_mid_body_and_duplicate_delivery_make_one_effect(dq: DqEnv) -> None:
    a = dq.worker("worker-a")
    key = "effect:killed"
    dq.send("write_effect", "killed", sleep_first_attempt=60)
    dq.wait("body of attempt 1 started", lambda: dq.rows(
        sa.text("SELECT * FROM test_progress WHERE key = :k").bindparams(k=key)), 90)
    dq.killpg(a)
    a.wait(timeout=20)
    dq.worker("worker-b")
    dq.send("write_effect", "killed")  # a duplicate delivery of the same work (same key)
    dq.wait("run succeeded after the takeover", lambda: dq.state(key) == "succeeded", 120)
    time.sleep(4)  # the redelivered message (heartbeat timeout 3 s) is processed too
    dq.wait("the second message deduplicated or found the lease busy",
            lambda: {"deduplicated"} & set(outcomes(dq.attempts(key)))
            or len(dq.attempts(key)) >= 3, 60)
    rows = dq.attempts(key)
    assert outcomes(rows).count("succeeded") == 1, rows
    assert rows[0]["outcome"] == "failed" and rows[0]["fence_token"] == 1, rows
    eff = dq.effects(key)
    assert len(eff) == 1 and eff[0]["fence"] >= 2, (eff, rows)


def test_transient_failures_retry_then_succeed(dq: DqEnv) -> None:
    dq.worker()
    dq.send("flaky", "t2", 2, key="flaky:t2")
    dq.wait("succeeded after two retries", lambda: dq.state("flaky:t2") == "succeeded", 120)
    assert outcomes(dq.attempts("flaky:t2")) == ["retrying", "retrying", "succeeded"]
    assert len(dq.effects("flaky:t2")) == 1


def test_transient_then_permanent_failure_is_a_dead_letter(dq: DqEnv) -> None:
    dq.worker()
    dq.send("flaky", "perm", 1, then_permanent=True, key="flaky:perm")
    dq.wait("dead", lambda: dq.state("flaky:perm") == "dead", 120)
    assert outcomes(dq.attempts("flaky:perm")) == ["retrying", "dead"]
    letters = dq.rows(sa.select(dead_letters).where(
        dead_letters.c.key == "flaky:perm"))
    assert len(letters) == 1, letters
    assert letters[0]["payload"]["actor"] == "flaky"
    assert letters[0]["payload"]["options"]["reliable_beat"]["key"] == "flaky:perm"
    # Dramatiq failed the message too (throws): it is in the queue's dead-letter set.
    import redis

    r = redis.Redis.from_url(dq.redis_url)
    dq.wait("message in .XQ", lambda: r.zcard(f"dq-{dq.tag}:q-{dq.tag}.XQ") == 1, 30)
    assert not dq.effects("flaky:perm")


def test_exhausted_budget_is_a_dead_letter(dq: DqEnv) -> None:
    dq.worker()
    dq.send("flaky", "ex", 99, key="flaky:ex")  # always transient; budget 4 tries
    dq.wait("dead (exhausted)", lambda: dq.state("flaky:ex") == "dead", 150)
    assert outcomes(dq.attempts("flaky:ex")) == ["retrying"] * 3 + ["dead"]
    assert runs.get_run(dq.store, "flaky:ex")["reason"] == "exhausted"


def test_time_limit_interrupt_is_a_transient_failure(dq: DqEnv) -> None:
    """Dramatiq's TimeLimit interrupts the body asynchronously (a BaseException, §6 trap):
    recorded ``retrying`` and retried by us; the next try succeeds. One effect."""
    dq.worker()
    dq.send("slow", "tl", key="slow:tl")
    dq.wait("succeeded after the time limit", lambda: dq.state("slow:tl") == "succeeded", 120)
    assert outcomes(dq.attempts("slow:tl")) == ["retrying", "succeeded"]
    assert len(dq.effects("slow:tl")) == 1


def test_outbox_row_to_dramatiq_is_delivered_by_the_relay(dq: DqEnv) -> None:
    """An actor commits an outbox row for the ``dramatiq`` destination with its run;
    ``reliable-beat dramatiq relay`` delivers it as a Dramatiq message; the target runs once."""
    dq.worker()
    dq.send("fan_out", "fo", key="fan_out:fo")
    dq.wait("fan_out succeeded", lambda: dq.state("fan_out:fo") == "succeeded", 90)
    assert dq.rows(sa.select(outbox.c.state).where(outbox.c.destination == "dramatiq")
                   ) == [{"state": "pending"}]
    dq.relay()
    dq.wait("the outbox row was delivered and ran", lambda: dq.state("effect:fo") == "succeeded",
            120)
    assert dq.rows(sa.select(outbox.c.state).where(outbox.c.destination == "dramatiq")
                   ) == [{"state": "sent"}]
    assert len(dq.effects("effect:fo")) == 1


def test_beat_refuses_a_bad_periodic_entry_naming_it(dq: DqEnv) -> None:
    dq.extra["RB_BAD_PERIODIC"] = "1"
    beat = dq.beat("bad")
    assert beat.wait(timeout=60) == 2, dq.logs()
    out = dq.logs()
    assert "bad_cron" in out and "61 * * * *" in out, out
    assert "Traceback" not in out, out


def test_beat_started_before_the_schema_waits_then_fires(
    pg_url: str, redis_url: str, tmp_path: Path
) -> None:
    """A Dramatiq beat started before the deploy's migration step (an empty database) says
    why it waits and keeps waiting; once ``db upgrade`` ran it syncs and fires. Fails on the
    old Dramatiq beat: it exited at once on the missing schema (the core loop's start-up
    wait was only in the Celery scheduler)."""
    from reliable_beat.db.migrate import upgrade

    sys.path.insert(0, str(APPS))
    try:
        from dq_app import meta
    finally:
        sys.path.remove(str(APPS))
    store = Store.from_url(pg_url, role="cli")
    env = DqEnv(pg_url, redis_url, store, tmp_path)
    env.extra["RB_PERIOD"] = "1"
    try:
        beat = env.beat("early")
        env.wait("the beat to say it waits for the schema",
                 lambda: "waiting for it" in env.logs(), 90)
        time.sleep(1.5)
        assert beat.poll() is None, env.logs()  # still waiting, not exited
        upgrade(store)
        meta.create_all(store.engine)
        env.worker()
        env.wait("a slot run by the beat that waited", lambda: env.rows(
            sa.select(runs_table).where(runs_table.c.state == "succeeded")), 120)
        assert beat.poll() is None, env.logs()
    finally:
        env.kill_all()
        store.dispose()
