"""A stock Celery app whose ``task_prerun`` records what a worker saw of each message (for
the hand-built trigger messages of :class:`reliable_beat.celery.publishing._MessageBuilder`).

Environment: ``RB_BROKER_URL``; ``RB_TEST_OUT`` (a file each task start appends one JSON
line to).
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery
from celery.signals import task_prerun
from kombu import Queue

app = Celery("builder_app", broker=os.environ.get("RB_BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.broker_connection_retry_on_startup = True
app.conf.task_ignore_result = True
app.conf.task_queues = [Queue("celery"), Queue("q2")]

#: request fields a task sees that come from the message
FIELDS = ("id", "root_id", "parent_id", "retries", "eta", "expires", "argsrepr",
          "kwargsrepr", "origin", "timelimit", "reliable_beat_key", "reliable_beat_fire_at",
          "reliable_beat_message_id", "x_custom")


@task_prerun.connect
def _record(sender: Any = None, task_id: str | None = None, task: Any = None,
            args: Any = None, kwargs: Any = None, **_: Any) -> None:
    req = task.request
    line = {f: getattr(req, f, None) for f in FIELDS}
    line.update(task=task.name, args=list(args or []), kwargs=dict(kwargs or {}),
                routing_key=(req.delivery_info or {}).get("routing_key"),
                priority=(req.delivery_info or {}).get("priority"))
    with open(os.environ["RB_TEST_OUT"], "a") as fh:
        fh.write(json.dumps(line, default=str) + "\n")


@app.task(name="bb.echo")
def echo(*args: Any, **kwargs: Any) -> None:
    return None
