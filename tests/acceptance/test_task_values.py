"""Issue 12 with real ``celery worker`` processes, real Redis and real PostgreSQL.

* Decimal / datetime / UUID returned: the run succeeds, the caller sees SUCCESS and the
  values, nothing is dead-lettered (so ``dead-letters requeue`` has nothing to run twice).
* Decimal / datetime / UUID arguments of an ad-hoc call arrive as those types and are
  stored as Celery's JSON carries them.
* A key the store can never take is refused once, visibly, not retried for ever.
* "Busy" retries (another runner holds the lease) do not spend Celery's ``max_retries``:
  the second message waits and deduplicates instead of being dropped.

Workers: ``celery -A values_app worker --pool solo`` on a queue of the test's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat import runs
from reliable_beat.celery.task import KEY_HEADER
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import dead_letters

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"
sys.path.insert(0, str(APPS))
from rb_task_app import effects, meta  # noqa: E402

CELERY = Path(sys.executable).parent / "celery"
pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(180)]

AMOUNT = Decimal("12.50")
AT = datetime(2026, 3, 1, 12, 30, tzinfo=timezone.utc)
REF = uuid.UUID("12345678-1234-5678-1234-567812345678")


class Env:
    def __init__(self, pg_url: str, redis_url: str, store: Store, tmp: Path) -> None:
        self.pg_url, self.redis_url, self.store, self.tmp = pg_url, redis_url, store, tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.client = Celery("rb_client", broker=redis_url, backend=redis_url,
                             set_as_current=False)
        self.client.conf.broker_connection_retry_on_startup = True
        self.tag = uuid.uuid4().hex[:8]

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{APPS}",
                "RB_BROKER_URL": self.redis_url, "RB_DATABASE_URL": self.pg_url,
                "RB_LEASE_SECONDS": "2"}

    def queue(self, name: str) -> str:
        return f"q-{self.tag}-{name}"

    def worker(self, name: str, pool: str = "solo") -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"worker-{name}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [str(CELERY), "-A", "values_app", "worker", "--pool", pool, "-c", "1",
             "-Q", self.queue(name), "-n", f"{name}-{self.tag}@%h", "--without-gossip",
             "--without-mingle", "--without-heartbeat", "-l", "INFO"],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
        )
        self.procs.append(proc)
        return proc

    def send(self, task: str, args: list[Any], queue: str, key: str | None = None,
             **kwargs: Any) -> Any:
        return self.client.send_task(task, args=args, kwargs=kwargs, queue=self.queue(queue),
                                     headers={KEY_HEADER: key} if key else {})

    def log(self, name: str) -> str:
        return (self.tmp / f"worker-{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                         for p in sorted(self.tmp.glob("worker-*.log")))

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
                except ProcessLookupError:
                    pass
            proc.wait(timeout=10)

    def rows(self, stmt: Any) -> list[dict[str, Any]]:
        with self.store.engine.connect() as conn:
            return [dict(r) for r in conn.execute(stmt).mappings()]

    def attempts(self, key: str) -> list[str]:
        try:
            run = runs.get_run(self.store, key)
        except runs.RunNotFound:
            return []
        return [r["outcome"] for r in runs.list_attempts(self.store, run["id"])]

    def wait(self, what: str, cond: Callable[[], Any], timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            for proc in self.procs:
                if proc.poll() is not None:
                    pytest.fail(f"worker exited with {proc.returncode}\n{self.logs()}")
            time.sleep(0.1)
        pytest.fail(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")


@pytest.fixture
def env(pg_url: str, redis_url: str, pg_store: Store, tmp_path: Path) -> Iterator[Env]:
    meta.create_all(pg_store.engine)
    e = Env(pg_url, redis_url, pg_store, tmp_path)
    try:
        yield e
    finally:
        e.kill_all()
        e.client.close()


def test_typed_results_succeed_once_and_the_caller_sees_them(env: Env) -> None:
    env.worker("w")
    expected = {"amount": AMOUNT, "at": AT, "ref": REF, "day": AT.date()}
    for use_transaction in (True, False):
        name = f"typed-{use_transaction}"
        result = env.send("rb.values.typed_result", [name, use_transaction], "w")
        # main: FAILURE with self.transaction(); a dead run (+ dead letter) without it
        assert result.get(timeout=60) == expected
        assert result.status == "SUCCESS"
        key = f"effect:{name}"
        run = runs.get_run(env.store, key)
        assert run["state"] == "succeeded", run
        assert run["result"]["amount"] == {"__type__": "decimal", "__value__": "12.50"}
        assert len(env.rows(sa.select(effects).where(effects.c.key == key))) == 1
        # a replay is deduplicated and answers the same values
        assert env.send("rb.values.typed_result", [name, use_transaction], "w").get(
            timeout=60) == expected
        assert env.attempts(key) == ["succeeded", "deduplicated"]
    assert env.rows(sa.select(dead_letters)) == []


def test_typed_ad_hoc_arguments_arrive_and_are_stored(env: Env) -> None:
    env.worker("w")
    result = env.send("rb.values.echo_args", ["args", AT, AMOUNT, REF], "w", day=AT.date())
    # main: a bare TypeError on the worker, no run row
    assert result.get(timeout=60) == ["datetime", "Decimal", "UUID", "date"]
    run = runs.get_run(env.store, "effect:args")
    assert run["state"] == "succeeded"
    assert run["args"][1:] == [
        {"__type__": "datetime", "__value__": AT.isoformat()},
        {"__type__": "decimal", "__value__": "12.50"},
        {"__type__": "uuid", "__value__": {"hex": REF.hex}},
    ]
    assert run["kwargs"] == {"day": {"__type__": "date", "__value__": "2026-03-01"}}


def test_key_over_the_limit_is_refused_once_and_visibly(env: Env) -> None:
    env.worker("w")
    key = "invoice:" + "9" * 500
    env.send("rb.values.typed_result", ["long", True], "w", key=key)
    # main: DataError at the claim read as transient: retried for ever, nothing recorded
    env.wait("a dead letter for the refused message",
             lambda: env.rows(sa.select(dead_letters)), 60)
    time.sleep(4.0)  # a retry would show up as a second refusal within this
    rows = env.rows(sa.select(dead_letters))
    assert len(rows) == 1, rows
    assert rows[0]["kind"] == "message" and rows[0]["reason"] == "invalid"
    assert rows[0]["payload"]["key"] == key
    assert "the limit is 400" in rows[0]["error"]
    assert env.log("w").count("refusing the message") == 1
    assert env.rows(sa.select(effects)) == []


def test_busy_retries_do_not_spend_max_retries(env: Env) -> None:
    """Task ``max_retries=1``; a second message for a key whose lease another worker holds
    for ~9 s is busy 3+ times. Main: the 2nd busy retry raised MaxRetriesExceededError and
    the message was dropped (no deduplicated attempt, the run left to the sweep)."""
    env.worker("a")
    env.worker("b")
    env.send("rb.values.hold", ["held", 9.0], "a")
    env.wait("first try in its body", lambda: "running" in env.attempts("effect:held"))
    second = env.send("rb.values.hold", ["held", 9.0], "b")
    assert second.get(timeout=90) == "held"  # main: MaxRetriesExceededError
    env.wait("the second message deduplicated after the first committed",
             lambda: "deduplicated" in env.attempts("effect:held"), 90)
    got = env.attempts("effect:held")
    assert got.count("succeeded") == 1 and got.count("busy") >= 2, got
    assert "MaxRetriesExceeded" not in env.log("b")
    assert len(env.rows(sa.select(effects).where(effects.c.key == "effect:held"))) == 1
    assert env.rows(sa.select(dead_letters)) == []


def test_typed_entry_arguments_reach_the_task_as_stock_beat_sends_them(env: Env) -> None:
    """A beat_schedule entry with datetime / Decimal / UUID / date arguments (stock beat
    sends them through Celery's JSON serializer; main refused the entry): stored in kombu's
    form, published by a real tick, decoded by the worker into the same types."""
    from reliable_beat.beat import Beat
    from reliable_beat.celery.scheduler import publish_triggers
    from reliable_beat.entries import definition_from_celery, sync_config_entries
    from reliable_beat.settings import Settings

    env.worker("w")
    with env.store.engine.connect() as conn:
        now = env.store.now(conn)
    definition = definition_from_celery(
        "typed-entry",
        {"task": "rb.values.echo_args", "schedule": 1.0,
         "args": ["entry", AT, AMOUNT, REF], "kwargs": {"day": AT.date()},
         "options": {"queue": env.queue("w")}},
        default_timezone="UTC", settings=Settings(), now=now,
    )
    sync_config_entries(env.store, [definition])
    triggers: list[Any] = []

    def tick() -> bool:
        triggers.extend(Beat(env.store, owner="test:1").tick().triggers)
        return bool(triggers)

    env.wait("a due slot", tick, 30)
    with env.store.engine.connect() as conn:
        at = env.store.now(conn)
    assert publish_triggers(env.store, env.client, triggers, at) == len(triggers)
    key = triggers[0].key
    # (the result is stored right after the commit of self.transaction(), in a second one)
    env.wait("the slot's run succeeded with its result",
             lambda: runs.get_run(env.store, key)["result"] is not None, 60)
    run = runs.get_run(env.store, key)
    assert run["state"] == "succeeded" and run["entry_name"] == "typed-entry"
    assert run["result"] == ["datetime", "Decimal", "UUID", "date"]
    assert run["args"][1] == {"__type__": "datetime", "__value__": AT.isoformat()}


def test_poison_message_dead_letters_after_max_retries_plus_one_tries(env: Env) -> None:
    """A message that kills its worker process on every try (prefork: the parent requeues
    it), ``max_retries=2``: each redelivery first finds the dead try's lease live (busy),
    waits for it without spending the budget, takes over, and after 3 tries the next claim
    dead-letters it. Main: the busy waits spent max_retries (MaxRetriesExceededError), the
    message was dropped and the run sat ``running``."""
    from rb_task_app import progress

    env.worker("p", pool="prefork")
    started = time.monotonic()
    env.send("rb.values.poison", ["poison"], "p")
    env.wait("the poison run dead-lettered",
             lambda: runs.get_run(env.store, "effect:poison")["state"] == "dead"
             if env.attempts("effect:poison") else False, 120)
    elapsed = time.monotonic() - started
    run = runs.get_run(env.store, "effect:poison")
    tries = env.rows(sa.select(progress).where(progress.c.key == "effect:poison"))
    [dl] = env.rows(sa.select(dead_letters))
    print(f"poison message dead-lettered after {elapsed:.1f}s; attempts: "
          f"{env.attempts('effect:poison')}")
    assert len(tries) == 3, tries  # max_retries=2: 3 tries ran the body
    assert run["attempts"] == 3 and dl["attempts"] == 3 and dl["reason"] == "exhausted"
    assert "MaxRetriesExceeded" not in env.log("p")
