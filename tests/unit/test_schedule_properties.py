"""Property tests of the slot engine (hypothesis), biased towards DST transitions.

The oracle for 5-field crons is a brute force independent of the engine: walk every
UTC minute of the window, keep those whose local wall time matches (respecting the
repeated-time rule through PEP 495 ``fold``), then add the wall times that fall in
a spring-forward gap with the gap rule.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from functools import cache
from itertools import pairwise
from zoneinfo import ZoneInfo

from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from reliable_beat.errors import InvalidScheduleError
from reliable_beat.schedules import CronSchedule, IntervalSchedule
from tests.unit.cron_oracle import Cron

UTC = timezone.utc
ZONES = [
    "UTC",
    "Europe/Berlin",
    "Europe/London",
    "America/New_York",
    "America/Los_Angeles",
    "Africa/Cairo",
    "Australia/Lord_Howe",
]
MINUTE = st.sampled_from(["*", "*/15", "0", "30", "0,30", "5", "*/7", "45", "10-20/5"])
HOUR = st.sampled_from(["*", "*/2", "0", "1", "2", "3", "1-3", "23", "2,3", "*/1", "0-23/5"])
DOM = st.sampled_from(["*", "*", "*", "1", "15", "29", "L", "25-31"])
MONTH = st.sampled_from(["*", "*", "*", "3,10", "4", "3-11"])
DOW = st.sampled_from(["*", "*", "*", "0", "sun", "1-5", "6"])
SECOND = st.sampled_from(["0", "30", "*/20", "10,40"])
NONEXISTENT = st.sampled_from([None, "shift", "gap_end", "skip"])
REPEATED = st.sampled_from([None, "first", "last", "both"])
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@cache
def transitions(zone_name: str) -> tuple[datetime, ...]:
    """All offset changes of the zone in 2020-2030 (UTC, whole seconds)."""
    zone = ZoneInfo(zone_name)
    out: list[datetime] = []
    t = datetime(2020, 1, 1, tzinfo=UTC)
    step = timedelta(days=1)
    while t.year < 2031:
        if t.astimezone(zone).utcoffset() != (t + step).astimezone(zone).utcoffset():
            lo, hi = t, t + step
            while hi - lo > timedelta(seconds=1):
                mid = lo + (hi - lo) / 2
                mid = mid.replace(microsecond=0)
                if mid.astimezone(zone).utcoffset() == lo.astimezone(zone).utcoffset():
                    lo = mid
                else:
                    hi = mid
            out.append(hi)
        t += step
    return tuple(out)


@st.composite
def instants(draw: st.DrawFn, zone_name: str) -> datetime:
    """An instant in 2020-2030, often within 6 h of one of the zone's transitions."""
    near = transitions(zone_name)
    if near and draw(st.booleans()):
        base = draw(st.sampled_from(near))
        return base + timedelta(seconds=draw(st.integers(-6 * 3600, 6 * 3600)))
    seconds = draw(st.integers(0, int(timedelta(days=3652).total_seconds())))
    return datetime(2020, 1, 1, tzinfo=UTC) + timedelta(seconds=seconds)


@st.composite
def cron_cases(draw: st.DrawFn, seconds: bool) -> tuple[CronSchedule, datetime]:
    fields = [draw(MINUTE), draw(HOUR), draw(DOM), draw(MONTH), draw(DOW)]
    if seconds:
        fields.append(draw(SECOND))
    zone_name = draw(st.sampled_from(ZONES))
    try:
        schedule = CronSchedule(
            " ".join(fields),
            zone_name,
            day_or=draw(st.booleans()),
            nonexistent=draw(NONEXISTENT),
            repeated=draw(REPEATED),
        )
    except InvalidScheduleError as exc:  # '0 * * * * 0': refused as seconds-first
        assert "seconds-FIRST" in str(exc)
        reject()
    return schedule, draw(instants(zone_name))


