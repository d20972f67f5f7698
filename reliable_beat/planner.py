"""Pure planning: which slots of a due entry fire, which are skipped, and the next slot.

No I/O and no clock: the caller passes the database's ``now``. The rules (design.md §6):

* A slot is **on time** when it is late by at most ``misfire_grace`` and is still the
  latest due slot of its entry: it fires, under every policy. A slot whose successor is
  already due has been missed, however small the delay (so a 5 s entry resumed after a pause
  or a downtime is never a burst of "on time" runs).
* A slot late by more is **missed**; the misfire policy decides:
  ``catch_up`` fires every missed slot inside the catch-up window, oldest first, at most
  ``catch_up_limit`` of them (the most recent ones); ``fire_once`` fires **one** run per
  plan: the latest due slot (trigger ``schedule`` when it is on time, ``catch_up`` when it
  was missed too), like APScheduler's ``coalesce``; ``skip`` fires none.
* Every slot not fired is returned as skipped, with its reason, so the caller records it and
  "did 10:15 run?" is answered from data. Past :data:`SKIP_RECORD_LIMIT` skipped slots in one
  plan they are returned as one :class:`SkippedRange` ("slots A..B skipped, n slots") instead
  of one decision each.
* The next slot is computed from the last *slot* (grid anchoring, invariant 3), never from
  ``now`` or from when a run finished.
* **Claim ahead** (``claim_until``): an entry whose next slot is still in the future but at
  most ``claim_until`` gets exactly that one slot, on time (it cannot be late: it has not
  happened yet), and advances one step on the grid. Due entries are planned against the
  real ``now`` exactly as without it, so looking ahead never makes an upcoming slot "missed"
  nor makes the earlier of two slots lose the "latest due slot" rule.

**Bounded work.** Given ``previous_at_or_before``, a plan never walks the missed slots one by
one: it jumps to the latest due slot (one backward step), then walks backwards at most
``catch_up_limit`` + :data:`SKIP_RECORD_LIMIT` + 2 steps. A minutely cron one year behind
costs the same as one an hour behind (design: the claim transaction must stay short,
``idle_in_transaction_session_timeout`` counts this time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from reliable_beat.policies import MAX_CATCH_UP_LIMIT, MisfirePolicy

__all__ = ["MAX_CATCH_UP_PER_PLAN", "SKIP_RECORD_LIMIT", "Plan", "SkippedRange", "SlotDecision",
           "plan_entry"]

#: Most skipped slots one plan returns one by one; past it they become one
#: :class:`SkippedRange` (so a 1 s entry a week behind is one row, not 604,800).
SKIP_RECORD_LIMIT = 20

#: Most missed slots one ``catch_up`` plan fires: one plan is at most this many schedule steps
#: (about 0.5 s for a cron). A larger ``catch_up_limit`` is refused where it enters
#: (:data:`reliable_beat.policies.MAX_CATCH_UP_LIMIT`); the bound below is only a guard.
MAX_CATCH_UP_PER_PLAN = MAX_CATCH_UP_LIMIT

_EPS = timedelta(microseconds=1)


@dataclass(frozen=True)
class SlotDecision:
    """One slot and what happens to it.

    Attributes:
        fire_at: the slot, UTC-aware, whole seconds.
        fire: True to fire it, False to record it as skipped.
        trigger: ``schedule`` (on time) or ``catch_up`` (missed but fired) when fired.
        reason: why it was skipped (``misfire:skip``, ``misfire:fire_once``,
            ``misfire:catch_up_limit``, ``misfire:catch_up_window``), None when fired.
    """

    fire_at: datetime
    fire: bool
    trigger: str = "schedule"
    reason: str | None = None


@dataclass(frozen=True)
class SkippedRange:
    """A run of consecutive due slots skipped for one reason, recorded as one row.

    Attributes:
        first: the first skipped slot (UTC-aware).
        last: the last skipped slot (UTC-aware, ``>= first``).
        count: how many slots ``first..last`` holds (both included), or None when counting
            them would mean walking them (a cron schedule: its slots are not evenly spaced).
        reason: as :attr:`SlotDecision.reason`.
    """

    first: datetime
    last: datetime
    count: int | None
    reason: str

    def describe(self) -> str:
        """``"slots <first>..<last> skipped, <n> slots"`` (ISO 8601 UTC)."""
        n = f"{self.count} slots" if self.count is not None else "count not enumerated"
        return (f"slots {self.first:%Y-%m-%dT%H:%M:%SZ}..{self.last:%Y-%m-%dT%H:%M:%SZ} "
                f"skipped, {n}")


@dataclass
class Plan:
    """What one tick does for one entry.

    Attributes:
        decisions: due slots in ascending order, fired or skipped, one by one.
        skipped_ranges: older due slots skipped in bulk (each before every decision),
            ascending; empty unless more than :data:`SKIP_RECORD_LIMIT` slots were skipped.
        next_fire_at: the first slot after the last due one (None: the schedule has ended).
    """

    decisions: list[SlotDecision] = field(default_factory=list)
    skipped_ranges: list[SkippedRange] = field(default_factory=list)
    next_fire_at: datetime | None = None

    @property
    def fired(self) -> list[SlotDecision]:
        return [d for d in self.decisions if d.fire]

    @property
    def skipped(self) -> list[SlotDecision]:
        return [d for d in self.decisions if not d.fire]

    @property
    def last_slot(self) -> datetime | None:
        """The latest slot this plan decided (fired or skipped), or None."""
        if self.decisions:
            return self.decisions[-1].fire_at
        if self.skipped_ranges:
            return self.skipped_ranges[-1].last
        return None

    @property
    def skipped_count(self) -> int | None:
        """Slots skipped in total (None: a range was not counted)."""
        total = len(self.skipped)
        for r in self.skipped_ranges:
            if r.count is None:
                return None
            total += r.count
        return total


def plan_entry(
    *,
    next_fire_at: datetime,
    now: datetime,
    next_after: Callable[[datetime], datetime | None],
    misfire_policy: MisfirePolicy | str,
    misfire_grace: timedelta,
    catch_up_limit: int,
    catch_up_window: timedelta | None = None,
    end_at: datetime | None = None,
    claim_until: datetime | None = None,
    previous_at_or_before: Callable[[datetime], datetime | None] | None = None,
    count_slots: Callable[[datetime, datetime], int | None] | None = None,
) -> Plan:
    """Decide the due slots of one entry.

    Args:
        next_fire_at: the entry's first unfired slot (UTC-aware). If it is after ``now``
            nothing is due and the plan is empty with ``next_fire_at`` unchanged.
        now: the database's clock (UTC-aware).
        next_after: the schedule's ``next_after`` (first slot strictly after an instant).
        misfire_policy: ``catch_up``, ``fire_once`` or ``skip``.
        misfire_grace: how late a slot may be and still count as on time.
        catch_up_limit: most missed slots ``catch_up`` fires in one plan (the newest ones);
            at most :data:`MAX_CATCH_UP_PER_PLAN`.
        catch_up_window: ``catch_up`` only fires missed slots at most this old (None: no bound).
        end_at: no slot after this instant fires; the schedule ends there.
        claim_until: the look-ahead bound (UTC-aware, ``now + claim ahead``). When
            ``now < next_fire_at <= claim_until`` the plan fires that one slot with trigger
            ``schedule`` and ``next_fire_at`` becomes the following slot; the caller must
            not publish it before its instant. None (or a slot after it): nothing is due.
        previous_at_or_before: the schedule's ``previous_at_or_before`` (latest slot at or
            before an instant). Given, the plan costs at most ``catch_up_limit`` +
            :data:`SKIP_RECORD_LIMIT` + 3 schedule steps whatever the downtime. None: the
            due slots are walked forward one by one (test schedules only: unbounded).
        count_slots: ``(first, last) -> n``, the number of due slots from ``first`` (the
            entry's ``next_fire_at``, a slot or not) to ``last`` (a slot), both included; or
            None when it cannot be had without walking. Only used for the ``count`` of a
            :class:`SkippedRange`.

    Returns:
        A :class:`Plan`. Deterministic: the same inputs always give the same plan.

    Raises:
        ValueError: a naive datetime.
    """
    for value in (next_fire_at, now, claim_until):
        if value is not None and value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass UTC-aware datetimes")
    policy = MisfirePolicy(misfire_policy)
    catch_up_limit = min(catch_up_limit, MAX_CATCH_UP_PER_PLAN)
    plan = Plan(next_fire_at=next_fire_at)
    if next_fire_at > now:
        if end_at is not None and next_fire_at > end_at:
            plan.next_fire_at = None  # the schedule has ended
        elif claim_until is not None and next_fire_at <= claim_until:
            # A future slot, claimed ahead: on time by definition, one slot only.
            plan.decisions.append(SlotDecision(next_fire_at, True, "schedule"))
            following = next_after(next_fire_at)
            if following is not None and end_at is not None and following > end_at:
                following = None
            plan.next_fire_at = following
        return plan
    if end_at is not None and next_fire_at > end_at:
        plan.next_fire_at = None
        return plan
    horizon = now if end_at is None else min(now, end_at)
    fire_budget = 1 + (max(catch_up_limit, 0) if policy is MisfirePolicy.CATCH_UP else 0)
    walk = fire_budget + SKIP_RECORD_LIMIT + 1

    # The due slots: next_fire_at itself (a slot, or an instant a person or a retry set),
    # then every slot after it up to the horizon. `tail` holds the newest `walk` of them.
    tail, complete, last = _due_tail(next_fire_at, horizon, walk, next_after,
                                     previous_at_or_before)
    following = next_after(last)
    if following is not None and end_at is not None and following > end_at:
        following = None
    plan.next_fire_at = following

    on_time = now - last <= misfire_grace
    # Which slots of the tail fire (always the newest ones), per policy.
    fired: dict[datetime, str] = {}
    if on_time:
        fired[last] = "schedule"
    missed_tail = tail[:-1] if on_time else tail
    if policy is MisfirePolicy.CATCH_UP:
        eligible = [s for s in missed_tail
                    if catch_up_window is None or now - s <= catch_up_window]
        for s in eligible[-catch_up_limit:] if catch_up_limit > 0 else []:
            fired[s] = "catch_up"
    elif policy is MisfirePolicy.FIRE_ONCE and not on_time and missed_tail:
        # One run per plan: the latest due slot. When it is on time it is that run, and
        # the missed ones before it are skipped (a paused 10 s entry resumed 27 s later
        # fires once, not "the last missed slot and the current one").
        fired[missed_tail[-1]] = "catch_up"

    def reason_of(s: datetime) -> str:
        if policy is MisfirePolicy.CATCH_UP:
            if catch_up_window is not None and now - s > catch_up_window:
                return "misfire:catch_up_window"
            return "misfire:catch_up_limit"
        return f"misfire:{policy.value}"

    if complete:
        for s in tail:
            if s in fired:
                plan.decisions.append(SlotDecision(s, True, fired[s]))
            else:
                plan.decisions.append(SlotDecision(s, False, reason=reason_of(s)))
        return plan

    # More due slots than the walk: every slot older than the oldest fired one is skipped
    # (fired slots are always the newest), recorded as ranges, not one by one.
    first_fired = min(fired) if fired else None
    keep = [s for s in tail if first_fired is not None and s >= first_fired]
    older = [s for s in tail if first_fired is None or s < first_fired]
    # `older` is not empty: the walk is longer than the fire budget.
    skipped_last = older[-1]
    boundary: datetime | None = None  # the last slot outside the catch-up window
    if policy is MisfirePolicy.CATCH_UP and catch_up_window is not None:
        cutoff = now - catch_up_window
        if skipped_last < cutoff:
            boundary = skipped_last
        elif next_fire_at < cutoff:
            outside = [s for s in older if s < cutoff]
            boundary = (outside[-1] if outside
                        else _latest_before(cutoff, next_fire_at, previous_at_or_before))
    if boundary is not None:
        plan.skipped_ranges.append(SkippedRange(
            next_fire_at, boundary, _count(count_slots, next_fire_at, boundary),
            "misfire:catch_up_window"))
        if boundary < skipped_last:
            start = next_after(boundary)
            if start is None or start > skipped_last:  # pragma: no cover - a grid's own steps
                start = skipped_last
            plan.skipped_ranges.append(SkippedRange(
                start, skipped_last, _count_from(count_slots, next_fire_at, boundary,
                                                 skipped_last),
                "misfire:catch_up_limit"))
    else:
        plan.skipped_ranges.append(SkippedRange(
            next_fire_at, skipped_last, _count(count_slots, next_fire_at, skipped_last),
            reason_of(skipped_last)))
    for s in keep:
        if s in fired:
            plan.decisions.append(SlotDecision(s, True, fired[s]))
        else:
            plan.decisions.append(SlotDecision(s, False, reason=reason_of(s)))
    return plan


def _due_tail(
    first: datetime,
    horizon: datetime,
    walk: int,
    next_after: Callable[[datetime], datetime | None],
    previous_at_or_before: Callable[[datetime], datetime | None] | None,
) -> tuple[list[datetime], bool, datetime]:
    """The newest ``walk`` due slots (ascending), whether they are all of them, and the
    latest due slot. Due: ``first`` and every slot in ``(first, horizon]``."""
    if previous_at_or_before is None:
        tail: list[datetime] = []
        slot: datetime | None = first
        dropped = False
        while slot is not None and slot <= horizon:
            tail.append(slot)
            if len(tail) > walk:
                tail.pop(0)
                dropped = True
            slot = next_after(slot)
        return tail, not dropped, tail[-1]
    last = previous_at_or_before(horizon)
    if last is None or last <= first:
        return [first], True, first
    newest_first = [last]
    cur = last
    while len(newest_first) < walk:
        prev = previous_at_or_before(cur - _EPS)
        if prev is None or prev <= first:
            newest_first.append(first)
            return newest_first[::-1], True, last
        newest_first.append(prev)
        cur = prev
    return newest_first[::-1], False, last


def _latest_before(cutoff: datetime, first: datetime,
                   previous_at_or_before: Callable[[datetime], datetime | None] | None
                   ) -> datetime:
    """The latest due slot strictly before ``cutoff`` (``first`` is due and before it)."""
    if previous_at_or_before is None:  # pragma: no cover - only with the forward walk
        return first
    found = previous_at_or_before(cutoff - _EPS)
    return found if found is not None and found > first else first


def _count(count_slots: Callable[[datetime, datetime], int | None] | None,
           first: datetime, last: datetime) -> int | None:
    return count_slots(first, last) if count_slots is not None else None


def _count_from(count_slots: Callable[[datetime, datetime], int | None] | None,
                first: datetime, boundary: datetime, last: datetime) -> int | None:
    """Slots in ``(boundary, last]`` from two counts that start at ``first``."""
    whole = _count(count_slots, first, last)
    head = _count(count_slots, first, boundary)
    return None if whole is None or head is None else whole - head
