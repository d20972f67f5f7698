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


# fire_once: the latest missed slot, plus the current slot if it is on time at the tick;
# skip: only a current on-time slot; catch_up: all of them.
@pytest.mark.parametrize(("policy", "fired"), [("fire_once", (1, 2)), ("skip", (0, 1)),
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
