"""Importing RedBeat and django-celery-beat entries: real RedBeat entries in a real Redis, a
real django-celery-beat schema (its own Django migrations) in a real PostgreSQL.

The cutover rule under test: each entry starts at its first slot strictly after the old
scheduler's ``last_run_at``; the slot the old scheduler sent is not sent again, and slots
missed at the cutover meet the misfire policy on the first tick.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.schedules import crontab, schedule
from click.testing import CliRunner
from sqlalchemy import func, select

from reliable_beat.beat import Beat
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.celery.importers import import_entries, read_django_celery_beat, read_redbeat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, runs
from reliable_beat.errors import EntryValidationError
from reliable_beat.settings import Settings

SEED = Path(__file__).resolve().parents[1] / "apps" / "dcb_seed.py"
UTC = timezone.utc


def _entry(store: Store, name: str) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(select(entries).where(entries.c.name == name)).one()


def _count(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(entries)).scalar_one())


# -- RedBeat ---------------------------------------------------------------------------------


@pytest.fixture
def redbeat_app(redis_url: str) -> Celery:
    app = Celery("legacy", set_as_current=False)
    app.conf.update(redbeat_redis_url=redis_url,
                    redbeat_key_prefix=f"rb-import-{uuid.uuid4().hex[:8]}:",
                    timezone="Europe/Berlin")
    return app


def _save(app: Celery, name: str, sched: Any, **kw: Any) -> None:
    from redbeat import RedBeatSchedulerEntry

    RedBeatSchedulerEntry(name, kw.pop("task", "tasks.poll"), sched, app=app, **kw).save()


def test_redbeat_entries_import_with_cutover(redbeat_app: Celery, redis_url: str,
                                             sqlite_store: Store) -> None:
    prefix = redbeat_app.conf.redbeat_key_prefix
    last = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=12, seconds=5)
    _save(redbeat_app, "nightly", crontab(minute=0, hour=2), task="tasks.pay",
          args=[1], kwargs={"k": "v"}, options={"queue": "payouts"})
    _save(redbeat_app, "every-5m", schedule(run_every=300), last_run_at=last)
    _save(redbeat_app, "off", schedule(run_every=60), enabled=False)
    _save(redbeat_app, "celery.backend_cleanup", crontab(minute=0, hour=4),
          task="celery.backend_cleanup")

    found = read_redbeat(redis_url, key_prefix=prefix)
    assert [f.name for f in found] == ["celery.backend_cleanup", "every-5m", "nightly", "off"]
    outcomes = import_entries(sqlite_store, found, settings=Settings(),
                              default_timezone="Europe/Berlin")
    assert {o.name: o.action for o in outcomes} == {
        "celery.backend_cleanup": "skipped", "every-5m": "imported", "nightly": "imported",
        "off": "imported"}

    nightly = _entry(sqlite_store, "nightly")
    assert nightly.origin == "runtime" and nightly.task == "tasks.pay"
    assert nightly.timezone == "Europe/Berlin"  # a RedBeat crontab runs in the app's zone
    assert nightly.schedule["expr"].split()[:2] == ["0", "2"]
    assert (nightly.args, nightly.kwargs, nightly.options["queue"]) == ([1], {"k": "v"},
                                                                        "payouts")
    berlin = nightly.next_fire_at.astimezone(ZoneInfo("Europe/Berlin"))
    assert (berlin.hour, berlin.minute) == (2, 0)

    # The interval keeps RedBeat's cadence through last_run_at: the next slot is last + 5 min
    # (already past: the first tick meets it with the misfire policy), not "now + 5 min".
    every = _entry(sqlite_store, "every-5m")
    assert every.next_fire_at == last + timedelta(minutes=5)
    assert _entry(sqlite_store, "off").paused is True

    result = Beat(sqlite_store, owner="t:1").tick()
    assert result.claimed >= 1
    with sqlite_store.engine.connect() as conn:
        slots = [tuple(r) for r in conn.execute(
            select(runs.c.fire_at, runs.c.state).where(runs.c.entry_name == "every-5m")
            .order_by(runs.c.fire_at))]
    # fire_once (the default): of the slots missed at the cutover (last+5, last+10 min) the
    # latest fires once, the other is recorded as skipped; the slot RedBeat already sent
    # (last) gets no run at all.
    assert [s[0] for s in slots] == [last + timedelta(minutes=5), last + timedelta(minutes=10)]
    assert slots[0][1] == "skipped" and slots[1][1] != "skipped"

    again = import_entries(sqlite_store, read_redbeat(redis_url, key_prefix=prefix),
                           settings=Settings(), default_timezone="Europe/Berlin")
    assert {o.action for o in again if o.name != "celery.backend_cleanup"} == {"exists"}


def test_redbeat_invalid_entry_imports_nothing_unless_skipped(
        redbeat_app: Celery, redis_url: str, sqlite_store: Store) -> None:
    from redbeat.schedules import rrule

    prefix = redbeat_app.conf.redbeat_key_prefix
    _save(redbeat_app, "fine", schedule(run_every=60))
    _save(redbeat_app, "weird", rrule("MINUTELY", interval=5))
    _save(redbeat_app, "bad-option", schedule(run_every=60), options={"link": "x"})
    found = read_redbeat(redis_url, key_prefix=prefix)

    with pytest.raises(EntryValidationError) as err:
        import_entries(sqlite_store, found, settings=Settings())
    text = str(err.value)
    assert "'weird'" in text and "rrule" in text
    assert "'bad-option'" in text and "'link'" in text
    assert _count(sqlite_store) == 0  # all or nothing

    outcomes = import_entries(sqlite_store, found, settings=Settings(), skip_invalid=True)
    assert {o.name: o.action for o in outcomes} == {
        "bad-option": "skipped", "fine": "imported", "weird": "skipped"}
    assert _count(sqlite_store) == 1


# -- django-celery-beat ----------------------------------------------------------------------


def _seed_django(pg_url: str, *extra: str) -> dict[str, datetime]:
    proc = subprocess.run([sys.executable, str(SEED), pg_url, *extra], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return {k: datetime.fromisoformat(v) for k, v in json.loads(proc.stdout).items()}


def _first_weekday_0230_berlin_after(instant: datetime) -> datetime:
    zone = ZoneInfo("Europe/Berlin")
    day = instant.astimezone(zone).date()
    while True:
        local = datetime(day.year, day.month, day.day, 2, 30, tzinfo=zone)
        if local > instant and local.weekday() < 5:
            return local.astimezone(UTC)
        day += timedelta(days=1)


def test_django_celery_beat_import(pg_url: str, pg_store: Store) -> None:
    _check_django_import(pg_url, pg_store)


@pytest.mark.mariadb
def test_django_celery_beat_import_from_mariadb(mariadb_url: str, mariadb_store: Store) -> None:
    """The same from a django-celery-beat schema on MariaDB (made by its own Django
    migrations; Django stores naive UTC ``DATETIME(6)`` there, no time zone at all)."""
    _check_django_import(mariadb_url, mariadb_store)


def _check_django_import(url: str, store: Store) -> None:
    last = _seed_django(url)
    found = read_django_celery_beat(url)
    outcomes = import_entries(store, found, settings=Settings())
    assert {o.name: (o.action, o.paused) for o in outcomes} == {
        "berlin-report": ("imported", False), "celery.backend_cleanup": ("skipped", False),
        "old-disabled": ("imported", True), "once-tomorrow": ("imported", False),
        "ten-minutes": ("imported", False)}

    report = _entry(store, "berlin-report")
    assert report.timezone == "Europe/Berlin" and report.task == "tasks.report"
    assert (report.args, report.kwargs) == ([1, "x"], {"full": True})
    assert report.options == {"queue": "reports", "priority": 5, "expires": 600,
                              "headers": {"team": "finance"}}
    # Celery's crontab ANDs day_of_week with day_of_month: weekdays only, 02:30 Berlin time,
    # the first after django-celery-beat's last run.
    assert report.next_fire_at == _first_weekday_0230_berlin_after(last["berlin-report"])

    ten = _entry(store, "ten-minutes")
    assert ten.next_fire_at == last["ten-minutes"] + timedelta(minutes=10)
    once = _entry(store, "once-tomorrow")
    assert once.schedule_kind == "once" and once.next_fire_at > datetime.now(UTC)
    disabled = _entry(store, "old-disabled")
    assert disabled.paused is True


def test_django_celery_beat_solar_refused_names_the_entry(pg_url: str, pg_store: Store) -> None:
    _seed_django(pg_url, "--with-solar")
    runner = CliRunner()
    args = ["--database-url", pg_url, "entries", "import", "django-celery-beat",
            "--from-url", pg_url]
    res = runner.invoke(reliable_beat, args)
    assert res.exit_code == 2, res.output
    assert "'at-sunrise'" in res.output and "solar" in res.output
    assert _count(pg_store) == 0

    res = runner.invoke(reliable_beat, [*args, "--skip-invalid", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "4 imported" in res.output and "dry run" in res.output
    assert _count(pg_store) == 0

    res = runner.invoke(reliable_beat, [*args, "--skip-invalid", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["counts"] == {"imported": 4, "exists": 0, "skipped": 2}
    assert _count(pg_store) == 4


def test_import_from_a_database_without_django_tables(pg_url: str, pg_store: Store) -> None:
    res = CliRunner().invoke(reliable_beat, ["--database-url", pg_url, "entries", "import",
                                             "django-celery-beat", "--from-url", pg_url])
    assert res.exit_code == 2
    assert "no django-celery-beat tables" in res.output
