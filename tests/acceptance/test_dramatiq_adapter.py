"""The Dramatiq adapter with real ``dramatiq`` worker processes and real
``reliable-beat dramatiq beat`` processes, on the real Redis and PostgreSQL the tests start.

``--broker rabbitmq`` runs the same tests on the session's RabbitMQ node with Dramatiq's
``RabbitmqBroker(confirm_delivery=True)`` (publisher confirms: a trigger marked sent is in
the broker; a SIGKILLed worker's deliveries come back when its connection drops).

Each test gets its own Redis namespace and queue (no leftovers between tests) and its own
database; every subprocess runs in its own session and is SIGKILLed by the finalizer.
Waits poll the database with generous deadlines (the machine is shared).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

pytest.importorskip("dramatiq")

from reliable_beat import runs
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import dead_letters, outbox
from reliable_beat.db.tables import runs as runs_table
from tests.apps.adapter_rig import Rig, create_test_tables, running

DRAMATIQ = Path(sys.executable).parent / "dramatiq"
pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(240)]


class DqEnv(Rig):
    """The Dramatiq processes of one test (``redis_url``: the broker of ``--broker``)."""

    wait_timeout = 60.0

    def __init__(self, pg_url: str, redis_url: str, store: Store, tmp: Path) -> None:
        super().__init__(pg_url, redis_url, store, tmp)
        self.redis_url = redis_url
        self.amqp = redis_url.startswith("amqp")  # --broker rabbitmq

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

    def cli(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        """``reliable-beat dramatiq ARGS --broker dq_app:broker``."""
        return subprocess.run([sys.executable, "-m", "reliable_beat.cli", "dramatiq", *args,
                               "--broker", "dq_app:broker"], env=self.env, cwd=self.tmp,
                              capture_output=True, text=True, timeout=timeout)

    def dead_lettered_messages(self) -> int:
        """Messages in Dramatiq's dead-letter queue ``<queue>.XQ`` of the test's queue."""
        queue = f"q-{self.tag}.XQ"
        if self.amqp:
            import pika

            from reliable_beat.dramatiq import rabbitmq_url

            conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url(self.redis_url)))
            try:
                return int(conn.channel().queue_declare(queue, passive=True)
                           .method.message_count)
            except pika.exceptions.ChannelClosedByBroker:  # not declared yet
                return 0
            finally:
                with contextlib.suppress(Exception):
                    conn.close()
        import redis

        r = redis.Redis.from_url(self.redis_url)
        try:
            return int(r.zcard(f"dq-{self.tag}:{queue}"))
        finally:
            r.close()

    def send(self, actor: str, *args: Any, key: str | None = None, **kwargs: Any) -> None:
        """Send a message through the app's broker, from a separate process (like a client)."""
        code = ("import sys, json; import dq_app; a = dq_app.broker.get_actor(sys.argv[1]); "
                "args, kwargs, key = json.loads(sys.argv[2]); "
                "(a.send_with_key(key, *args, **kwargs) if key else a.send(*args, **kwargs))")
        import json

        subprocess.run([sys.executable, "-c", code, actor, json.dumps([args, kwargs, key])],
                       env=self.env, cwd=self.tmp, check=True, timeout=60)


@pytest.fixture
def dq(pg_url: str, broker_url: str, pg_store: Store, tmp_path: Path) -> Iterator[DqEnv]:
    """Redis (default) or, with ``--broker rabbitmq``, the session's RabbitMQ node."""
    with running(DqEnv(pg_url, broker_url, pg_store, tmp_path)) as e:
        yield e


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
    # Dramatiq failed the message too (throws): it is in the queue's dead-letter queue.
    dq.wait("message in .XQ", lambda: dq.dead_lettered_messages() == 1, 30)
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
        create_test_tables(store)
        env.worker()
        env.wait("a slot run by the beat that waited", lambda: env.rows(
            sa.select(runs_table).where(runs_table.c.state == "succeeded")), 120)
        assert beat.poll() is None, env.logs()
    finally:
        env.kill_all()
        store.dispose()
# ----------------------------------------------------- issue 14 part 2: small gaps ----

def _sync_entries_with_a_beat(dq: DqEnv) -> None:
    """Start a beat until it synced the app's entries into the store, then stop it."""
    beat = dq.beat("sync")
    dq.wait("entries synced", lambda: "schedule group" in dq.logs(), 90)
    dq.killpg(beat, signal.SIGTERM)
    beat.wait(timeout=30)


def _key_of(out: str) -> str:
    import re

    m = re.search(r"key (\S+),", out)
    assert m, out
    return m.group(1)


