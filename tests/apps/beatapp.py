"""A test Celery app for real `celery beat` processes (acceptance tests).

Configured from the environment so each test can point it at its own servers:
RB_BROKER_URL, RELIABLE_BEAT_DATABASE_URL, RB_SCHEDULE (JSON: name -> {"cron"|"every", "task"}).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

from celery import Celery

app = Celery("beatapp", broker=os.environ.get("RB_BROKER_URL", "memory://"))
app.conf.beat_scheduler = "reliable_beat.celery:ReliableScheduler"
app.conf.reliable_beat_database_url = os.environ["RELIABLE_BEAT_DATABASE_URL"]
app.conf.beat_max_loop_interval = float(os.environ.get("RB_MAX_LOOP", "5"))
app.conf.timezone = "UTC"
app.conf.broker_connection_retry_on_startup = True


@app.task(name="beatapp.tick")
def tick(label: str = "") -> str:
    return label


schedule: dict[str, dict[str, object]] = {}
for name, spec in json.loads(os.environ.get("RB_SCHEDULE", "{}")).items():
    sched: object = spec["cron"] if "cron" in spec else timedelta(seconds=spec["every"])
    item: dict[str, object] = {"task": spec.get("task", "beatapp.tick"), "schedule": sched,
                               "args": [name]}
    if "reliable_beat" in spec:
        item["options"] = {"reliable_beat": spec["reliable_beat"]}
    schedule[name] = item
app.conf.beat_schedule = schedule
