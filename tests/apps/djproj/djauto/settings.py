"""Settings of the ``djauto`` project: the test project's (``djsettings``) plus Celery's,
without ``reliable_beat_database_url`` unless ``RB_CELERY_STORE_URL`` is set (then
``CELERY_RELIABLE_BEAT_DATABASE_URL``: the setting must win over the Django database).
``RB_DJANGO_MYSQL_URL`` (a SQLAlchemy MariaDB URL) makes ``DATABASES["default"]`` a MySQL
database (Django's mysql backend, on PyMySQL posing as mysqlclient, as some projects do:
Celery's Django fix-up loads the backend for its checks; the store uses PyMySQL anyway)."""

import os

import sqlalchemy as sa
from djsettings import *  # noqa: F403

if os.environ.get("RB_DJANGO_MYSQL_URL"):
    import pymysql

    pymysql.install_as_MySQLdb()
    _my = sa.engine.make_url(os.environ["RB_DJANGO_MYSQL_URL"])
    DATABASES = {"default": {
        "ENGINE": "django.db.backends.mysql", "NAME": _my.database, "USER": _my.username or "",
        "PASSWORD": _my.password or "", "HOST": _my.host or "", "PORT": str(_my.port or ""),
        "OPTIONS": {"charset": "utf8mb4"},
    }}

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
