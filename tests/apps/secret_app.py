"""A Celery app whose webhook destination reads its token from ``RB_TEST_HOOK_TOKEN``."""

from __future__ import annotations

from celery import Celery

app = Celery("secret_app", broker="memory://", set_as_current=False)
app.conf.reliable_beat_webhook_destinations = {
    "billing": {"base_url": "https://billing.example",
                "headers": {"Authorization": {"env": "RB_TEST_HOOK_TOKEN"}}},
}
