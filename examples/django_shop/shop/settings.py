"""Settings of the Django shop example (configured from the environment by the runner).

``SHOP_DATABASE_URL``: a SQLAlchemy PostgreSQL URL (Django's database AND reliable_beat's
store); ``SHOP_BROKER_URL``: Redis; ``SHOP_WEBHOOK_URL``: where merchants are notified.
"""

from __future__ import annotations

import os

from sqlalchemy.engine import make_url

_db = make_url(os.environ.get("SHOP_DATABASE_URL", "postgresql://postgres@127.0.0.1/shop"))

SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "example-only-not-secret")
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
TIME_ZONE = "Europe/Berlin"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.database,
        "USER": _db.username or "",
        "PASSWORD": _db.password or "",
        "HOST": _db.host or "",
        "PORT": str(_db.port or ""),
        "CONN_MAX_AGE": 60,
    }
}
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "reliable_beat.contrib.django",
    "examples.django_shop.payouts",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "examples.django_shop.shop.urls"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
STATIC_URL = "/static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# reliable_beat: nothing to set. The store is DATABASES["default"] and the Celery app is the
# `celery_app` of this package (shop/__init__.py), for the admin and `manage.py reliable_beat`.

# Celery, read with namespace="CELERY"
CELERY_BROKER_URL = os.environ.get("SHOP_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_TIMEZONE = TIME_ZONE
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_MAX_LOOP_INTERVAL = 5
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 15, "unacked_restore_interval": 1,
                                   "unacked_restore_throttle": 1, "unacked_mutex_expire": 5}
CELERY_BEAT_SCHEDULE = {
    "pay-merchants": {
        "task": "shop.pay_merchants",
        # every 5 s for the demo (croniter: seconds LAST); a real shop: "0 2 * * *"
        "schedule": os.environ.get("SHOP_SCHEDULE", "* * * * * */5"),
        "options": {"reliable_beat": {"misfire_policy": "catch_up", "catch_up_limit": 50}},
    }
}
