"""A Celery app whose every input carries a distinct secret (tests/acceptance/test_secret_leaks.py).

Configured from the environment: ``RB_LEAK_DB_URL`` (the store), ``RB_LEAK_BROKER_URL``,
``RB_LEAK_METRICS_PORT``, ``RB_LEAK_API_KEY`` (an auth header in an entry's publish options),
``RB_LEAK_WEBHOOK_BASE`` / ``RB_LEAK_WEBHOOK_DOWN`` (webhook destinations' base URLs, with a
token in the path), ``RB_LEAK_DEST_KEY`` (an inline auth header of a destination),
``RB_LEAK_SMTP_PORT`` / ``RB_LEAK_SMTP_CA``; the relay reads ``RB_LEAK_AUTH`` and
``RB_LEAK_SMTP_PW`` itself.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from celery import Celery

app = Celery("leakapp", broker=os.environ["RB_LEAK_BROKER_URL"])
app.conf.update(
    timezone="UTC",
    beat_scheduler="reliable_beat.ReliableScheduler",
    broker_connection_retry_on_startup=False,
    reliable_beat_database_url=os.environ["RB_LEAK_DB_URL"],
    reliable_beat_metrics_port=int(os.environ.get("RB_LEAK_METRICS_PORT", "0")) or None,
    reliable_beat_outbox_max_attempts=1,  # one failure dead-letters: the error is stored
    beat_max_loop_interval=1,
    reliable_beat_webhook_destinations={
        "leaky": {
            "base_url": os.environ.get("RB_LEAK_WEBHOOK_BASE", "http://127.0.0.1:1/hook"),
            "headers": {"Authorization": {"env": "RB_LEAK_AUTH"},
                        "X-Api-Key": os.environ.get("RB_LEAK_DEST_KEY", "")},
        },
        "down": {"base_url": os.environ.get("RB_LEAK_WEBHOOK_DOWN", "http://127.0.0.1:1/x")},
    },
    reliable_beat_smtp={
        "host": "127.0.0.1", "port": int(os.environ.get("RB_LEAK_SMTP_PORT", "1")),
        "username": "rb", "password": {"env": "RB_LEAK_SMTP_PW"}, "from": "rb@example.com",
        **({"ca_file": os.environ["RB_LEAK_SMTP_CA"]} if os.environ.get("RB_LEAK_SMTP_CA")
           else {}),
    },
    beat_schedule={
        "leak-every-second": {
            "task": "leakapp.noop",
            "schedule": timedelta(seconds=1),
            "options": {"headers": {"X-Api-Key": os.environ.get("RB_LEAK_API_KEY", "")}},
        },
    },
)


@app.task(name="leakapp.noop")
def noop(*args: Any, **kwargs: Any) -> None:
    """Nothing: the test never runs a worker."""
