"""The project's Celery app, configured from Django settings (namespace ``CELERY``) and
nothing else: no ``django.setup()`` here, Celery's Django fix-up does it."""

from __future__ import annotations

import os

from celery import Celery

from reliable_beat.celery.task import IdempotentTask

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "djauto.settings")

app = Celery("djauto")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()  # djshop/tasks.py, when the app's task modules are loaded


@app.task(base=IdempotentTask, bind=True, name="djauto.record")
def record(self: IdempotentTask) -> str:
    """One payout per slot, through the ORM, committed with the key."""
    from djshop.models import Payout

    with self.transaction(using="default"):
        Payout.objects.create(key=self.idempotency_key, fence=self.fence_token,
                              run_id=self.run_id, pid=os.getpid())
    return str(self.idempotency_key)
