"""Seed a real django-celery-beat schema (its own Django migrations) and periodic tasks.

Run as ``python dcb_seed.py DATABASE_URL``, with a SQLAlchemy URL of a PostgreSQL or a
MariaDB/MySQL database (``mysql+pymysql://``: Django's MySQL backend then runs on PyMySQL
posing as mysqlclient, since the dev install has PyMySQL only).
Prints one JSON line: each task's ``last_run_at`` (ISO, UTC) as Django stored it.
Django is configured in this process only, so the test process stays free of it.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import django
import sqlalchemy as sa
from django.conf import settings
from django.core.management import call_command


def main(url: str) -> None:
    u = sa.engine.make_url(url)
    engine = "django.db.backends.postgresql"
    if u.get_backend_name() in ("mysql", "mariadb"):
        import pymysql

        # Django's MySQL backend imports MySQLdb and wants mysqlclient >= 2.2.1
        pymysql.version_info = (2, 2, 1, "final", 0)
        pymysql.install_as_MySQLdb()
        engine = "django.db.backends.mysql"
    settings.configure(
        DATABASES={"default": {
            "ENGINE": engine, "NAME": u.database,
            "USER": u.username or "", "PASSWORD": u.password or "",
            "HOST": u.host or "", "PORT": str(u.port or ""),
        }},
        INSTALLED_APPS=["django_celery_beat"],
        USE_TZ=True,
        TIME_ZONE="UTC",
        CELERY_TIMEZONE="UTC",
    )
    django.setup()
    call_command("migrate", "django_celery_beat", verbosity=0)
    from django_celery_beat.models import (
        ClockedSchedule,
        CrontabSchedule,
        IntervalSchedule,
        PeriodicTask,
        SolarSchedule,
    )

    now = datetime.now(timezone.utc).replace(microsecond=0)
    berlin = CrontabSchedule.objects.create(minute="30", hour="2", day_of_week="1-5",
                                            day_of_month="*", month_of_year="*",
                                            timezone=ZoneInfo("Europe/Berlin"))
    ten = IntervalSchedule.objects.create(every=10, period=IntervalSchedule.MINUTES)
    clocked = ClockedSchedule.objects.create(clocked_time=now + timedelta(days=1))
    solar = SolarSchedule.objects.create(event="sunrise", latitude="52.52", longitude="13.40")
    last = {
        "berlin-report": now - timedelta(days=1, hours=3),
        "ten-minutes": now - timedelta(minutes=25, seconds=30),
        "old-disabled": now - timedelta(days=30),
    }
    PeriodicTask.objects.create(
        name="berlin-report", task="tasks.report", crontab=berlin, args='[1, "x"]',
        kwargs='{"full": true}', queue="reports", priority=5, expire_seconds=600,
        headers='{"team": "finance"}', last_run_at=last["berlin-report"])
    PeriodicTask.objects.create(name="ten-minutes", task="tasks.poll", interval=ten,
                                last_run_at=last["ten-minutes"])
    PeriodicTask.objects.create(name="once-tomorrow", task="tasks.poll", clocked=clocked,
                                one_off=True)
    PeriodicTask.objects.create(name="old-disabled", task="tasks.poll", interval=ten,
                                enabled=False, last_run_at=last["old-disabled"])
    PeriodicTask.objects.create(name="celery.backend_cleanup", task="celery.backend_cleanup",
                                crontab=CrontabSchedule.objects.create(minute="0", hour="4"))
    if "--with-solar" in sys.argv:
        PeriodicTask.objects.create(name="at-sunrise", task="tasks.poll", solar=solar)
    print(json.dumps({k: v.isoformat() for k, v in last.items()}))


if __name__ == "__main__":
    main(sys.argv[1])
