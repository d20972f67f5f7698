"""A Django settings module the way Django projects carry Celery settings (namespace CELERY).

Used by ``dj_celery`` (``app.config_from_object("django.conf:settings", namespace="CELERY")``)
in tests/acceptance/test_django_settings.py. Configured from the environment:
``RB_BROKER_URL``, ``RB_DATABASE_URL``, ``RB_QUEUE``; ``RB_TYPO=1`` adds a misspelt
``CELERY_RELIABLE_BEAT_LEASE_SECOND``.
"""

import os

SECRET_KEY = "reliable-beat-tests"
INSTALLED_APPS: list[str] = []
USE_TZ = True
TIME_ZONE = "UTC"

CELERY_BROKER_URL = os.environ.get("RB_BROKER_URL", "memory://")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("RB_QUEUE", "celery")
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULER = "reliable_beat.ReliableScheduler"
CELERY_BEAT_MAX_LOOP_INTERVAL = 1.0
CELERY_BEAT_SCHEDULE = {
    "dj-tick": {"task": "dj_celery.record", "schedule": 1.0},
}
# The reliable_beat settings in the namespaced upper-case form, and one without the namespace.
CELERY_RELIABLE_BEAT_DATABASE_URL = os.environ.get("RB_DATABASE_URL") or None  # None: default
CELERY_RELIABLE_BEAT_RUN_MIGRATIONS = True
RELIABLE_BEAT_LEASE_SECONDS = 5.0
if os.environ.get("RB_TYPO"):
    CELERY_RELIABLE_BEAT_LEASE_SECOND = 10
