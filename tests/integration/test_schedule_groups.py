"""Schedule groups and config versions: several apps, and old and new pods, on one store.

Real ``ReliableScheduler`` instances (the start-up sync a ``celery beat`` runs) of different
Celery apps on one real PostgreSQL store, and on one real MariaDB store.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import select, update

from reliable_beat.celery.commands import reliable_beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries

SCHEDULER_LOG = "reliable_beat.scheduler"


def _noop(*args: Any) -> None:
    """A plain task."""


def _app(main: str, url: str, schedule: dict[str, Any], **conf: Any) -> Celery:
    app = Celery(main, broker="memory://", set_as_current=False)
    app.conf.update(reliable_beat_database_url=url, timezone="UTC",
                    beat_schedule=schedule, **conf)
    app.task(name=f"{main}.tick")(_noop)
    return app


def _tick(main: str, cron: str = "* * * * *", *args: Any) -> dict[str, Any]:
    return {"task": f"{main}.tick", "schedule": cron, "args": list(args)}


@pytest.fixture
def start(server_store: Store) -> Iterator[Any]:
    """Start (set up) a ``ReliableScheduler`` of a new app: what `celery beat` does first."""
    from reliable_beat.celery.scheduler import ReliableScheduler

    started: list[Any] = []

    def go(main: str, schedule: dict[str, Any], **conf: Any) -> Any:
        app = _app(main, server_store.url, schedule, **conf)
        sched = ReliableScheduler(app=app)  # checks the schema, syncs beat_schedule
        started.append(sched)
        return sched

    yield go
    for sched in started:
        sched.close()


def _rows(store: Store) -> dict[str, Any]:
    with store.engine.connect() as conn:
        return {r.name: r for r in conn.execute(select(entries))}


def test_two_apps_on_one_store_keep_each_others_entries(
    server_store: Store, start: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Fails on the code before groups: the later sync disabled the other app's entries."""
    start("billing", {"invoice": _tick("billing"), "dunning": _tick("billing")})
    with caplog.at_level(logging.INFO, logger=SCHEDULER_LOG):
        start("reports", {"daily": _tick("reports", "0 6 * * *")})
    rows = _rows(server_store)
    assert {n: r.enabled for n, r in rows.items()} == {
        "invoice": True, "dunning": True, "daily": True}
    assert "disabled" not in caplog.text
    assert {n: r.schedule_group for n, r in rows.items()} == {
        "invoice": "billing", "dunning": "billing", "daily": "reports"}
    # billing restarts with the same config: nothing changes, one quiet INFO line.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=SCHEDULER_LOG):
        start("billing", {"invoice": _tick("billing"), "dunning": _tick("billing")})
    assert "is current" in caplog.text and "WARNING" not in caplog.text
    assert all(r.enabled for r in _rows(server_store).values())
    # billing drops 'dunning': disabled by a billing beat, at WARNING, with the name.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=SCHEDULER_LOG):
        start("billing", {"invoice": _tick("billing")})
    rows = _rows(server_store)
    assert rows["dunning"].enabled is False and rows["dunning"].disabled_at is not None
    assert rows["daily"].enabled is True and rows["invoice"].enabled is True
    warn = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 1 and "dunning" in warn[0].getMessage()
    assert "'billing'" in warn[0].getMessage()


def test_group_setting_overrides_main_name(server_store: Store, start: Any) -> None:
    start("proj", {"a": _tick("proj")}, reliable_beat_schedule_group="web")
    start("proj", {"b": _tick("proj")}, reliable_beat_schedule_group="batch")
    rows = _rows(server_store)
    assert {n: (r.enabled, r.schedule_group) for n, r in rows.items()} == {
        "a": (True, "web"), "b": (True, "batch")}


def test_same_name_in_two_groups_is_refused_per_entry(
    server_store: Store, start: Any, caplog: pytest.LogCaptureFixture
) -> None:
    start("one", {"shared": _tick("one"), "mine": _tick("one")})
    with caplog.at_level(logging.INFO, logger=SCHEDULER_LOG):
        start("two", {"shared": _tick("two", "0 * * * *"), "theirs": _tick("two")})
    rows = _rows(server_store)
    # 'shared' stays one's (and one's definition); two's other entry is synced.
    assert rows["shared"].schedule_group == "one" and rows["shared"].task == "one.tick"
    assert rows["theirs"].enabled and rows["theirs"].schedule_group == "two"
    err = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("'shared'" in m and "'one'" in m for m in err), err
    # one drops it: disabled there; two's next start adopts it.
    start("one", {"mine": _tick("one")})
    assert _rows(server_store)["shared"].enabled is False
    start("two", {"shared": _tick("two", "0 * * * *"), "theirs": _tick("two")})
    shared = _rows(server_store)["shared"]
    assert (shared.enabled, shared.schedule_group, shared.task) == (True, "two", "two.tick")


