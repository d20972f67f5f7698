"""A one-off whose instant has passed when it is stored is due at once and meets its misfire
policy; before, it was stored ``ended`` (next slot: none) and never ran, silently.

Found by a fresh user: ``entries add --at <now + 5 s>`` on a loaded machine, where the CLI
took more than 5 s to start, stored the entry a second after its instant: no run row, no
skipped row, ``status --check`` 0. The same for a ``beat_schedule`` one-off deployed after its
instant, and a django-celery-beat clocked task imported after its time without a run.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import select

from reliable_beat import schedules as sch
from reliable_beat.beat import Beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, runs
from reliable_beat.entries import (
    EntryDefinition,
    remove,
    save_runtime_entry,
    sync_schedule_group,
)

UTC = timezone.utc


def _now(store: Store) -> datetime:
    with store.begin() as conn:
        return store.now(conn).replace(microsecond=0)


def _runs(store: Store, name: str) -> list[tuple[datetime, str, str]]:
    with store.engine.connect() as conn:
        return [(r.fire_at.replace(tzinfo=UTC) if r.fire_at.tzinfo is None else r.fire_at,
                 r.trigger, r.state)
                for r in conn.execute(select(runs).where(runs.c.entry_name == name))]


def _next(store: Store, name: str) -> datetime | None:
    with store.engine.connect() as conn:
        value = conn.execute(
            select(entries.c.next_fire_at).where(entries.c.name == name)).scalar_one()
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def _one_off(name: str, at: datetime, **kw: object) -> EntryDefinition:
    return EntryDefinition(name=name, task="shop.tasks.once", args=[name],
                           schedule=sch.OneOffSchedule(at), **kw)  # type: ignore[arg-type]


def test_a_runtime_one_off_added_after_its_instant_fires_once(store: Store) -> None:
    at = _now(store) - timedelta(seconds=5)
    save_runtime_entry(store, _one_off("late", at), create=True)
    assert _next(store, "late") == at  # main: None ("ended")
    for _ in range(3):
        Beat(store, owner="t:1").tick()
    fired = _runs(store, "late")
    assert [(f, s) for f, _t, s in fired] == [(at, "scheduled")], fired  # trigger committed
    # removed and added again with the same instant: the slot's run exists, no second run
    remove(store, "late")
    save_runtime_entry(store, _one_off("late", at), create=True)
    Beat(store, owner="t:1").tick()
    assert len(_runs(store, "late")) == 1


def test_a_one_off_long_past_meets_its_misfire_policy(store: Store) -> None:
    at = _now(store) - timedelta(hours=2)
    save_runtime_entry(store, _one_off("skipped", at, misfire_policy="skip"), create=True)
    save_runtime_entry(store, _one_off("fired", at, misfire_policy="fire_once"), create=True)
    Beat(store, owner="t:1").tick()
    skipped, fired = _runs(store, "skipped"), _runs(store, "fired")
    assert [(f, s) for f, _t, s in skipped] == [(at, "skipped")], skipped  # visible, not lost
    assert [(f, t, s) for f, t, s in fired] == [(at, "catch_up", "scheduled")], fired


def test_a_config_one_off_deployed_after_its_instant_fires_once(store: Store) -> None:
    at = _now(store) - timedelta(seconds=5)
    sync_schedule_group(store, [_one_off("deploy", at)], group="shop", owner="b:1")
    Beat(store, owner="t:1").tick()
    assert [f for f, _t, _s in _runs(store, "deploy")] == [at]
    # a new config (args changed, same instant): the slot fired already, nothing more
    changed = _one_off("deploy", at)
    changed.args = ["again"]
    sync_schedule_group(store, [changed], group="shop", owner="b:2")
    Beat(store, owner="t:1").tick()
    assert len(_runs(store, "deploy")) == 1
    assert _next(store, "deploy") is None
    # a new instant, also already past: that is a new slot, due at once
    later = _now(store) - timedelta(seconds=1)
    sync_schedule_group(store, [_one_off("deploy", later)], group="shop", owner="b:3")
    Beat(store, owner="t:1").tick()
    assert sorted(f for f, _t, _s in _runs(store, "deploy")) == [at, later]


def test_a_future_one_off_and_recurring_entries_are_unchanged(store: Store) -> None:
    now = _now(store)
    save_runtime_entry(store, _one_off("future", now + timedelta(hours=1)), create=True)
    assert _next(store, "future") == now + timedelta(hours=1)
    every = EntryDefinition(name="every", task="t", schedule=sch.IntervalSchedule(
        timedelta(hours=1), now - timedelta(minutes=90)))
    save_runtime_entry(store, every, create=True)
    assert _next(store, "every") == now + timedelta(minutes=30)  # strictly after now
