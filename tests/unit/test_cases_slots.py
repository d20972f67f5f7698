"""Handed cases (``tests/cases/handed.json``) of kind cron_slots / interval_slots.

The expected values are transcribed below so the tests run without the shared
file; when the file is present, a second set of tests checks the transcription
against it (so a changed case cannot silently diverge).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery.schedules import crontab
from celery.schedules import schedule as celery_schedule

from reliable_beat.errors import InvalidScheduleError
from reliable_beat.schedules import CronSchedule, IntervalSchedule, Schedule, from_celery

UTC = timezone.utc
CASES_FILE = Path(__file__).parents[1] / "cases" / "handed.json"
PAPERLESS_FILE = Path(__file__).parents[1] / "cases" / "real" / "paperless-schedule.json"


def z(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def iso(values: list[datetime]) -> list[str]:
    return [f"{v:%Y-%m-%dT%H:%M:%SZ}" for v in values]


def window(s: Schedule, start: str, end: str) -> list[str]:
    return iso(list(s.slots_between(z(start), z(end))))


def by_next_after(s: Schedule, start: str, end: str) -> list[str]:
    """The same window, walked with next_after (what a beat loop does)."""
    out: list[datetime] = []
    cur = s.next_after(z(start) - timedelta(seconds=1))
    while cur is not None and cur < z(end):
        out.append(cur)
        cur = s.next_after(cur)
    return iso(out)


ANCHOR = datetime(2020, 1, 1, tzinfo=UTC)

# --- dst-ny-daily-fixed --------------------------------------------------------------

NY_A = ["2025-03-08T21:04:00Z", "2025-03-09T20:04:00Z", "2025-03-10T20:04:00Z"]
NY_B = ["2025-11-01T21:00:00Z", "2025-11-02T22:00:00Z", "2025-11-03T22:00:00Z"]


@pytest.mark.parametrize(
    "schedule",
    [
        CronSchedule("4 16 * * *", "America/New_York"),
        from_celery(crontab(minute=4, hour=16), timezone="America/New_York", anchor=ANCHOR),
    ],
)
def test_dst_ny_daily_fixed_a(schedule: Schedule) -> None:
    got = window(schedule, "2025-03-08T05:00:00Z", "2025-03-11T04:00:00Z")
    assert got == NY_A
    assert "2025-03-09T21:04:00Z" not in got
    assert by_next_after(schedule, "2025-03-08T05:00:00Z", "2025-03-11T04:00:00Z") == NY_A


@pytest.mark.parametrize(
    "schedule",
    [
        CronSchedule("0 17 * * *", "America/New_York"),
        from_celery(crontab(minute=0, hour=17), timezone="America/New_York", anchor=ANCHOR),
    ],
)
def test_dst_ny_daily_fixed_b(schedule: Schedule) -> None:
    got = window(schedule, "2025-11-01T04:00:00Z", "2025-11-04T05:00:00Z")
    assert got == NY_B
    assert "2025-11-02T21:00:00Z" not in got
    assert by_next_after(schedule, "2025-11-01T04:00:00Z", "2025-11-04T05:00:00Z") == NY_B


# --- dst-pacific-hourly-fallback ----------------------------------------------------

PACIFIC = [
    "2026-11-01T07:00:00Z",
    "2026-11-01T08:00:00Z",
    "2026-11-01T09:00:00Z",
    "2026-11-01T10:00:00Z",
]


@pytest.mark.parametrize(
    "schedule",
    [
        CronSchedule("0 * * * *", "America/Los_Angeles"),
        from_celery(crontab(minute=0, hour="*"), timezone="America/Los_Angeles", anchor=ANCHOR),
        CronSchedule("0 * * * *", "US/Pacific"),
    ],
)
def test_dst_pacific_hourly_fallback(schedule: Schedule) -> None:
    assert window(schedule, "2026-11-01T07:00:00Z", "2026-11-01T11:00:00Z") == PACIFIC
    assert by_next_after(schedule, "2026-11-01T07:00:00Z", "2026-11-01T11:00:00Z") == PACIFIC
    # the beat's view: last fired slot 06:00Z, then next_after each fired slot
    assert schedule.next_after(z("2026-11-01T06:00:00Z")) == z(PACIFIC[0])
    assert schedule.next_after(z("2026-11-01T08:00:00Z")) == z("2026-11-01T09:00:00Z")


# --- dst-paris-fixed-offset-base ----------------------------------------------------

PARIS = ["2022-10-30T19:00:00Z", "2022-10-31T19:00:00Z", "2022-11-01T19:00:00Z"]


@pytest.mark.parametrize(
    "schedule",
    [
        CronSchedule("0 20 * * *", "Europe/Paris"),
        from_celery(crontab(minute=0, hour=20), timezone="Europe/Paris", anchor=ANCHOR),
    ],
)
def test_dst_paris_fixed_offset_base(schedule: Schedule) -> None:
    from zoneinfo import ZoneInfo

    start, end = z("2022-10-29T22:00:00Z"), z("2022-11-01T23:00:00Z")
    fixed = timezone(timedelta(hours=2))
    paris = ZoneInfo("Europe/Paris")
    for tz in (UTC, paris, fixed):
        got = iso(list(schedule.slots_between(start.astimezone(tz), end.astimezone(tz))))
        assert got == PARIS, tz
        cur = schedule.next_after(start.astimezone(tz))
        walked = []
        while cur is not None and cur < end:
            walked.append(cur)
            cur = schedule.next_after(cur.astimezone(tz))
        assert iso(walked) == PARIS, tz
        assert schedule.previous_at_or_before(end.astimezone(tz)) == z(PARIS[-1])
    # the exact trap: "now" read back as 2022-10-30T00:00+02:00 (fixed offset)
    assert schedule.next_after(datetime(2022, 10, 30, 0, 0, tzinfo=fixed)) == z(PARIS[0])


# --- dst-london-15s-repeated-hour ---------------------------------------------------


def test_dst_london_15s_repeated_hour() -> None:
    s = CronSchedule("* * * * * */15", "Europe/London")
    got = list(s.slots_between(z("2025-10-26T00:00:00Z"), z("2025-10-26T02:00:00Z")))
    assert len(got) == 480
    assert got[0] == z("2025-10-26T00:00:00Z")
    assert got[-1] == z("2025-10-26T01:59:45Z")
    assert got == [z("2025-10-26T00:00:00Z") + timedelta(seconds=15 * i) for i in range(480)]
    walked = by_next_after(s, "2025-10-26T00:00:00Z", "2025-10-26T02:00:00Z")
    assert walked == iso(got)


def test_dst_london_15s_is_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The window is walked once: one croniter step per wall time of the walked range.

    Counted, not timed (a wall-time bound fails on a loaded machine): the walk covers the
    2 h window widened by the 1 h fall-back lookback, i.e. 3 h of 15 s wall times (720),
    plus the step that passes the end. A per-slot search near the transition (up to four
    steps a slot) or a restart per slot would be over 1,900.
    """
    import reliable_beat.schedules as schedules_mod

    steps = {"n": 0}
    real_next = schedules_mod.croniter.get_next

    def counting_next(self: Any, *args: Any, **kwargs: Any) -> Any:
        steps["n"] += 1
        return real_next(self, *args, **kwargs)

    monkeypatch.setattr(schedules_mod.croniter, "get_next", counting_next)
    s = CronSchedule("* * * * * */15", "Europe/London")
    n = len(list(s.slots_between(z("2025-10-26T00:00:00Z"), z("2025-10-26T02:00:00Z"))))
    assert n == 480
    assert steps["n"] <= 3 * 240 + 4, steps


