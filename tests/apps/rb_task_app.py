"""Celery app used by the acceptance tests' real worker processes.

Configured from the environment (set by the tests):

* ``RB_BROKER_URL``: Redis or RabbitMQ (``amqp://``) URL; ``RB_DATABASE_URL``: the store;
* ``RB_LEASE_SECONDS``: the lease (default 2 s, so a paused worker loses it quickly).

The Redis ``visibility_timeout`` is 5 s (restores checked every second) so that a message
whose worker was SIGKILLed is redelivered within seconds instead of the default hour, and
kombu's restore lock expires after 3 s (default 300 s) so that a worker killed while holding
it does not stop redelivery for five minutes.

Effects go to ``test_effects`` (no unique constraint: only fencing and the key keep them
single). ``test_progress`` rows are committed at once, outside the body's transaction, so
a test can see that a body has started (and its fence) while the effect is uncommitted.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from celery import Celery

from reliable_beat.celery.task import IdempotentTask
from reliable_beat.errors import PermanentError

meta = sa.MetaData()
effects = sa.Table(
    "test_effects",
    meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("fence", sa.Integer, nullable=False),
    sa.Column("run_id", sa.Integer, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
)
progress = sa.Table(
    "test_progress",
    meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("fence", sa.Integer, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("what", sa.String(50), nullable=False),
)

app = Celery("rb_task_app", broker=os.environ.get("RB_BROKER_URL", "memory://"))
app.conf.update(
    broker_transport_options={
        # RB_VISIBILITY_TIMEOUT: a test that needs a paused worker's message to stay with it
        # (as RabbitMQ keeps an unacknowledged message with a live connection) sets it high
        "visibility_timeout": float(os.environ.get("RB_VISIBILITY_TIMEOUT", "5")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # kombu's restore holds a Redis lock (default expiry 300 s); a worker SIGKILLed
        # while holding it would stop every redelivery on this Redis for five minutes.
        "unacked_mutex_expire": 3,
        # RabbitMQ (ignored by Redis): Celery's own publishes (self.retry) confirmed too,
        # as docs/operations.md recommends.
        "confirm_publish": True,
    },
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    reliable_beat_database_url=os.environ.get("RB_DATABASE_URL", "sqlite:///rb-test.sqlite3"),
    reliable_beat_lease_seconds=float(os.environ.get("RB_LEASE_SECONDS", "2")),
    reliable_beat_retry_max_attempts=6,
    reliable_beat_retry_base_seconds=1.0,
    reliable_beat_retry_cap_seconds=60.0,
    reliable_beat_outbox_handlers={"hook": "rb_task_app.hook"},
)


def _mark(task: IdempotentTask, what: str) -> None:
    with task.store.begin() as conn:
        conn.execute(progress.insert().values(
            key=task.idempotency_key, fence=task.fence_token, attempt=task.attempt,
            pid=os.getpid(), what=what))


class EffectTask(IdempotentTask):
    def idempotency_key_for(self, name: str, *args: Any, **kwargs: Any) -> str | None:
        return f"effect:{name}"


@app.task(base=EffectTask, bind=True, name="rb.write_effect")
def write_effect(
    self: IdempotentTask, name: str, sleep_first_attempt: float = 0.0, sleep: float = 0.0
) -> dict[str, Any]:
    """Insert one effect row in the body's transaction; optionally sleep with it uncommitted."""
    with self.transaction() as tx:
        tx.execute(effects.insert().values(
            key=self.idempotency_key, fence=self.fence_token, run_id=self.run_id,
            pid=os.getpid()))
        _mark(self, "in_body")
        pause = sleep_first_attempt if self.attempt == 1 else sleep
        deadline = time.monotonic() + pause
        while time.monotonic() < deadline:
            time.sleep(0.05)
        _mark(self, "leaving_body")
    return {"name": name, "fence": self.fence_token}


