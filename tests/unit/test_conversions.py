"""Conversions from Celery's schedules never change what a schedule means (issue 12).

Every crontab conversion is checked against Celery's own expanded field sets
(``crontab.minute``, ``.hour``, ``.day_of_month``, ``.month_of_year``, ``.day_of_week``,
ANDed as Celery does), walked day by day and minute by minute by the independent oracle in
``cron_oracle.py`` with the DST rule of design.md §7 on top, in zones with and without DST.
Intervals are checked against Celery's ``run_every``; what Celery cannot key (solar,
custom ``BaseSchedule``, ``relative=True``) is refused with the reason and the fix.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone
from itertools import pairwise
from typing import Any

import pytest
from celery.schedules import BaseSchedule, crontab, solar
from celery.schedules import schedule as celery_schedule
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from reliable_beat.entries import definition_from_celery
from reliable_beat.errors import EntryValidationError, InvalidScheduleError
from reliable_beat.schedules import CronSchedule, IntervalSchedule, from_celery
from reliable_beat.settings import Settings
from tests.unit.cron_oracle import walk

UTC = timezone.utc
ANCHOR = datetime(2026, 1, 1, tzinfo=UTC)
NOW = datetime(2026, 3, 1, tzinfo=UTC)
ZONES = ["UTC", "Asia/Kolkata", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe"]


def z(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _star(orig: Any, values: set[int], full: range) -> bool:
    """The DST rule's wildcard test on what the user wrote (a full set counts as '*')."""
    return (isinstance(orig, str) and orig.startswith("*")) or values == set(full)


def celery_slots(c: crontab, zone: str, start: datetime, end: datetime) -> list[datetime]:
    """Celery's meaning, by brute force: a wall time is due when every field of Celery's
    expanded sets holds it (day_of_month AND day_of_week; isoweekday() % 7: 0 = Sunday)."""
    fixed = not _star(c._orig_minute, c.minute, range(60)) and not _star(
        c._orig_hour, c.hour, range(24)
    )
    return walk(
        lambda d: d.day in c.day_of_month
        and d.month in c.month_of_year
        and d.isoweekday() % 7 in c.day_of_week,
        c.hour,
        c.minute,
        {0},
        lambda w: w.minute in c.minute and w.hour in c.hour,
        zone,
        start,
        end,
        fixed_time=fixed,
    )


# --- crontab: rendered from Celery's sets ------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "step"),
    [
        ({"minute": "*/2 5"}, timedelta(minutes=2)),  # was rendered '*/25'
        ({"minute": 0, "hour": "*/2 5"}, timedelta(hours=2)),  # was once a day
        ({"minute": "*/2, 5"}, None),
    ],
)
def test_crontab_step_with_a_space_keeps_celery_meaning(
    kwargs: dict[str, Any], step: timedelta | None
) -> None:
    c = crontab(**kwargs)
    s = from_celery(c, timezone="UTC", anchor=ANCHOR, entry="e")
    start, end = z("2026-01-05T00:00:00Z"), z("2026-01-06T00:00:00Z")
    got = list(s.slots_between(start, end))
    assert got == celery_slots(c, "UTC", start, end)
    if step is not None:
        assert all(b - a == step for a, b in pairwise(got))
    assert isinstance(s, CronSchedule) and not s.fixed_time  # still a wildcard entry


def test_star_text_with_extra_values_stays_a_wildcard() -> None:
    """minute='*/15,5' at hour 2 is a wildcard entry (DST rule): nothing in a gap."""
    c = crontab(minute="*/15,5", hour=2)
    s = from_celery(c, timezone="Europe/Berlin", anchor=ANCHOR)
    day = (z("2026-03-28T23:00:00Z"), z("2026-03-29T22:00:00Z"))  # 02:xx does not exist
    assert list(s.slots_between(*day)) == [] == celery_slots(c, "Europe/Berlin", *day)
    fixed = from_celery(crontab(minute="0,5,15,30,45", hour=2), timezone="Europe/Berlin",
                        anchor=ANCHOR)
    assert len(list(fixed.slots_between(*day))) == 5  # fixed-time: shifted, once each


