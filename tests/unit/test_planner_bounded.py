"""Long downtime costs bounded planning work (issue 12), checked against the slow walk.

The reference below is the plain rule of design.md §6 written the obvious way: walk every
due slot forward, then apply the misfire policy. The bounded planner (jump to the latest due
slot, walk back at most the catch-up limit + a few, record older skipped slots as one
range) must decide exactly the same slots, for every schedule kind, zone and policy.
"""

from __future__ import annotations

import random
import time
from datetime import datetime, timedelta, timezone

import pytest

from reliable_beat import schedules as sch
from reliable_beat.beat import slot_counter
from reliable_beat.entries import definitions_from_beat_schedule
from reliable_beat.errors import ConfigurationError, InvalidScheduleError
from reliable_beat.planner import SKIP_RECORD_LIMIT, Plan, plan_entry
from reliable_beat.settings import Settings

UTC = timezone.utc
ONE = timedelta(seconds=1)
BASE = datetime(2026, 3, 1, tzinfo=UTC)
NOW = BASE + timedelta(days=400, milliseconds=500)  # the latest due slot is 0.5 s late


def reference(schedule: sch.Schedule, nfa: datetime, now: datetime, policy: str,
              grace: timedelta, limit: int, window: timedelta | None,
              end_at: datetime | None) -> tuple[list[tuple[datetime, bool, str]],
                                                 datetime | None]:
    """Every due slot, walked forward: (slot, fired, trigger-or-reason), next_fire_at."""
    due: list[datetime] = []
    slot: datetime | None = nfa
    while slot is not None and slot <= now and (end_at is None or slot <= end_at):
        due.append(slot)
        slot = schedule.next_after(slot)
    if slot is not None and end_at is not None and slot > end_at:
        slot = None
    out: list[tuple[datetime, bool, str]] = []
    if not due:
        return out, slot
    on_time = now - due[-1] <= grace
    missed = due[:-1] if on_time else due
    fired: dict[datetime, str] = {due[-1]: "schedule"} if on_time else {}
    if policy == "catch_up":
        eligible = [s for s in missed if window is None or now - s <= window]
        for s in eligible[-limit:] if limit > 0 else []:
            fired[s] = "catch_up"
    elif policy == "fire_once" and not on_time:
        fired[missed[-1]] = "catch_up"
    for s in due:
        if s in fired:
            out.append((s, True, fired[s]))
        elif policy == "catch_up":
            out.append((s, False, "misfire:catch_up_window"
                        if window is not None and now - s > window else "misfire:catch_up_limit"))
        else:
            out.append((s, False, f"misfire:{policy}"))
    return out, slot


def expand(schedule: sch.Schedule, plan: Plan) -> list[tuple[datetime, bool, str]]:
    out: list[tuple[datetime, bool, str]] = []
    for rng in plan.skipped_ranges:
        slots = [rng.first,
                 *schedule.slots_between(rng.first + timedelta(microseconds=1), rng.last + ONE)]
        if rng.count is not None:
            assert rng.count == len(slots), rng
        out.extend((s, False, rng.reason) for s in slots)
    for d in plan.decisions:
        out.append((d.fire_at, d.fire, d.trigger if d.fire else d.reason or ""))
    return out


SCHEDULES = [
    sch.IntervalSchedule(ONE, BASE),
    sch.IntervalSchedule(timedelta(seconds=7), BASE + timedelta(seconds=3)),
    sch.CronSchedule("* * * * *", "UTC"),
    sch.CronSchedule("*/5 * * * *", "Europe/Paris"),
    sch.CronSchedule("30 * * * *", "America/New_York"),  # crosses the 2026-03-08 gap
    sch.CronSchedule("0 0 1 * *", "Australia/Sydney"),
    sch.CronSchedule("* * * * * */10", "UTC"),
    sch.CronSchedule("*/15 * * * *", "Australia/Sydney"),  # 2026-04-05 fall-back: repeated
    sch.CronSchedule("30 2 * * *", "Europe/Paris"),  # 2026-03-29 02:30 does not exist
]


