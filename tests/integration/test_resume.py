"""Resuming a frequent entry after a pause applies its misfire policy: no burst of runs."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select, update

from reliable_beat import entries as rb_entries
from reliable_beat import schedules as sch
from reliable_beat.beat import Beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, runs


# fire_once: one run, the latest due slot (the current one if it is on time at the tick,
# else the latest missed one; issue 12: never both); skip: only a current on-time slot;
# catch_up: all of them.
@pytest.mark.parametrize(("policy", "fired"), [("fire_once", (1, 1)), ("skip", (0, 1)),
                                               ("catch_up", (20, 21))])
def test_resume_after_95_s_pause(store: Store, policy: str, fired: tuple[int, int]) -> None:
    with store.begin() as conn:
        now = store.now(conn).replace(microsecond=0)
    d = rb_entries.EntryDefinition(
        name="rt2", task="t", schedule=sch.IntervalSchedule(timedelta(seconds=5),
                                                            now - timedelta(hours=1)),
        misfire_policy=policy, misfire_grace=timedelta(seconds=60),
    )
    rb_entries.save_runtime_entry(store, d, create=True)
    rb_entries.pause(store, "rt2")
    # 95 s of pause: the first unfired slot is 95 s old.
    paused_from = now - timedelta(seconds=95)
    with store.begin() as conn:
        conn.execute(update(entries).values(next_fire_at=paused_from))
    assert Beat(store, owner="t").tick().triggers == []  # paused: nothing
    rb_entries.resume(store, "rt2")
    result = Beat(store, owner="t").tick()
    with store.engine.connect() as conn:
        rows = conn.execute(select(runs.c.fire_at, runs.c.state).order_by(runs.c.fire_at)).all()
    states = [s for _, s in rows]
    assert fired[0] <= len(result.triggers) <= fired[1], rows
    assert states.count("scheduled") == len(result.triggers)
    assert len(rows) >= 20  # every slot of the pause is on record, fired or skipped
    if policy != "catch_up":  # no burst: everything before the last two slots is skipped
        assert set(states[:-2]) == {"skipped"}, states


def test_fire_once_10s_entry_paused_27s_fires_one_run(store: Store) -> None:
    """Issue 12: a 10 s entry paused 27 s fired the last missed slot AND the current slot
    within 10 ms; the docs say one run ("resuming never fires a surprise extra run")."""
    with store.begin() as conn:
        now = store.now(conn)
    slot = now.replace(microsecond=0) - timedelta(seconds=17)  # the first slot of the pause
    d = rb_entries.EntryDefinition(
        name="ten", task="t", schedule=sch.IntervalSchedule(timedelta(seconds=10), slot),
        misfire_policy="fire_once", misfire_grace=timedelta(seconds=60),
    )
    rb_entries.save_runtime_entry(store, d, create=True)
    rb_entries.pause(store, "ten")
    with store.begin() as conn:  # paused 27 s ago, just before `slot`
        conn.execute(update(entries).values(next_fire_at=slot))
    rb_entries.resume(store, "ten")
    result = Beat(store, owner="t").tick()
    with store.engine.connect() as conn:
        rows = conn.execute(select(runs.c.fire_at, runs.c.state, runs.c.trigger, runs.c.reason)
                            .order_by(runs.c.fire_at)).all()
    assert len(result.triggers) == 1, rows
    assert [(r.fire_at, r.state, r.reason) for r in rows] == [
        (slot, "skipped", "misfire:fire_once"),
        (slot + timedelta(seconds=10), "scheduled", None),
    ]
