"""Several apps with their own brokers on one store: every path that publishes a trigger
into a broker takes only its own schedule group's entries (and group-less ones).

A beat publishes into its own app's broker; another app's workers never see what is there.
Before this, a beat claimed any group's due entries, and its sweep and redispatch took any
group's trigger rows and stuck runs (issue 11 follow-up). Real PostgreSQL.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import select, update

from reliable_beat import schedules as sch
from reliable_beat import unsent
from reliable_beat.beat import TRIGGER_DESTINATION, Beat
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, outbox, runs
from reliable_beat.entries import EntryDefinition
from reliable_beat.redispatch import claim_stuck_runs
from reliable_beat.relay import Relay, claim_outbox_batch

pytestmark = pytest.mark.postgres

#: entry name -> its schedule group (None: a row stored before groups existed)
GROUPS: dict[str, str | None] = {"a-proj": "proj", "b-proj2": "proj2", "c-none": None}


def _now(store: Store) -> datetime:
    with store.begin() as conn:
        return store.now(conn)


def _seed(store: Store) -> None:
    with store.begin() as conn:
        now = store.now(conn)
        anchor = now - timedelta(seconds=30)
        for name, group in GROUPS.items():
            d = EntryDefinition(name=name, task="t.tick", args=[name],
                                schedule=sch.IntervalSchedule(timedelta(seconds=60), anchor))
            values = d.row_values()
            values.update(next_fire_at=anchor, created_at=now, updated_at=now, enabled=True,
                          paused=False, schedule_group=group,
                          origin="config" if group else "runtime")
            conn.execute(entries.insert().values(**values))


def _fired(store: Store) -> set[str]:
    with store.engine.connect() as conn:
        return {r.entry_name for r in conn.execute(select(runs.c.entry_name))}


def _beat(store: Store, group: str | None) -> Beat:
    return Beat(store, owner=f"beat-{group}", schedule_group=group)


def test_a_beat_claims_only_its_groups_entries_and_group_less_ones(pg_store: Store) -> None:
    """Fails on the old claim: the first beat claimed every due entry, proj2's too."""
    _seed(pg_store)
    first = _beat(pg_store, "proj").tick()
    assert sorted(t.payload["args"][0] for t in first.triggers) == ["a-proj", "c-none"]
    assert _fired(pg_store) == {"a-proj", "c-none"}
    # proj2's entry, still due, is not proj's next claim (no busy loop on it)
    assert first.next_fire_at is not None and first.next_fire_at > _now(pg_store)
    second = _beat(pg_store, "proj2").tick()
    assert [t.payload["args"][0] for t in second.triggers] == ["b-proj2"]
    assert _fired(pg_store) == {"a-proj", "b-proj2", "c-none"}


def test_a_beat_without_a_group_claims_every_entry(pg_store: Store) -> None:
    _seed(pg_store)
    result = _beat(pg_store, None).tick()
    assert sorted(t.payload["args"][0] for t in result.triggers) == sorted(GROUPS)


def _fire_all(store: Store) -> None:
    """Commit every entry's trigger (as three beats would) without publishing any."""
    _seed(store)
    for group in ("proj", "proj2"):
        _beat(store, group).tick()


def _sweep(store: Store, group: str | None) -> list[Any]:
    """A beat's sweep of ``group``: the trigger rows of due slots committed without one
    (a due slot's trigger has no row until then), then the claim of unsent rows."""
    with store.begin() as conn:
        now = store.now(conn) + timedelta(hours=1)  # past every sweep delay
        unsent.materialise_unsent(store, conn, now=now, sweep_delay=timedelta(seconds=10),
                                  destination=TRIGGER_DESTINATION, schedule_group=group,
                                  limit=100)
        return claim_outbox_batch(store, conn, owner=f"sweep-{group}", now=now,
                                  lease=timedelta(seconds=30), limit=100,
                                  destinations=[TRIGGER_DESTINATION], schedule_group=group)


def test_the_sweep_publishes_only_its_groups_triggers(pg_store: Store) -> None:
    """Fails on the old sweep: proj2's beat took proj's unsent trigger into its broker."""
    _fire_all(pg_store)
    proj2 = _sweep(pg_store, "proj2")
    assert sorted(m.payload["args"][0] for m in proj2) == ["b-proj2", "c-none"]
    proj = _sweep(pg_store, "proj")
    assert [m.payload["args"][0] for m in proj] == ["a-proj"]


def test_the_redispatch_takes_only_its_groups_stuck_runs(pg_store: Store) -> None:
    """Fails on the old redispatch: proj's beat re-sent proj2's stuck run into its broker."""
    _fire_all(pg_store)
    with pg_store.begin() as conn:
        now = pg_store.now(conn)
        conn.execute(update(runs).values(state="dispatched",
                                         dispatched_at=now - timedelta(hours=1)))
        conn.execute(update(outbox).values(state="sent"))

    def stuck(group: str | None) -> list[str]:
        with pg_store.begin() as conn:
            found = claim_stuck_runs(pg_store, conn, now=pg_store.now(conn),
                                     after=timedelta(seconds=60), tasks=["t.tick"],
                                     schedule_group=group)
        return sorted(m.payload["args"][0] for m in found)

    assert stuck("proj") == ["a-proj", "c-none"]
    assert stuck("proj2") == ["b-proj2"]