def test_seconds_first_mistake_is_rejected() -> None:
    with pytest.raises(InvalidScheduleError, match="seconds field LAST") as info:
        CronSchedule("*/15 * * * * *", "Europe/London")
    assert "*/15 * * * * *" in str(info.value)
    assert "'* * * * * */15'" in str(info.value)


# --- celery-crontab-and-vs-cron-or ----------------------------------------------------

AND_A = ["2026-02-07T22:00:00Z"]
OR_B = [
    "2026-02-01T22:00:00Z",
    "2026-02-02T22:00:00Z",
    "2026-02-03T22:00:00Z",
    "2026-02-04T22:00:00Z",
    "2026-02-05T22:00:00Z",
    "2026-02-06T22:00:00Z",
    "2026-02-07T22:00:00Z",
    "2026-02-14T22:00:00Z",
    "2026-02-21T22:00:00Z",
    "2026-02-28T22:00:00Z",
]


def test_celery_crontab_and_vs_cron_or() -> None:
    a = from_celery(
        crontab(minute=0, hour=22, day_of_month="1-7", day_of_week="saturday"),
        timezone="UTC",
        anchor=ANCHOR,
    )
    b = CronSchedule("0 22 1-7 * 6", "UTC")
    assert isinstance(a, CronSchedule)
    assert a.day_or is False
    assert window(a, "2026-02-01T00:00:00Z", "2026-03-01T00:00:00Z") == AND_A
    assert window(b, "2026-02-01T00:00:00Z", "2026-03-01T00:00:00Z") == OR_B
    # Celery: 02-07, then 03-07, 04-04
    assert iso(
        [a.next_after(z("2026-02-07T22:00:00Z")), a.next_after(z("2026-03-07T22:00:00Z"))]
    ) == [  # type: ignore[list-item]
        "2026-03-07T22:00:00Z",
        "2026-04-04T22:00:00Z",
    ]


