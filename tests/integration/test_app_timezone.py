"""The beat evaluates entries in the app's zone as Celery resolves it (issue 11).

``enable_utc=False`` without ``timezone``: Celery's crontabs run in the host's local zone, so
ours must too (before: UTC, a silent 5-hour shift on a New York host). ``entries list``
prints the zone of each entry.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab
from click.testing import CliRunner
from sqlalchemy import select

from reliable_beat.celery.commands import reliable_beat as cli_main
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries


def _beat(store: Store, **conf: Any) -> Any:
    from reliable_beat.celery.scheduler import ReliableScheduler

    app = Celery("tzapp", broker="memory://", set_as_current=False)
    app.conf.update(reliable_beat_database_url=store.url,
                    beat_schedule={"nightly": {"task": "tzapp.t",
                                               "schedule": crontab(hour=2, minute=0)}},
                    **conf)
    return ReliableScheduler(app=app)


def test_enable_utc_false_without_timezone_uses_the_host_zone(
        sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "America/New_York")
    sched = _beat(sqlite_store, enable_utc=False)
    sched.close()
    with sqlite_store.engine.connect() as conn:
        row = conn.execute(select(entries.c.timezone, entries.c.next_fire_at)
                           .where(entries.c.name == "nightly")).one()
    assert row.timezone == "America/New_York"
    next_at = row.next_fire_at.replace(tzinfo=timezone.utc)
    assert next_at.hour in (6, 7) and next_at > datetime.now(timezone.utc)  # 02:00 EST/EDT
    out = CliRunner().invoke(cli_main, ["--database-url", sqlite_store.url, "entries", "list"])
    assert out.exit_code == 0, out.output
    header, line = out.output.splitlines()[:2]
    assert "ZONE" in header and "America/New_York" in line


def test_timezone_setting_wins_over_the_host_zone(
        sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "America/New_York")
    _beat(sqlite_store, enable_utc=False, timezone="Europe/Berlin").close()
    with sqlite_store.engine.connect() as conn:
        zone = conn.execute(select(entries.c.timezone)).scalar_one()
    assert zone == "Europe/Berlin"
