"""The shop's Celery app: Django settings (namespace CELERY) and reliable_beat's scheduler.

No ``reliable_beat_database_url``: with ``reliable_beat.contrib.django`` installed, the store
is Django's own database (``DATABASES["default"]``), so the ORM effect commits with the key;
every beat, worker and relay banner says ``(from Django DATABASES['default'])``."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_shop.shop.settings")

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")

_hook = urlsplit(os.environ.get("SHOP_WEBHOOK_URL", "http://127.0.0.1:8765/hook"))
app.conf.update(
    beat_scheduler="reliable_beat.ReliableScheduler",
    reliable_beat_lease_seconds=float(os.environ.get("SHOP_LEASE_SECONDS", "10")),
    reliable_beat_redispatch_seconds=20.0,
    reliable_beat_webhook_destinations={
        "merchants": {"base_url": f"{_hook.scheme}://{_hook.netloc}"}},
)
app.autodiscover_tasks(["examples.django_shop.payouts"])