def test_entries_trigger_and_backfill_publish_through_dramatiq(dq: DqEnv) -> None:
    """``reliable-beat dramatiq entries trigger|backfill``: trigger rows of destination
    ``dramatiq``, published through the broker at once; a worker runs them, one effect
    each."""
    dq.extra["RB_MANUAL_ENTRIES"] = "1"
    _sync_entries_with_a_beat(dq)
    dq.worker()
    done = dq.cli("entries", "trigger", "manual_effect")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "published through the Dramatiq broker" in done.stdout, done.stdout
    key = _key_of(done.stdout)
    dq.wait("the manual run succeeded", lambda: dq.state(key) == "succeeded", 90)
    assert len(dq.effects(key)) == 1
    assert dq.rows(sa.select(outbox.c.destination, outbox.c.state).where(
        outbox.c.message_id == "trigger:" + key)) == [{"destination": "dramatiq",
                                                       "state": "sent"}]
    from datetime import datetime, timedelta, timezone

    end = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    start = end - timedelta(hours=3)
    done = dq.cli("entries", "backfill", "manual_effect", start.isoformat(), end.isoformat())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 runs created" in done.stdout and "3 published" in done.stdout, done.stdout
    keys = [r["idempotency_key"] for r in dq.rows(sa.select(runs_table.c.idempotency_key)
                                                 .where(runs_table.c.trigger == "backfill"))]
    assert len(keys) == 3
    dq.wait("the backfilled runs succeeded",
            lambda: all(dq.state(k) == "succeeded" for k in keys), 120)
    assert all(len(dq.effects(k)) == 1 for k in keys)


def test_a_trigger_delivered_after_its_expires_is_recorded_skipped(dq: DqEnv) -> None:
    """Dramatiq's AgeLimit skips a trigger older than the entry's ``expires`` (counted from
    the slot); ``after_skip_message`` records its run ``skipped`` (reason ``expired``) at
    once, not silently left ``dispatched``. No effect."""
    dq.extra["RB_MANUAL_ENTRIES"] = "1"
    _sync_entries_with_a_beat(dq)
    done = dq.cli("entries", "trigger", "expiring")  # no worker yet: it waits in the queue
    assert done.returncode == 0, done.stdout + done.stderr
    key = _key_of(done.stdout)
    assert dq.state(key) == "dispatched"
    time.sleep(3)  # past expires (2 s)
    dq.worker()
    dq.wait("the aged-out trigger recorded skipped", lambda: dq.state(key) == "skipped", 90)
    assert runs.get_run(dq.store, key)["reason"] == "expired"
    assert not dq.effects(key)
    assert "recorded skipped (expired)" in dq.logs()


def test_dead_letter_requeued_through_the_broker_runs_once(dq: DqEnv) -> None:
    """A dead Dramatiq run is requeued under the same key with ``reliable-beat dramatiq
    dead-letters requeue``: a new message through the broker, one effect; the Celery
    requeue command refuses it, naming the Dramatiq one."""
    flag = dq.tmp / "refuse.flag"
    flag.write_text("no")
    key = "perm:requeue"
    dq.worker()
    dq.send("permanent_unless_file_gone", "rq", str(flag), key=key)
    dq.wait("dead", lambda: dq.state(key) == "dead", 90)
    (dl,) = dq.rows(sa.select(dead_letters).where(dead_letters.c.key == key))
    celery_cli = subprocess.run(
        [sys.executable, "-m", "reliable_beat.cli", "--database-url", dq.pg_url,
         "dead-letters", "requeue", str(dl["id"]), "--yes"],
        env=dq.env, cwd=dq.tmp, capture_output=True, text=True, timeout=60)
    assert celery_cli.returncode != 0
    assert "reliable-beat dramatiq dead-letters requeue" in celery_cli.stderr, celery_cli.stderr
    assert dq.state(key) == "dead"
    flag.unlink()
    done = dq.cli("dead-letters", "requeue", str(dl["id"]), "--yes", "--by", "tester")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"under key {key!r}" in done.stdout
    dq.wait("the requeued run succeeded", lambda: dq.state(key) == "succeeded", 90)
    assert len(dq.effects(key)) == 1
    (dl,) = dq.rows(sa.select(dead_letters).where(dead_letters.c.key == key))
    assert dl["requeued_by"] == "tester"
    again = dq.cli("dead-letters", "requeue", str(dl["id"]), "--yes")
    assert again.returncode != 0 and "requeued" in again.stderr, again.stderr