# --- leap-day-feb29 -----------------------------------------------------------------


def test_leap_day_feb29() -> None:
    a = CronSchedule("0 0 29 * *", "UTC")
    for at in ("2024-03-02T00:00:00Z", "2024-03-15T00:00:00Z", "2024-03-28T00:00:00Z"):
        assert a.previous_at_or_before(z(at)) == z("2024-02-29T00:00:00Z")
    b = CronSchedule("15 22 29 2 *", "UTC")
    assert b.next_after(z("2024-02-29T00:00:00Z")) == z("2024-02-29T22:15:00Z")
    assert b.next_after(z("2024-02-29T22:15:00Z")) == z("2028-02-29T22:15:00Z")
    assert b.previous_at_or_before(z("2024-02-29T00:00:00Z")) == z("2020-02-29T22:15:00Z")
    c = window(a, "2025-01-01T00:00:00Z", "2026-01-01T00:00:00Z")
    assert len(c) == 11
    assert c == [f"2025-{m:02d}-29T00:00:00Z" for m in range(1, 13) if m != 2]


# --- month-end-31-and-L -------------------------------------------------------------

MONTH_A = [
    "2026-01-31T00:00:00Z",
    "2026-03-31T00:00:00Z",
    "2026-05-31T00:00:00Z",
    "2026-07-31T00:00:00Z",
    "2026-08-31T00:00:00Z",
    "2026-10-31T00:00:00Z",
    "2026-12-31T00:00:00Z",
]
MONTH_B = [
    "2015-10-31T00:00:00Z",
    "2015-11-30T00:00:00Z",
    "2015-12-31T00:00:00Z",
    "2016-01-31T00:00:00Z",
    "2016-02-29T00:00:00Z",
    "2016-03-31T00:00:00Z",
]
MONTH_C = [
    "2020-03-01T00:00:00Z",
    "2020-03-16T00:00:00Z",
    "2020-03-31T00:00:00Z",
    "2020-04-01T00:00:00Z",
    "2020-04-16T00:00:00Z",
    "2020-05-01T00:00:00Z",
]


def next_n(s: Schedule, after: str, n: int) -> list[str]:
    out: list[datetime] = []
    cur: datetime | None = z(after)
    for _ in range(n):
        assert cur is not None
        cur = s.next_after(cur)
        assert cur is not None
        out.append(cur)
    return iso(out)


def test_month_end_31_and_l() -> None:
    assert window(CronSchedule("0 0 31 * *"), "2026-01-01T00:00:00Z", "2027-01-01T00:00:00Z") == (
        MONTH_A
    )
    assert next_n(CronSchedule("0 0 L * *"), "2015-09-30T00:00:00Z", 6) == MONTH_B
    assert next_n(CronSchedule("0 0 1,16,31 * *"), "2020-02-18T00:00:00Z", 6) == MONTH_C


# --- interval-2h-across-dst ---------------------------------------------------------

INTERVAL_A = [
    "2026-03-29T01:00:00Z",
    "2026-03-29T03:00:00Z",
    "2026-03-29T05:00:00Z",
    "2026-03-29T07:00:00Z",
]
INTERVAL_A_WRONG = [
    "2026-03-29T01:00:00Z",
    "2026-03-29T02:00:00Z",
    "2026-03-29T04:00:00Z",
    "2026-03-29T06:00:00Z",
]
INTERVAL_B = [
    "2026-10-25T00:00:00Z",
    "2026-10-25T02:00:00Z",
    "2026-10-25T04:00:00Z",
    "2026-10-25T06:00:00Z",
]
INTERVAL_B_WRONG = [
    "2026-10-25T00:00:00Z",
    "2026-10-25T03:00:00Z",
    "2026-10-25T05:00:00Z",
    "2026-10-25T07:00:00Z",
]


