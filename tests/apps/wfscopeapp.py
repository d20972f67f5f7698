"""Two Celery apps with their own brokers on one store, each running its own workflows
(acceptance test of schedule groups scoping the workflows' messages): the same module is
started as either app.

* RB_APP: the app's main name (its schedule group), e.g. ``proj`` or ``proj2``; its
  workflow is ``<RB_APP>.flow`` (activity, timer, child ``<RB_APP>.child`` with an activity)
  and its activity task ``<RB_APP>.tick``: a message of one app consumed by the other app's
  worker is an unknown workflow / an unregistered task there;
* RB_BROKER_URL (its own Redis database), RELIABLE_BEAT_DATABASE_URL (shared), RB_QUEUE;
* RB_SCHEDULE: seconds between the slots of the entry ``<RB_APP>-flow`` that starts a
  ``<RB_APP>.flow`` workflow per slot (overlap policy ``skip``); unset: no entry.

``<RB_APP>.kick(n, prefix)`` (a plain task) starts ``n`` workflows ``<prefix>-<i>`` from this
app (the way an application starts them: ``flow.start(id)``).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from celery import Celery

from reliable_beat.celery.task import IdempotentTask
from reliable_beat.workflows import WorkflowContext, workflow
from reliable_beat.workflows.scheduled import START_TASK

MAIN = os.environ["RB_APP"]
QUEUE = os.environ.get("RB_QUEUE", "celery")
app = Celery(MAIN, broker=os.environ["RB_BROKER_URL"])
app.conf.beat_scheduler = "reliable_beat.celery:ReliableScheduler"
app.conf.reliable_beat_database_url = os.environ["RELIABLE_BEAT_DATABASE_URL"]
app.conf.beat_max_loop_interval = 1.0
app.conf.timezone = "UTC"
app.conf.broker_connection_retry_on_startup = True
app.conf.task_default_queue = QUEUE
app.conf.task_ignore_result = True
app.conf.worker_prefetch_multiplier = 1
app.conf.reliable_beat_lease_seconds = 5.0


@app.task(base=IdempotentTask, bind=True, name=f"{MAIN}.tick")
def tick(self: IdempotentTask, label: str) -> str:
    return f"{MAIN}:{label}"


@workflow(app, name=f"{MAIN}.child", queue=QUEUE)
def child(ctx: WorkflowContext, label: str) -> Any:
    return ctx.activity(tick, f"child-{label}", queue=QUEUE)


@workflow(app, name=f"{MAIN}.flow", queue=QUEUE)
def flow(ctx: WorkflowContext, label: str) -> Any:
    first = ctx.activity(tick, label, queue=QUEUE)
    ctx.sleep(timedelta(seconds=1))
    kid = ctx.child(child, label)
    return [first, kid]


@app.task(name=f"{MAIN}.kick")
def kick(n: int, prefix: str) -> int:
    for i in range(n):
        flow.start(f"{prefix}-{i}", args=(f"{prefix}-{i}",))
    return n


if os.environ.get("RB_SCHEDULE"):
    app.conf.beat_schedule = {
        f"{MAIN}-flow": {"task": START_TASK,
                         "schedule": timedelta(seconds=float(os.environ["RB_SCHEDULE"])),
                         "args": [f"{MAIN}.flow", "slot"],
                         "options": {"reliable_beat": {"overlap_policy": "skip"},
                                     "queue": QUEUE}},
    }
