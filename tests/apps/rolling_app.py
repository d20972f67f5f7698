"""The Celery app of the rolling-deploy test (tests/integration/test_rolling_deploy.py): its
beats and workers run either an old revision's ``reliable_beat`` or the current one, so it
uses only APIs both have (``ReliableScheduler``, ``IdempotentTask`` and its
``transaction()``, ``idempotency_key``, ``fence_token``, ``run_id``).

Configured from the environment:

* ``RB_BROKER_URL``, ``RELIABLE_BEAT_DATABASE_URL``, ``RB_MAX_LOOP`` (beat_max_loop_interval);
* ``RB_QUEUE``: the plain task's queue (nothing consumes it: the test counts its messages);
  ``RB_EFFECT_QUEUE``: the ``IdempotentTask``'s queue (the workers consume it);
* ``RB_ENTRIES``: JSON list of entry names; each fires every second (``effect-*``: the
  ``IdempotentTask``, others the plain task); ``cron`` in the name: a 6-field cron, else an
  interval of 1 s.

``rolling.effect`` writes one row per attempt that commits into ``rolling_effects``, in the
run's transaction; the table has no unique constraint, so a second effect of a slot would show.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from celery import Celery

import reliable_beat
from reliable_beat.celery.task import IdempotentTask

# which code this process runs (the test checks it: an old process must import the old tree)
print(f"rolling_app: reliable_beat from {os.path.dirname(reliable_beat.__file__)}",
      file=sys.stderr, flush=True)

meta = sa.MetaData()
effects = sa.Table(
    "rolling_effects",
    meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),  # deliberately not unique
    sa.Column("fence", sa.Integer, nullable=False),
    sa.Column("run_id", sa.Integer, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
)

PLAIN_QUEUE = os.environ.get("RB_QUEUE", "rolling-plain")
EFFECT_QUEUE = os.environ.get("RB_EFFECT_QUEUE", "rolling-effect")

app = Celery("rolling_app", broker=os.environ.get("RB_BROKER_URL", "memory://"))
app.conf.update(
    beat_scheduler="reliable_beat.celery:ReliableScheduler",
    reliable_beat_database_url=os.environ.get("RELIABLE_BEAT_DATABASE_URL",
                                              "sqlite:///rolling.sqlite3"),
    reliable_beat_lease_seconds=2.0,
    beat_max_loop_interval=float(os.environ.get("RB_MAX_LOOP", "1")),
    timezone="UTC",
    task_default_queue=PLAIN_QUEUE,
    task_routes={"rolling.effect": {"queue": EFFECT_QUEUE}},
    task_acks_late=True,
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        # a SIGKILLed worker's message comes back within seconds, not kombu's hour
        "visibility_timeout": 5.0,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 3,
    },
)


@app.task(base=IdempotentTask, bind=True, name="rolling.effect")  # type: ignore[untyped-decorator]
def effect(self: IdempotentTask, name: str) -> str:
    """One effect row for the slot, in the run's transaction."""
    with self.transaction() as tx:
        tx.execute(effects.insert().values(
            key=self.idempotency_key, fence=self.fence_token, run_id=self.run_id,
            pid=os.getpid()))
    return name


@app.task(name="rolling.plain")  # type: ignore[untyped-decorator]
def plain(name: str) -> str:
    """A plain task (no run state): the test counts its trigger messages in the broker."""
    return name


schedule: dict[str, dict[str, Any]] = {}
for entry in json.loads(os.environ.get("RB_ENTRIES", "[]")):
    schedule[entry] = {
        "task": "rolling.effect" if entry.startswith("effect") else "rolling.plain",
        "schedule": "* * * * * */1" if "cron" in entry else timedelta(seconds=1),
        "args": [entry],
    }
app.conf.beat_schedule = schedule
