"""The herd: entries with the same schedule spec share one schedule object in a beat, so a
tick over many ``0 * * * *`` entries parses the cron once, not once per entry; every entry
still gets its own slot, run and trigger."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select

from reliable_beat import schedules as sch
from reliable_beat.beat import Beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, runs
from reliable_beat.entries import EntryDefinition


def _seed(store: Store, n: int, cron: str, zone: str = "UTC") -> None:
    with store.begin() as conn:
        now = store.now(conn)
        slot = now.replace(minute=0, second=0, microsecond=0)
        for i in range(n):
            d = EntryDefinition(name=f"h{cron}{zone}{i}", task="t",
                                schedule=sch.CronSchedule(cron, zone),
                                misfire_grace=timedelta(hours=2))
            values = d.row_values()
            values.update(next_fire_at=slot, created_at=now, updated_at=now, enabled=True,
                          paused=False)
            conn.execute(entries.insert().values(**values))


def test_entries_with_one_cron_share_one_schedule(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    _seed(store, 40, "0 * * * *")
    _seed(store, 10, "0 * * * *", "Europe/Berlin")  # another spec: its own schedule
    built: list[str] = []
    real = sch.schedule_from_spec

    def counting(spec: dict[str, object]) -> sch.Schedule:
        built.append(str(spec.get("timezone")))
        return real(spec)

    monkeypatch.setattr(sch, "schedule_from_spec", counting)
    steps: list[object] = []
    real_next = sch.CronSchedule.next_after

    def counting_next(self: sch.CronSchedule, after: object) -> object:
        steps.append(after)
        return real_next(self, after)  # type: ignore[arg-type]

    monkeypatch.setattr(sch.CronSchedule, "next_after", counting_next)
    beat = Beat(store, owner="herd", batch_size=100)
    result = beat.tick()
    assert result.claimed == 50
    assert len(result.triggers) == 50
    assert sorted(built) == ["Europe/Berlin", "UTC"]  # one per spec, not one per entry
    # the same question to the same schedule in one tick is answered once
    assert 0 < len(steps) <= 10, len(steps)
    with store.begin() as conn:
        assert conn.execute(select(func.count()).select_from(runs)).scalar_one() == 50
        nexts = {r.next_fire_at for r in conn.execute(select(entries.c.next_fire_at))}
    assert len(nexts) == 1  # every entry advanced to the next top of the hour
