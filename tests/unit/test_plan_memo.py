"""The beat remembers a tick's plans by their inputs (``beat._PlanCalls.plan``): entries that
share a schedule, a next slot and their policies (the herd) get one plan. A remembered plan
must be exactly the plan :func:`plan_entry` makes afresh, with a schedule built afresh, for
every entry: across DST transitions, odd cron strings, intervals, and rows that share a slot
but differ in a policy."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest

from reliable_beat import schedules as sch
from reliable_beat.beat import _PlanCalls, slot_counter
from reliable_beat.planner import Plan, plan_entry

UTC = timezone.utc

SPECS: list[dict[str, Any]] = [
    # fixed time inside Berlin's spring-forward gap and its repeated autumn hour
    {"kind": "cron", "expr": "30 2 * * *", "timezone": "Europe/Berlin"},
    # wildcard hour across both transitions
    {"kind": "cron", "expr": "*/20 * * * *", "timezone": "Europe/Berlin"},
    # New York's repeated 01:xx, with an override
    {"kind": "cron", "expr": "30 1 * * *", "timezone": "America/New_York",
     "repeated": "both"},
    {"kind": "cron", "expr": "30 2 * * *", "timezone": "America/New_York",
     "nonexistent": "skip"},
    # odd strings: ranges with steps, day-of-month OR day-of-week, month ends, seconds last
    {"kind": "cron", "expr": "5-55/7 1-3 * * *", "timezone": "Europe/Berlin"},
    {"kind": "cron", "expr": "0 0 31 * 1", "timezone": "Australia/Lord_Howe"},
    {"kind": "cron", "expr": "59 23 29 2 *", "timezone": "UTC"},
    {"kind": "cron", "expr": "0 2 * * 0", "timezone": "Europe/London", "day_or": False},
    {"kind": "cron", "expr": "* * * * * */15", "timezone": "Europe/Berlin"},
    {"kind": "interval", "every_seconds": 3600, "anchor": "2026-03-29T00:30:00Z",
     "timezone": "Europe/Berlin"},
]

#: around the 2026 transitions: Berlin/London 29 Mar and 25 Oct, New York 8 Mar and 1 Nov
AROUND = [datetime(2026, 3, 29, 0, 0, tzinfo=UTC), datetime(2026, 10, 24, 23, 0, tzinfo=UTC),
          datetime(2026, 3, 8, 6, 0, tzinfo=UTC), datetime(2026, 11, 1, 4, 0, tzinfo=UTC),
          datetime(2026, 4, 4, 15, 0, tzinfo=UTC)]

POLICIES = [("catch_up", 60, 3, None), ("catch_up", 60, 50, 7200), ("fire_once", 0, 0, None),
            ("skip", 30, 0, None), ("catch_up", 3600, 0, None)]


def _row(nfa: datetime, policy: tuple[str, int, int, int | None],
         end_at: datetime | None = None) -> SimpleNamespace:
    misfire, grace, limit, window = policy
    return SimpleNamespace(next_fire_at=nfa, misfire_policy=misfire,
                           misfire_grace_seconds=grace, catch_up_limit=limit,
                           catch_up_window_seconds=window, end_at=end_at)


def _fresh(spec: dict[str, Any], row: SimpleNamespace, now: datetime,
           claim_until: datetime | None) -> Plan:
    """The plan made with no memo at all: a schedule built afresh, its own methods."""
    schedule = sch.schedule_from_spec(spec)
    window = row.catch_up_window_seconds
    return plan_entry(
        next_fire_at=row.next_fire_at, now=now, next_after=schedule.next_after,
        misfire_policy=row.misfire_policy,
        misfire_grace=timedelta(seconds=row.misfire_grace_seconds),
        catch_up_limit=row.catch_up_limit,
        catch_up_window=None if window is None else timedelta(seconds=window),
        end_at=row.end_at, claim_until=claim_until,
        previous_at_or_before=schedule.previous_at_or_before,
        count_slots=slot_counter(schedule))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.get('expr', 'interval')}@"
                                                      f"{s['timezone']}")
def test_remembered_plans_equal_fresh_plans_across_dst_and_odd_crons(
        spec: dict[str, Any]) -> None:
    rnd = random.Random(repr(spec))
    schedule = sch.schedule_from_spec(spec)
    for around in AROUND:
        calls = _PlanCalls(schedule)  # one tick: one memo, many rows
        now = around + timedelta(hours=rnd.randint(1, 30), seconds=rnd.randint(0, 59),
                                 microseconds=rnd.randint(0, 999_999))
        first = schedule.next_after(around - timedelta(hours=2))
        assert first is not None
        slots = [first]
        while len(slots) < 6:
            nxt = schedule.next_after(slots[-1])
            assert nxt is not None
            slots.append(nxt)
        # a herd: many rows on a few slots and policies, in random order, each asked twice;
        # some slots still in the future (claim ahead), one row with an end
        rows = [(_row(nfa, pol), None) for nfa in slots for pol in POLICIES]
        rows += [(_row(slots[2], POLICIES[0], end_at=slots[3]), None)]
        rows += [(_row(s, POLICIES[0]), now + timedelta(hours=2)) for s in slots]
        rows *= 2
        rnd.shuffle(rows)
        for row, claim_until in rows:
            got = calls.plan(row, now, claim_until)
            assert got == _fresh(spec, row, now, claim_until), (row, claim_until)


def test_rows_sharing_a_slot_but_not_a_policy_get_their_own_plans() -> None:
    """The memo's key holds every input of the plan: after a downtime, rows of one schedule
    and one next slot but another catch-up limit, window, grace, policy or end get the plan
    of their own inputs, never the first row's."""
    spec = {"kind": "cron", "expr": "*/10 * * * *", "timezone": "Europe/Berlin"}
    schedule = sch.schedule_from_spec(spec)
    nfa = datetime(2026, 3, 29, 0, 0, tzinfo=UTC)
    now = nfa + timedelta(hours=2, seconds=5)
    calls = _PlanCalls(schedule)
    variants = [_row(nfa, ("catch_up", 60, 3, None)), _row(nfa, ("catch_up", 60, 5, None)),
                _row(nfa, ("catch_up", 60, 5, 1800)), _row(nfa, ("catch_up", 1, 5, None)),
                _row(nfa, ("fire_once", 60, 5, None)), _row(nfa, ("skip", 60, 5, None)),
                _row(nfa, ("catch_up", 60, 5, None), end_at=nfa + timedelta(minutes=30))]
    plans = [calls.plan(r, now, None) for r in variants]
    for row, plan in zip(variants, plans, strict=True):
        assert plan == _fresh(spec, row, now, None)
    # every variant decides differently (so a key missing any of the fields would fail)
    shapes = {(tuple((d.fire_at, d.fire, d.trigger, d.reason) for d in p.decisions),
               tuple(p.skipped_ranges), p.next_fire_at) for p in plans}
    assert len(shapes) == len(variants)
    # and one tick's later instant (another `now`) is a plan of its own too
    later = calls.plan(variants[0], now + timedelta(minutes=10), None)
    assert later == _fresh(spec, variants[0], now + timedelta(minutes=10), None)
    assert later != plans[0]
