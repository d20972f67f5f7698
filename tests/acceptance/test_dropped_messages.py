"""Task messages a Celery worker drops end as dead letters, with real worker processes on
PostgreSQL + Redis.

An outbox row (destination ``celery``) naming a task no worker registers is published by the
relay and marked sent; the worker that receives it logs "Received unregistered task" and
Celery rejects the message. With reliable_beat in the worker that message is a ``message``
dead letter (reason ``unregistered``) naming the task and the fix: ``dead-letters list``
shows it, ``status --check`` fails, and once a worker registers the task ``dead-letters
requeue`` sends the same message again: its effect happens once. An ``IdempotentTask``
message sent without a key (``send_task`` with no ``reliable_beat_key``) is a dead letter too
(reason ``no_key``, not requeueable), not only an ERROR line; so is a message Celery cannot read
as a task (reason ``rejected``).
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
import redis
import sqlalchemy as sa
from celery import Celery

from reliable_beat import outbox, runs
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox as outbox_table
from reliable_beat.ops.actions import requeue_dead_message
from reliable_beat.relay import Relay

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
import procs as procs_mod  # tests/apps

APPS = Path(__file__).resolve().parents[1] / "apps"
ROOT = APPS.parents[1]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[procs_mod.BeatProcs]:
    manager = procs_mod.BeatProcs(logdir=tmp_path)
    try:
        yield manager
    finally:
        manager.cleanup()


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, **env, PYTHONPATH=os.pathsep.join([str(ROOT), str(APPS)]))
    return subprocess.run([sys.executable, "-m", "reliable_beat.cli", "-A", "lostapp", *args],
                          env=full, cwd=str(APPS), capture_output=True, text=True, timeout=120)


def start_worker(procs: procs_mod.BeatProcs, queue: str, **env: str) -> procs_mod.Beat:
    worker = procs.start("worker", app="lostapp", command=[
        "worker", "-l", "info", "-Q", queue, "-P", "solo", "-c", "1",
        "-n", f"w-{uuid.uuid4().hex[:6]}@%h", "--without-mingle", "--without-gossip"], **env)
    procs_mod.wait_for(lambda: " ready." in worker.output(), 60, "the worker to start")
    return worker


def dead_letters(store: Store, reason: str) -> list[dict[str, Any]]:
    return [d for d in runs.list_dead_letters(store) if d["reason"] == reason]


@pytest.fixture
def setup(pg_store: Store, redis_url: str, procs: procs_mod.BeatProcs
          ) -> tuple[dict[str, str], str]:
    queue = f"rbq_{uuid.uuid4().hex[:10]}"
    env = {"RB_BROKER_URL": redis_url, "RELIABLE_BEAT_DATABASE_URL": pg_store.url,
           "RB_QUEUE": queue}
    procs.env.update(env)
    return env, queue


def test_outbox_row_for_an_unregistered_task_is_a_requeueable_dead_letter(
    pg_store: Store, redis_url: str, procs: procs_mod.BeatProcs,
    setup: tuple[dict[str, str], str],
) -> None:
    env, queue = setup
    effects = redis.Redis.from_url(redis_url)
    worker = start_worker(procs, queue)
    with pg_store.begin() as conn:
        mid = outbox.add(conn, "celery", {"task": "lostapp.late", "args": ["a"]})
    app = Celery("lostapp", broker=redis_url)
    app.conf.task_default_queue = queue
    relay = Relay(pg_store, app, claim_lease_seconds=10)
    procs_mod.wait_for(lambda: relay.run_once() or outbox_state(pg_store, mid) == "sent", 30,
                       "the relay to publish the row")

    dead = procs_mod.wait_for(lambda: dead_letters(pg_store, "unregistered"), 30,
                              "the dropped message's dead letter")
    assert "Received unregistered task" in worker.output()
    [dl] = dead
    assert dl["kind"] == "message" and dl["task"] == "lostapp.late", dl
    assert "'lostapp.late' is not registered in the worker" in dl["error"], dl["error"]
    assert "register the task" in dl["error"] and "dead-letters requeue" in dl["error"]
    assert dl["payload"]["args"] == ["a"] and dl["payload"]["queue"] == queue, dl["payload"]

    listed = cli(env, "dead-letters", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [d["id"] for d in json.loads(listed.stdout)] == [dl["id"]]
    checked = cli(env, "status", "--check")
    assert checked.returncode == 1 and "dead letters wait for a person" in checked.stdout, (
        checked.stdout + checked.stderr)
    assert effects.lrange(f"{queue}:effects", 0, -1) == []

    # A worker that registers the task; the person requeues the dead letter.
    procs.terminate(worker)
    worker2 = start_worker(procs, queue, RB_REGISTER_LATE="1")
    requeued = cli(env, "dead-letters", "requeue", str(dl["id"]), "--yes", "--by", "alice")
    assert requeued.returncode == 0, requeued.stdout + requeued.stderr
    procs_mod.wait_for(lambda: effects.lrange(f"{queue}:effects", 0, -1), 30,
                       "the requeued message to run")
    with pytest.raises(ValueError, match="was requeued at"):  # twice needs --force
        requeue_dead_message(pg_store, app, dl["id"], dl["payload"], by="bob")
    relay.run_once()  # the row stays sent: not published a second time
    assert effects.lrange(f"{queue}:effects", 0, -1) == [b"late:a"]
    assert runs.get_dead_letter(pg_store, dl["id"])["requeued_by"] == "alice"
    assert runs.list_dead_letters(pg_store, include_requeued=False) == []  # no alarm left
    assert "Received unregistered task" not in worker2.output()


def test_keyless_and_unreadable_messages_are_dead_letters(
    pg_store: Store, redis_url: str, procs: procs_mod.BeatProcs,
    setup: tuple[dict[str, str], str],
) -> None:
    env, queue = setup
    worker = start_worker(procs, queue)
    app = Celery("lostapp", broker=redis_url)
    app.conf.task_default_queue = queue
    task_id = app.send_task("lostapp.pay", args=["k"]).id  # no reliable_beat_key header

    dead = procs_mod.wait_for(lambda: dead_letters(pg_store, "no_key"), 30,
                              "the keyless message's dead letter")
    [dl] = dead
    assert dl["kind"] == "message" and dl["task"] == "lostapp.pay", dl
    assert dl["payload"]["task_id"] == task_id and dl["payload"]["args"] == ["k"], dl
    assert "no idempotency key" in dl["error"] and "delay_with_key" in dl["error"], dl["error"]
    assert "refusing to run lostapp.pay" in worker.output()
    checked = cli(env, "status", "--check")
    assert checked.returncode == 1 and "dead letters wait for a person" in checked.stdout
    with pytest.raises(ValueError, match="not requeueable"):
        requeue_dead_message(pg_store, app, dl["id"], dl["payload"], by="bob")

    # An outbox row's message id in a slot's key form (a row given key="<entry>@<instant>Z"):
    # reserved, so not the key; a dead letter naming it, not that slot's run.
    slot_id = app.send_task("lostapp.pay", args=["s"], headers={
        "reliable_beat_message_id": "nightly@2026-01-01T02:00:00Z"}).id
    slotted = procs_mod.wait_for(
        lambda: [d for d in dead_letters(pg_store, "no_key")
                 if d["payload"]["task_id"] == slot_id], 30, "the slot-shaped id's dead letter")
    assert "form of a scheduled slot's key" in slotted[0]["error"], slotted[0]["error"]
    with pytest.raises(runs.RunNotFound):
        runs.get_run(pg_store, "nightly@2026-01-01T02:00:00Z")

    # A message Celery cannot read as a task (an ETA that is no instant): rejected, recorded.
    bad_id = str(uuid.uuid4())
    with app.producer_or_acquire() as producer:
        producer.publish([["b"], {}, {}], routing_key=queue, serializer="json",
                         headers={"lang": "py", "task": "lostapp.pay", "id": bad_id,
                                  "eta": "not an instant", "reliable_beat_key": "bad-eta"})
    [bad] = procs_mod.wait_for(lambda: dead_letters(pg_store, "rejected"), 30,
                               "the unreadable message's dead letter")
    assert bad["task"] == "lostapp.pay" and bad["payload"]["task_id"] == bad_id, bad
    assert "invalid ETA value" in bad["error"] and bad["key"] == "bad-eta", bad["error"]
    assert redis.Redis.from_url(redis_url).lrange(f"{queue}:effects", 0, -1) == []


def test_outbox_row_to_an_idempotent_task_runs_once_under_the_row_id(
    pg_store: Store, redis_url: str, procs: procs_mod.BeatProcs,
    setup: tuple[dict[str, str], str],
) -> None:
    """A ``celery`` outbox row addressed to an ``IdempotentTask`` with no key of its own
    runs under the row's stable message id (the ``reliable_beat_message_id`` header the
    relay sets), and the same row published twice (a relay that died between publishing and
    marking it sent) runs once. Fails on the old code: every delivery was a ``no_key`` dead
    letter, not requeueable, and the effect was lost."""
    _env, queue = setup
    effects = redis.Redis.from_url(redis_url)
    start_worker(procs, queue)
    with pg_store.begin() as conn:
        mid = outbox.add(conn, "celery", {"task": "lostapp.pay", "args": ["ob"]},
                         key="ob-pay-1")
        outbox.add(conn, "celery", {"task": "lostapp.pay", "args": ["given"],  # its own key
                                    "headers": {"reliable_beat_key": "pay:given"}})
    app = Celery("lostapp", broker=redis_url)
    app.conf.task_default_queue = queue
    relay = Relay(pg_store, app, claim_lease_seconds=10)
    procs_mod.wait_for(lambda: relay.run_once() or outbox_state(pg_store, mid) == "sent", 30,
                       "the relay to publish the row")
    procs_mod.wait_for(lambda: run_state(pg_store, mid) == "succeeded"
                       and run_state(pg_store, "pay:given") == "succeeded", 30,
                       "the rows' messages to run, under the message id / the given key")
    # the same row published again: its message is a duplicate of the first
    with pg_store.begin() as conn:
        conn.execute(outbox_table.update().where(outbox_table.c.message_id == mid).values(
            state="pending", claimed_by=None, available_at=sa.func.now()))
    procs_mod.wait_for(lambda: relay.run_once() or outbox_state(pg_store, mid) == "sent", 30,
                       "the relay to publish the row again")
    run_id = runs.get_run(pg_store, mid)["id"]
    procs_mod.wait_for(lambda: len(runs.list_attempts(pg_store, run_id)) == 2, 30,
                       "the second delivery")
    assert [a["outcome"] for a in runs.list_attempts(pg_store, run_id)] == [
        "succeeded", "deduplicated"]
    assert sorted(effects.lrange(f"{queue}:effects", 0, -1)) == [b"pay:given", b"pay:ob"]
    assert runs.list_dead_letters(pg_store) == []


def run_state(store: Store, key: str) -> str | None:
    try:
        return str(runs.get_run(store, key)["state"])
    except runs.RunNotFound:
        return None


def outbox_state(store: Store, message_id: str) -> str | None:
    with store.engine.connect() as conn:
        return str(conn.execute(
            outbox_table.select().where(outbox_table.c.message_id == message_id)
        ).mappings().one()["state"])
