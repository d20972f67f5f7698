"""A Celery project whose tasks live in a separate module listed in ``include=``."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("cliproj", broker="memory://", include=["cliproj.tasks"])
app.conf.timezone = "UTC"
app.conf.reliable_beat_database_url = os.environ.get(
    "RELIABLE_BEAT_DATABASE_URL", "sqlite:///reliable_beat.sqlite3")
if os.environ.get("CLIPROJ_SCHEDULE"):  # name -> cron string, for `schedule sync` tests
    import json

    app.conf.beat_schedule = {
        name: {"task": "cliproj.tasks.plain", "schedule": cron}
        for name, cron in json.loads(os.environ["CLIPROJ_SCHEDULE"]).items()
    }
