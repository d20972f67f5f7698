"""The Celery app of the ``celery beat`` process of :mod:`benchmarks.stacks` (lateness).

Configured from the environment: ``STK_BROKER`` (broker URL), ``STK_DB`` (store URL),
``STK_QUEUE`` (the queue every trigger goes to), ``STK_N`` (entries, every second).
Publisher confirms are on (RabbitMQ; Redis ignores the option), as in production.
The app registers ``stk.probe`` (the benchmark's kombu consumer, not a worker, takes the
triggers): the beat parks an entry whose task its app does not register.
"""

from __future__ import annotations

import os
from datetime import timedelta

from celery import Celery

app = Celery("bench_stacks", broker=os.environ.get("STK_BROKER", "memory://"))
app.conf.update(
    timezone="UTC",
    beat_scheduler="reliable_beat.celery:ReliableScheduler",
    beat_max_loop_interval=1,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"confirm_publish": True},
    task_default_queue=os.environ.get("STK_QUEUE", "stk"),
    reliable_beat_database_url=os.environ.get("STK_DB", "sqlite:///stacks.sqlite3"),
)
app.conf.beat_schedule = {
    f"lat{i:03d}": {"task": "stk.probe", "schedule": timedelta(seconds=1)}
    for i in range(int(os.environ.get("STK_N", "10")))
}


@app.task(name="stk.probe")
def probe() -> None:
    """The entries' task; no worker runs it (the consumer only reads the triggers' headers)."""