@pytest.mark.parametrize(
    ("anchor", "start", "end", "expected", "wrong"),
    [
        (
            "2026-03-28T23:00:00Z",
            "2026-03-28T23:00:01Z",
            "2026-03-29T07:00:01Z",
            INTERVAL_A,
            INTERVAL_A_WRONG,
        ),
        (
            "2026-10-24T22:00:00Z",
            "2026-10-24T22:00:01Z",
            "2026-10-25T06:00:01Z",
            INTERVAL_B,
            INTERVAL_B_WRONG,
        ),
    ],
)
def test_interval_2h_across_dst(
    anchor: str, start: str, end: str, expected: list[str], wrong: list[str]
) -> None:
    forms = [
        IntervalSchedule(timedelta(seconds=7200), z(anchor), "Europe/Berlin"),
        from_celery(
            celery_schedule(timedelta(hours=2)), timezone="Europe/Berlin", anchor=z(anchor)
        ),
        from_celery(7200, timezone="Europe/Berlin", anchor=z(anchor)),
    ]
    for s in forms:
        got = window(s, start, end)
        assert got == expected
        assert got != wrong
        assert by_next_after(s, start, end) == expected


# --- paperless-ngx default beat schedule, Europe/Berlin -----------------------------

BERLIN = "Europe/Berlin"
SPRING = ("2026-03-28T23:00:00Z", "2026-03-29T22:00:00Z")  # local 2026-03-29, 23 h
AUTUMN = ("2026-10-24T22:00:00Z", "2026-10-25T23:00:00Z")  # local 2026-10-25, 25 h


def every(start: str, step: timedelta, count: int) -> list[str]:
    return iso([z(start) + step * i for i in range(count)])


PAPERLESS: list[tuple[str, Any, str, list[str], list[str]]] = [
    (
        "Check all e-mail accounts",
        crontab(minute="*/10"),
        "*/10 * * * *",
        every("2026-03-28T23:00:00Z", timedelta(minutes=10), 138),
        every("2026-10-24T22:00:00Z", timedelta(minutes=10), 150),
    ),
    (
        "Train the classifier",
        crontab(minute=5, hour="*/1"),
        "5 */1 * * *",
        every("2026-03-28T23:05:00Z", timedelta(hours=1), 23),
        every("2026-10-24T22:05:00Z", timedelta(hours=1), 25),
    ),
    (
        "Optimize the index",
        crontab(minute=0, hour=0),
        "0 0 * * *",
        ["2026-03-28T23:00:00Z"],
        ["2026-10-24T22:00:00Z"],
    ),
    (
        "Perform sanity check",
        crontab(minute=30, hour=0, day_of_week="sun"),
        "30 0 * * sun",
        ["2026-03-28T23:30:00Z"],
        ["2026-10-24T22:30:00Z"],
    ),
    (
        "Empty trash",
        crontab(minute=0, hour=1),
        "0 1 * * *",
        ["2026-03-29T00:00:00Z"],
        ["2026-10-24T23:00:00Z"],
    ),
    (
        "Check and run scheduled workflows",
        crontab(minute=5, hour="*/1"),
        "5 */1 * * *",
        every("2026-03-28T23:05:00Z", timedelta(hours=1), 23),
        every("2026-10-24T22:05:00Z", timedelta(hours=1), 25),
    ),
    (
        "Rebuild LLM index",
        crontab(minute=10, hour=2),
        "10 2 * * *",
        ["2026-03-29T01:10:00Z"],  # 02:10 does not exist: read with CET -> 03:10 CEST
        ["2026-10-25T00:10:00Z"],  # 02:10 twice: first (CEST)
    ),
    (
        "Cleanup expired share link bundles",
        crontab(minute=0, hour=2),
        "0 2 * * *",
        ["2026-03-29T01:00:00Z"],  # 02:00 CET does not exist -> 03:00 CEST
        ["2026-10-25T00:00:00Z"],  # first 02:00 (CEST)
    ),
]


@pytest.mark.parametrize(
    ("name", "obj", "expr", "spring", "autumn"), PAPERLESS, ids=[p[0] for p in PAPERLESS]
)
def test_paperless_schedule_on_dst_days(
    name: str, obj: Any, expr: str, spring: list[str], autumn: list[str]
) -> None:
    converted = from_celery(obj, timezone=BERLIN, anchor=ANCHOR, entry=name)
    for s in (converted, CronSchedule(expr, BERLIN)):
        assert window(s, *SPRING) == spring
        assert window(s, *AUTUMN) == autumn
        assert by_next_after(s, *SPRING) == spring
        assert by_next_after(s, *AUTUMN) == autumn


