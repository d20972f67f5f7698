"""Settings of the ``djauto`` project: the test project's (``djsettings``) plus Celery's,
without ``reliable_beat_database_url`` unless ``RB_CELERY_STORE_URL`` is set (then
``CELERY_RELIABLE_BEAT_DATABASE_URL``: the setting must win over the Django database)."""

import os

from djsettings import *  # noqa: F403

CELERY_BROKER_URL = os.environ.get("RB_BROKER_URL", "memory://")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("RB_QUEUE", "celery")
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULER = "reliable_beat.ReliableScheduler"
CELERY_BEAT_MAX_LOOP_INTERVAL = 1.0
CELERY_BEAT_SCHEDULE = {"auto-tick": {"task": "djauto.record", "schedule": 1.0}}
CELERY_RELIABLE_BEAT_RUN_MIGRATIONS = True
CELERY_RELIABLE_BEAT_LEASE_SECONDS = 10.0
if os.environ.get("RB_CELERY_STORE_URL"):
    CELERY_RELIABLE_BEAT_DATABASE_URL = os.environ["RB_CELERY_STORE_URL"]
