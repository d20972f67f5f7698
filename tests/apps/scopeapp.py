"""Two Celery apps on one store, each with its own broker (acceptance test of schedule groups
scoping the firing): the same module is started as either app.

* RB_APP: the app's main name (its schedule group), e.g. ``proj`` or ``proj2``; its tasks are
  ``<RB_APP>.plain`` (a plain task) and ``<RB_APP>.idem`` (an ``IdempotentTask``), so a
  trigger consumed by the other app's worker is an unregistered task;
* RB_BROKER_URL (its own Redis database), RELIABLE_BEAT_DATABASE_URL (shared), RB_QUEUE,
  RB_REDISPATCH, RB_SCHEDULE (JSON name -> {"every": seconds, "task": "plain" | "idem"}).

Workers record the starts of plain tasks' triggers (``reliable_beat.celery.acks``), so the
test reads from the runs table which slot started, and when.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

from celery import Celery

from reliable_beat.celery.task import IdempotentTask

MAIN = os.environ["RB_APP"]
app = Celery(MAIN, broker=os.environ["RB_BROKER_URL"])
app.conf.beat_scheduler = "reliable_beat.celery:ReliableScheduler"
app.conf.reliable_beat_database_url = os.environ["RELIABLE_BEAT_DATABASE_URL"]
app.conf.beat_max_loop_interval = 1.0
app.conf.timezone = "UTC"
app.conf.broker_connection_retry_on_startup = True
app.conf.task_default_queue = os.environ.get("RB_QUEUE", "celery")
app.conf.reliable_beat_redispatch_seconds = float(os.environ.get("RB_REDISPATCH", "120"))
app.conf.imports = ["reliable_beat.celery.acks"]


@app.task(name=f"{MAIN}.plain")
def plain(label: str = "") -> str:
    return label


@app.task(base=IdempotentTask, bind=True, name=f"{MAIN}.idem")
def idem(self: IdempotentTask, label: str = "") -> str:
    return label


app.conf.beat_schedule = {
    name: {"task": f"{MAIN}.{spec['task']}", "schedule": timedelta(seconds=spec["every"]),
           "args": [name]}
    for name, spec in json.loads(os.environ.get("RB_SCHEDULE", "{}")).items()
}