def test_beat_waits_for_the_database_at_start_and_says_so(dq: DqEnv) -> None:
    """A Dramatiq beat started before its database exists, then before its schema is
    upgraded, waits and says so on stderr (no crash, no restart loop); once the schema is
    at head it syncs its entries and runs."""
    from sqlalchemy.engine import make_url

    name = f"rbwait_{dq.tag}"
    url = make_url(dq.pg_url).set(database=name).render_as_string(hide_password=False)
    dq.extra["RB_DATABASE_URL"] = url
    beat = dq.beat("waiting")
    dq.wait("database unavailable said", lambda: "at start: " in dq.logs(), 90)
    assert beat.poll() is None, dq.logs()
    admin = sa.create_engine(dq.pg_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        dq.wait("schema missing said", lambda: "db upgrade" in dq.logs(), 90)
        assert beat.poll() is None, dq.logs()
        up = subprocess.run([sys.executable, "-m", "reliable_beat.cli", "--database-url", url,
                             "db", "upgrade"], env=dq.env, cwd=dq.tmp, capture_output=True,
                            text=True, timeout=120)
        assert up.returncode == 0, up.stdout + up.stderr
        dq.wait("the beat started after the upgrade", lambda: "schedule group" in dq.logs(), 90)
        assert beat.poll() is None, dq.logs()
        assert "Traceback" not in dq.logs()
    finally:
        dq.killpg(beat)
        beat.wait(timeout=30)
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


# -------------------------------------- messages without a key; outbox rows to actors ----

def _python(dq: DqEnv, code: str) -> subprocess.CompletedProcess[str]:
    """``python -c code`` as a client of the app (``dq_app`` importable)."""
    return subprocess.run([sys.executable, "-c", code], env=dq.env, cwd=dq.tmp,
                          capture_output=True, text=True, timeout=60)


def test_keyless_send_is_refused_and_a_keyless_message_is_a_dead_letter(dq: DqEnv) -> None:
    """``send()`` on an ``IdempotentActor`` with no ``idempotency_key`` option is refused at
    the call site, naming the fix; a keyless message put on the queue anyway (another
    producer's ``broker.enqueue``) is a ``message`` dead letter ``no_key`` that ``status
    --check`` alarms on, not requeueable. Fails on the old code: ``send()`` was accepted and
    the worker logged one INFO line ("expected exception IdempotencyKeyError"), nothing
    recorded."""
    refused = _python(dq, "import dq_app; dq_app.broker.get_actor('flaky').send('nk', 0)")
    assert refused.returncode != 0, refused.stdout + refused.stderr
    assert "IdempotencyKeyError" in refused.stderr, refused.stderr
    assert "flaky.send_with_key(key, ...)" in refused.stderr, refused.stderr
    dq.worker()
    sent = _python(dq, "import dramatiq, dq_app; m = dramatiq.Message(queue_name=dq_app.QUEUE, "
                       "actor_name='flaky', args=('nk', 0), kwargs={}, options={}); "
                       "dq_app.broker.enqueue(m); print(m.message_id)")
    assert sent.returncode == 0, sent.stderr
    message_id = sent.stdout.strip()
    (dl,) = dq.wait("the keyless message's dead letter", lambda: dq.rows(
        sa.select(dead_letters).where(dead_letters.c.reason == "no_key")), 60)
    assert dl["kind"] == "message" and dl["task"] == "flaky" and dl["key"] == message_id, dl
    assert "no idempotency key" in dl["error"] and "send_with_key" in dl["error"], dl["error"]
    assert dl["payload"]["args"] == ["nk", 0], dl["payload"]
    assert len(dq.rows(sa.select(dead_letters))) == 1  # the refused send() enqueued nothing
    assert "refusing to run flaky" in dq.logs()
    checked = subprocess.run(
        [sys.executable, "-m", "reliable_beat.cli", "--database-url", dq.pg_url, "status",
         "--check"], env=dq.env, cwd=dq.tmp, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "1 dead letters wait for a person" in checked.stdout, checked.stdout
    again = dq.cli("dead-letters", "requeue", str(dl["id"]), "--yes")
    assert again.returncode != 0 and "not requeueable" in again.stderr, again.stderr
    assert not dq.progress(message_id) and not dq.rows(sa.select(runs_table))


def test_outbox_row_to_an_actor_without_a_key_runs_once_under_the_row_id(dq: DqEnv) -> None:
    """An outbox row addressed to an ``IdempotentActor`` that derives no key runs under the
    row's stable message id (the relay's ``reliable_beat_message_id`` option), so the same
    row published twice (a relay that died between publishing and marking it sent) runs
    once. Fails on the old code: each delivery was refused (INFO line), nothing ran."""
    from reliable_beat import outbox as rb_outbox

    dq.worker()
    key = "ob-flaky-1"
    with dq.store.begin() as conn:
        rb_outbox.add(conn, "dramatiq", {"actor": "flaky", "args": ["ob", 0]}, key=key)
    relay = dq.relay()
    dq.wait("the row's message ran", lambda: dq.state(key) == "succeeded", 90)
    sent = sa.select(outbox.c.state).where(outbox.c.message_id == key)
    dq.wait("the row marked sent", lambda: dq.rows(sent) == [{"state": "sent"}], 30)
    # the relay publishes the same row again (as after a crash before it marked it sent)
    with dq.store.begin() as conn:
        conn.execute(sa.update(outbox).where(outbox.c.message_id == key).values(
            state="pending", claimed_by=None, available_at=sa.func.now()))
    dq.wait("the second delivery deduplicated",
            lambda: "deduplicated" in outcomes(dq.attempts(key)), 90)
    assert relay.poll() is None, dq.logs()
    assert outcomes(dq.attempts(key)) == ["succeeded", "deduplicated"]
    assert len(dq.effects(key)) == 1
    assert dq.rows(sa.select(dead_letters)) == []
