"""A Celery app configured from Django settings with ``namespace="CELERY"`` (see dj_settings).

``dj_celery.record`` is an IdempotentTask that writes one ``dj_effects`` row per run in the
run's transaction, so a test can count effects per slot key in the store.
"""

from __future__ import annotations

import os
from typing import Any

import django
import sqlalchemy as sa
from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dj_settings")
django.setup()

from reliable_beat.celery.task import IdempotentTask  # noqa: E402

meta = sa.MetaData()
dj_effects = sa.Table(
    "dj_effects",
    meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
)

app = Celery("dj_celery")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task(base=IdempotentTask, bind=True, name="dj_celery.record")
def record(self: Any) -> str:
    with self.transaction() as tx:
        tx.execute(dj_effects.insert().values(key=self.idempotency_key, pid=os.getpid()))
    return str(self.idempotency_key)
