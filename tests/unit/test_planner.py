"""Handed restart / misfire cases (tests/cases/handed.json) through ``plan_entry``.

A simulated beat ticks every whole second of simulated time while it is up; the entry's
``next_fire_at`` persists across restarts (it lives in the store). Expected values are
transcribed below; when the shared cases file is present, the transcription is checked
against it too, so a drift between the two fails.

Every test runs twice: without claim-ahead, and with the beat claiming slots up to 1 s
before they are due (``claim_until = tick + 1 s``, published at the slot). The expected
slots, triggers, skips and publish instants are the same: looking ahead never turns an
upcoming slot into a missed one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from reliable_beat import schedules as sch
from reliable_beat.beat import slot_counter
from reliable_beat.entries import EntryDefinition
from reliable_beat.planner import SKIP_RECORD_LIMIT, Plan, plan_entry

UTC = timezone.utc
ONE = timedelta(seconds=1)
HANDED = Path(__file__).resolve().parents[1] / "cases" / "handed.json"
_CLAIM_AHEAD = [timedelta(0)]


@pytest.fixture(autouse=True, params=[0, 1], ids=["now", "claim_ahead_1s"])
def claim_ahead(request: pytest.FixtureRequest) -> Iterator[timedelta]:
    """The simulated beat's claim-ahead for this test."""
    _CLAIM_AHEAD[0] = timedelta(seconds=request.param)
    yield _CLAIM_AHEAD[0]
    _CLAIM_AHEAD[0] = timedelta(0)


