"""A worker app for the dropped-message tests (tests/acceptance/test_dropped_messages.py).

Environment: RB_BROKER_URL (Redis), RELIABLE_BEAT_DATABASE_URL, RB_QUEUE (the default
queue); RB_REGISTER_LATE: also register ``lostapp.late`` (the task a first worker lacks).

Each task's effect is one item pushed onto the Redis list ``<queue>:effects``.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

from reliable_beat.celery import IdempotentTask

QUEUE = os.environ.get("RB_QUEUE", "celery")
app = Celery("lostapp", broker=os.environ.get("RB_BROKER_URL", "memory://"))
app.conf.reliable_beat_database_url = os.environ["RELIABLE_BEAT_DATABASE_URL"]
app.conf.task_default_queue = QUEUE
app.conf.broker_connection_retry_on_startup = True
app.conf.timezone = "UTC"


def effect(label: str) -> None:
    redis.Redis.from_url(os.environ["RB_BROKER_URL"]).rpush(f"{QUEUE}:effects", label)


@app.task(bind=True, base=IdempotentTask, name="lostapp.pay")
def pay(self: IdempotentTask, label: str) -> str:
    effect(f"pay:{label}")
    return label


if os.environ.get("RB_REGISTER_LATE"):
    @app.task(name="lostapp.late")
    def late(label: str) -> str:
        effect(f"late:{label}")
        return label