@app.task(base=EffectTask, bind=True, name="rb.flaky")
def flaky(self: IdempotentTask, name: str, fail_times: int) -> str:
    """ConnectionError on the first ``fail_times`` attempts, then one effect (no explicit tx)."""
    _mark(self, "in_body")
    if self.attempt <= fail_times:
        raise ConnectionError(f"attempt {self.attempt}: upstream refused")
    with self.transaction() as tx:
        tx.execute(effects.insert().values(
            key=self.idempotency_key, fence=self.fence_token, run_id=self.run_id,
            pid=os.getpid()))
    return "ok"


@app.task(base=EffectTask, bind=True, name="rb.permanent_unless_file_gone")
def permanent_unless_file_gone(self: IdempotentTask, name: str, flag_file: str) -> str:
    """PermanentError while ``flag_file`` exists; else one effect (the requeue proof)."""
    _mark(self, "in_body")
    if Path(flag_file).exists():
        raise PermanentError(f"{flag_file} says no")
    with self.transaction() as tx:
        tx.execute(effects.insert().values(
            key=self.idempotency_key, fence=self.fence_token, run_id=self.run_id,
            pid=os.getpid()))
    return "ok"


@app.task(base=EffectTask, bind=True, name="rb.effect_with_webhook")
def effect_with_webhook(
    self: IdempotentTask, name: str, url: str, sleep_first_attempt: float = 0.0
) -> str:
    """One effect row and one outbox webhook in the same transaction."""
    with self.transaction() as tx:
        tx.execute(effects.insert().values(
            key=self.idempotency_key, fence=self.fence_token, run_id=self.run_id,
            pid=os.getpid()))
        self.outbox.add(tx, "hook", {"url": url, "body": {"name": name}})
        _mark(self, "in_body")
        if self.attempt == 1 and sleep_first_attempt:
            time.sleep(sleep_first_attempt)
    return "ok"


def hook(message: Any) -> None:
    """Outbox handler: POST with ``Idempotency-Key``. ``RB_KILL_POINT`` (``before_delivery``
    or ``after_delivery``) makes the relay process die there once, while ``RB_KILL_FLAG``
    (a file) exists."""
    import urllib.request

    flag = os.environ.get("RB_KILL_FLAG", "")
    point = os.environ.get("RB_KILL_POINT", "")
    armed = bool(flag) and Path(flag).exists()
    if armed and point == "before_delivery":
        Path(flag).unlink()
        os._exit(9)
    req = urllib.request.Request(
        message.payload["url"], data=json.dumps(message.payload["body"]).encode(),
        method="POST", headers={"Content-Type": "application/json",
                                "Idempotency-Key": message.message_id},
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        resp.read()
    if armed and point == "after_delivery":
        Path(flag).unlink()
        os._exit(9)


# ``RB_PERIOD`` (seconds): a periodic IdempotentTask ``rb.tick`` fired by ReliableScheduler
# beats on ``RB_QUEUE``, one effect per slot (the key is the slot's): the Celery side of the
# shared adapter tests (tests/acceptance/test_adapters_celery_dramatiq.py), twin of
# ``tick`` in dq_app.
if os.environ.get("RB_PERIOD"):
    from datetime import timedelta

    app.conf.beat_scheduler = "reliable_beat.celery:ReliableScheduler"
    app.conf.beat_max_loop_interval = 1.0
    app.conf.timezone = "UTC"
    app.conf.beat_schedule = {"tick": {
        "task": "rb.tick", "schedule": timedelta(seconds=float(os.environ["RB_PERIOD"])),
        "options": {"queue": os.environ.get("RB_QUEUE", "celery"),
                    "reliable_beat": {"misfire_policy": "skip"}},
    }}


@app.task(base=IdempotentTask, bind=True, name="rb.tick")
def tick(self: IdempotentTask) -> None:
    """One effect row per slot, in the run's transaction."""
    with self.transaction() as tx:
        tx.execute(effects.insert().values(
            key=self.idempotency_key, fence=self.fence_token, run_id=self.run_id,
            pid=os.getpid()))