MINUTES = st.one_of(
    st.sampled_from(["*", "*/5", "*/15", "*/2 5", "*/7", "0", "30", "0,30", "10-20",
                     "10-50/10", "*/15,5", "59", "0-59/20"]),
    st.integers(0, 59),
    st.sets(st.integers(0, 59), min_size=1, max_size=4),
)
HOURS = st.one_of(
    st.sampled_from(["*", "*/2", "*/3 1", "0", "2", "3", "1-3", "2,3", "9-17", "*/6,1",
                     "0-23/4", "23"]),
    st.integers(0, 23),
    st.just(range(24)),
)
DAYS_OF_MONTH = st.sampled_from(["*", "*", "1", "15", "1-7", "*/10", "28-31", "29", "31", "2,16"])
MONTHS = st.sampled_from(["*", "*", "*/3", "1,7", "3", "3-10", "10,11"])
DAYS_OF_WEEK = st.sampled_from(
    ["*", "*", "mon-fri", "sun,sat", "saturday", "0", "1", "*/2", "0-6/3", "wed"]
)


@st.composite
def crontabs(draw: st.DrawFn) -> crontab:
    try:
        return crontab(
            minute=draw(MINUTES),
            hour=draw(HOURS),
            day_of_month=draw(DAYS_OF_MONTH),
            month_of_year=draw(MONTHS),
            day_of_week=draw(DAYS_OF_WEEK),
        )
    except ValueError:  # Celery refuses it itself (e.g. day 31 in a 30-day month only)
        reject()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    crontabs(),
    st.sampled_from(ZONES),
    st.dates(date(2020, 1, 1), date(2030, 1, 1)),
    st.integers(1, 45),
)
def test_crontab_slots_equal_celery_sets(c: crontab, zone: str, first: date, span: int) -> None:
    """Property: for random crontab arguments, our slots are exactly the wall times in
    Celery's expanded sets (AND of the day fields), with the DST rule on top."""
    s = from_celery(c, timezone=zone, anchor=ANCHOR, entry="prop")
    assert isinstance(s, CronSchedule) and s.day_or is False
    start = datetime(first.year, first.month, first.day, tzinfo=UTC)
    end = start + timedelta(days=span)
    assert list(s.slots_between(start, end)) == celery_slots(c, zone, start, end)


def test_crontab_conversion_agrees_near_transitions() -> None:
    """The property test's dates rarely fall on a DST day: these always do."""
    for kwargs in ({"minute": "*/2 5", "hour": "1-3"}, {"minute": 30, "hour": "2"},
                   {"minute": "*/20", "hour": "*/2 5"}, {"minute": 0, "hour": range(24)}):
        c = crontab(**kwargs)
        for zone, day in (("Europe/Berlin", "2026-03-28"), ("Europe/Berlin", "2026-10-24"),
                          ("America/New_York", "2025-11-01"),
                          ("Australia/Lord_Howe", "2025-04-05")):
            start = z(f"{day}T00:00:00Z")
            end = start + timedelta(days=2)
            s = from_celery(c, timezone=zone, anchor=ANCHOR)
            assert list(s.slots_between(start, end)) == celery_slots(c, zone, start, end), (
                kwargs, zone, day)


def test_crontab_errors_quote_what_the_user_wrote() -> None:
    c = crontab(minute="*/2 5", hour=3)
    c.minute = {75}  # a set no field can hold (a broken subclass, a hand-edited object)
    with pytest.raises(InvalidScheduleError) as info:
        from_celery(c, timezone="UTC", anchor=ANCHOR, entry="quoted")
    text = str(info.value)
    assert "entry 'quoted'" in text
    assert "crontab(minute='*/2 5', hour=3)" in text
    assert "*/25" not in text


# --- intervals: Celery's run_every, on a fixed grid ---------------------------------------


@pytest.mark.parametrize(
    "value",
    [celery_schedule(timedelta(minutes=7)), celery_schedule(run_every=90), timedelta(hours=2),
     45, 2.0],
)
@pytest.mark.parametrize("zone", ["UTC", "Europe/Berlin"])
def test_interval_conversions_keep_run_every(value: Any, zone: str) -> None:
    every = (
        value.run_every if isinstance(value, celery_schedule)
        else value if isinstance(value, timedelta) else timedelta(seconds=value)
    )
    s = from_celery(value, timezone=zone, anchor=ANCHOR)
    assert isinstance(s, IntervalSchedule)
    got = list(s.slots_between(z("2026-03-28T00:00:00Z"), z("2026-03-30T00:00:00Z")))
    assert got and all(b - a == every for a, b in pairwise(got))
    assert all((g - ANCHOR) % every == timedelta(0) for g in got)


# --- relative: ignored where Celery ignores it, refused where it changes the meaning ------


def _define(raw: dict[str, Any], name: str = "e") -> Any:
    return definition_from_celery(name, raw, default_timezone="UTC", settings=Settings(),
                                  now=NOW)