def T(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


def Z(at: datetime) -> str:
    return f"{at:%Y-%m-%dT%H:%M:%SZ}"


def handed(case_id: str) -> dict:
    for case in json.loads(HANDED.read_text()):
        if case["id"] == case_id:
            return case
    raise AssertionError(f"case {case_id!r} missing from {HANDED}")


@dataclass
class Sim:
    """Result of a simulated beat: each fired slot with the instant it is published (the
    tick that decided it, or the slot itself when it was claimed ahead) and its trigger;
    each skipped slot with its reason."""

    fired: list[tuple[datetime, datetime, str]] = field(default_factory=list)
    skipped: list[tuple[datetime, str]] = field(default_factory=list)
    next_fire_at: datetime | None = None

    @property
    def fired_slots(self) -> list[str]:
        return [Z(s) for s, _, _ in self.fired]


def simulate(
    schedule: sch.Schedule,
    next_fire_at: datetime | None,
    up: list[tuple[datetime, datetime]],
    *,
    policy: str,
    grace: float = 60,
    catch_up_limit: int = 100,
    catch_up_window: timedelta | None = None,
    on_tick: Callable[[datetime, Plan], None] | None = None,
) -> Sim:
    """Tick every whole second inside each ``up`` interval ``[start, end)``.

    Seconds where nothing is due are jumped over (ticks that would find nothing due do
    nothing), so a fortnight of simulated time costs a few thousand plan calls. With the
    module's claim-ahead A, a tick also claims a slot at most A after it, published at the
    slot (a beat holding it publishes it at its instant, even while stopping).
    """
    ahead = _CLAIM_AHEAD[0]
    sim = Sim()
    for start, end in up:
        t = start
        while t < end and next_fire_at is not None:
            if next_fire_at - ahead > t:
                # jump to the first whole-second tick of this up period at or after it
                k = -(-(next_fire_at - ahead - start) // ONE)
                t = start + k * ONE
                continue
            plan = plan_entry(
                next_fire_at=next_fire_at, now=t, next_after=schedule.next_after,
                misfire_policy=policy, misfire_grace=timedelta(seconds=grace),
                catch_up_limit=catch_up_limit, catch_up_window=catch_up_window,
                # the stop at `end` ends the observation: nothing claimed for after it (a
                # beat stopped while holding slots is proven in tests/acceptance)
                claim_until=min(t + ahead, end - timedelta(microseconds=1)) if ahead else None,
                previous_at_or_before=schedule.previous_at_or_before,
            )
            for rng in plan.skipped_ranges:
                # a range stands for every slot in it: expand it to check the slot sets
                slots = [rng.first, *schedule.slots_between(
                    rng.first + timedelta(microseconds=1), rng.last + ONE)]
                sim.skipped.extend((s, rng.reason) for s in slots)
            if on_tick:
                on_tick(max(t, plan.decisions[0].fire_at) if plan.decisions else t, plan)
            for d in plan.decisions:
                if d.fire:
                    sim.fired.append((d.fire_at, max(t, d.fire_at), d.trigger))
                else:
                    sim.skipped.append((d.fire_at, d.reason or ""))
            assert plan.next_fire_at is None or plan.next_fire_at > t
            next_fire_at = plan.next_fire_at
            t += ONE
    sim.next_fire_at = next_fire_at
    return sim


def assert_once(sim: Sim) -> None:
    slots = [s for s, _, _ in sim.fired] + [s for s, _ in sim.skipped]
    assert len(slots) == len(set(slots)), "a slot was decided twice"


# -- interval-7d-frequent-restarts --------------------------------------------------------
def test_interval_7d_frequent_restarts() -> None:
    expected = ["2026-01-12T09:00:00Z", "2026-01-19T09:00:00Z"]
    case = handed("interval-7d-frequent-restarts")
    if case:
        assert case["expected"]["fire_slots_utc"] == expected
    anchor = T("2026-01-05T09:00:00Z")
    schedule = sch.IntervalSchedule(timedelta(days=7), anchor)
    d = EntryDefinition(name="weekly", task="t", schedule=schedule)
    created = anchor
    nfa = d.first_fire_at(created)
    # up from creation; daily 08:00 stop, start again 30 s later, 2026-01-06 .. 2026-01-20
    up: list[tuple[datetime, datetime]] = []
    start = created
    for day in range(6, 21):
        stop = datetime(2026, 1, day, 8, 0, 0, tzinfo=UTC)
        up.append((start, stop))
        start = stop + timedelta(seconds=30)
    up.append((start, T("2026-01-21T00:00:00Z")))
    for policy in ("catch_up", "fire_once", "skip"):
        sim = simulate(schedule, nfa, up, policy=policy)
        assert sim.fired_slots == expected, policy
        assert sim.skipped == []
        assert all(fired_at == slot for slot, fired_at, _ in sim.fired)
        assert_once(sim)


# -- restart-straddles-slot ---------------------------------------------------------------
STRADDLE_EXPECTED = ["2025-02-13T15:00:00Z", "2025-02-14T15:00:00Z"]


def _straddle_up() -> list[tuple[datetime, datetime]]:
    return [
        (T("2025-02-12T15:00:00Z"), T("2025-02-13T14:59:59Z")),
        (T("2025-02-13T15:00:16Z"), T("2025-02-15T00:00:00Z")),
    ]


@pytest.mark.parametrize("policy", ["catch_up", "fire_once", "skip"])
def test_restart_straddles_slot(policy: str) -> None:
    case = handed("restart-straddles-slot")
    if case:
        assert case["expected"]["fire_slots_utc"] == STRADDLE_EXPECTED
        assert policy in case["expected"]["same_for_policies"]
    schedule = sch.CronSchedule("0 16 * * *", "Europe/Berlin")
    # slot 2025-02-12T15:00Z fired normally: next_fire_at is the following slot
    nfa = schedule.next_after(T("2025-02-12T15:00:00Z"))
    sim = simulate(schedule, nfa, _straddle_up(), policy=policy, grace=60,
                   catch_up_window=timedelta(days=1))
    assert sim.fired_slots == STRADDLE_EXPECTED
    assert sim.fired[0][1] >= T("2025-02-13T15:00:16Z")  # first_published_not_before
    assert sim.fired[0][1] == T("2025-02-13T15:00:16Z")
    assert sim.fired[0][2] == "schedule"  # 16 s late is inside the grace: on time
    assert sim.skipped == []
    assert_once(sim)


def test_restart_straddles_slot_grace_0_skip_records_skipped() -> None:
    case = handed("restart-straddles-slot")
    if case:
        assert case["expected"]["only_if_misfire_grace_0_and_skip"].startswith(
            "2025-02-13T15:00:00Z is skipped"
        )
    schedule = sch.CronSchedule("0 16 * * *", "Europe/Berlin")
    nfa = schedule.next_after(T("2025-02-12T15:00:00Z"))
    sim = simulate(schedule, nfa, _straddle_up(), policy="skip", grace=0,
                   catch_up_window=timedelta(days=1))
    assert sim.fired_slots == ["2025-02-14T15:00:00Z"]
    assert [(Z(s), r) for s, r in sim.skipped] == [("2025-02-13T15:00:00Z", "misfire:skip")]
    assert_once(sim)


# -- new-entry-start-time-no-spurious-run -------------------------------------------------
def test_new_entry_start_time_no_spurious_run() -> None:
    expected = ["2026-02-10T15:00:00Z", "2026-02-11T15:00:00Z"]
    case = handed("new-entry-start-time-no-spurious-run")
    if case:
        assert case["expected"]["fire_slots_utc"] == expected
    schedule = sch.CronSchedule("0 15 * * *", "UTC")
    d = EntryDefinition(name="new", task="t", schedule=schedule,
                        start_at=T("2026-02-10T13:58:00Z"))
    created = T("2026-02-10T14:00:00Z")
    nfa = d.first_fire_at(created)
    assert nfa == T("2026-02-10T15:00:00Z")
    # reloads at 14:59:55 and 15:00:00 leave an unchanged entry's next_fire_at alone (the
    # config hash is unchanged; see test_beat_tick sync tests); each is a stop/start here.
    up = [
        (created, T("2026-02-10T14:59:55Z")),
        (T("2026-02-10T14:59:55Z"), T("2026-02-10T15:00:00Z")),
        (T("2026-02-10T15:00:00Z"), T("2026-02-12T00:00:00Z")),
    ]
    for policy in ("catch_up", "fire_once", "skip"):
        sim = simulate(schedule, nfa, up, policy=policy)
        assert sim.fired_slots == expected, policy
        assert not [s for s, _, _ in sim.fired
                    if T("2026-02-10T14:00:00Z") <= s < T("2026-02-10T15:00:00Z")]
        assert sim.skipped == []
        assert_once(sim)


# -- naive-local-last-run-after-restart ---------------------------------------------------
@pytest.mark.parametrize("process_tz", ["UTC", "Europe/London"])
def test_naive_local_last_run_after_restart(process_tz: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    expected = [f"2024-08-28T09:0{m}:00Z" for m in range(1, 6)]
    case = handed("naive-local-last-run-after-restart")
    if case:
        assert case["expected"]["fire_slots_utc"] == expected
    monkeypatch.setenv("TZ", process_tz)
    time.tzset()
    try:
        schedule = sch.CronSchedule("* * * * *", "Europe/London")
        nfa = schedule.next_after(T("2024-08-28T09:00:00Z"))  # 09:00Z fired and persisted
        up = [(T("2024-08-28T09:00:00Z"), T("2024-08-28T09:00:10Z")),
              (T("2024-08-28T09:00:30Z"), T("2024-08-28T09:05:30Z"))]
        for policy in ("catch_up", "fire_once", "skip"):
            sim = simulate(schedule, nfa, up, policy=policy)
            assert sim.fired_slots == expected
            assert "2024-08-28T09:00:00Z" not in sim.fired_slots
            assert sim.skipped == []
            assert_once(sim)
    finally:
        monkeypatch.undo()
        time.tzset()


# -- downtime-misfire-policies ------------------------------------------------------------
DOWNTIME = {
    "catch_up": ([f"2026-01-10T10:{m:02d}:00Z" for m in range(5, 60, 5)]
                 + ["2026-01-10T11:00:00Z", "2026-01-10T11:05:00Z"], 0),
    "fire_once": (["2026-01-10T11:00:00Z", "2026-01-10T11:05:00Z"], 11),
    "skip": (["2026-01-10T11:05:00Z"], 12),
}


@pytest.mark.parametrize("policy", sorted(DOWNTIME))
def test_downtime_misfire_policies(policy: str) -> None:
    fired, skipped = DOWNTIME[policy]
    case = handed("downtime-misfire-policies")
    if case:
        exp = case["expected"][policy]
        assert exp["fire_slots_utc"] == fired
        assert exp.get("skipped_recorded", 0) == skipped
    schedule = sch.CronSchedule("*/5 * * * *", "UTC")
    nfa = schedule.next_after(T("2026-01-10T10:00:00Z"))
    up = [(T("2026-01-10T10:00:00Z"), T("2026-01-10T10:02:00Z")),
          (T("2026-01-10T11:03:00Z"), T("2026-01-10T11:10:00Z"))]
    sim = simulate(schedule, nfa, up, policy=policy, grace=60,
                   catch_up_window=timedelta(days=1))
    assert sim.fired_slots == fired  # oldest first
    assert len(sim.skipped) == skipped
    missed = {f"2026-01-10T{h}:00Z" for h in
              [f"10:{m:02d}" for m in range(5, 60, 5)] + ["11:00"]}
    assert {Z(s) for s, _, _ in sim.fired} | {Z(s) for s, _ in sim.skipped} == (
        missed | {"2026-01-10T11:05:00Z"})
    assert all(r == f"misfire:{policy}" for _, r in sim.skipped)
    assert_once(sim)
    # the missed ones are labelled catch_up, 11:05 (on time) is schedule
    assert sim.fired[-1][2] == "schedule"
    assert all(trig == "catch_up" for _, _, trig in sim.fired[:-1])


# -- blocked-loop-catch-up-all ------------------------------------------------------------
BLOCKED = {
    "catch_up": [f"2026-01-10T12:{m:02d}:00Z" for m in range(1, 32)],
    "fire_once": ["2026-01-10T12:30:00Z", "2026-01-10T12:31:00Z"],
    "skip": ["2026-01-10T12:31:00Z"],
}


@pytest.mark.parametrize("policy", sorted(BLOCKED))
def test_blocked_loop(policy: str) -> None:
    expected = BLOCKED[policy]
    case = handed("blocked-loop-catch-up-all")
    if case:
        exp = case["expected"][policy]
        if policy == "catch_up":
            assert exp["count"] == len(expected)
            assert exp["fire_slots_utc_range"] == [expected[0], expected[-1]]
        else:
            assert exp["fire_slots_utc"] == expected
    schedule = sch.CronSchedule("* * * * *", "UTC")
    nfa = schedule.next_after(T("2026-01-10T12:00:00Z"))
    up = [(T("2026-01-10T12:00:00Z"), T("2026-01-10T12:00:30Z")),
          (T("2026-01-10T12:30:30Z"), T("2026-01-10T12:32:00Z"))]
    sim = simulate(schedule, nfa, up, policy=policy, grace=10,
                   catch_up_window=timedelta(days=1))
    assert sim.fired_slots == expected
    assert len(sim.fired) + len(sim.skipped) == 31
    assert_once(sim)


# -- leap-day-feb29 (A_after_restart) ------------------------------------------------------
LEAP = {"catch_up": ["2024-02-29T00:00:00Z"], "fire_once": ["2024-02-29T00:00:00Z"],
        "skip": []}


@pytest.mark.parametrize("policy", sorted(LEAP))
def test_leap_day_after_restart(policy: str) -> None:
    case = handed("leap-day-feb29")
    if case:
        assert case["expected"]["A_after_restart"][policy] == LEAP[policy]
    schedule = sch.CronSchedule("0 0 29 * *", "UTC")
    nfa = schedule.next_after(T("2024-01-29T00:00:00Z"))
    assert nfa == T("2024-02-29T00:00:00Z")
    restart = T("2024-03-15T00:00:00Z")
    plans: list[tuple[datetime, Plan]] = []
    sim = simulate(schedule, nfa, [(T("2024-01-29T00:00:00Z"), T("2024-02-20T00:00:00Z")),
                                   (restart, restart + timedelta(days=1))],
                   policy=policy, grace=60, catch_up_window=timedelta(days=30),
                   on_tick=lambda t, p: plans.append((t, p)))
    assert sim.fired_slots == LEAP[policy]
    assert [t for t, _ in plans] == [restart]
    if policy == "skip":
        assert [(Z(s), r) for s, r in sim.skipped] == [("2024-02-29T00:00:00Z", "misfire:skip")]
    else:
        assert sim.skipped == []
    assert sim.next_fire_at == T("2024-03-29T00:00:00Z")


# -- planner edge cases -------------------------------------------------------------------
def test_catch_up_limit_keeps_newest_and_is_bounded() -> None:
    schedule = sch.IntervalSchedule(timedelta(seconds=1), T("2026-01-01T00:00:00Z"))
    nfa = T("2026-01-01T00:00:01Z")
    now = nfa + timedelta(seconds=9_999)
    calls = 0

    def counted(step: Callable[[datetime], datetime | None]) -> Callable[[datetime],
                                                                          datetime | None]:
        def call(at: datetime) -> datetime | None:
            nonlocal calls
            calls += 1
            return step(at)
        return call

    plan = plan_entry(next_fire_at=nfa, now=now, next_after=counted(schedule.next_after),
                      previous_at_or_before=counted(schedule.previous_at_or_before),
                      count_slots=slot_counter(schedule),
                      misfire_policy="catch_up", misfire_grace=timedelta(0),
                      catch_up_limit=5000)
    # Steps bounded by the catch-up limit, not by the 10,000-slot window (counted, not
    # timed: a wall-time bound fails on a loaded machine).
    assert calls <= 5000 + SKIP_RECORD_LIMIT + 4, f"catch_up planning made {calls} steps"
    assert len(plan.fired) == 5001  # 5000 missed + the on-time one at `now`
    assert plan.fired[0].fire_at == now - timedelta(seconds=5000)
    skipped = len(plan.skipped) + sum(r.count or 0 for r in plan.skipped_ranges)
    assert skipped == 10_000 - 5001 == plan.skipped_count
    assert {d.reason for d in plan.skipped} | {r.reason for r in plan.skipped_ranges} == {
        "misfire:catch_up_limit"}
    assert plan.skipped_ranges[0].first == nfa


def test_naive_rejected() -> None:
    with pytest.raises(ValueError):
        plan_entry(next_fire_at=datetime(2026, 1, 1), now=datetime.now(UTC),
                   next_after=lambda s: s + ONE, misfire_policy="skip",
                   misfire_grace=ONE, catch_up_limit=1)


# -- claim ahead ----------------------------------------------------------------------------
EVERY_S = sch.IntervalSchedule(ONE, T("2026-01-01T00:00:00Z"))


def _plan(nfa: datetime, now: datetime, claim_until: datetime | None, *,
          policy: str = "skip", grace: float = 0.0, end_at: datetime | None = None) -> Plan:
    return plan_entry(next_fire_at=nfa, now=now, next_after=EVERY_S.next_after,
                      misfire_policy=policy, misfire_grace=timedelta(seconds=grace),
                      catch_up_limit=100, end_at=end_at, claim_until=claim_until)


@pytest.mark.parametrize("policy", ["catch_up", "fire_once", "skip"])
def test_claim_ahead_future_slot_is_one_on_time_slot(policy: str) -> None:
    slot = T("2026-01-01T00:00:10Z")
    now = slot - timedelta(milliseconds=400)
    plan = _plan(slot, now, now + ONE, policy=policy, grace=0.0)
    assert plan.decisions == [plan.decisions[0]] and plan.decisions[0].fire_at == slot
    assert (plan.decisions[0].fire, plan.decisions[0].trigger) == (True, "schedule")
    assert plan.next_fire_at == slot + ONE  # grid, one step: not now + anything
    # outside the look-ahead, or without it: nothing
    assert _plan(slot, now, now + timedelta(milliseconds=300)).decisions == []
    assert _plan(slot, now, None).decisions == []
    assert _plan(slot, now, None).next_fire_at == slot


def test_claim_ahead_never_claims_a_second_slot_even_with_a_long_look_ahead() -> None:
    slot = T("2026-01-01T00:00:10Z")
    now = slot - timedelta(milliseconds=400)
    plan = _plan(slot, now, now + timedelta(seconds=30))
    assert [d.fire_at for d in plan.decisions] == [slot]
    assert plan.next_fire_at == slot + ONE


@pytest.mark.parametrize("late_ms", [0, 300, 900])
@pytest.mark.parametrize("policy", ["catch_up", "fire_once", "skip"])
def test_claim_ahead_does_not_change_a_due_entry(policy: str, late_ms: int) -> None:
    """A due slot whose successor lies inside the look-ahead is still the latest *due* slot:
    on time within its grace, planned exactly as without the look-ahead (the successor is
    not claimed in the same plan)."""
    slot = T("2026-01-01T00:00:10Z")
    now = slot + timedelta(milliseconds=late_ms)
    with_ahead = _plan(slot, now, now + ONE, policy=policy, grace=1.0)
    assert with_ahead == _plan(slot, now, None, policy=policy, grace=1.0)
    assert [(d.fire_at, d.fire, d.trigger) for d in with_ahead.decisions] == [
        (slot, True, "schedule")]
    assert with_ahead.next_fire_at == slot + ONE


def test_claim_ahead_many_due_slots_planned_on_real_now() -> None:
    nfa = T("2026-01-01T00:00:01Z")
    now = T("2026-01-01T00:00:05.500Z")
    for policy in ("catch_up", "fire_once", "skip"):
        assert _plan(nfa, now, now + ONE, policy=policy, grace=2.0) == _plan(
            nfa, now, None, policy=policy, grace=2.0)


def test_claim_ahead_respects_end_at() -> None:
    slot = T("2026-01-01T00:00:10Z")
    now = slot - timedelta(milliseconds=400)
    last = _plan(slot, now, now + ONE, end_at=slot)
    assert [d.fire_at for d in last.decisions] == [slot] and last.next_fire_at is None
    ended = _plan(slot, now, now + ONE, end_at=slot - ONE)
    assert ended.decisions == [] and ended.next_fire_at is None


def test_claim_ahead_naive_rejected() -> None:
    with pytest.raises(ValueError):
        _plan(T("2026-01-01T00:00:10Z"), T("2026-01-01T00:00:09Z"), datetime(2026, 1, 1))