@pytest.mark.parametrize("seed", range(12))
def test_bounded_plan_equals_the_slow_walk(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        schedule = rng.choice(SCHEDULES)
        start = BASE + timedelta(seconds=rng.randrange(0, 45 * 86400))
        nfa = schedule.next_after(start)
        assert nfa is not None
        if rng.random() < 0.1:
            nfa = start + timedelta(microseconds=rng.randrange(1, 10**6))  # off the grid
        period = schedule.nominal_period or ONE
        behind = period * rng.choice([0, 1, 2, 3, 5, 21, 22, 23, 40, 200]) + timedelta(
            seconds=rng.randrange(0, int(period.total_seconds()) + 1))
        now = nfa + behind + timedelta(microseconds=rng.randrange(0, 10**6))
        policy = rng.choice(["catch_up", "fire_once", "skip"])
        grace = rng.choice([timedelta(0), ONE * 5, timedelta(seconds=60), period * 3])
        limit = rng.choice([0, 1, 3, 30])
        window = rng.choice([None, period * 4, period * 25, timedelta(days=1)])
        end_at = rng.choice([None, None, nfa + behind / 2])
        expected, expected_next = reference(schedule, nfa, now, policy, grace, limit, window,
                                            end_at)
        plan = plan_entry(next_fire_at=nfa, now=now, next_after=schedule.next_after,
                          previous_at_or_before=schedule.previous_at_or_before,
                          count_slots=slot_counter(schedule), misfire_policy=policy,
                          misfire_grace=grace, catch_up_limit=limit,
                          catch_up_window=window, end_at=end_at)
        case = (schedule, nfa, now, policy, grace, limit, window, end_at)
        assert expand(schedule, plan) == expected, case
        assert plan.next_fire_at == expected_next, case
        assert len(plan.decisions) <= limit + SKIP_RECORD_LIMIT + 2, case
        if len(expected) - sum(f for _, f, _ in expected) <= SKIP_RECORD_LIMIT:
            assert not plan.skipped_ranges, case  # few skipped: one row each, as before


def _timed_plan(schedule: sch.Schedule, behind: timedelta, policy: str,
                limit: int = 100) -> tuple[Plan, float, int]:
    now = NOW
    nfa = schedule.next_after(now - behind)
    assert nfa is not None
    steps = 0

    def counting(fn):  # type: ignore[no-untyped-def]
        def call(at: datetime) -> datetime | None:
            nonlocal steps
            steps += 1
            return fn(at)  # type: ignore[no-any-return]
        return call

    started = time.perf_counter()
    plan = plan_entry(next_fire_at=nfa, now=now, next_after=counting(schedule.next_after),
                      previous_at_or_before=counting(schedule.previous_at_or_before),
                      count_slots=slot_counter(schedule), misfire_policy=policy,
                      misfire_grace=timedelta(0), catch_up_limit=limit)
    return plan, time.perf_counter() - started, steps


@pytest.mark.parametrize("policy", ["skip", "fire_once", "catch_up"])
@pytest.mark.parametrize(("schedule", "behind"), [
    (sch.IntervalSchedule(ONE, BASE), timedelta(days=7)),
    (sch.CronSchedule("* * * * *", "UTC"), timedelta(days=365)),
    (sch.CronSchedule("* * * * * *", "Europe/Paris"), timedelta(days=365)),
], ids=["interval-1s-7d", "cron-minutely-1y", "cron-every-second-1y"])
def test_long_downtime_costs_bounded_steps(schedule: sch.Schedule, behind: timedelta,
                                          policy: str) -> None:
    """Before: a 1 s interval 7 days behind took 7.9 s and a minutely cron 1 year behind
    226 s (one step per missed slot). Now: at most limit + SKIP_RECORD_LIMIT + 4 steps."""
    limit = 100
    plan, seconds, steps = _timed_plan(schedule, behind, policy, limit)
    assert steps <= limit + SKIP_RECORD_LIMIT + 4, steps
    now = BASE + timedelta(days=400)
    # the entry is advanced past now, on the grid, and the skip record is one range row
    assert plan.next_fire_at is not None and now < plan.next_fire_at <= now + timedelta(
        minutes=1)
    assert len(plan.skipped_ranges) == 1
    rng = plan.skipped_ranges[0]
    assert rng.first == schedule.next_after(now - behind)
    if isinstance(schedule, sch.IntervalSchedule):
        fired = len(plan.fired)
        assert rng.count is not None
        assert rng.count + len(plan.skipped) + fired == int(behind / ONE)
    fired_slots = [d.fire_at for d in plan.fired]
    assert len(fired_slots) == {"skip": 0, "fire_once": 1, "catch_up": limit}[policy]
    assert seconds < 5.0  # generous: a loaded CI machine; typically a few ms


def test_fire_once_after_pause_fires_one_run() -> None:
    """A 10 s entry paused 27 s: the last missed slot and the current (on-time) slot were
    both fired within 10 ms. fire_once means one run: the latest due slot."""
    schedule = sch.IntervalSchedule(timedelta(seconds=10), BASE)
    nfa = BASE + timedelta(seconds=10)  # paused just before this slot
    now = BASE + timedelta(seconds=27)  # resumed: slots :10 and :20 are due
    for previous in (schedule.previous_at_or_before, None):
        plan = plan_entry(next_fire_at=nfa, now=now, next_after=schedule.next_after,
                          previous_at_or_before=previous, misfire_policy="fire_once",
                          misfire_grace=timedelta(seconds=60), catch_up_limit=100)
        assert [(d.fire_at, d.trigger) for d in plan.fired] == [(BASE + 20 * ONE, "schedule")]
        assert [(d.fire_at, d.reason) for d in plan.skipped] == [
            (BASE + 10 * ONE, "misfire:fire_once")]
        assert plan.next_fire_at == BASE + 30 * ONE


def test_cron_expression_length_is_capped() -> None:
    long_expr = ",".join(str(m % 60) for m in range(30_000)) + " * * * *"
    with pytest.raises(InvalidScheduleError, match=f"at most {sch.MAX_CRON_LENGTH}"):
        sch.CronSchedule(long_expr)
    with pytest.raises(ConfigurationError) as info:
        definitions_from_beat_schedule(
            {"huge": {"task": "t", "schedule": long_expr}},
            default_timezone="UTC", settings=Settings(), now=BASE)
    assert "'huge'" in str(info.value) and "characters long" in str(info.value)
    assert len(str(info.value)) < 2000  # the expression is not echoed whole


@pytest.mark.parametrize("policy", ["catch_up", "fire_once", "skip"])
@pytest.mark.parametrize(("schedule", "start"), [
    (sch.CronSchedule("*/15 * * * *", "Australia/Sydney"),  # fall-back: 02:00-03:00 twice
     datetime(2026, 4, 4, 12, 0, tzinfo=UTC)),
    (sch.CronSchedule("30 2 * * *", "Europe/Paris"),  # 02:30 missing on 2026-03-29
     datetime(2026, 3, 20, tzinfo=UTC)),
    (sch.CronSchedule("* * * * *", "America/New_York"),  # spring-forward 2026-03-08
     datetime(2026, 3, 7, 12, 0, tzinfo=UTC)),
], ids=["sydney-fallback", "paris-gap", "new-york-gap"])
def test_bounded_plan_across_dst_equals_the_slow_walk(schedule: sch.Schedule, start: datetime,
                                                     policy: str) -> None:
    nfa = schedule.next_after(start)
    assert nfa is not None
    for hours in (1, 14, 30, 24 * 12):
        now = start + timedelta(hours=hours, milliseconds=300)
        expected, expected_next = reference(schedule, nfa, now, policy, timedelta(0), 3,
                                            timedelta(hours=10), None)
        plan = plan_entry(next_fire_at=nfa, now=now, next_after=schedule.next_after,
                          previous_at_or_before=schedule.previous_at_or_before,
                          misfire_policy=policy, misfire_grace=timedelta(0),
                          catch_up_limit=3, catch_up_window=timedelta(hours=10))
        assert expand(schedule, plan) == expected, (hours, policy)
        assert plan.next_fire_at == expected_next


def test_huge_catch_up_limit_is_bounded_per_plan() -> None:
    from reliable_beat.planner import MAX_CATCH_UP_PER_PLAN

    schedule = sch.IntervalSchedule(ONE, BASE)
    plan, _seconds, steps = _timed_plan(schedule, timedelta(days=7), "catch_up",
                                        limit=10**9)
    assert steps <= MAX_CATCH_UP_PER_PLAN + SKIP_RECORD_LIMIT + 4
    assert len(plan.fired) == MAX_CATCH_UP_PER_PLAN
    [rng] = plan.skipped_ranges  # the older ones are recorded, not dropped
    assert rng.reason == "misfire:catch_up_limit"
    assert rng.count is not None
    assert rng.count + len(plan.skipped) + len(plan.fired) == 7 * 86400
