""":func:`reliable_beat.rows.next_fire_problem`: an active entry's ``next_fire_at`` its
schedule cannot have put there (NULL while it has a next slot, or far beyond its next slot)
is named; every legitimate value is not (a yearly cron's next fire months ahead, an ended
entry, a one-off that fired, a ``start_at`` in the future, an instant in the past, a cron
across a DST change)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from reliable_beat import schedules as sch
from reliable_beat.rows import next_fire_problem, repaired_next_fire

UTC = timezone.utc
NOW = datetime(2026, 12, 6, 22, 40, 3, tzinfo=UTC)
EVERY5 = sch.IntervalSchedule(timedelta(seconds=5), datetime(2026, 1, 1, tzinfo=UTC))


def problem(schedule: sch.Schedule, nxt: datetime | None, last: datetime | None = None, *,
            start: datetime | None = None, end: datetime | None = None,
            now: datetime = NOW) -> str | None:
    return next_fire_problem(schedule, next_fire_at=nxt, last_fire_at=last, start_at=start,
                             end_at=end, now=now)


def test_null_next_of_an_unbounded_interval_is_named() -> None:
    last = datetime(2026, 12, 6, 22, 40, tzinfo=UTC)
    found = problem(EVERY5, None, last)
    assert found is not None and found.startswith("next_fire_at=NULL")
    assert "2026-12-06T22:40:05Z" in found
    assert repaired_next_fire(EVERY5, last_fire_at=last, start_at=None, end_at=None,
                              now=NOW) == datetime(2026, 12, 6, 22, 40, 5, tzinfo=UTC)


def test_far_future_next_of_an_interval_is_named() -> None:
    last = datetime(2026, 12, 6, 22, 40, tzinfo=UTC)
    found = problem(EVERY5, datetime(2999, 1, 1, tzinfo=UTC), last)
    assert found is not None and found.startswith("next_fire_at=2999-01-01T00:00:00Z")
    assert "its next slot is 2026-12-06T22:40:05Z" in found


def test_legitimate_values_are_no_problem() -> None:
    last = datetime(2026, 12, 6, 22, 40, tzinfo=UTC)
    assert problem(EVERY5, datetime(2026, 12, 6, 22, 40, 5, tzinfo=UTC), last) is None
    assert problem(EVERY5, datetime(1970, 1, 1, tzinfo=UTC), last) is None  # past: misfire
    # a beat pushes an entry it cannot plan a minute ahead: within the tolerance
    assert problem(EVERY5, NOW + timedelta(seconds=60), last) is None
    yearly = sch.CronSchedule("0 0 1 1 *", "UTC")
    assert problem(yearly, datetime(2027, 1, 1, tzinfo=UTC),
                   datetime(2026, 1, 1, tzinfo=UTC)) is None
    assert problem(yearly, datetime(2028, 1, 1, tzinfo=UTC)) is None  # one period ahead
    assert problem(yearly, datetime(2029, 1, 1, tzinfo=UTC)) is not None
    # ended: past end_at, or a one-off that fired
    assert problem(EVERY5, None, last, end=last + timedelta(seconds=3)) is None
    once = sch.OneOffSchedule(datetime(2026, 12, 6, 20, 0, tzinfo=UTC))
    assert problem(once, None, datetime(2026, 12, 6, 20, 0, tzinfo=UTC)) is None
    assert problem(sch.OneOffSchedule(NOW + timedelta(days=3)), None) is not None
    # a start_at in the future puts the first slot there
    start = NOW + timedelta(days=30)
    assert problem(EVERY5, start, start=start) is None
    assert problem(EVERY5, start + timedelta(days=1), start=start) is not None


def test_a_cron_across_a_dst_change_is_no_problem() -> None:
    # Berlin leaves summer time on 2026-10-25: 02:30 local happens twice, 02:00-03:00 is long
    cron = sch.CronSchedule("30 2 * * *", "Europe/Berlin")
    now = datetime(2026, 10, 24, 23, 0, tzinfo=UTC)
    nxt = cron.next_after(now)
    assert nxt is not None
    assert problem(cron, nxt, now=now) is None
    assert problem(cron, cron.next_after(nxt), now=now) is None  # one period ahead
    assert problem(cron, nxt + timedelta(days=3), now=now) is not None


def test_a_never_fired_entry_is_repaired_from_its_creation_not_from_now() -> None:
    """NULL set on an entry that never fired: a one-off still owes its one slot, even once
    its instant has passed (it was lost silently: `entries resume` answered "next -"); a
    recurring entry resumes at its first slot after it was created, so the slots missed
    meanwhile go through its misfire policy (it restarted from now)."""
    once = sch.OneOffSchedule(NOW - timedelta(minutes=3))
    created = NOW - timedelta(minutes=10)
    found = next_fire_problem(once, next_fire_at=None, last_fire_at=None, start_at=None,
                              end_at=None, now=NOW, created_at=created)
    assert found is not None and found.startswith("next_fire_at=NULL"), found
    assert repaired_next_fire(once, last_fire_at=None, start_at=None, end_at=None, now=NOW,
                              created_at=created) == once.at
    # a one-off that fired is ended, as before
    assert problem(once, None, once.at) is None
    assert repaired_next_fire(EVERY5, last_fire_at=None, start_at=None, end_at=None, now=NOW,
                              created_at=created) == datetime(2026, 12, 6, 22, 30, 5, tzinfo=UTC)
