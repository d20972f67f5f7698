"""The slot engine against an independent brute-force oracle (tests/unit/cron_oracle.py).

The oracle parses croniter's syntax itself and matches every field on its own (ranges,
steps, lists, names, ``L``, ``W``, ``#``, POSIX OR of the day fields when both are
restricted), then applies the default DST rule of design.md §7. Zones with and without
DST, 5 and 6 fields.

croniter on its own is wrong for a restricted day-of-month OR'd with a day-of-week holding
``L<d>`` or ``<d>#<n>``, for a day-of-month ``nW`` OR'd with any restricted day of week, and
for ``1-31`` OR'd with ``*/2`` as day of week (it turns ``1-31`` into ``*``): it ANDs
them (``0 0 1 * L5`` "the 1st or the last Friday" is refused as never matching;
``0 0 15W * 5`` fires on the 15th-nearest weekday only when it is a Friday). The engine
walks such an expression as the union of two croniter expressions with one day field each;
``KNOWN_CRONITER_WRONG`` below is checked against the oracle, with and without croniter.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone

import pytest
from croniter import CroniterBadDateError, croniter
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from reliable_beat.errors import InvalidScheduleError
from reliable_beat.schedules import CronSchedule
from tests.unit.cron_oracle import Cron, slots

UTC = timezone.utc
ZONES = ["UTC", "Asia/Kolkata", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe"]


def z(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


# --- the oracle itself, on hand-checked dates --------------------------------------


def days(expr: str, start: str, end: str, *, day_or: bool = True) -> list[str]:
    got = slots(Cron.parse(expr, day_or=day_or), "UTC", z(start), z(end))
    return [f"{d:%Y-%m-%d}" for d in got]


def test_oracle_on_known_dates() -> None:
    # 2026-02-15 is a Sunday -> 15W is Monday the 16th; 2026-03-15 Sunday -> 16th;
    # 2026-08-01 Saturday -> 1W is Monday the 3rd (never leaves the month)
    assert days("0 0 15W * *", "2026-02-01T00:00:00Z", "2026-04-01T00:00:00Z") == [
        "2026-02-16",
        "2026-03-16",
    ]
    assert days("0 0 1W * *", "2026-08-01T00:00:00Z", "2026-09-01T00:00:00Z") == ["2026-08-03"]
    # last Friday, second Friday, the last day
    assert days("0 0 * * L5", "2026-01-01T00:00:00Z", "2026-03-01T00:00:00Z") == [
        "2026-01-30",
        "2026-02-27",
    ]
    assert days("0 0 * * fri#2", "2026-01-01T00:00:00Z", "2026-03-01T00:00:00Z") == [
        "2026-01-09",
        "2026-02-13",
    ]
    assert days("0 0 L * *", "2026-01-01T00:00:00Z", "2026-03-01T00:00:00Z") == [
        "2026-01-31",
        "2026-02-28",
    ]
    # POSIX OR (both restricted) and AND (day_or=False, Celery's meaning)
    assert days("0 0 1 * L5", "2026-01-01T00:00:00Z", "2026-03-01T00:00:00Z") == [
        "2026-01-01",
        "2026-01-30",
        "2026-02-01",
        "2026-02-27",
    ]
    assert days("0 0 1-7 * 6", "2026-02-01T00:00:00Z", "2026-03-01T00:00:00Z", day_or=False) == [
        "2026-02-07"
    ]
    # names, ranges, steps, seconds last
    got = slots(Cron.parse("*/20 9 * jan mon-fri 15,45"), "UTC", z("2026-01-05T00:00:00Z"),
                z("2026-01-06T00:00:00Z"))
    assert [f"{d:%H:%M:%S}" for d in got] == [
        "09:00:15", "09:00:45", "09:20:15", "09:20:45", "09:40:15", "09:40:45"
    ]


# --- the expressions croniter alone gets wrong ----------------------------------------

KNOWN_CRONITER_WRONG = [
    "0 0 L * L5",
    "0 0 L * 1#5",
    "0 0 1 * fri#1",
    "0 0 1 * L5",
    "0 0 15 * sat#3",
    "0 0 1-7 * fri#1",
    "0 0 L,15 * L0",
    "0 0 */10 * 5#2",
    "0 0 15W * 5",
    "0 0 15W * mon-fri",
    "0 0 1W * fri#1",
    "0 0 1-31 * L5",
    "0 0 1-31 * */2",  # plain values: croniter turns 1-31 into '*' next to a step, then ANDs
]


def croniter_alone(expr: str, start: datetime, end: datetime) -> list[datetime] | None:
    """What croniter gives on its own (UTC), or None when it finds no match at all."""
    it = croniter(expr, start - timedelta(seconds=1), day_or=True, max_years_between_matches=30)
    out: list[datetime] = []
    try:
        while (t := it.get_next(datetime)) < end:
            out.append(t)
    except CroniterBadDateError:
        return None
    return out


@pytest.mark.parametrize("expr", KNOWN_CRONITER_WRONG)
@pytest.mark.parametrize("zone", ["UTC", "Europe/Berlin", "Australia/Lord_Howe"])
def test_day_or_with_l_w_hash_matches_the_oracle(expr: str, zone: str) -> None:
    start, end = z("2025-01-01T00:00:00Z"), z("2027-01-01T00:00:00Z")
    expected = slots(Cron.parse(expr), zone, start, end)
    schedule = CronSchedule(expr, zone)
    assert list(schedule.slots_between(start, end)) == expected
    # the walks a beat does agree too
    cur, walked = schedule.next_after(start - timedelta(seconds=1)), []
    while cur is not None and cur < end:
        walked.append(cur)
        cur = schedule.next_after(cur)
    assert walked == expected
    assert schedule.previous_at_or_before(end - timedelta(seconds=1)) == expected[-1]


@pytest.mark.parametrize("expr", KNOWN_CRONITER_WRONG)
def test_croniter_alone_is_wrong_there(expr: str) -> None:
    """The record behind the workaround: if croniter is fixed, this says so."""
    start, end = z("2025-01-01T00:00:00Z"), z("2027-01-01T00:00:00Z")
    wall = [t.replace(tzinfo=UTC) for t in croniter_alone(expr, start.replace(tzinfo=None),
                                                           end.replace(tzinfo=None)) or []]
    assert wall != slots(Cron.parse(expr), "UTC", start, end)


@pytest.mark.parametrize(
    "expr", ["0 0 29W * *", "0 0 31W * *", "0 0 1W,15 * *", "0 0 1-5W * *", "0 0 LW * *"]
)
def test_w_is_a_single_day_up_to_28(expr: str) -> None:
    """croniter reads 31W in a 30-day month as the weekday nearest the 30th; Quartz says W
    is a single day; a day some months lack has no agreed meaning: refused."""
    with pytest.raises(InvalidScheduleError, match=r"'W' \(nearest weekday\)") as info:
        CronSchedule(expr)
    assert repr(expr) in str(info.value)


# --- a property test over every feature ------------------------------------------------

MINUTE = st.sampled_from(["*", "*/15", "0", "30", "0,30", "*/7", "10-20/5", "5-9", "45/5"])
HOUR = st.sampled_from(["*", "*/6", "0", "2", "9", "1-3", "2,3", "0-23/5", "22-23"])
DOM = st.sampled_from(
    ["*", "*", "1", "15", "29", "31", "L", "1-7", "25-31", "*/10", "L,15", "15W", "1W", "28W",
     "1-31"]
)
MONTH = st.sampled_from(["*", "*", "*", "3,10", "jan-jun", "*/2", "feb", "4-11", "oct,nov"])
DOW = st.sampled_from(
    ["*", "*", "0", "7", "sun", "mon-fri", "6", "L5", "L0", "fri#2", "1#1", "5#5", "sat,sun",
     "*/2", "2-4"]
)
SECOND = st.sampled_from(["30", "*/20", "10,40", "15-45/15"])


@st.composite
def expressions(draw: st.DrawFn) -> tuple[str, bool]:
    fields = [draw(MINUTE), draw(HOUR), draw(DOM), draw(MONTH), draw(DOW)]
    if draw(st.booleans()):
        fields.append(draw(SECOND))
    return " ".join(fields), draw(st.booleans())


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    expressions(),
    st.sampled_from(ZONES),
    st.dates(date(2020, 1, 1), date(2030, 1, 1)),
    st.integers(1, 60),
)
def test_engine_matches_the_oracle(
    case: tuple[str, bool], zone: str, first: date, span_days: int
) -> None:
    expr, day_or = case
    try:
        schedule = CronSchedule(expr, zone, day_or=day_or)
    except InvalidScheduleError as exc:
        # only a day combination that never occurs (AND) may be refused
        assert "never matches" in str(exc)
        assert not day_or or "*" in (expr.split()[2], expr.split()[4])
        reject()
    start = datetime(first.year, first.month, first.day, tzinfo=UTC)
    end = start + timedelta(days=span_days)
    seconds = len(expr.split()) == 6
    if seconds and span_days > 7:  # keep the second-by-second walk small
        end = start + timedelta(days=7)
    expected = slots(Cron.parse(expr, day_or=day_or), zone, start, end)
    assert list(schedule.slots_between(start, end)) == expected
    if expected:
        assert schedule.next_after(start - timedelta(seconds=1)) == expected[0]
        assert schedule.previous_at_or_before(end - timedelta(seconds=1)) == expected[-1]


# --- seconds-first (Spring / Quartz) strings ----------------------------------------------


@pytest.mark.parametrize(
    ("expr", "fix"),
    [
        ("0 0 9 * * 1-5", "'0 9 * * 1-5'"),  # weekdays 09:00 (Spring)
        ("0 0 9 * * MON-FRI", "'0 9 * * MON-FRI'"),
        ("0 30 8 * * mon", "'30 8 * * mon'"),
        ("0 15 10 * * 6#3", "'15 10 * * 6#3'"),
        ("0 0 12 * * L5", "'0 12 * * L5'"),
        ("0 0 9 * * 1", "'0 9 * * 1'"),  # the shape '0 m h * mon d'
        ("30 0 9 * * 1,3,5", "'0 9 * * 1,3,5 30'"),
        ("0 0 9-17 * * *", "'0 9-17 * * *'"),
    ],
)
def test_seconds_first_forms_are_refused_with_the_fix(expr: str, fix: str) -> None:
    with pytest.raises(InvalidScheduleError) as info:
        CronSchedule(expr)
    text = str(info.value)
    assert repr(expr) in text
    assert "seconds" in text and "LAST" in text
    assert fix in text, text


@pytest.mark.parametrize(
    "expr",
    ["0 0 12 ? * MON-FRI", "0 0 12 * * ?", "0 9 ? * 2", "0 15 10 ? * 6L"],
)
def test_quartz_question_mark_is_refused(expr: str) -> None:
    with pytest.raises(InvalidScheduleError, match=r"'\?' is Quartz syntax") as info:
        CronSchedule(expr)
    assert "1=Sunday" in str(info.value)


@pytest.mark.parametrize(
    "expr",
    [
        "* * * * * */15",
        "30 2 * * * 0",  # 02:30:00 daily (docs/dst.md)
        "0 9 * * * 30",  # 09:00:30 (30 is no day of week)
        "0 0 * 1-12 * 5",  # the documented way to say 'second 5' in the ambiguous shape
        "*/5 * * * * 10,40",
        "15 2 * * * */20",
        "* * * * * *",
    ],
)
def test_seconds_last_forms_are_accepted(expr: str) -> None:
    CronSchedule(expr)
