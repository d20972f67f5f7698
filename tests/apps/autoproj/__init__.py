"""A Celery project that finds its tasks with ``autodiscover_tasks`` (Django-style layout)."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("autoproj", broker="memory://")
app.conf.timezone = "UTC"
app.conf.reliable_beat_database_url = os.environ.get(
    "RELIABLE_BEAT_DATABASE_URL", "sqlite:///reliable_beat.sqlite3")
app.autodiscover_tasks(["autoproj.billing"])