def test_paperless_transcription_matches_file() -> None:
    data = json.loads(PAPERLESS_FILE.read_text())
    assert [(e["name"], e["schedule"]["expr"]) for e in data["entries"]] == [
        (p[0], p[2]) for p in PAPERLESS
    ]


# --- the shared file, when present ----------------------------------------------------


def _load_cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = json.loads(CASES_FILE.read_text())
    return [c for c in cases if c["kind"] in ("cron_slots", "interval_slots")]


def test_transcription_matches_file() -> None:
    cases = {c["id"]: c for c in _load_cases()}
    assert set(cases) == {
        "dst-ny-daily-fixed",
        "dst-pacific-hourly-fallback",
        "dst-paris-fixed-offset-base",
        "dst-london-15s-repeated-hour",
        "celery-crontab-and-vs-cron-or",
        "leap-day-feb29",
        "month-end-31-and-L",
        "interval-2h-across-dst",
    }
    e = {k: c["expected"] for k, c in cases.items()}
    assert e["dst-ny-daily-fixed"]["A_fire_slots_utc"] == NY_A
    assert e["dst-ny-daily-fixed"]["B_fire_slots_utc"] == NY_B
    assert e["dst-pacific-hourly-fallback"]["fire_slots_utc"] == PACIFIC
    assert e["dst-paris-fixed-offset-base"]["fire_slots_utc"] == PARIS
    assert e["dst-london-15s-repeated-hour"]["count"] == 480
    assert e["celery-crontab-and-vs-cron-or"]["A_fire_slots_utc"] == AND_A
    assert e["celery-crontab-and-vs-cron-or"]["B_fire_slots_utc"] == OR_B
    assert e["month-end-31-and-L"]["A_fire_slots_utc"] == MONTH_A
    assert e["month-end-31-and-L"]["B_next_6"] == MONTH_B
    assert e["month-end-31-and-L"]["C_next_6"] == MONTH_C
    assert e["interval-2h-across-dst"]["A_fire_slots_utc"] == INTERVAL_A
    assert e["interval-2h-across-dst"]["A_wrong_wallclock_answer"] == INTERVAL_A_WRONG
    assert e["interval-2h-across-dst"]["B_fire_slots_utc"] == INTERVAL_B
    assert e["interval-2h-across-dst"]["B_wrong_wallclock_answer"] == INTERVAL_B_WRONG


@pytest.mark.parametrize("case", _load_cases(), ids=lambda c: c["id"])
def test_file_case_generic(case: dict[str, Any]) -> None:
    """Drive each file case straight from the JSON (single-schedule windows only)."""
    sched, exp, win, tz = case["schedule"], case["expected"], case["window"], case["timezone"]
    if case["id"] == "dst-ny-daily-fixed":
        pairs = [("A", sched["expr"]), ("B", sched["variant_B"]["expr"])]
        for key, expr in pairs:
            s = CronSchedule(expr, tz)
            got = window(s, win[key]["start"], win[key]["end"])
            assert got == exp[f"{key}_fire_slots_utc"]
            assert not set(got) & set(exp[f"{key}_must_not_fire_utc"])
    elif case["id"] == "interval-2h-across-dst":
        for key in ("A", "B"):
            s = IntervalSchedule(
                timedelta(seconds=sched["every_seconds"]), z(sched[f"anchor_{key}"]), tz
            )
            assert window(s, win[key]["start"], win[key]["end"]) == exp[f"{key}_fire_slots_utc"]
    elif "expr" in sched and "fire_slots_utc" in exp:
        s = CronSchedule(sched["expr"], tz)
        assert window(s, win["start"], win["end"]) == exp["fire_slots_utc"]
    elif case["id"] == "dst-london-15s-repeated-hour":
        s = CronSchedule(sched["expr"], tz)
        got = window(s, win["start"], win["end"])
        assert (len(got), got[0], got[-1]) == (
            exp["count"],
            exp["first_slot_utc"],
            exp["last_slot_utc"],
        )
        with pytest.raises(InvalidScheduleError):
            CronSchedule(sched["same_as_seconds_first"], tz)
    elif case["id"] == "leap-day-feb29":
        b = CronSchedule(sched["B"]["expr"], tz)
        for after, nxt in exp["B_next_after"].items():
            assert iso([b.next_after(z(after))]) == [nxt]  # type: ignore[list-item]
        for at, prev in exp["B_latest_before"].items():
            assert iso([b.previous_at_or_before(z(at))]) == [prev]  # type: ignore[list-item]
    else:
        assert case["id"] in ("celery-crontab-and-vs-cron-or", "month-end-31-and-L")