def matches(s: CronSchedule, wall: datetime) -> bool:
    """Field-by-field match by the independent oracle (croniter ANDs the day fields when
    one holds L, W or #, even under POSIX OR: see test_cron_oracle.py)."""
    return Cron.parse(s.expr, day_or=s.day_or).matches(wall)


def oracle(s: CronSchedule, start: datetime, end: datetime) -> list[datetime]:
    """Brute force over every UTC minute of [start, end) (5-field crons only)."""
    zone = ZoneInfo(s.timezone)
    fixed = not s.expr.split()[0].startswith("*") and not s.expr.split()[1].startswith("*")
    gap_rule = s.nonexistent or ("shift" if fixed else "skip")
    rep_rule = s.repeated or ("first" if fixed else "both")
    found: set[datetime] = set()
    t = start - timedelta(hours=3)
    while t < end + timedelta(hours=3):
        local = t.astimezone(zone)
        wall = local.replace(tzinfo=None)
        if start <= t < end and matches(s, wall):
            repeated = wall.replace(fold=1, tzinfo=zone).utcoffset() != local.utcoffset() or (
                wall.replace(fold=0, tzinfo=zone).utcoffset() != local.utcoffset()
            )
            first_pass = local.fold == 0
            if not repeated or rep_rule == "both" or (rep_rule == "first") == first_pass:
                found.add(t)
        before = (t - timedelta(minutes=1)).astimezone(zone).utcoffset()
        after = local.utcoffset()
        assert before is not None and after is not None
        if after > before:  # spring forward at t: walls [t+before, t+after) do not exist
            w = t.replace(tzinfo=None) + before
            while w < t.replace(tzinfo=None) + after:
                if matches(s, w) and gap_rule != "skip":
                    instant = (w - before).replace(tzinfo=UTC) if gap_rule == "shift" else t
                    if start <= instant < end:
                        found.add(instant)
                w += timedelta(minutes=1)
        t += timedelta(minutes=1)
    return sorted(found)


@SETTINGS
@given(cron_cases(seconds=False), st.integers(1, 6 * 60))
def test_cron_matches_brute_force_oracle(case: tuple[CronSchedule, datetime], minutes: int) -> None:
    s, t = case
    start = t.replace(second=0)
    end = start + timedelta(minutes=minutes)
    assert list(s.slots_between(start, end)) == oracle(s, start, end)


def walk_forward(s: CronSchedule, start: datetime, end: datetime) -> list[datetime]:
    out: list[datetime] = []
    cur = s.next_after(start - timedelta(seconds=1))
    while cur is not None and cur < end:
        out.append(cur)
        cur = s.next_after(cur)
    return out


def walk_backward(s: CronSchedule, start: datetime, end: datetime) -> list[datetime]:
    out: list[datetime] = []
    cur = s.previous_at_or_before(end - timedelta(seconds=1))
    while cur is not None and cur >= start:
        out.append(cur)
        cur = s.previous_at_or_before(cur - timedelta(seconds=1))
    return out[::-1]


@SETTINGS
@given(cron_cases(seconds=True) | cron_cases(seconds=False), st.integers(1, 6 * 3600))
def test_cron_walks_agree(case: tuple[CronSchedule, datetime], span: int) -> None:
    s, start = case
    end = start + timedelta(seconds=span)
    slots = list(s.slots_between(start, end))
    assert all(a < b for a, b in pairwise(slots))  # strictly increasing, unique
    assert all(x.tzinfo is UTC and x.microsecond == 0 for x in slots)
    assert walk_forward(s, start, end) == slots
    assert walk_backward(s, start, end) == slots
    nxt = s.next_after(start)
    if nxt is not None:
        assert nxt > start
        assert s.previous_at_or_before(nxt) == nxt
    prev = s.previous_at_or_before(start)
    if prev is not None:
        assert prev <= start
        assert s.next_after(prev - timedelta(seconds=1)) == prev