def test_older_config_of_a_rolling_deploy_does_not_flap(
    server_store: Store, start: Any, caplog: pytest.LogCaptureFixture
) -> None:
    old = {"keep": _tick("app"), "cron": _tick("app", "*/5 * * * *"),
           "removed": _tick("app"), "old-name": _tick("app", "* * * * *", "r")}
    new = {"keep": _tick("app"), "cron": _tick("app", "*/10 * * * *"),
           "added": _tick("app", "* * * * *", "a"), "new-name": _tick("app", "* * * * *", "r")}
    start("app", old)
    with caplog.at_level(logging.INFO, logger=SCHEDULER_LOG):
        start("app", new)
    changed = caplog.text
    assert "inserted 2 (added, new-name)" in changed and "updated 1 (cron)" in changed
    assert "disabled 2 config entries" in changed and "old-name, removed" in changed
    assert "renamed old-name -> new-name" in changed

    def state() -> dict[str, Any]:
        return {n: (r.enabled, r.schedule["expr"] if r.schedule_kind == "cron" else None)
                for n, r in _rows(server_store).items()}

    want = {"keep": (True, "* * * * *"), "cron": (True, "*/10 * * * *"),
            "added": (True, "* * * * *"), "new-name": (True, "* * * * *"),
            "removed": (False, "* * * * *"), "old-name": (False, "* * * * *")}
    assert state() == want
    # Old and new pods keep restarting: the stored schedule stays the new one, and neither
    # logs a change again.
    for _ in range(3):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=SCHEDULER_LOG):
            start("app", old)
            start("app", new)
        assert state() == want
        assert "older version" in caplog.text and "is current" in caplog.text
        assert "synced" not in caplog.text and "disabled" not in caplog.text
    # A rollback is a person's decision: `schedule sync --force` with the old config.
    runner = CliRunner()
    res = runner.invoke(reliable_beat, ["--database-url", server_store.url, "schedule", "list",
                                        "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    configs = json.loads(res.output)
    assert [c["current"] for c in configs if c["schedule_group"] == "app"].count(True) == 1


def test_status_shows_disabled_and_alarms(server_store: Store, start: Any) -> None:
    start("web", {"a": _tick("web"), "b": _tick("web")})
    sched = start("web", {"a": _tick("web")})
    runner = CliRunner()

    def status(*args: str) -> Any:
        return runner.invoke(reliable_beat, ["--database-url", server_store.url, "status", *args],
                             catch_exceptions=False)

    info = json.loads(status("--json").output)
    b = next(e for e in info["entries"] if e["name"] == "b")
    assert b["status"] == "disabled" and b["schedule_group"] == "web"
    assert b["disabled_at"].endswith("Z")
    assert info["recently_disabled"] == ["b"]
    assert any("RECENTLY DISABLED" in p and "b" in p for p in info["problems"])
    assert status("--check").exit_code == 1
    assert status("--check", "--disabled-within", "0").exit_code == 0
    # the text view shows no NEXT for it (a disabled entry never fires)
    [row] = [ln.split() for ln in status("--all").output.splitlines() if ln.startswith("b ")]
    assert row[2] == "disabled" and row[4] == "-", row
    # All beats of the group gone (no heartbeat for longer than the alive window): alarm.
    from reliable_beat.db.tables import beats

    sched.close()
    with server_store.begin() as conn:
        conn.execute(update(beats).values(seen_at=server_store.now(conn) - timedelta(minutes=5),
                                          stopped_at=None))
    r = status("--check", "--disabled-within", "0")
    assert r.exit_code == 1 and "NO BEAT" in r.output and "'web'" in r.output


def test_unregistered_task_is_an_error_and_counted(
    server_store: Store, start: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=SCHEDULER_LOG):
        start("web", {"ok": _tick("web"), "typo": {"task": "web.tikc", "schedule": 60.0}})
    err = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("'typo'" in m and "'web.tikc'" in m for m in err), err
    res = CliRunner().invoke(reliable_beat, ["--database-url", server_store.url, "status",
                                             "--json"], catch_exceptions=False)
    info = json.loads(res.output)
    assert info["unregistered"] == {"typo": "web.tikc"}


def test_a_renamed_entry_continues_the_old_names_grid(server_store: Store, start: Any) -> None:
    every = {"task": "app.tick", "schedule": 3600.0, "args": [1]}
    start("app", {"old-name": every, "other": _tick("app")})
    before = _rows(server_store)["old-name"]
    anchor = datetime.fromisoformat(before.schedule["anchor"].replace("Z", "+00:00"))
    last = anchor + timedelta(hours=1)  # the old name fired its slot an hour after its anchor
    with server_store.begin() as conn:
        conn.execute(update(entries).where(entries.c.name == "old-name")
                     .values(last_fire_at=last, next_fire_at=last + timedelta(hours=1)))
    time.sleep(1.1)  # a new entry would get a new anchor
    start("app", {"new-name": every, "other": _tick("app")})
    rows = _rows(server_store)
    assert rows["old-name"].enabled is False
    new = rows["new-name"]
    # same grid (anchor), first slot after the old name's last: none repeated, none skipped
    assert new.schedule == before.schedule
    assert new.next_fire_at == last + timedelta(hours=1)


def test_a_config_that_would_disable_the_whole_group_is_refused(
    server_store: Store, start: Any, caplog: pytest.LogCaptureFixture
) -> None:
    start("tasks", {"a": _tick("tasks"), "b": _tick("tasks")}, reliable_beat_owner_id="b1")
    # A beat whose settings did not load (empty beat_schedule), and another app that happens
    # to have the same main name: neither disables the group's entries.
    with caplog.at_level(logging.INFO, logger=SCHEDULER_LOG):
        start("tasks", {}, reliable_beat_owner_id="b2")
        start("tasks", {"x": _tick("tasks")}, reliable_beat_owner_id="b3")
    rows = _rows(server_store)
    assert {n: r.enabled for n, r in rows.items()} == {"a": True, "b": True}
    err = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("is empty" in m and "schedule retire tasks" in m for m in err), err
    assert any("shares no entry" in m and "reliable_beat_schedule_group" in m for m in err)
    res = CliRunner().invoke(reliable_beat, ["--database-url", server_store.url, "status",
                                             "--json"], catch_exceptions=False)
    info = json.loads(res.output)
    tasks = next(g for g in info["groups"] if g["group"] == "tasks")
    assert tasks["beats_alive"] == 3 and tasks["beats_on_other_config"] == 2
    assert any("2 of 3 live beats" in w for w in info["warnings"])
    # A real change that keeps an entry is synced as usual.
    start("tasks", {"a": _tick("tasks"), "c": _tick("tasks", "0 * * * *")})
    rows = _rows(server_store)
    assert {n: r.enabled for n, r in rows.items()} == {"a": True, "b": False, "c": True}


def test_an_entry_with_no_group_is_refused_where_two_apps_share_the_store(
    server_store: Store, start: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Two apps on one store: an entry added without ``-A`` or ``--group`` would be fired by
    the beats of both apps, each through its own broker (one app's workers do not know the
    other's task). Fails on the old code: the add succeeded silently with no group."""
    runner = CliRunner()

    def add(name: str, *extra: str) -> Any:
        return runner.invoke(reliable_beat, ["--database-url", server_store.url, "entries", "add",
                                             name, "--task", "billing.tick", "--cron",
                                             "0 2 * * *", *extra])

    start("billing", {"a": _tick("billing")})
    # One app: a group-less entry is fired by that app's beats only: allowed.
    assert add("early").exit_code == 0
    caplog.set_level(logging.WARNING, logger=SCHEDULER_LOG)
    start("reports", {"r": _tick("reports")})  # a second app joins the store
    warned = [r.getMessage() for r in caplog.records if "no schedule group" in r.getMessage()]
    assert warned and "group: early." in warned[0] and "'billing', 'reports'" in warned[0]
    assert "entries update NAME --group GROUP" in warned[0]

    refused = add("late")
    assert refused.exit_code != 0
    assert "'late' has no schedule group" in refused.output
    assert "'billing', 'reports'" in refused.output and "--group GROUP" in refused.output
    assert "late" not in _rows(server_store)
    ok = add("late", "--group", "billing")
    assert ok.exit_code == 0, ok.output
    assert _rows(server_store)["late"].schedule_group == "billing"

    # Once it has a group, a beat's start no longer warns about it.
    moved = runner.invoke(reliable_beat, ["--database-url", server_store.url, "entries",
                                          "update", "early", "--group", "billing"])
    assert moved.exit_code == 0, moved.output
    caplog.clear()
    start("reports", {"r": _tick("reports")})
    assert not [r for r in caplog.records if "no schedule group" in r.getMessage()]
