"""``status`` / ``entries list`` report what would silently cost slots, before it does:

* MALFORMED ENTRY: an enabled entry whose stored row (changed by SQL) fails the check a
  beat's claim makes (:func:`reliable_beat.rows.check_entry`); on main it showed ``active``,
  ``status --check`` exited 0, and the beat quarantined it only when it came due (slot lost).
* NAME CONFLICT: an entry of one group's beat_schedule that another group owns; on main
  only an ERROR in that beat's log said its job never runs.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import text

from reliable_beat import schedules as sch
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.db.dialects import Store
from reliable_beat.entries import EntryDefinition, sync_schedule_group
from reliable_beat.groups import record_beat


def _cli(store: Store, *args: str) -> Result:
    result = CliRunner().invoke(reliable_beat, ["--database-url", store.url, *args],
                                catch_exceptions=False)
    assert result.exit_code in (0, 1), result.output
    return result


def _daily(name: str) -> EntryDefinition:
    return EntryDefinition(name=name, task="proj.report", args=[1],
                           schedule=sch.CronSchedule("0 9 * * *", "UTC"))


@pytest.fixture(params=["pg_store", "sqlite_store"])
def any_store(request: pytest.FixtureRequest) -> Store:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def test_malformed_entry_reported_before_it_is_due(any_store: Store) -> None:
    store = any_store
    synced = sync_schedule_group(store, [_daily("weekday9"), _daily("fine")], group="proj",
                                 owner="beat-a")
    record_beat(store, owner="beat-a", group="proj", config_hash=synced.config_hash,
                unregistered={})  # a live beat of the group: no NO BEAT problem
    assert _cli(store, "status", "--check").exit_code == 0
    with store.begin() as conn:  # an ended entry (no next slot: past end_at) is not malformed
        conn.execute(text("UPDATE reliable_beat_entries SET next_fire_at = NULL, "
                          "end_at = '2001-01-01 00:00:00' WHERE name = 'fine'"))
    with store.begin() as conn:
        conn.execute(text("UPDATE reliable_beat_entries SET args = '\"notalist\"', "
                          "schedule = '{\"every\": \"soon\"}' WHERE name = 'weekday9'"))
    checked = _cli(store, "status", "--check")
    assert checked.exit_code == 1, checked.output  # main: 0
    assert "MALFORMED ENTRY: 1 enabled entries" in checked.output
    assert "'weekday9': " in checked.output and "args=" in checked.output
    assert "schedule=" in checked.output and "schedule sync" in checked.output
    info = json.loads(_cli(store, "status", "--json").output)
    (bad,) = info["malformed_entries"]
    assert bad["name"] == "weekday9" and bad["origin"] == "config"
    assert {p.split("=")[0] for p in bad["problems"]} == {"args", "schedule"}
    by_name = {e["name"]: e for e in info["entries"]}
    assert by_name["weekday9"]["status"] == "malformed"
    assert by_name["fine"]["status"] == "ended"
    assert not info["ok"]
    listed = _cli(store, "entries", "list")
    line = next(x for x in listed.output.splitlines() if x.startswith("weekday9"))
    assert "MALFORMED" in line
    assert "MALFORMED ENTRY 'weekday9'" in listed.output
    as_json = {r["name"]: r for r in json.loads(_cli(store, "entries", "list", "--json").output)}
    assert as_json["weekday9"]["malformed"] and "malformed" not in as_json["fine"]
    # the fix the report gives works: a sync of the current config (a beat's restart,
    # `schedule sync`) rewrites the malformed row from the config (main: "unchanged")
    again = sync_schedule_group(store, [_daily("weekday9"), _daily("fine")], group="proj",
                                owner="beat-a")
    assert again.outcome == "current" and again.updated == ["weekday9"], again
    with store.engine.connect() as conn:
        args, schedule, nxt = conn.execute(text(
            "SELECT args, schedule, next_fire_at FROM reliable_beat_entries "
            "WHERE name = 'weekday9'")).one()
    assert (json.loads(args) if isinstance(args, str) else args) == [1]
    assert (json.loads(schedule) if isinstance(schedule, str) else schedule)["expr"] == "0 9 * * *"
    assert nxt is not None
    # and a sync of healthy rows changes nothing
    quiet = sync_schedule_group(store, [_daily("weekday9"), _daily("fine")], group="proj",
                                owner="beat-a")
    assert quiet.updated == [] and quiet.unchanged == 2, quiet
    after = _cli(store, "status", "--check")
    assert after.exit_code == 0, after.output
    assert "MALFORMED" not in after.output


def test_two_groups_with_one_entry_name_are_a_status_problem(pg_store: Store) -> None:
    store = pg_store
    first = sync_schedule_group(store, [_daily("tick3"), _daily("other")], group="proj",
                                owner="host:1")
    record_beat(store, owner="host:1", group="proj", config_hash=first.config_hash,
                unregistered={})
    assert not first.conflicts
    second = sync_schedule_group(store, [_daily("tick3"), _daily("own")], group="reports",
                                 owner="host:2")
    assert second.conflicts == {"tick3": "proj"}
    record_beat(store, owner="host:2", group="reports", config_hash=second.config_hash,
                unregistered={})
    checked = _cli(store, "status", "--check")
    assert checked.exit_code == 1, checked.output
    assert ("NAME CONFLICT: entry 'tick3' of group 'reports' (beat host:2) is owned by group "
            "'proj'; rename it in one app's beat_schedule") in checked.output
    info = json.loads(_cli(store, "status", "--json").output)
    assert info["name_conflicts"] == [{"entry": "tick3", "group": "reports",
                                       "owner_group": "proj", "synced_by": "host:2",
                                       "owner_enabled": True}]
    # removed from proj's beat_schedule: proj disables it, reports has not adopted it yet
    dropped = sync_schedule_group(store, [_daily("other")], group="proj", owner="host:1")
    assert dropped.disabled == ["tick3"], dropped
    info = json.loads(_cli(store, "status", "--json").output)
    assert [c["owner_enabled"] for c in info["name_conflicts"]] == [False]
    assert any("which disabled it: it does not fire for either" in p
               for p in info["problems"]), info["problems"]
    adopted = sync_schedule_group(store, [_daily("tick3"), _daily("own")], group="reports",
                                  owner="host:2")
    assert adopted.adopted == ["tick3"]
    assert json.loads(_cli(store, "status", "--json").output)["name_conflicts"] == []
    # back in proj (a fresh conflict), then renamed in the reports app: the conflict is gone
    sync_schedule_group(store, [_daily("tick3-reports"), _daily("own")], group="reports",
                        owner="host:2")
    sync_schedule_group(store, [_daily("tick3"), _daily("other")], group="proj",
                        owner="host:1")
    # renamed in the reports app: the conflict is gone
    sync_schedule_group(store, [_daily("tick3-reports"), _daily("own")], group="reports",
                        owner="host:2")
    info = json.loads(_cli(store, "status", "--json").output)
    assert info["name_conflicts"] == []
    assert not any("NAME CONFLICT" in p for p in info["problems"]), info["problems"]


def test_malformed_check_cost_at_20000_entries(pg_store: Store) -> None:
    """Measured (printed): ``status --json`` with 20,000 entries; one malformed is found."""
    import time

    from reliable_beat.db.tables import entries

    store = pg_store
    with store.begin() as conn:
        now = store.now(conn)
        slot = (now + timedelta(minutes=30)).replace(microsecond=0)
        rows = []
        for i in range(20_000):
            d = EntryDefinition(name=f"big-{i:05d}", task="bigapp.work", args=[i],
                                schedule=sch.CronSchedule(f"{i % 60} {i % 24} * * *", "UTC"))
            v = d.row_values()
            v.update(next_fire_at=slot, created_at=now, updated_at=now, enabled=True,
                     paused=False, origin="runtime")
            rows.append(v)
        conn.execute(entries.insert(), rows)
        conn.execute(text("UPDATE reliable_beat_entries SET kwargs = '[1]' "
                          "WHERE name = 'big-12345'"))
    from reliable_beat.cli.status import collect_status, malformed_entries

    t0 = time.perf_counter()
    with store.engine.connect() as conn:
        found = malformed_entries(conn)
    t1 = time.perf_counter()
    info = collect_status(store)
    t2 = time.perf_counter()
    print(f"\n20,000 entries (120 distinct crons): malformed_entries {t1 - t0:.2f} s, "
          f"collect_status {t2 - t1:.2f} s")
    assert [m["name"] for m in found] == ["big-12345"]
    assert [m["name"] for m in info["malformed_entries"]] == ["big-12345"]
    assert t2 - t1 < 60  # generous: a loaded 2-core machine