@SETTINGS
@given(cron_cases(seconds=True) | cron_cases(seconds=False), st.integers(1, 6 * 3600))
def test_every_slot_matches_or_is_a_documented_shift(
    case: tuple[CronSchedule, datetime], span: int
) -> None:
    s, start = case
    zone = ZoneInfo(s.timezone)
    for slot in s.slots_between(start, start + timedelta(seconds=span)):
        wall = slot.astimezone(zone).replace(tzinfo=None)
        if matches(s, wall):
            continue
        # only allowed: the instant lies just after a gap, and is a gap wall read with
        # the pre-gap offset (shift) or the transition instant itself (gap_end)
        pre = (slot - timedelta(hours=3)).astimezone(zone).utcoffset()
        post = slot.astimezone(zone).utcoffset()
        assert pre is not None and post is not None and pre < post, slot
        shifted_wall = slot.replace(tzinfo=None) + pre
        shift_ok = s._nonexistent == "shift" and matches(s, shifted_wall)
        gap_end_ok = s._nonexistent == "gap_end" and slot in transitions(s.timezone)
        assert shift_ok or gap_end_ok, slot


@SETTINGS
@given(
    st.integers(1, 10 * 86400),
    st.integers(0, 10**9),
    st.integers(-(10**9), 10**9),
    st.sampled_from(ZONES),
)
def test_interval_grid(every: int, anchor_s: int, offset_s: int, zone: str) -> None:
    anchor = datetime(2000, 1, 1, tzinfo=UTC) + timedelta(seconds=anchor_s)
    s = IntervalSchedule(timedelta(seconds=every), anchor, zone)
    t = anchor + timedelta(seconds=offset_s, microseconds=offset_s % 7)
    nxt = s.next_after(t)
    prev = s.previous_at_or_before(t)
    assert prev <= t < nxt
    assert nxt - prev == timedelta(seconds=every)
    assert (nxt - anchor).total_seconds() % every == 0
    assert list(s.slots_between(prev, nxt + timedelta(seconds=1))) == [prev, nxt]


@SETTINGS
@given(cron_cases(seconds=False))
def test_next_and_previous_agree_with_a_long_window(case: tuple[CronSchedule, datetime]) -> None:
    """next_after/previous_at_or_before vs slots_between over 8 days (gaps skipped, etc.)."""
    s, t = case
    t = t.replace(second=0)
    later = list(s.slots_between(t + timedelta(seconds=1), t + timedelta(days=8)))
    nxt = s.next_after(t)
    if later:
        assert nxt == later[0]
    else:
        assert nxt is None or nxt >= t + timedelta(days=8)
    earlier = list(s.slots_between(t - timedelta(days=8), t + timedelta(seconds=1)))
    prev = s.previous_at_or_before(t)
    if earlier:
        assert prev == earlier[-1]
    else:
        assert prev is None or prev < t - timedelta(days=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    minute=MINUTE, hour=HOUR, dom=DOM, dow=DOW, zone=st.sampled_from(ZONES),
    calls=st.lists(
        st.tuples(st.booleans(),
                  st.datetimes(min_value=datetime(2025, 1, 1), max_value=datetime(2027, 12, 31))),
        min_size=2, max_size=12),
)
def test_a_reused_schedule_answers_as_a_fresh_one(
    minute: str, hour: str, dom: str, dow: str, zone: str,
    calls: list[tuple[bool, datetime]],
) -> None:
    """The croniter kept per schedule and direction (repositioned at each step) gives the
    answers a fresh schedule gives, whatever the order of forward and backward calls and
    however far apart they are (including failed searches in between)."""
    expr = f"{minute} {hour} {dom} * {dow}"
    try:
        reused = CronSchedule(expr, zone)
    except InvalidScheduleError:
        reject()
    for forward, naive in calls:
        at = naive.replace(tzinfo=UTC)
        fresh = CronSchedule(expr, zone)
        if forward:
            assert reused.next_after(at) == fresh.next_after(at), (expr, zone, at)
        else:
            assert (reused.previous_at_or_before(at)
                    == fresh.previous_at_or_before(at)), (expr, zone, at)
