"""Unit tests of reliable_beat.schedules and reliable_beat.slots (exact values)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery.schedules import crontab, solar
from celery.schedules import schedule as celery_schedule

from reliable_beat.errors import ConfigurationError, InvalidScheduleError, UnknownTimezoneError
from reliable_beat.schedules import (
    CronSchedule,
    IntervalSchedule,
    OneOffSchedule,
    Schedule,
    from_celery,
    schedule_from_spec,
    validate_timezone,
)
from reliable_beat.slots import format_fire_at, idempotency_key, truncate

UTC = timezone.utc
ANCHOR = datetime(2020, 1, 1, tzinfo=UTC)


def z(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def iso(values: Any) -> list[str]:
    return [f"{v:%Y-%m-%dT%H:%M:%SZ}" for v in values]


def window(s: Schedule, start: str, end: str) -> list[str]:
    return iso(s.slots_between(z(start), z(end)))


def walked(s: Schedule, start: str, end: str) -> list[str]:
    out = []
    cur = s.next_after(z(start) - timedelta(seconds=1))
    while cur is not None and cur < z(end):
        out.append(cur)
        cur = s.next_after(cur)
    return iso(out)


def walked_back(s: Schedule, start: str, end: str) -> list[str]:
    out = []
    cur = s.previous_at_or_before(z(end) - timedelta(seconds=1))
    while cur is not None and cur >= z(start):
        out.append(cur)
        cur = s.previous_at_or_before(cur - timedelta(seconds=1))
    return iso(out[::-1])


def check(s: Schedule, start: str, end: str, expected: list[str]) -> None:
    """slots_between, next_after walks and previous_at_or_before walks all agree."""
    assert window(s, start, end) == expected
    assert walked(s, start, end) == expected
    assert walked_back(s, start, end) == expected


# --- slots.py -------------------------------------------------------------------------


def test_truncate_converts_to_utc_and_drops_microseconds() -> None:
    at = datetime(2026, 1, 10, 11, 5, 7, 999_999, tzinfo=timezone(timedelta(hours=1)))
    assert truncate(at) == datetime(2026, 1, 10, 10, 5, 7, tzinfo=UTC)
    assert truncate(at).tzinfo is UTC


def test_naive_datetimes_are_rejected() -> None:
    naive = datetime(2026, 1, 10, 10, 5)
    with pytest.raises(ValueError, match="naive"):
        truncate(naive)
    with pytest.raises(ValueError, match="naive"):
        idempotency_key("e", naive)
    s = CronSchedule("* * * * *")
    for call in (
        lambda: s.next_after(naive),
        lambda: s.previous_at_or_before(naive),
        lambda: list(s.slots_between(naive, naive)),
        lambda: IntervalSchedule(timedelta(minutes=1), naive),
        lambda: OneOffSchedule(naive),
        lambda: IntervalSchedule(timedelta(minutes=1), ANCHOR).next_after(naive),
    ):
        with pytest.raises(ValueError, match="naive"):
            call()


def test_idempotency_key_and_format() -> None:
    at = datetime(2026, 1, 10, 11, 5, 0, 123, tzinfo=timezone(timedelta(hours=1)))
    assert format_fire_at(at) == "2026-01-10T10:05:00Z"
    assert idempotency_key("report", at) == "report@2026-01-10T10:05:00Z"


# --- validation -----------------------------------------------------------------------


def test_invalid_cron_quotes_expression_and_keeps_cause() -> None:
    with pytest.raises(InvalidScheduleError) as info:
        CronSchedule("61 * * * *")
    message = str(info.value)
    assert "'61 * * * *'" in message
    assert "seconds field LAST" in message
    assert info.value.__cause__ is not None
    assert isinstance(info.value, ConfigurationError)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("expr", ["* * * *", "* * * * * * *", "", "@fortnightly"])
def test_wrong_field_count(expr: str) -> None:
    with pytest.raises(InvalidScheduleError, match="seconds field LAST"):
        CronSchedule(expr)


@pytest.mark.parametrize("expr", ["*/15 * * * * *", "0 */5 * * * *", "30 2 * * * *"])
def test_seconds_first_is_rejected(expr: str) -> None:
    with pytest.raises(InvalidScheduleError, match="seconds field LAST") as info:
        CronSchedule(expr)
    assert repr(expr) in str(info.value)


def test_every_second_is_allowed() -> None:
    s = CronSchedule("* * * * * *")
    assert s.next_after(z("2026-01-01T00:00:00Z")) == z("2026-01-01T00:00:01Z")
    assert s.nominal_period == timedelta(seconds=1)


def test_never_matching_cron_is_rejected() -> None:
    with pytest.raises(InvalidScheduleError, match="never matches"):
        CronSchedule("0 0 31 2 *")
    with pytest.raises(InvalidScheduleError, match="never matches"):
        CronSchedule("0 0 30 2 *", "Europe/Berlin")


@pytest.mark.parametrize(
    "kwargs", [{"nonexistent": "later"}, {"repeated": "twice"}, {"nonexistent": "first"}]
)
def test_unknown_rule_is_rejected(kwargs: dict[str, str]) -> None:
    with pytest.raises(InvalidScheduleError, match="is not one of"):
        CronSchedule("0 2 * * *", "Europe/Berlin", **kwargs)


def test_unknown_timezone() -> None:
    with pytest.raises(UnknownTimezoneError, match=r"'Mars/Olympus'.*IANA"):
        CronSchedule("* * * * *", "Mars/Olympus")
    with pytest.raises(UnknownTimezoneError):
        validate_timezone("")
    with pytest.raises(UnknownTimezoneError):
        IntervalSchedule(timedelta(seconds=5), ANCHOR, "Europe/Nowhere")
    assert validate_timezone("Europe/Berlin") == "Europe/Berlin"


@pytest.mark.parametrize(
    "every", [timedelta(0), timedelta(milliseconds=500), timedelta(seconds=1.5), timedelta(-1)]
)
def test_interval_must_be_whole_seconds(every: timedelta) -> None:
    with pytest.raises(InvalidScheduleError, match="whole number of seconds"):
        IntervalSchedule(every, ANCHOR)


# --- cron basics ----------------------------------------------------------------------


def test_aliases_and_names() -> None:
    assert CronSchedule("@daily", "Europe/Berlin").fixed_time
    assert not CronSchedule("@hourly", "Europe/Berlin").fixed_time
    check(
        CronSchedule("@weekly"),
        "2026-01-01T00:00:00Z",
        "2026-01-20T00:00:00Z",
        ["2026-01-04T00:00:00Z", "2026-01-11T00:00:00Z", "2026-01-18T00:00:00Z"],
    )
    check(
        CronSchedule("0 9 * jan mon#2"),
        "2026-01-01T00:00:00Z",
        "2027-01-01T00:00:00Z",
        ["2026-01-12T09:00:00Z"],
    )


def test_microseconds_in_inputs() -> None:
    s = CronSchedule("0 * * * *")
    just_after = datetime(2026, 1, 1, 10, 0, 0, 500, tzinfo=UTC)
    assert s.next_after(just_after) == z("2026-01-01T11:00:00Z")
    assert s.previous_at_or_before(just_after) == z("2026-01-01T10:00:00Z")
    assert list(s.slots_between(just_after, just_after + timedelta(hours=1))) == [
        z("2026-01-01T11:00:00Z")
    ]
    assert list(s.slots_between(z("2026-01-01T09:30:00Z"), just_after)) == [
        z("2026-01-01T10:00:00Z")
    ]


def test_empty_or_reversed_window() -> None:
    s = CronSchedule("* * * * *")
    assert list(s.slots_between(z("2026-01-01T10:00:00Z"), z("2026-01-01T10:00:00Z"))) == []
    assert list(s.slots_between(z("2026-01-01T11:00:00Z"), z("2026-01-01T10:00:00Z"))) == []


def test_nominal_period() -> None:
    assert CronSchedule("*/5 * * * *").nominal_period == timedelta(minutes=5)
    assert CronSchedule("* * * * * */15").nominal_period == timedelta(seconds=15)
    assert CronSchedule("0 3 * * *", "Europe/Berlin").nominal_period == timedelta(days=1)
    assert IntervalSchedule(timedelta(hours=2), ANCHOR).nominal_period == timedelta(hours=2)
    assert OneOffSchedule(ANCHOR).nominal_period is None


# --- DST: Europe/Berlin (gap 2026-03-29 02:00-03:00, repeat 2026-10-25 02:00-03:00) -----

SPRING = ("2026-03-28T23:00:00Z", "2026-03-29T22:00:00Z")
AUTUMN = ("2026-10-24T22:00:00Z", "2026-10-25T23:00:00Z")


@pytest.mark.parametrize(
    ("nonexistent", "expected"),
    [
        (None, ["2026-03-29T01:30:00Z"]),  # shift: 02:30 read as CET = 03:30 CEST
        ("shift", ["2026-03-29T01:30:00Z"]),
        ("gap_end", ["2026-03-29T01:00:00Z"]),  # 03:00 CEST, the first instant after
        ("skip", []),
    ],
)
def test_berlin_gap_fixed(nonexistent: str | None, expected: list[str]) -> None:
    check(CronSchedule("30 2 * * *", "Europe/Berlin", nonexistent=nonexistent), *SPRING, expected)


@pytest.mark.parametrize(
    ("repeated", "expected"),
    [
        (None, ["2026-10-25T00:30:00Z"]),  # first 02:30 (CEST)
        ("first", ["2026-10-25T00:30:00Z"]),
        ("last", ["2026-10-25T01:30:00Z"]),  # second 02:30 (CET)
        ("both", ["2026-10-25T00:30:00Z", "2026-10-25T01:30:00Z"]),
    ],
)
def test_berlin_repeated_fixed(repeated: str | None, expected: list[str]) -> None:
    check(CronSchedule("30 2 * * *", "Europe/Berlin", repeated=repeated), *AUTUMN, expected)


def test_berlin_wildcard_defaults() -> None:
    spring = CronSchedule("30 * * * *", "Europe/Berlin")
    check(
        spring,
        "2026-03-28T23:00:00Z",
        "2026-03-29T03:00:00Z",
        # 00:30 CET, 01:30 CET, (02:30 does not exist), 03:30 CEST, 04:30 CEST
        [
            "2026-03-28T23:30:00Z",
            "2026-03-29T00:30:00Z",
            "2026-03-29T01:30:00Z",
            "2026-03-29T02:30:00Z",
        ],
    )
    autumn = CronSchedule("30 * * * *", "Europe/Berlin")
    both = ["2026-10-24T23:30:00Z", "2026-10-25T00:30:00Z", "2026-10-25T01:30:00Z"]
    check(autumn, "2026-10-24T23:00:00Z", "2026-10-25T02:00:00Z", both)
    first = CronSchedule("30 * * * *", "Europe/Berlin", repeated="first")
    check(
        first,
        "2026-10-24T23:00:00Z",
        "2026-10-25T03:00:00Z",
        [both[0], both[1], "2026-10-25T02:30:00Z"],
    )
    shifted = CronSchedule("30 * * * *", "Europe/Berlin", nonexistent="shift")
    check(
        shifted,
        "2026-03-29T00:00:00Z",
        "2026-03-29T03:00:00Z",
        ["2026-03-29T00:30:00Z", "2026-03-29T01:30:00Z", "2026-03-29T02:30:00Z"],
    )


def test_berlin_shift_dedupes_same_instant() -> None:
    # 02:00 (gap, read as CET) and 03:00 CEST are the same instant 01:00Z: one slot
    s = CronSchedule("0 2,3 * * *", "Europe/Berlin")
    check(s, *SPRING, ["2026-03-29T01:00:00Z"])
    check(
        s,
        "2026-03-29T22:00:00Z",
        "2026-03-30T22:00:00Z",
        ["2026-03-30T00:00:00Z", "2026-03-30T01:00:00Z"],
    )
    gap_end = CronSchedule("0,20,40 2 * * *", "Europe/Berlin", nonexistent="gap_end")
    check(gap_end, *SPRING, ["2026-03-29T01:00:00Z"])


def test_gap_skipped_wildcard_continues_next_day() -> None:
    s = CronSchedule("*/20 2 * * *", "Europe/Berlin")
    assert s.next_after(z("2026-03-29T00:30:00Z")) == z("2026-03-30T00:00:00Z")
    assert s.previous_at_or_before(z("2026-03-29T21:00:00Z")) == z("2026-03-28T01:40:00Z")
    check(s, *SPRING, [])


def test_berlin_seconds_cron_through_gap() -> None:
    s = CronSchedule("15 2 * * * */20", "Europe/Berlin")  # fixed: 02:15:00/20/40, in the gap
    check(
        s,
        *SPRING,
        ["2026-03-29T01:15:00Z", "2026-03-29T01:15:20Z", "2026-03-29T01:15:40Z"],
    )
    wildcard = CronSchedule("15 * * * * */20", "Europe/Berlin")
    assert len(window(wildcard, *SPRING)) == 23 * 3


# --- DST: America/New_York (gap 2025-03-09 02:00-03:00, repeat 2025-11-02 01:00-02:00) --


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, ["2025-03-09T07:30:00Z"]),  # 02:30 read as EST = 03:30 EDT
        ({"nonexistent": "gap_end"}, ["2025-03-09T07:00:00Z"]),
        ({"nonexistent": "skip"}, []),
    ],
)
def test_new_york_gap(kwargs: dict[str, str], expected: list[str]) -> None:
    check(
        CronSchedule("30 2 * * *", "America/New_York", **kwargs),
        "2025-03-09T05:00:00Z",
        "2025-03-10T04:00:00Z",
        expected,
    )


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, ["2025-11-02T05:30:00Z"]),  # first 01:30 (EDT)
        ({"repeated": "last"}, ["2025-11-02T06:30:00Z"]),
        ({"repeated": "both"}, ["2025-11-02T05:30:00Z", "2025-11-02T06:30:00Z"]),
    ],
)
def test_new_york_repeat(kwargs: dict[str, str], expected: list[str]) -> None:
    check(
        CronSchedule("30 1 * * *", "America/New_York", **kwargs),
        "2025-11-02T04:00:00Z",
        "2025-11-03T05:00:00Z",
        expected,
    )


def test_new_york_wildcard_minutes_in_repeated_hour() -> None:
    s = CronSchedule("*/30 1 * * *", "America/New_York")  # minute starts with '*'
    check(
        s,
        "2025-11-02T04:00:00Z",
        "2025-11-02T08:00:00Z",
        [
            "2025-11-02T05:00:00Z",
            "2025-11-02T05:30:00Z",
            "2025-11-02T06:00:00Z",
            "2025-11-02T06:30:00Z",
        ],
    )


# --- DST: Africa/Cairo (midnight gap 2024-04-26 00:00-01:00, repeat 2024-10-31 23:00-24:00)


def test_cairo_midnight_gap() -> None:
    daily = CronSchedule("0 0 * * *", "Africa/Cairo")
    check(
        daily,
        "2024-04-24T00:00:00Z",
        "2024-04-27T12:00:00Z",
        # 04-25 00:00 EET, 04-26 00:00 does not exist -> read as EET = 01:00 EEST, 04-27 EEST
        ["2024-04-24T22:00:00Z", "2024-04-25T22:00:00Z", "2024-04-26T21:00:00Z"],
    )
    half = ("2024-04-25T12:00:00Z", "2024-04-26T12:00:00Z")
    check(CronSchedule("30 0 * * *", "Africa/Cairo"), *half, ["2024-04-25T22:30:00Z"])
    check(
        CronSchedule("30 0 * * *", "Africa/Cairo", nonexistent="gap_end"),
        *half,
        ["2024-04-25T22:00:00Z"],
    )
    check(CronSchedule("30 0 * * *", "Africa/Cairo", nonexistent="skip"), *half, [])
    wildcard = CronSchedule("*/30 * * * *", "Africa/Cairo")
    check(
        wildcard,
        "2024-04-25T21:00:00Z",
        "2024-04-25T23:00:00Z",
        # 23:00, 23:30 EET; 00:00-00:59 skipped; 01:00, 01:30 EEST: even real-time spacing
        [
            "2024-04-25T21:00:00Z",
            "2024-04-25T21:30:00Z",
            "2024-04-25T22:00:00Z",
            "2024-04-25T22:30:00Z",
        ],
    )


def test_cairo_repeated_hour() -> None:
    window_ = ("2024-10-31T12:00:00Z", "2024-11-01T12:00:00Z")
    check(CronSchedule("30 23 * * *", "Africa/Cairo"), *window_, ["2024-10-31T20:30:00Z"])
    check(
        CronSchedule("30 23 * * *", "Africa/Cairo", repeated="last"),
        *window_,
        ["2024-10-31T21:30:00Z"],
    )
    check(
        CronSchedule("0,30 * * * *", "Africa/Cairo"),
        "2024-10-31T20:00:00Z",
        "2024-10-31T22:00:00Z",
        [
            "2024-10-31T20:00:00Z",
            "2024-10-31T20:30:00Z",
            "2024-10-31T21:00:00Z",
            "2024-10-31T21:30:00Z",
        ],
    )


# --- DST: Australia/Lord_Howe (30-minute shifts) -----------------------------------------
# 2025-04-06 02:00 (+11) -> 01:30 (+10:30) at 15:00Z: 01:30-01:59 occur twice.
# 2025-10-05 02:00 (+10:30) -> 02:30 (+11) at 15:30Z: 02:00-02:29 do not exist.


@pytest.mark.parametrize(
    ("expr", "kwargs", "expected"),
    [
        ("30 1 * * *", {}, ["2025-04-05T14:30:00Z"]),
        ("30 1 * * *", {"repeated": "last"}, ["2025-04-05T15:00:00Z"]),
        ("45 1 * * *", {}, ["2025-04-05T14:45:00Z"]),
        ("45 1 * * *", {"repeated": "last"}, ["2025-04-05T15:15:00Z"]),
        ("45 1 * * *", {"repeated": "both"}, ["2025-04-05T14:45:00Z", "2025-04-05T15:15:00Z"]),
        ("15 1 * * *", {}, ["2025-04-05T14:15:00Z"]),  # not repeated
    ],
)
def test_lord_howe_april(expr: str, kwargs: dict[str, str], expected: list[str]) -> None:
    check(
        CronSchedule(expr, "Australia/Lord_Howe", **kwargs),
        "2025-04-05T10:00:00Z",
        "2025-04-06T10:00:00Z",
        expected,
    )


@pytest.mark.parametrize(
    ("expr", "kwargs", "expected"),
    [
        ("30 1 * * *", {}, ["2025-10-04T15:00:00Z"]),  # 01:30 +10:30, before the gap
        ("45 1 * * *", {}, ["2025-10-04T15:15:00Z"]),
        ("15 2 * * *", {}, ["2025-10-04T15:45:00Z"]),  # 02:15 read at +10:30 = 02:45 +11
        ("15 2 * * *", {"nonexistent": "gap_end"}, ["2025-10-04T15:30:00Z"]),
        ("15 2 * * *", {"nonexistent": "skip"}, []),
        ("0,15,30,45 2 * * *", {}, ["2025-10-04T15:30:00Z", "2025-10-04T15:45:00Z"]),  # deduped
        ("*/15 2 * * *", {}, ["2025-10-04T15:30:00Z", "2025-10-04T15:45:00Z"]),  # 02:30, 02:45
    ],
)
def test_lord_howe_october(expr: str, kwargs: dict[str, str], expected: list[str]) -> None:
    check(
        CronSchedule(expr, "Australia/Lord_Howe", **kwargs),
        "2025-10-04T10:00:00Z",
        "2025-10-05T10:00:00Z",
        expected,
    )


# --- hot path -----------------------------------------------------------------------


def test_next_after_is_bounded_for_one_second_cron(monkeypatch: pytest.MonkeyPatch) -> None:
    """One croniter step per call on a plain day, at most four near a DST transition
    (the documented bound, whatever the cron's frequency). Counted, not timed: a
    wall-time bound fails on a loaded machine."""
    import reliable_beat.schedules as schedules_mod

    steps = {"n": 0}
    real_next, real_prev = schedules_mod.croniter.get_next, schedules_mod.croniter.get_prev

    def counting_next(self: Any, *args: Any, **kwargs: Any) -> Any:
        steps["n"] += 1
        return real_next(self, *args, **kwargs)

    def counting_prev(self: Any, *args: Any, **kwargs: Any) -> Any:
        steps["n"] += 1
        return real_prev(self, *args, **kwargs)

    monkeypatch.setattr(schedules_mod.croniter, "get_next", counting_next)
    monkeypatch.setattr(schedules_mod.croniter, "get_prev", counting_prev)
    s = CronSchedule("* * * * * *", "Europe/Berlin")
    for start, per_call in ((z("2026-06-01T12:00:00Z"), 1),  # plain day
                            (z("2026-10-25T00:30:00Z"), 4)):  # fall-back at 01:00Z
        cur = start
        worst = 0
        for _ in range(500):
            before = steps["n"]
            nxt = s.next_after(cur)
            worst = max(worst, steps["n"] - before)
            assert nxt == cur + timedelta(seconds=1)
            cur = nxt
        assert worst <= per_call, (start, worst)


# --- interval and one-off -----------------------------------------------------------


def test_interval_grid_ignores_zone_and_dst() -> None:
    s = IntervalSchedule(timedelta(hours=2), z("2026-03-28T23:00:00.900Z"), "Europe/Berlin")
    assert s.anchor == z("2026-03-28T23:00:00Z")
    assert s.next_after(z("2026-03-28T23:00:00Z")) == z("2026-03-29T01:00:00Z")
    assert s.next_after(z("2026-03-29T00:59:59.999Z")) == z("2026-03-29T01:00:00Z")
    assert s.previous_at_or_before(z("2026-03-29T01:00:00Z")) == z("2026-03-29T01:00:00Z")
    assert s.previous_at_or_before(z("2026-03-28T22:59:59Z")) == z("2026-03-28T21:00:00Z")
    check(
        s,
        "2026-03-28T20:00:00Z",
        "2026-03-29T03:00:00Z",
        ["2026-03-28T21:00:00Z", "2026-03-28T23:00:00Z", "2026-03-29T01:00:00Z"],
    )


def test_interval_no_float_drift() -> None:
    s = IntervalSchedule(timedelta(seconds=7), z("2000-01-01T00:00:00Z"))
    far = z("2100-01-01T00:00:00Z")
    nxt = s.next_after(far)
    assert (nxt - z("2000-01-01T00:00:00Z")).total_seconds() % 7 == 0
    assert timedelta(0) < nxt - far <= timedelta(seconds=7)


def test_one_off() -> None:
    s = OneOffSchedule(z("2026-05-01T08:00:00.5Z"), "Europe/Berlin")
    assert s.at == z("2026-05-01T08:00:00Z")
    assert s.next_after(z("2026-05-01T07:59:59Z")) == s.at
    assert s.next_after(s.at) is None
    assert s.previous_at_or_before(s.at) == s.at
    assert s.previous_at_or_before(z("2026-05-01T07:59:59Z")) is None
    assert list(s.slots_between(s.at, s.at + timedelta(seconds=1))) == [s.at]
    assert list(s.slots_between(s.at - timedelta(hours=1), s.at)) == []


# --- specs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule",
    [
        CronSchedule("*/5 * * * *"),
        CronSchedule(
            "0 2 * * *", "Europe/Berlin", day_or=False, nonexistent="skip", repeated="both"
        ),
        CronSchedule("@daily", "America/New_York"),
        IntervalSchedule(timedelta(days=7), z("2026-01-05T09:00:00Z"), "Europe/London"),
        OneOffSchedule(z("2026-05-01T08:00:00Z"), "Asia/Tokyo"),
    ],
)
def test_spec_round_trip(schedule: Schedule) -> None:
    spec = schedule.to_spec()
    assert spec["kind"] == schedule.kind
    assert spec["timezone"] == schedule.timezone
    again = schedule_from_spec(json.loads(json.dumps(spec)))
    assert again.to_spec() == spec
    assert again == schedule
    assert hash(again) == hash(schedule)
    assert type(schedule).__name__ in repr(schedule)


def test_spec_shapes() -> None:
    assert CronSchedule("0 2 * * *", "Europe/Berlin").to_spec() == {
        "kind": "cron",
        "expr": "0 2 * * *",
        "timezone": "Europe/Berlin",
        "day_or": True,
        "nonexistent": None,
        "repeated": None,
    }
    assert IntervalSchedule(timedelta(hours=2), z("2026-03-28T23:00:00Z")).to_spec() == {
        "kind": "interval",
        "every_seconds": 7200,
        "anchor": "2026-03-28T23:00:00Z",
        "timezone": "UTC",
    }
    assert OneOffSchedule(z("2026-05-01T08:00:00Z")).to_spec() == {
        "kind": "once",
        "at": "2026-05-01T08:00:00Z",
        "timezone": "UTC",
    }


@pytest.mark.parametrize(
    "spec",
    [
        {"kind": "solar"},
        {"kind": "cron"},
        {"expr": "* * * * *"},
        {"kind": "interval", "every_seconds": 1.5, "anchor": "2026-01-01T00:00:00Z"},
        {"kind": "interval", "every_seconds": 60, "anchor": "2026-01-01T00:00:00"},
        {"kind": "once", "at": "yesterday"},
    ],
)
def test_bad_specs(spec: dict[str, Any]) -> None:
    with pytest.raises(InvalidScheduleError):
        schedule_from_spec(spec)


# --- from_celery ----------------------------------------------------------------------


def test_from_celery_kinds() -> None:
    anchor = z("2026-01-05T09:00:00Z")
    assert from_celery(30, timezone="UTC", anchor=anchor) == IntervalSchedule(
        timedelta(seconds=30), anchor
    )
    assert from_celery(30.0, timezone="UTC", anchor=anchor).nominal_period == timedelta(seconds=30)
    assert from_celery(timedelta(minutes=5), timezone="Europe/Berlin", anchor=anchor) == (
        IntervalSchedule(timedelta(minutes=5), anchor, "Europe/Berlin")
    )
    assert from_celery(celery_schedule(run_every=60), timezone="UTC", anchor=anchor) == (
        IntervalSchedule(timedelta(seconds=60), anchor)
    )
    assert from_celery("0 2 * * *", timezone="Europe/Berlin", anchor=anchor) == CronSchedule(
        "0 2 * * *", "Europe/Berlin"
    )
    own = CronSchedule("0 3 * * *", "Asia/Tokyo")
    assert from_celery(own, timezone="Europe/Berlin", anchor=anchor) is own
    converted = from_celery(
        crontab(minute="*/15", hour="9-17", day_of_week="mon-fri"), timezone="UTC", anchor=anchor
    )
    assert converted.to_spec()["expr"] == "*/15 9-17 * * 1-5"
    assert converted.to_spec()["day_or"] is False


def test_from_celery_refusals_name_the_entry() -> None:
    with pytest.raises(InvalidScheduleError, match=r"'sunrise job'.*solar"):
        # solar() needs the optional ephem package; an uninitialised instance is enough
        from_celery(object.__new__(solar), timezone="UTC", anchor=ANCHOR, entry="sunrise job")
    with pytest.raises(InvalidScheduleError, match=r"'weird'.*unsupported"):
        from_celery(object(), timezone="UTC", anchor=ANCHOR, entry="weird")
    with pytest.raises(InvalidScheduleError, match=r"'fast'.*whole number of seconds"):
        from_celery(0.5, timezone="UTC", anchor=ANCHOR, entry="fast")
    with pytest.raises(InvalidScheduleError, match=r"'bad'.*seconds field LAST"):
        from_celery("*/15 * * * * *", timezone="UTC", anchor=ANCHOR, entry="bad")
    with pytest.raises(InvalidScheduleError, match="'flag'"):
        from_celery(True, timezone="UTC", anchor=ANCHOR, entry="flag")


def celery_matches(c: crontab, at: datetime) -> bool:
    """Celery's own field sets (its AND meaning); isoweekday() % 7 gives 0 = Sunday."""
    return (
        at.minute in c.minute
        and at.hour in c.hour
        and at.day in c.day_of_month
        and at.month in c.month_of_year
        and at.isoweekday() % 7 in c.day_of_week
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"minute": 0, "hour": 22, "day_of_month": "1-7", "day_of_week": "saturday"},
        {"minute": "*/20", "hour": "*/6", "day_of_week": "sun,wed"},
        {"minute": 30, "hour": 4, "day_of_month": "*/10", "month_of_year": "*/3"},
        {"minute": 5, "hour": "0-23/8", "day_of_month": "28-31"},
    ],
)
def test_crontab_conversion_agrees_with_celery(kwargs: dict[str, Any]) -> None:
    c = crontab(**kwargs)
    s = from_celery(c, timezone="UTC", anchor=ANCHOR)
    start, end = z("2026-01-01T00:00:00Z"), z("2026-04-01T00:00:00Z")
    expected = []
    t = start
    while t < end:
        if celery_matches(c, t):
            expected.append(t)
        t += timedelta(minutes=1)
    assert list(s.slots_between(start, end)) == expected
    assert expected  # the example exercises something
