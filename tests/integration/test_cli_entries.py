"""`reliable-beat entries ...` against real stores (SQLite and PostgreSQL), through click."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import func, select, update

from reliable_beat.beat import Beat
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, outbox, runs
from reliable_beat.runtime import BackfillLimitError, backfill
from tests.apps.cliapp import HAS_IDEMPOTENT

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.apps.cliapp"


def cli(store: Store, *args: str, app: bool = False) -> Result:
    base = ["--database-url", store.url]
    if app:
        base = ["-A", APP, *base]
    return CliRunner().invoke(reliable_beat, [*base, *args], catch_exceptions=False)


def ok(result: Result) -> str:
    assert result.exit_code == 0, result.output
    return result.output


def count(store: Store, table: Any, *where: Any) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table).where(*where)).scalar_one())


def db_now(store: Store) -> datetime:
    with store.engine.connect() as conn:
        return store.now(conn)


def iso(at: datetime) -> str:
    return at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_add_list_show_update_pause_resume_remove(store: Store) -> None:
    out = ok(cli(store, "entries", "add", "nightly", "--task", "shop.pay", "--cron", "0 2 * * *",
                 "--timezone", "Europe/Berlin", "--args", '[1, "a"]', "--kwargs", '{"k": 2}',
                 "--queue", "payouts", "--misfire-policy", "catch_up", "--catch-up-limit", "3",
                 "--misfire-grace", "30", "--dst-nonexistent", "skip", "--dst-repeated", "both"))
    assert "added nightly" in out
    ok(cli(store, "entries", "add", "fast", "--task", "shop.tick", "--every", "5"))
    ok(cli(store, "entries", "add", "once", "--task", "shop.tick",
           "--at", "2099-01-01T00:00:00+01:00"))

    listed = json.loads(ok(cli(store, "entries", "list", "--json")))
    assert [e["name"] for e in listed] == ["fast", "nightly", "once"]
    text = ok(cli(store, "entries", "list"))
    assert "cron '0 2 * * *' Europe/Berlin" in text and "every 5s" in text

    shown = json.loads(ok(cli(store, "entries", "show", "nightly", "--json")))
    assert shown["task"] == "shop.pay"
    assert shown["args"] == [1, "a"] and shown["kwargs"] == {"k": 2}
    assert shown["options"] == {"queue": "payouts"}
    assert shown["misfire_policy"] == "catch_up" and shown["catch_up_limit"] == 3
    assert shown["misfire_grace_seconds"] == 30.0
    assert shown["schedule"]["nonexistent"] == "skip" and shown["schedule"]["repeated"] == "both"
    assert shown["timezone"] == "Europe/Berlin" and shown["origin"] == "runtime"
    assert shown["next_fire_at"].endswith(":00Z")
    once = json.loads(ok(cli(store, "entries", "show", "once", "--json")))
    assert once["next_fire_at"] == "2098-12-31T23:00:00Z"
    assert "task" in ok(cli(store, "entries", "show", "fast"))

    # update changes only what is given
    ok(cli(store, "entries", "update", "nightly", "--misfire-policy", "skip"))
    after = json.loads(ok(cli(store, "entries", "show", "nightly", "--json")))
    assert after["misfire_policy"] == "skip"
    for key in ("task", "args", "kwargs", "options", "schedule", "timezone", "catch_up_limit",
                "misfire_grace_seconds", "next_fire_at"):
        assert after[key] == shown[key], key
    ok(cli(store, "entries", "update", "nightly", "--timezone", "America/New_York"))
    moved = json.loads(ok(cli(store, "entries", "show", "nightly", "--json")))
    assert moved["timezone"] == "America/New_York"
    assert moved["schedule"]["expr"] == "0 2 * * *"
    assert moved["next_fire_at"] != shown["next_fire_at"]  # recomputed on the new grid
    fast = json.loads(ok(cli(store, "entries", "show", "fast", "--json")))
    ok(cli(store, "entries", "update", "fast", "--args", "[7]"))
    fast2 = json.loads(ok(cli(store, "entries", "show", "fast", "--json")))
    assert fast2["args"] == [7] and fast2["schedule"] == fast["schedule"]  # grid kept

    ok(cli(store, "entries", "pause", "fast"))
    paused = json.loads(ok(cli(store, "entries", "show", "fast", "--json")))
    assert paused["paused"] is True and paused["status"] == "paused"
    assert paused["next_fire_at"] == fast2["next_fire_at"]  # the grid is kept
    assert "resumed fast" in ok(cli(store, "entries", "resume", "fast"))
    assert json.loads(ok(cli(store, "entries", "show", "fast", "--json")))["paused"] is False

    ok(cli(store, "entries", "remove", "once"))
    assert [e["name"] for e in json.loads(ok(cli(store, "entries", "list", "--json")))] == [
        "fast", "nightly"]
    missing = cli(store, "entries", "show", "once")
    assert missing.exit_code == 1 and "no entry named 'once'" in missing.output


def test_add_twice_and_config_entries_are_refused(store: Store) -> None:
    ok(cli(store, "entries", "add", "a", "--task", "t", "--every", "60"))
    again = cli(store, "entries", "add", "a", "--task", "t", "--every", "60")
    assert again.exit_code == 2 and "already exists" in again.output
    with store.begin() as conn:
        conn.execute(update(entries).where(entries.c.name == "a").values(origin="config"))
    upd = cli(store, "entries", "update", "a", "--every", "30")
    assert upd.exit_code == 2 and "beat_schedule" in upd.output
    rm = cli(store, "entries", "remove", "a")
    assert rm.exit_code == 2 and "beat_schedule" in rm.output


def test_invalid_input_exits_2_lists_every_problem_and_writes_nothing(store: Store) -> None:
    r = cli(store, "entries", "add", "bad", "--task", "t", "--cron", "99 * * *",
            "--timezone", "Mars/Olympus", "--args", "[1", "--kwargs", "[]")
    assert r.exit_code == 2
    assert "1 invalid entry (4 problems)" in r.output  # one entry, four problems
    for needle in ("--args is not JSON", "--kwargs must be a JSON object",
                   "unknown time zone 'Mars/Olympus'", "has 4 fields"):
        assert needle in r.output, needle
    assert r.output.count("entry 'bad'") == 4
    assert count(store, entries) == 0

    for args in (["--task", "t"],  # no schedule
                 ["--task", "t", "--every", "5", "--cron", "* * * * *"],
                 ["--task", "t", "--at", "2030-01-01T00:00:00"],  # naive
                 ["--task", "t", "--at", "tomorrow"],
                 ["--task", "t", "--every", "5", "--dst-repeated", "both"],  # cron only
                 ["--cron", "* * * * *"]):  # no task
        r = cli(store, "entries", "add", "bad", *args)
        assert r.exit_code == 2, (args, r.output)
        assert "entry 'bad'" in r.output, args
    assert count(store, entries) == 0


def test_unknown_task_and_plain_overlap_refused_when_an_app_is_given(store: Store) -> None:
    r = cli(store, "entries", "add", "x", "--task", "cliapp.nope", "--every", "5", app=True)
    assert r.exit_code == 2
    assert "task 'cliapp.nope' is not registered" in r.output
    r = cli(store, "entries", "add", "x", "--task", "cliapp.plain", "--every", "5",
            "--overlap-policy", "skip", app=True)
    assert r.exit_code == 2 and "plain Celery task" in r.output
    assert count(store, entries) == 0
    ok(cli(store, "entries", "add", "x", "--task", "cliapp.plain", "--every", "5", app=True))


def test_add_without_a_zone_uses_the_apps_timezone(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """`entries add -A proj` without --timezone evaluates the cron in the app's zone, as a
    beat_schedule entry does; old code stored UTC, firing a Berlin app's 02:00 job at 03:00
    or 04:00 Berlin time."""
    from tests.apps import cliapp

    monkeypatch.setattr(cliapp.app.conf, "timezone", "Europe/Berlin")
    ok(cli(store, "entries", "add", "nightly", "--task", "cliapp.plain", "--cron", "0 2 * * *",
           app=True))
    shown = json.loads(ok(cli(store, "entries", "show", "nightly", "--json")))
    assert shown["timezone"] == "Europe/Berlin"
    with store.engine.connect() as conn:
        nxt = conn.execute(select(entries.c.next_fire_at)
                           .where(entries.c.name == "nightly")).scalar_one()
    if nxt.tzinfo is None:
        nxt = nxt.replace(tzinfo=timezone.utc)
    from zoneinfo import ZoneInfo
    assert nxt.astimezone(ZoneInfo("Europe/Berlin")).hour == 2
    # without -A there is no app zone: UTC, as documented
    ok(cli(store, "entries", "add", "utc", "--task", "cliapp.plain", "--cron", "0 2 * * *"))
    assert json.loads(ok(cli(store, "entries", "show", "utc", "--json")))["timezone"] == "UTC"


def test_trigger_fires_once_now_under_its_own_key(store: Store) -> None:
    ok(cli(store, "entries", "add", "rep", "--task", "cliapp.plain", "--cron", "0 3 * * *",
           "--args", "[1]"))
    before = json.loads(ok(cli(store, "entries", "show", "rep", "--json")))
    out1 = ok(cli(store, "entries", "trigger", "rep"))
    out2 = ok(cli(store, "entries", "trigger", "rep"))
    assert "queued in the outbox" in out1
    k1 = out1.split("key ")[1].split(",")[0]
    k2 = out2.split("key ")[1].split(",")[0]
    assert k1 != k2 and k1.startswith("rep@manual:")
    with store.engine.connect() as conn:
        rows = conn.execute(select(runs).where(runs.c.entry_name == "rep")).all()
        assert {r.trigger for r in rows} == {"manual"}
        assert all(r.fire_at is None and r.state == "scheduled" and r.args == [1] for r in rows)
        box = conn.execute(select(outbox).order_by(outbox.c.id)).all()
        now = store.now(conn)
    assert [b.message_id for b in box] == [f"trigger:{k1}", f"trigger:{k2}"]
    assert all(b.state == "pending" and b.available_at <= now for b in box)
    assert box[0].payload["headers"]["reliable_beat_trigger"] == "manual"
    assert box[0].payload["headers"]["reliable_beat_key"] == k1
    after = json.loads(ok(cli(store, "entries", "show", "rep", "--json")))
    assert after["next_fire_at"] == before["next_fire_at"]  # the schedule is untouched

    # With an app, the trigger is published at once (in-memory broker) and marked sent.
    out3 = ok(cli(store, "entries", "trigger", "rep", app=True))
    k3 = out3.split("key ")[1].split(",")[0]
    assert "published" in out3
    with store.engine.connect() as conn:
        run = conn.execute(select(runs).where(runs.c.idempotency_key == k3)).one()
        sent = conn.execute(select(outbox).where(outbox.c.message_id == f"trigger:{k3}")).one()
    assert run.state == "dispatched" and run.dispatched_at is not None
    assert sent.state == "sent"

    assert cli(store, "entries", "trigger", "nope").exit_code == 1


def test_backfill_creates_missing_slots_once(store: Store) -> None:
    ok(cli(store, "entries", "add", "min", "--task", "t", "--cron", "* * * * *"))
    now = db_now(store)
    end = now.replace(second=0, microsecond=0)
    start = end - timedelta(minutes=10)
    # A slot that already ran stays untouched.
    half = json.loads(ok(cli(store, "entries", "backfill", "min", iso(start),
                             iso(start + timedelta(minutes=3)), "--json")))
    assert half["created"] == 3 and half["existing"] == 0
    res = json.loads(ok(cli(store, "entries", "backfill", "min", iso(start), iso(end), "--json")))
    assert res["slots"] == 10 and res["created"] == 7 and res["existing"] == 3
    assert res["keys"][0] == f"min@{iso(start + timedelta(minutes=3))}"
    again = json.loads(ok(cli(store, "entries", "backfill", "min", iso(start), iso(end),
                              "--json")))
    assert again["created"] == 0 and again["existing"] == 10
    assert count(store, runs, runs.c.entry_name == "min") == 10
    assert count(store, runs, runs.c.trigger == "backfill", runs.c.state == "scheduled") == 10
    assert count(store, outbox) == 10
    with store.engine.connect() as conn:
        fires = conn.execute(select(runs.c.fire_at).where(runs.c.entry_name == "min")).scalars()
        assert sorted(fires) == [start + timedelta(minutes=i) for i in range(10)]
    # Future slots are left to the beat.
    fut = json.loads(ok(cli(store, "entries", "backfill", "min", iso(end),
                            iso(end + timedelta(hours=1)), "--json")))
    assert fut["future"] >= 59 and fut["created"] <= 1

    text = ok(cli(store, "entries", "backfill", "min", iso(start), iso(end)))
    assert "0 runs created, 10 already had a run" in text
    bad = cli(store, "entries", "backfill", "min", iso(end), iso(start))
    assert bad.exit_code == 2 and "window is empty" in bad.output
    naive = cli(store, "entries", "backfill", "min", "2026-01-01T00:00:00", iso(end))
    assert naive.exit_code == 2 and "no UTC offset" in naive.output


def test_backfill_limit_and_force(store: Store) -> None:
    ok(cli(store, "entries", "add", "sec", "--task", "t", "--cron", "* * * * * *"))
    end = db_now(store).replace(microsecond=0) - timedelta(seconds=5)
    start = end - timedelta(seconds=1500)
    r = cli(store, "entries", "backfill", "sec", iso(start), iso(end))
    assert r.exit_code == 2 and "more than 1000 slots" in r.output and "--force" in r.output
    assert count(store, runs) == 0
    forced = json.loads(ok(cli(store, "entries", "backfill", "sec", iso(start), iso(end),
                               "--force", "--json")))
    assert forced["created"] == 1500
    assert count(store, runs) == 1500 and count(store, outbox) == 1500
    # The limit comes from the app's settings (reliable_beat_backfill_limit = 50 there).
    ok(cli(store, "entries", "add", "min", "--task", "cliapp.plain", "--cron", "* * * * *"))
    r = cli(store, "entries", "backfill", "min", iso(end - timedelta(hours=2)), iso(end), app=True)
    assert r.exit_code == 2 and "more than 50 slots" in r.output
    with pytest.raises(BackfillLimitError):
        backfill(store, "min", end - timedelta(minutes=6), end, limit=5)


def test_backfill_with_overlap_skip_releases_one_run_at_a_time(store: Store) -> None:
    ok(cli(store, "entries", "add", "job", "--task", "t", "--cron", "* * * * *",
           "--overlap-policy", "skip"))
    end = db_now(store).replace(second=0, microsecond=0)
    res = backfill(store, "job", end - timedelta(minutes=3), end, limit=100)
    assert res.created == 3 and res.buffered == 3
    assert count(store, outbox) == 0
    beat = Beat(store, owner="test")
    released: list[str] = []
    for _ in range(3):
        tick = beat.tick()
        mine = [t.key for t in tick.triggers if t.key in res.keys]
        assert len(mine) == 1, mine  # one at a time, oldest first
        released += mine
        again = beat.tick()  # the released run is active: nothing more is released
        assert not [t.key for t in again.triggers if t.key in res.keys]
        with store.begin() as conn:  # the run finishes
            conn.execute(update(runs).where(runs.c.idempotency_key == mine[0])
                         .values(state="succeeded"))
    assert released == res.keys


def test_describe_plain_and_idempotent(store: Store) -> None:
    ok(cli(store, "entries", "add", "p", "--task", "cliapp.plain", "--every", "60", app=True))
    text = ok(cli(store, "entries", "describe", "p", app=True))
    assert "Can it run twice? YES" in text and "Is it idempotent? NO" in text
    assert "(plain)" in text
    info = json.loads(ok(cli(store, "entries", "describe", "p", "--json", app=True)))
    assert info["task_kind"] == "plain" and info["period_seconds"] == 60.0
    assert set(info["questions"]) == {"run_twice", "overlap", "machine_dies", "retry",
                                      "idempotent"}
    unknown = json.loads(ok(cli(store, "entries", "describe", "p", "--json")))
    assert unknown["task_kind"] == "unknown"
    if HAS_IDEMPOTENT:
        ok(cli(store, "entries", "add", "i", "--task", "cliapp.idem", "--every", "60",
               "--overlap-policy", "skip", app=True))
        info = json.loads(ok(cli(store, "entries", "describe", "i", "--json", app=True)))
        assert info["task_kind"] == "idempotent"
        assert info["questions"]["run_twice"]["answer"] == "no"
        assert info["questions"]["overlap"]["answer"] == "no"
        assert info["questions"]["idempotent"]["answer"] == "yes"


def test_celery_subcommand_plugin(sqlite_store: Store) -> None:
    """`celery -A APP reliable-beat ...` reaches the same commands (entry point plug-in)."""
    store = sqlite_store
    ok(cli(store, "entries", "add", "viacelery", "--task", "cliapp.plain", "--every", "30"))
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    celery = Path(sys.executable).with_name("celery")
    base = [str(celery), "-A", APP, "reliable-beat", "--database-url", store.url]
    proc = subprocess.run([*base, "entries", "list", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert [e["name"] for e in json.loads(proc.stdout)] == ["viacelery"]
    # The app comes from celery's own -A: an unknown task is refused like the beat would.
    proc = subprocess.run(
        [*base, "entries", "add", "z", "--task", "cliapp.nope", "--every", "5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "not registered" in proc.stderr


def test_cli_without_a_store_or_database_gives_one_line(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from reliable_beat.celery.commands import reliable_beat as group

    missing = tmp_path / "nothing-here.sqlite3"
    result = CliRunner().invoke(group, ["--database-url", f"sqlite:///{missing}", "status"])
    assert result.exit_code == 1
    assert "no reliable_beat store" in result.output and "db upgrade" in result.output
    assert not missing.exists()  # a read command never creates the store
    down = "postgresql+psycopg://postgres@127.0.0.1:1/x"
    result = CliRunner().invoke(group, ["--database-url", down, "runs"])
    assert result.exit_code == 1
    assert "Traceback" not in result.output and "is unavailable" in result.output


@pytest.mark.parametrize("garbage", [{"every_seconds": 60}, [1, 2, 3]])
def test_update_of_an_entry_with_a_garbage_schedule_names_the_entry_and_the_fix(
        store: Store, garbage: Any) -> None:
    ok(cli(store, "entries", "add", "broken", "--task", "shop.tick", "--every", "5"))
    with store.begin() as conn:
        conn.execute(update(entries).where(entries.c.name == "broken").values(schedule=garbage))
    r = cli(store, "entries", "update", "broken", "--args", "[1]")
    assert r.exit_code == 2, r.output
    assert "'broken'" in r.output and "--every" in r.output and "--cron" in r.output, r.output
    # the fix it names works
    ok(cli(store, "entries", "update", "broken", "--args", "[1]", "--every", "60"))
    with store.engine.connect() as conn:
        row = conn.execute(select(entries.c.schedule, entries.c.args)
                           .where(entries.c.name == "broken")).one()
    assert row.schedule["every_seconds"] == 60 and row.args == [1]


def test_backfill_leaves_slots_inside_a_skipped_range_alone(store: Store) -> None:
    """A long downtime under misfire_policy=skip records the older skipped slots as one range
    row; backfill treats those slots as recorded, exactly like single skipped slot rows."""
    ok(cli(store, "entries", "add", "min", "--task", "t", "--cron", "* * * * *",
           "--misfire-policy", "skip"))
    now = db_now(store)
    top = now.replace(second=0, microsecond=0)
    down_since = top - timedelta(minutes=40)
    with store.begin() as conn:
        conn.execute(update(entries).where(entries.c.name == "min")
                     .values(next_fire_at=down_since))
    Beat(store, owner="t").tick()  # 40 missed slots: recorded as a skipped range row
    with store.engine.connect() as conn:
        skipped = conn.execute(select(runs.c.fire_at, runs.c.reason)
                               .where(runs.c.entry_name == "min", runs.c.state == "skipped")
                               .order_by(runs.c.fire_at)).all()
    assert any("; slots " in (r.reason or "") for r in skipped), skipped  # a range row exists
    before = count(store, runs, runs.c.entry_name == "min")
    res = json.loads(ok(cli(store, "entries", "backfill", "min", iso(down_since),
                            iso(top - timedelta(minutes=1)), "--json")))
    assert res["slots"] == 39
    assert res["created"] == 0 and res["existing"] == 39, res  # range and single rows alike
    assert count(store, runs, runs.c.entry_name == "min") == before
    assert count(store, runs, runs.c.trigger == "backfill") == 0


def test_quarantined_entries_are_listed_and_resume_says_they_stay_quarantined(
        store: Store) -> None:
    """`entries list` shows quarantined entries without --all (they are what an operator must
    see); `entries resume` of a row still malformed says it stays quarantined and changes
    nothing; once repaired, resume releases it."""
    for name in ("good", "broken", "off"):
        ok(cli(store, "entries", "add", name, "--task", "shop.tick", "--every", "5"))
    with store.begin() as conn:
        good_schedule = conn.execute(select(entries.c.schedule)
                                     .where(entries.c.name == "broken")).scalar_one()
        conn.execute(update(entries).where(entries.c.name == "broken").values(
            schedule=[1], next_fire_at=store.now(conn) - timedelta(seconds=1)))  # due
        conn.execute(update(entries).where(entries.c.name == "off").values(enabled=False))
    Beat(store, owner="t:1").tick()  # the beat quarantines the malformed row
    with store.engine.connect() as conn:
        reason = conn.execute(select(entries.c.quarantine_reason)
                              .where(entries.c.name == "broken")).scalar_one()
    assert reason, "the beat did not quarantine the row"

    out = ok(cli(store, "entries", "list"))
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "quarantined" in lines["broken"], out
    assert "off" not in lines and "1 disabled entries not shown: --all" in out, out
    assert "1 quarantined" in out and "entries show NAME" in out, out
    assert "off" in ok(cli(store, "entries", "list", "--all"))
    listed = json.loads(ok(cli(store, "entries", "list", "--json")))
    assert {e["name"]: e["status"] for e in listed} == {"good": "active",
                                                        "broken": "quarantined"}

    r = cli(store, "entries", "resume", "broken")
    assert r.exit_code == 1, r.output
    assert "stays quarantined" in r.output and "resumed broken" not in r.output, r.output
    assert "schedule" in r.output and "entries update broken" in r.output, r.output
    with store.engine.connect() as conn:
        row = conn.execute(select(entries.c.enabled, entries.c.quarantine_reason)
                           .where(entries.c.name == "broken")).one()
    assert not row.enabled and row.quarantine_reason == reason  # nothing changed

    with store.begin() as conn:  # repaired by hand: now resume releases it
        conn.execute(update(entries).where(entries.c.name == "broken")
                     .values(schedule=good_schedule))
    assert "resumed broken" in ok(cli(store, "entries", "resume", "broken"))
    with store.engine.connect() as conn:
        row = conn.execute(select(entries.c.enabled, entries.c.quarantine_reason)
                           .where(entries.c.name == "broken")).one()
    assert row.enabled and row.quarantine_reason is None


ARGS_APP = "tests.apps.argsapp"


def test_arguments_that_cannot_fit_the_task_are_refused_where_the_entry_is_written(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    """Fails on the old code: `schedule sync` said nothing and `entries add` took
    `--args '[1,2,3]'` for `bill(self, amount)`; each slot then dead-lettered with a
    TypeError. A configured entry that does not fit is named at ERROR but synced (a
    misread signature must not stop a working beat's other entries); a task wrapped by a
    decorator that supplies an argument is taken as its wrapper takes it (no false
    alarm)."""
    def run(*args: str) -> Result:
        return CliRunner().invoke(reliable_beat, ["-A", ARGS_APP, "--database-url", store.url,
                                                  *args], catch_exceptions=False)

    with caplog.at_level(logging.ERROR, logger="reliable_beat.definitions"):
        ok(run("schedule", "sync"))
    said = "\n".join(r.getMessage() for r in caplog.records
                     if r.name == "reliable_beat.definitions")
    for name in ("bill-missing", "bill-too-many", "plain-wrong-kwarg"):
        assert f"entry {name!r}" in said
    assert "task 'argsapp.bill', which takes (amount)" in said
    assert "missing a required argument" in said
    assert "too many positional arguments" in said
    assert "(0 positional argument(s) and keyword(s) 'amt') do not fit task 'argsapp.plain'" \
        ", which takes (amount, currency='EUR')" in said
    for name in ("good-bill", "good-plain", "good-any", "good-untyped", "elsewhere",
                 "good-wrapped"):
        assert f"entry {name!r}" not in said
    assert count(store, entries) == 9
    ok(run("entries", "add", "w", "--task", "argsapp.wrapped", "--every", "60",
           "--args", '["m1"]'))
    assert count(store, entries) == 10
    with store.begin() as conn:
        conn.execute(entries.delete())

    r = run("entries", "add", "x", "--task", "argsapp.bill", "--every", "60",
            "--args", "[1,2,3]")
    assert r.exit_code == 2 and "entry 'x'" in r.output and "takes (amount)" in r.output
    r = run("entries", "add", "x", "--task", "argsapp.plain", "--every", "60")
    assert r.exit_code == 2 and "missing a required argument: 'amount'" in r.output
    assert count(store, entries) == 0
    ok(run("entries", "add", "x", "--task", "argsapp.bill", "--every", "60", "--args", "[1]"))
    r = run("entries", "update", "x", "--kwargs", '{"amount": 2}')
    assert r.exit_code == 2 and "multiple values for argument 'amount'" in r.output
    ok(run("entries", "update", "x", "--args", "[]", "--kwargs", '{"amount": 2}'))
    # without the app nothing can be checked: accepted as before (no false refusal)
    ok(cli(store, "entries", "add", "y", "--task", "argsapp.bill", "--every", "60",
           "--args", "[1,2,3]"))


def test_a_queue_name_with_leading_or_trailing_whitespace_is_refused(store: Store) -> None:
    """Fails on the old code: `--queue ' celery'` was stored; its triggers went to a queue no
    worker consumed, and status printed the name unquoted."""
    r = cli(store, "entries", "add", "q", "--task", "t", "--every", "60", "--queue", " celery")
    assert r.exit_code == 2, r.output
    assert "entry 'q': options['queue']=' celery' has leading or trailing whitespace" in r.output
    assert "give 'celery'" in r.output
    assert count(store, entries) == 0


def test_a_missing_sqlite_store_with_an_app_names_the_fixes_that_apply(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails on the old code: `-A app schedule ...` on a missing SQLite file said "or pass
    --database-url / -A" though -A was given."""
    monkeypatch.chdir(tmp_path)  # the embedded default store: ./reliable_beat.sqlite3, absent
    monkeypatch.delenv("RELIABLE_BEAT_DATABASE_URL", raising=False)
    r = CliRunner().invoke(reliable_beat, ["-A", ARGS_APP, "schedule", "list"])
    assert r.exit_code == 1, r.output
    assert "no reliable_beat store at" in r.output and "db upgrade" in r.output
    assert "-A" not in r.output
    assert "set reliable_beat_database_url in the app (or pass --database-url)" in r.output
    assert not (tmp_path / "reliable_beat.sqlite3").exists()
    r = CliRunner().invoke(reliable_beat, ["schedule", "list"])
    assert r.exit_code == 1 and "`reliable-beat --database-url URL schedule list`" in r.output


def test_a_missing_store_names_the_group_option_form_that_works(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails on the old code: `reliable-beat relay` without a store said "pass --database-url
    URL", but `reliable-beat relay --database-url URL` is "No such option" (a group option)."""
    monkeypatch.chdir(tmp_path)  # the embedded default store: ./reliable_beat.sqlite3, absent
    monkeypatch.delenv("RELIABLE_BEAT_DATABASE_URL", raising=False)
    r = CliRunner().invoke(reliable_beat, ["relay"], prog_name="reliable-beat")
    assert r.exit_code == 1, r.output
    assert "`reliable-beat --database-url URL relay`" in r.output, r.output
    assert "`reliable-beat -A APP relay`" in r.output, r.output
    # the form it names parses (it fails on the missing store, not on the option)
    url = f"sqlite:///{tmp_path / 'other.sqlite3'}"
    r = CliRunner().invoke(reliable_beat, ["--database-url", url, "relay"],
                           prog_name="reliable-beat")
    assert "No such option" not in r.output and "no reliable_beat store at" in r.output, r.output
