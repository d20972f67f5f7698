"""An active entry whose ``next_fire_at`` its schedule cannot have put there (set by SQL:
NULL while the schedule has a next slot, or far beyond it) never fired again and nothing
said so: ``status`` showed it ``ended`` (NULL) or ``active`` (2999), ``status --check`` had
no alarm, the beats logged nothing, and ``entries resume`` / ``entries update`` with the
same schedule left it as it was. Now ``status`` alarms (NEXT FIRE INCONSISTENT), a beat's
sweep quarantines it (ERROR naming the entry and the fix), and ``entries resume`` /
``entries update`` / a sync recompute it from the schedule (after the last slot, so the
misfire policy decides the slots missed meanwhile)."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import select, text

from reliable_beat import schedules as sch
from reliable_beat.beat import Beat
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries
from reliable_beat.entries import EntryDefinition, save_runtime_entry, sync_schedule_group
from reliable_beat.loop import BeatLoop
from reliable_beat.settings import Settings
from tests.apps.quiet_handler import QuietHandler as _Quiet

UTC = timezone.utc


def cli(store: Store, *args: str) -> Result:
    r = CliRunner().invoke(reliable_beat, ["--database-url", store.url, *args],
                           catch_exceptions=False)
    assert r.exit_code in (0, 1), r.output
    return r


@pytest.fixture(params=["pg_store", "sqlite_store"])
def any_store(request: pytest.FixtureRequest) -> Store:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def _now(store: Store) -> datetime:
    with store.begin() as conn:
        return store.now(conn)


def _every(name: str, seconds: int = 5) -> EntryDefinition:
    return EntryDefinition(name=name, task="proj.tick", schedule=sch.IntervalSchedule(
        timedelta(seconds=seconds), datetime(2026, 1, 1, tzinfo=UTC)))


def _set(store: Store, name: str, nxt: str | None, last: datetime | None = None) -> None:
    with store.begin() as conn:
        conn.execute(text("UPDATE reliable_beat_entries SET next_fire_at = :n, "
                          "last_fire_at = :l WHERE name = :name"),
                     {"n": nxt, "l": last, "name": name})


def _row(store: Store, name: str) -> dict[str, object]:
    with store.engine.connect() as conn:
        return dict(conn.execute(select(entries).where(entries.c.name == name))
                    .mappings().one())


def _aware(value: object) -> datetime:
    assert isinstance(value, datetime), value
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def test_status_alarms_and_resume_or_update_recompute(any_store: Store) -> None:
    store = any_store
    for d in (_every("null5"), _every("far5"), _every("past5"), _every("fine5"),
              EntryDefinition(name="yearly", task="proj.tick",
                              schedule=sch.CronSchedule("0 0 1 1 *", "UTC"))):
        save_runtime_entry(store, d, create=True)
    now = _now(store)
    # the last slot on the 5 s grid, one slot ago: its next slot is due now
    last = _every("x").schedule.previous_at_or_before(now - timedelta(seconds=6))
    assert last is not None
    _set(store, "null5", None, last)
    _set(store, "far5", "2999-01-01 00:00:00", last)
    _set(store, "past5", "1970-01-01 00:00:00", last)  # due: the misfire policy's business

    checked = cli(store, "status", "--check")
    assert checked.exit_code == 1, checked.output
    alarms = [x for x in checked.output.splitlines() if "NEXT FIRE INCONSISTENT" in x]
    assert len(alarms) == 2, checked.output
    assert "entry 'null5' will not fire: next_fire_at=NULL" in alarms[0] + alarms[1]
    assert "entry 'far5' will not fire: next_fire_at=2999-01-01" in alarms[0] + alarms[1]
    assert all("reliable-beat entries resume" in a for a in alarms)
    info = json.loads(cli(store, "status", "--json").output)
    assert sorted(e["name"] for e in info["inconsistent_next_fire"]) == ["far5", "null5"]
    status = {e["name"]: e["status"] for e in info["entries"]}
    assert status["null5"] == "malformed" and status["far5"] == "malformed"  # main: ended
    assert status["yearly"] == status["fine5"] == status["past5"] == "active"

    # the repairs: resume (no pause needed) and update with the same schedule
    resumed = cli(store, "entries", "resume", "null5")
    assert resumed.exit_code == 0, resumed.output
    assert _aware(_row(store, "null5")["next_fire_at"]) == last + timedelta(seconds=5)
    updated = cli(store, "entries", "update", "far5", "--every", "5")
    assert updated.exit_code == 0 and "unchanged" not in updated.output, updated.output
    assert _aware(_row(store, "far5")["next_fire_at"]) <= now + timedelta(seconds=10)
    assert json.loads(cli(store, "status", "--json").output)["inconsistent_next_fire"] == []

    fired = Beat(store, owner="t:1").tick()  # both fire again
    names = {t.payload["headers"]["reliable_beat_entry"] for t in fired.triggers}
    assert {"null5", "far5"} <= names, names


def test_a_sync_recomputes_a_config_entry(sqlite_store: Store) -> None:
    store = sqlite_store
    daily = EntryDefinition(name="daily", task="proj.report", origin="config",
                            schedule=sch.CronSchedule("0 9 * * *", "UTC"))
    sync_schedule_group(store, [daily], group="proj", owner="beat-a")
    _set(store, "daily", None, datetime(2026, 1, 1, 9, tzinfo=UTC))
    again = sync_schedule_group(store, [daily], group="proj", owner="beat-a")
    assert again.updated == ["daily"], again  # main: unchanged, never fired again
    # after its last slot: the slots since go through the misfire policy at the next tick
    assert _aware(_row(store, "daily")["next_fire_at"]) == datetime(2026, 1, 2, 9, tzinfo=UTC)


def test_the_beat_sweep_quarantines_it_naming_the_fix(
    sqlite_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    store = sqlite_store
    save_runtime_entry(store, _every("null5"), create=True)
    save_runtime_entry(store, _every("far5"), create=True)
    save_runtime_entry(store, _every("fine5"), create=True)
    last = _every("x").schedule.previous_at_or_before(_now(store) - timedelta(seconds=6))
    assert last is not None
    _set(store, "null5", None, last)
    _set(store, "far5", "2999-01-01 00:00:00", last)
    loop = BeatLoop(store, Settings(), _Quiet(), owner="t:1")  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="reliable_beat.rows"):
        loop.sweep()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    for name in ("null5", "far5"):
        [line] = [e for e in errors if f"entry '{name}'" in e]
        assert "quarantined" in line and "next_fire_at=" in line, line
        assert f"reliable-beat entries resume {name}" in line, line
        row = _row(store, name)
        assert not row["enabled"] and row["quarantine_reason"], row
    assert _row(store, "fine5")["enabled"]
    checked = cli(store, "status", "--check")
    assert checked.exit_code == 1 and "QUARANTINED: 2 malformed" in checked.output

    assert cli(store, "entries", "resume", "null5").exit_code == 0
    row = _row(store, "null5")
    assert row["enabled"] and _aware(row["next_fire_at"]) == last + timedelta(seconds=5)
    # quarantined by the sweep, then rewritten with the same schedule (`entries update`, or
    # a sync of the same beat_schedule): the slots missed meanwhile still go through the
    # misfire policy (the rewrite used to restart it from now: catch_up slots lost silently)
    save_runtime_entry(store, _every("far5"), create=False)
    row = _row(store, "far5")
    assert row["enabled"] and _aware(row["next_fire_at"]) == last + timedelta(seconds=5), row
    loop.close()
