"""A Celery project whose tasks live in a separate module listed in ``include=``."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("cliproj", broker="memory://", include=["cliproj.tasks"])
app.conf.timezone = "UTC"
app.conf.reliable_beat_database_url = os.environ.get(
    "RELIABLE_BEAT_DATABASE_URL", "sqlite:///reliable_beat.sqlite3")
