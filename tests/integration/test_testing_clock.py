"""The testing kit's scheduler clock (issue 19): entries driven through a window on a
simulated database clock, real beat ticks on a real store, no waiting.

Expected slots are the handed cases of ``tests/cases/handed.json`` (DST days, downtime
with each misfire policy, a blocked loop, a restart straddling a slot), transcribed here so
the tests run without the shared file; when it is present, ``test_transcription_matches``
checks the transcription against it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from celery.schedules import crontab

from reliable_beat import testing as rbt
from reliable_beat.db.dialects import Store

CASES_FILE = Path(__file__).parents[1] / "cases" / "handed.json"


def z(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def iso(values: list[datetime]) -> list[str]:
    return [f"{v:%Y-%m-%dT%H:%M:%SZ}" for v in values]


@pytest.fixture
def store() -> Iterator[Store]:
    with rbt.throwaway_store() as s:
        yield s


def entry(schedule: Any, zone: str = "UTC", **policy: Any) -> dict[str, Any]:
    return {"task": "shop.job", "schedule": schedule,
            "options": {"reliable_beat": {"timezone": zone, **policy}}}


def window(store: Store, schedule: Any, zone: str, start: str, end: str,
           **policy: Any) -> rbt.Window:
    """A running beat over the half-open window [start, end): the entry is created just
    before ``start``."""
    clock = rbt.SchedulerClock(store, z(start) - timedelta(seconds=1))
    clock.sync({"job": entry(schedule, zone, **policy)})
    return clock.run_until(z(end))


# name -> (schedule, zone, start, end, expected fired slots); from handed.json
DST_CASES: dict[str, tuple[Any, str, str, str, list[str]]] = {
    "dst-ny-daily-fixed/A": (
        "4 16 * * *", "America/New_York", "2025-03-08T05:00:00Z", "2025-03-11T04:00:00Z",
        ["2025-03-08T21:04:00Z", "2025-03-09T20:04:00Z", "2025-03-10T20:04:00Z"]),
    "dst-ny-daily-fixed/A-crontab": (
        crontab(minute=4, hour=16), "America/New_York", "2025-03-08T05:00:00Z",
        "2025-03-11T04:00:00Z",
        ["2025-03-08T21:04:00Z", "2025-03-09T20:04:00Z", "2025-03-10T20:04:00Z"]),
    "dst-ny-daily-fixed/B": (
        "0 17 * * *", "America/New_York", "2025-11-01T04:00:00Z", "2025-11-04T05:00:00Z",
        ["2025-11-01T21:00:00Z", "2025-11-02T22:00:00Z", "2025-11-03T22:00:00Z"]),
    "dst-pacific-hourly-fallback": (
        "0 * * * *", "America/Los_Angeles", "2026-11-01T07:00:00Z", "2026-11-01T11:00:00Z",
        ["2026-11-01T07:00:00Z", "2026-11-01T08:00:00Z", "2026-11-01T09:00:00Z",
         "2026-11-01T10:00:00Z"]),
    "dst-paris-fixed-offset-base": (
        "0 20 * * *", "Europe/Paris", "2022-10-29T22:00:00Z", "2022-11-01T23:00:00Z",
        ["2022-10-30T19:00:00Z", "2022-10-31T19:00:00Z", "2022-11-01T19:00:00Z"]),
}


@pytest.mark.parametrize("case", list(DST_CASES))
def test_dst_day_fires_the_handed_slots_once(store: Store, case: str) -> None:
    schedule, zone, start, end, expected = DST_CASES[case]
    w = window(store, schedule, zone, start, end)
    assert iso(w.fired_at("job")) == expected
    assert w.skipped == []
    assert len(w.ticks) >= len(expected)  # the beat ticked at each slot, no real waiting


def test_dst_london_15s_across_the_repeated_hour(store: Store) -> None:
    w = window(store, "* * * * * */15", "Europe/London",
               "2025-10-26T00:00:00Z", "2025-10-26T02:00:00Z")
    fired = w.fired_at("job")
    assert len(fired) == 480 == len(set(fired))
    assert iso([fired[0], fired[-1]]) == ["2025-10-26T00:00:00Z", "2025-10-26T01:59:45Z"]
    assert {(b - a).total_seconds() for a, b in itertools.pairwise(fired)} == {15.0}


@pytest.mark.parametrize(("anchor", "start", "end", "expected"), [
    ("2026-03-28T23:00:00Z", "2026-03-28T23:00:01Z", "2026-03-29T07:00:01Z",
     ["2026-03-29T01:00:00Z", "2026-03-29T03:00:00Z", "2026-03-29T05:00:00Z",
      "2026-03-29T07:00:00Z"]),
    ("2026-10-24T22:00:00Z", "2026-10-24T22:00:01Z", "2026-10-25T06:00:01Z",
     ["2026-10-25T00:00:00Z", "2026-10-25T02:00:00Z", "2026-10-25T04:00:00Z",
      "2026-10-25T06:00:00Z"]),
])
def test_interval_2h_across_dst_is_elapsed_time(
    store: Store, anchor: str, start: str, end: str, expected: list[str]
) -> None:
    w = window(store, timedelta(hours=2), "Europe/Berlin", start, end, anchor=anchor)
    assert iso(w.fired_at("job")) == expected


MISSED = [f"2026-01-10T{t}:00Z" for t in ("10:05", "10:10", "10:15", "10:20", "10:25",
                                          "10:30", "10:35", "10:40", "10:45", "10:50",
                                          "10:55", "11:00")]


@pytest.mark.parametrize(("policy", "fired", "skipped"), [
    ("catch_up", [*MISSED, "2026-01-10T11:05:00Z"], 0),
    ("fire_once", ["2026-01-10T11:00:00Z", "2026-01-10T11:05:00Z"], 11),
    ("skip", ["2026-01-10T11:05:00Z"], 12),
])
def test_downtime_with_each_misfire_policy(
    store: Store, policy: str, fired: list[str], skipped: int
) -> None:
    """downtime-misfire-policies: slot 10:00 fired, beat down 10:02 -> 11:03."""
    clock = rbt.SchedulerClock(store, z("2026-01-10T09:59:00Z"))
    clock.sync({"job": entry("*/5 * * * *", misfire_policy=policy, misfire_grace=60,
                             catch_up_window=86400)})
    before = clock.run_until(z("2026-01-10T10:02:00Z"))
    assert iso(before.fired_at("job")) == ["2026-01-10T10:00:00Z"]
    after = clock.down_until(z("2026-01-10T11:03:00Z"))
    after.extend(clock.run_until(z("2026-01-10T11:10:00Z")))
    assert iso(after.fired_at("job")) == fired
    assert len(after.skipped_at("job")) == skipped
    assert {s.reason for s in after.skipped} <= {f"misfire:{policy}"}
    assert sorted(after.fired_at("job") + after.skipped_at("job")) == [
        z(t) for t in [*MISSED, "2026-01-10T11:05:00Z"]]  # every slot accounted for, once


@pytest.mark.parametrize(("policy", "fired"), [
    ("catch_up", [f"2026-01-10T12:{m:02d}:00Z" for m in range(1, 32)]),
    ("fire_once", ["2026-01-10T12:30:00Z", "2026-01-10T12:31:00Z"]),
    ("skip", ["2026-01-10T12:31:00Z"]),
])
def test_blocked_loop(store: Store, policy: str, fired: list[str]) -> None:
    """blocked-loop-catch-up-all: the loop is blocked 12:00:30 -> 12:30:30."""
    clock = rbt.SchedulerClock(store, z("2026-01-10T11:59:30Z"))
    clock.sync({"job": entry("* * * * *", misfire_policy=policy, misfire_grace=10,
                             catch_up_window=86400)})
    clock.run_until(z("2026-01-10T12:00:30Z"))
    w = clock.down_until(z("2026-01-10T12:30:30Z"))
    w.extend(clock.run_until(z("2026-01-10T12:32:00Z")))
    assert iso(w.fired_at("job")) == fired


def test_long_downtime_skips_are_recorded_as_a_range(store: Store) -> None:
    """Past ``SKIP_RECORD_LIMIT`` skipped slots, the beat records one range row; the clock's
    window gives its first slot, last slot and count."""
    clock = rbt.SchedulerClock(store, z("2026-01-10T11:59:30Z"))
    clock.sync({"job": entry(timedelta(minutes=1), misfire_policy="skip", misfire_grace=10,
                             anchor="2026-01-10T00:00:00Z")})
    clock.run_until(z("2026-01-10T12:00:30Z"))
    w = clock.down_until(z("2026-01-10T13:00:30Z"))
    assert w.fired == []
    assert w.skipped_count("job") == 60  # 12:01 .. 13:00, every one accounted for
    ranges = [s for s in w.skipped if s.count != 1]
    assert ranges and ranges[0].fire_at == z("2026-01-10T12:01:00Z")
    assert max(s.last for s in w.skipped if s.last) == z("2026-01-10T13:00:00Z")


@pytest.mark.parametrize("policy", ["catch_up", "fire_once", "skip"])
def test_restart_straddling_a_slot(store: Store, policy: str) -> None:
    """restart-straddles-slot: down 14:59:59 -> 15:00:16 (grace 60 s): 15:00Z still fires."""
    clock = rbt.SchedulerClock(store, z("2025-02-12T14:00:00Z"))
    clock.sync({"job": entry("0 16 * * *", "Europe/Berlin", misfire_policy=policy,
                             misfire_grace=60, catch_up_window=86400)})
    w = clock.run_until(z("2025-02-13T14:59:59Z"))
    w.extend(clock.down_until(z("2025-02-13T15:00:16Z")))
    w.extend(clock.run_until(z("2025-02-15T00:00:00Z")))
    assert iso(w.fired_at("job")) == ["2025-02-12T15:00:00Z", "2025-02-13T15:00:00Z",
                                      "2025-02-14T15:00:00Z"]
    assert w.skipped == []


def test_pause_resume_goes_through_the_misfire_policy(store: Store) -> None:
    clock = rbt.SchedulerClock(store, z("2026-01-10T09:59:30Z"))
    clock.sync({"job": entry("* * * * *", misfire_policy="skip", misfire_grace=10)})
    assert iso(clock.run_until(z("2026-01-10T10:01:30Z")).fired_at("job")) == [
        "2026-01-10T10:00:00Z", "2026-01-10T10:01:00Z"]
    clock.pause("job")
    assert clock.run_until(z("2026-01-10T10:05:30Z")).slots == []  # paused: nothing
    clock.resume("job")
    w = clock.run_until(z("2026-01-10T10:07:30Z"))
    assert iso(w.skipped_at("job")) == [f"2026-01-10T10:0{m}:00Z" for m in (2, 3, 4, 5)]
    assert iso(w.fired_at("job")) == ["2026-01-10T10:06:00Z", "2026-01-10T10:07:00Z"]


def test_overlap_policy_with_runs_left_running(store: Store) -> None:
    clock = rbt.SchedulerClock(store, z("2026-01-10T09:59:30Z"), complete_runs=False)
    clock.sync({"job": entry("* * * * *", overlap_policy="skip")})
    w = clock.run_until(z("2026-01-10T10:02:30Z"))
    assert iso(w.fired_at("job")) == ["2026-01-10T10:00:00Z"]
    assert [(f"{s.fire_at:%H:%M}", s.reason) for s in w.skipped] == [
        ("10:01", "overlap:skip"), ("10:02", "overlap:skip")]
    assert clock.complete("job") == 1
    assert iso(clock.run_until(z("2026-01-10T10:03:30Z")).fired_at("job")) == [
        "2026-01-10T10:03:00Z"]


def test_clock_refuses_naive_and_backwards_instants(store: Store) -> None:
    with pytest.raises(ValueError, match="naive"):
        rbt.SchedulerClock(store, datetime(2026, 1, 1))
    clock = rbt.SchedulerClock(store, z("2026-01-10T10:00:00Z"))
    with pytest.raises(ValueError, match="only moves forward"):
        clock.set(z("2026-01-10T09:00:00Z"))


def test_transcription_matches() -> None:
    cases = {c["id"]: c for c in json.loads(CASES_FILE.read_text())}
    for name, (_, zone, start, end, expected) in DST_CASES.items():
        case_id, _, variant = name.partition("/")
        case = cases[case_id]
        assert case["timezone"] == zone
        part = variant.split("-")[0]
        win = case["window"][part] if part else case["window"]
        assert (win["start"], win["end"]) == (start, end)
        key = f"{part}_fire_slots_utc" if part else "fire_slots_utc"
        assert case["expected"][key] == expected
    down = cases["downtime-misfire-policies"]["expected"]
    assert [f"2026-01-10T{t}:00Z" for t in down["missed_slots"]] == MISSED
    assert down["catch_up"]["fire_slots_utc"] == [*MISSED, "2026-01-10T11:05:00Z"]
    assert down["fire_once"]["fire_slots_utc"] == ["2026-01-10T11:00:00Z",
                                                   "2026-01-10T11:05:00Z"]
    assert down["fire_once"]["skipped_recorded"] == 11
    assert down["skip"]["skipped_recorded"] == 12
    interval = cases["interval-2h-across-dst"]["expected"]
    assert interval["A_fire_slots_utc"][0] == "2026-03-29T01:00:00Z"
    assert interval["B_fire_slots_utc"][-1] == "2026-10-25T06:00:00Z"