def test_relative_schedule_object_is_refused_naming_the_entry() -> None:
    with pytest.raises(EntryValidationError) as info:
        _define({"task": "t", "schedule": celery_schedule(timedelta(minutes=5), relative=True)},
                name="rel-obj")
    text = str(info.value)
    assert "entry 'rel-obj'" in text and "relative=True" in text and "fixed grid" in text


@pytest.mark.parametrize("value", [timedelta(minutes=5), 300, 300.0])
def test_relative_key_on_an_interval_is_refused(value: Any) -> None:
    """Celery turns the key into schedule(value, relative=True): the meaning changes."""
    with pytest.raises(EntryValidationError, match=r"entry 'rel-key'.*'relative': True"):
        _define({"task": "t", "schedule": value, "relative": True}, name="rel-key")


@pytest.mark.parametrize(
    "value",
    [crontab(minute=0, hour=2), "0 2 * * *", celery_schedule(timedelta(minutes=5))],
)
def test_relative_key_is_ignored_where_celery_ignores_it(value: Any) -> None:
    """maybe_schedule() applies the key to numbers and timedeltas only."""
    plain = _define({"task": "t", "schedule": value})
    keyed = _define({"task": "t", "schedule": value, "relative": True})
    assert keyed.schedule == plain.schedule
    assert keyed.config_hash() == plain.config_hash()


def test_relative_false_is_fine() -> None:
    d = _define({"task": "t", "schedule": timedelta(minutes=5), "relative": False})
    assert isinstance(d.schedule, IntervalSchedule)


# --- schedules with no fixed slots ---------------------------------------------------------


class EveryTickIfQueueNonEmpty(BaseSchedule):  # type: ignore[misc]
    """A custom schedule decided at run time (a query per tick)."""

    def is_due(self, last_run_at: datetime) -> tuple[bool, float]:
        return False, 5.0

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        return timedelta(seconds=5)


class Jittered(celery_schedule):  # type: ignore[misc]
    def is_due(self, last_run_at: datetime) -> tuple[bool, float]:
        return super().is_due(last_run_at)  # type: ignore[no-any-return]


def test_custom_base_schedule_is_refused_with_the_why_and_the_fix() -> None:
    with pytest.raises(InvalidScheduleError) as info:
        from_celery(EveryTickIfQueueNonEmpty(), timezone="UTC", anchor=ANCHOR, entry="queue")
    text = str(info.value)
    assert "entry 'queue'" in text
    assert "EveryTickIfQueueNonEmpty" in text
    assert "no fixed slots" in text
    assert "cron" in text and "runtime entry" in text
    assert " at 0x" not in text


def test_schedule_subclass_deciding_at_run_time_is_refused() -> None:
    with pytest.raises(InvalidScheduleError, match=r"Jittered.*is_due.*no fixed slots"):
        from_celery(Jittered(60), timezone="UTC", anchor=ANCHOR, entry="j")


def test_unsupported_object_never_shows_an_address() -> None:
    class Thing:
        pass

    with pytest.raises(InvalidScheduleError) as info:
        from_celery(Thing(), timezone="UTC", anchor=ANCHOR, entry="thing")
    assert " at 0x" not in str(info.value) and "Thing" in str(info.value)


def test_solar_is_refused() -> None:
    with pytest.raises(InvalidScheduleError, match=r"'sun'.*solar"):
        from_celery(object.__new__(solar), timezone="UTC", anchor=ANCHOR, entry="sun")


# --- a crontab's own clock ----------------------------------------------------------------


def test_crontab_nowfun_zone_is_its_meaning() -> None:
    """Celery evaluates a crontab on the clock nowfun() returns: 09:00 Tokyo is 00:00Z."""
    from zoneinfo import ZoneInfo

    c = crontab(minute=0, hour=9, nowfun=lambda: datetime.now(ZoneInfo("Asia/Tokyo")))
    s = from_celery(c, timezone="UTC", anchor=ANCHOR, entry="tokyo")
    assert s.timezone == "Asia/Tokyo"
    assert s.next_after(z("2026-01-05T12:00:00Z")) == z("2026-01-06T00:00:00Z")


def test_tz_aware_crontab_zone_is_its_meaning() -> None:
    from zoneinfo import ZoneInfo

    from django_celery_beat.tzcrontab import TzAwareCrontab

    c = TzAwareCrontab(minute=30, hour=2, tz=ZoneInfo("Europe/Berlin"))
    s = from_celery(c, timezone="UTC", anchor=ANCHOR, entry="berlin")
    assert s.timezone == "Europe/Berlin"
    assert s.next_after(z("2026-07-01T12:00:00Z")) == z("2026-07-02T00:30:00Z")