def test_an_entry_moved_to_another_group_follows_it(pg_store: Store) -> None:
    """The sweep reads the entry's current group: a trigger goes to the app owning it now."""
    _fire_all(pg_store)
    with pg_store.begin() as conn:
        conn.execute(update(entries).where(entries.c.name == "a-proj")
                     .values(schedule_group="proj2"))
    assert sorted(m.payload["args"][0] for m in _sweep(pg_store, "proj2")) == [
        "a-proj", "b-proj2", "c-none"]


def _cli(store: Store, *args: str, app: bool = False) -> str:
    base = ["--database-url", store.url]
    if app:
        base = ["-A", "tests.apps.cliapp", *base]
    result = CliRunner().invoke(reliable_beat, [*base, *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _groups(store: Store) -> dict[str, str | None]:
    with store.engine.connect() as conn:
        return {r.name: r.schedule_group
                for r in conn.execute(select(entries.c.name, entries.c.schedule_group))}


def test_entries_added_with_an_app_get_its_group(pg_store: Store) -> None:
    """Fails on the old CLI: a runtime entry added with -A had no group, so every other
    app's beat fired it into its own broker."""
    _cli(pg_store, "entries", "add", "mine", "--task", "cliapp.plain", "--every", "60",
         app=True)
    _cli(pg_store, "entries", "add", "other", "--task", "t", "--every", "60",
         "--group", "proj2")
    _cli(pg_store, "entries", "add", "anyone", "--task", "t", "--every", "60")
    assert _groups(pg_store) == {"mine": "cliapp", "other": "proj2", "anyone": None}
    _cli(pg_store, "entries", "update", "mine", "--every", "30")  # keeps its group
    _cli(pg_store, "entries", "update", "anyone", "--group", "proj2")  # moves
    assert _groups(pg_store) == {"mine": "cliapp", "other": "proj2", "anyone": "proj2"}


def test_a_relay_with_an_app_delivers_only_its_groups_triggers(pg_store: Store) -> None:
    """Fails on the old relay: proj's relay took proj2's trigger into proj's broker."""
    _fire_all(pg_store)
    app = Celery("proj", broker="memory://", set_as_current=False)
    app.conf.update(reliable_beat_database_url=pg_store.url)
    relay = Relay(pg_store, app, owner="relay-proj")
    relay.unsent_after = timedelta(0)  # past the beats' sweep delay
    assert relay.maybe_materialise_unsent() == 2  # its group's and group-less due slots
    claimed = relay.claim()
    assert sorted(m.payload["args"][0] for m in claimed) == ["a-proj", "c-none"]


def test_entries_trigger_with_another_groups_app_leaves_it_in_the_outbox(
    pg_store: Store,
) -> None:
    """Fails on the old CLI: `-A cliapp entries trigger` published proj2's trigger into
    cliapp's broker (marked sent: nothing re-sent it to proj2's workers)."""
    _cli(pg_store, "entries", "add", "theirs", "--task", "t", "--cron", "0 3 * * *",
         "--group", "proj2")
    out = _cli(pg_store, "entries", "trigger", "theirs", app=True)
    assert "queued in the outbox for schedule group 'proj2'" in out
    _cli(pg_store, "entries", "backfill", "theirs", "2020-01-01T00:00:00Z",
         "2020-01-03T00:00:00Z", app=True)
    with pg_store.engine.connect() as conn:
        states = [r.state for r in conn.execute(select(outbox.c.state))]
    assert states == ["pending"] * 3  # the manual trigger and two backfilled slots
    # proj2's own sweep takes them; cliapp's does not
    assert _sweep(pg_store, "cliapp") == []
    assert len(_sweep(pg_store, "proj2")) == 3


def test_status_reports_an_entry_whose_triggers_go_unstarted_between_started_ones(
    pg_store: Store,
) -> None:
    """Fails on the old check: an entry fired by two apps' beats (half its triggers consumed
    by the wrong app's worker as an unregistered task) stayed green whenever its latest
    trigger happened to be started; "unstarted" must see the lost ones in between."""
    with pg_store.begin() as conn:
        now = pg_store.now(conn)
        rows = []
        for i, (name, started) in enumerate([
            ("lossy", True), ("lossy", False), ("lossy", True),  # one lost between
            ("fixed", False), ("fixed", True),  # a task name fixed since: not an alarm
            ("healthy", True), ("healthy", True),
        ]):
            at = now - timedelta(minutes=60 - i)
            rows.append({
                "idempotency_key": f"{name}@{i}", "entry_name": name, "fire_at": at,
                "trigger": "schedule", "task": "t", "args": [], "kwargs": {},
                "state": "succeeded" if started else "dispatched", "created_at": at,
                "updated_at": at, "dispatched_at": at, "started_at": at if started else None,
            })
        conn.execute(runs.insert(), rows)
    info = collect_status(pg_store, redispatch_seconds=120)
    assert info["unstarted"] == {"lossy": 1}


def test_status_says_no_beat_for_a_group_of_runtime_entries_only(pg_store: Store) -> None:
    """Fails on the old status: a runtime entry added to a group no beat runs (a typo'd
    --group, an app never started) was never fired and status stayed green."""
    _cli(pg_store, "entries", "add", "orphan", "--task", "t", "--every", "60",
         "--group", "prjo")
    info = collect_status(pg_store)
    assert any(p.startswith("NO BEAT: schedule group 'prjo' has 1 enabled runtime entries")
               for p in info["problems"]), info["problems"]


def test_entries_import_with_an_app_gives_its_group(pg_store: Store, redis_url: str) -> None:
    """Fails on the old import: the imported entries had no group (any app's beat fired
    them into its own broker)."""
    import uuid

    from celery.schedules import schedule
    from redbeat import RedBeatSchedulerEntry

    prefix = f"rb-scope-{uuid.uuid4().hex[:8]}:"
    legacy = Celery("legacy", set_as_current=False)
    legacy.conf.update(redbeat_redis_url=redis_url, redbeat_key_prefix=prefix)
    for name in ("poll", "sync"):
        RedBeatSchedulerEntry(name, "cliapp.plain", schedule(run_every=60), app=legacy).save()
    _cli(pg_store, "entries", "import", "redbeat", "--from-url", redis_url,
         "--key-prefix", prefix, app=True)
    assert _groups(pg_store) == {"poll": "cliapp", "sync": "cliapp"}


class _Published:
    """A :class:`reliable_beat.loop.Publisher` that records what it publishes."""

    destination = "dramatiq"

    def __init__(self) -> None:
        self.published: list[Any] = []

    def publish(self, messages: Any, now: datetime) -> list[tuple[int, BaseException | None]]:
        self.published += messages
        return [(m.id, None) for m in messages]

    def tracked_tasks(self) -> list[str]:
        return []


def test_the_core_beat_loop_fires_only_its_groups_entries(pg_store: Store) -> None:
    """Fails on the old loop (Dramatiq's beat): it fired a Celery app's entries too, as
    Dramatiq messages no actor knows."""
    from reliable_beat.groups import DEFAULT_GROUP
    from reliable_beat.loop import BeatLoop
    from reliable_beat.settings import Settings

    _seed(pg_store)
    with pg_store.begin() as conn:  # a Dramatiq entry: synced into the default group
        conn.execute(update(entries).where(entries.c.name == "b-proj2")
                     .values(schedule_group=DEFAULT_GROUP))
    pub = _Published()
    BeatLoop(store=pg_store, settings=Settings(), publisher=pub, owner="dq:1").step()
    assert sorted(m.payload["args"][0] for m in pub.published) == ["b-proj2", "c-none"]


def test_a_start_not_recorded_between_started_ones_is_not_called_a_typo(
    pg_store: Store,
) -> None:
    """Fails on the old check: a plain task's trigger whose start the worker could not record
    (the database was down at that moment) raised NEVER STARTED with "no worker registers
    the task (a typo? a removed task?)" for 24 h, although later triggers of the entry did
    start. It is still reported (it may as well be a lost trigger), with the right advice."""
    with pg_store.begin() as conn:
        now = pg_store.now(conn)
        rows = []
        for i, (name, started) in enumerate([
            ("dbdown", True), ("dbdown", False), ("dbdown", True), ("dbdown", True),
            ("typo", False), ("typo", False),
        ]):
            at = now - timedelta(minutes=60 - i)
            rows.append({
                "idempotency_key": f"{name}@{i}", "entry_name": name, "fire_at": at,
                "trigger": "schedule", "task": "t", "args": [], "kwargs": {},
                "state": "dispatched", "created_at": at, "updated_at": at,
                "dispatched_at": at, "started_at": at if started else None,
            })
        conn.execute(runs.insert(), rows)
    info = collect_status(pg_store, redispatch_seconds=120)
    assert info["unstarted"] == {"dbdown": 1, "typo": 2}
    never = [p for p in info["problems"] if p.startswith("NEVER STARTED")]
    assert len(never) == 1 and "(typo)" in never[0] and "dbdown" not in never[0], never
    assert info["unstarted_between"] == ["dbdown"]
    gaps = [p for p in info["problems"] if p.startswith("UNSTARTED BETWEEN STARTED")]
    assert len(gaps) == 1 and "(dbdown)" in gaps[0], info["problems"]
    assert "could not record the start" in gaps[0] and "typo" not in gaps[0]
    assert not info["ok"]