def test_crontab_on_a_naive_clock_is_refused() -> None:
    c = crontab(minute=0, hour=9, nowfun=datetime.now)  # the host's local clock
    with pytest.raises(InvalidScheduleError, match=r"'local'.*naive.*timezone"):
        from_celery(c, timezone="UTC", anchor=ANCHOR, entry="local")


def test_entry_zone_conflicting_with_the_crontab_zone_is_refused() -> None:
    from zoneinfo import ZoneInfo

    c = crontab(minute=0, hour=9, nowfun=lambda: datetime.now(ZoneInfo("Asia/Tokyo")))
    with pytest.raises(EntryValidationError, match=r"'Europe/Berlin' conflicts.*'Asia/Tokyo'"):
        _define({"task": "t", "schedule": c,
                 "options": {"reliable_beat": {"timezone": "Europe/Berlin"}}})
    same = _define({"task": "t", "schedule": c,
                    "options": {"reliable_beat": {"timezone": "Asia/Tokyo"}}})
    assert same.schedule.timezone == "Asia/Tokyo"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(crontabs(), st.sampled_from(["UTC", "Asia/Kolkata"]),
       st.datetimes(datetime(2020, 1, 1), datetime(2030, 1, 1)))
def test_next_slot_equals_celery_own_remaining_estimate(
    c: crontab, zone: str, naive_start: datetime
) -> None:
    """Celery's own next-run computation (``crontab.remaining_estimate``, "now" = the last
    run) agrees with our next slot, step after step (zones without DST, where Celery's
    arithmetic has no known DST bugs)."""
    from zoneinfo import ZoneInfo

    from celery import Celery

    app = Celery(set_as_current=False)
    app.conf.timezone = zone
    app.conf.enable_utc = True
    theirs = crontab(minute=c._orig_minute, hour=c._orig_hour, day_of_month=c._orig_day_of_month,
                     month_of_year=c._orig_month_of_year, day_of_week=c._orig_day_of_week,
                     app=app)
    ours = from_celery(c, timezone=zone, anchor=ANCHOR)
    last = naive_start.replace(second=0, microsecond=0, tzinfo=ZoneInfo(zone))
    for _ in range(12):
        now = last
        theirs.nowfun = lambda: now  # noqa: B023 - read at once, inside this step
        expected = last + theirs.remaining_estimate(last)
        got = ours.next_after(last)
        assert got == expected.astimezone(UTC), (last, expected, got)
        last = got.astimezone(ZoneInfo(zone))


@pytest.mark.parametrize("field", ["minute", "hour", "day_of_week", "day_of_month",
                                   "month_of_year"])
def test_a_crontab_field_holding_spaces_keeps_celerys_meaning_and_warns(
    field: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`crontab(minute='*/2 6-17 * * *')`: Celery reads '*/2' and drops the rest without a
    word. The conversion keeps Celery's meaning and logs one WARNING naming the entry, the
    field, what is read and what is ignored; a clean crontab logs nothing."""
    import logging
    import uuid

    text = {"minute": "*/2 6-17 * * *", "hour": "6-17 * * *", "day_of_week": "1-5 *",
            "day_of_month": "1-15 x", "month_of_year": "*/3 x"}[field]
    read = text.split()[0]
    entry = f"poll-{uuid.uuid4().hex[:6]}"
    anchor = datetime(2026, 1, 1, tzinfo=timezone.utc)
    caplog.set_level(logging.WARNING, logger="reliable_beat.schedules")
    got = from_celery(crontab(**{field: text}), timezone="UTC", anchor=anchor, entry=entry)
    assert got == from_celery(crontab(**{field: read}), timezone="UTC", anchor=anchor,
                                  entry=entry)  # Celery's meaning, kept
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert f"entry {entry!r}: " in warned[0]
    assert f"{field}={text!r} is read as {field}={read!r}, ignoring " \
        f"{text.split(None, 1)[1]!r}" in warned[0], warned[0]
    caplog.clear()
    from_celery(crontab(**{field: text}), timezone="UTC", anchor=anchor, entry=entry)
    from_celery(crontab(minute="*/2", hour="6-17"), timezone="UTC", anchor=anchor,
                    entry=entry)
    assert [r for r in caplog.records if r.levelno == logging.WARNING] == []  # said once
