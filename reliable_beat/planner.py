"""Pure planning: which slots of a due entry fire, which are skipped, and the next slot.

No I/O and no clock: the caller passes the database's ``now``. The rules (design.md §6):

* A slot is **on time** when it is late by at most ``misfire_grace`` and is still the
  latest due slot of its entry: it fires, under every policy. A slot whose successor is
  already due has been missed, however small the delay (so a 5 s entry resumed after a pause
  or a downtime is never a burst of "on time" runs).
* A slot late by more is **missed**; the misfire policy decides:
  ``catch_up`` fires every missed slot inside the catch-up window, oldest first, at most
  ``catch_up_limit`` of them (the most recent ones); ``fire_once`` fires only the latest
  missed slot (like APScheduler's ``coalesce``); ``skip`` fires none.
* Every slot not fired is returned as skipped, with its reason, so the caller records it and
  "did 10:15 run?" is answered from data.
* The next slot is computed from the last *slot* (grid anchoring, invariant 3), never from
  ``now`` or from when a run finished.
* **Claim ahead** (``claim_until``): an entry whose next slot is still in the future but at
  most ``claim_until`` gets exactly that one slot, on time (it cannot be late: it has not
  happened yet), and advances one step on the grid. Due entries are planned against the
  real ``now`` exactly as without it, so looking ahead never makes an upcoming slot "missed"
  nor makes the earlier of two slots lose the "latest due slot" rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from reliable_beat.policies import MisfirePolicy

__all__ = ["MAX_SLOTS_PER_PLAN", "Plan", "SlotDecision", "plan_entry"]

#: Most due slots one plan enumerates for one entry (e.g. a 1 s cron after a day of downtime);
#: slots older than that are neither fired nor individually recorded (the plan says how many).
MAX_SLOTS_PER_PLAN = 10_000


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


@dataclass
class Plan:
    """What one tick does for one entry.

    Attributes:
        decisions: every due slot in ascending order, fired or skipped.
        next_fire_at: the first slot after the last due one (None: the schedule has ended).
        unrecorded: missed slots older than :data:`MAX_SLOTS_PER_PLAN` that were dropped.
    """

    decisions: list[SlotDecision] = field(default_factory=list)
    next_fire_at: datetime | None = None
    unrecorded: int = 0

    @property
    def fired(self) -> list[SlotDecision]:
        return [d for d in self.decisions if d.fire]

    @property
    def skipped(self) -> list[SlotDecision]:
        return [d for d in self.decisions if not d.fire]


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
) -> Plan:
    """Decide the due slots of one entry.

    Args:
        next_fire_at: the entry's first unfired slot (UTC-aware). If it is after ``now``
            nothing is due and the plan is empty with ``next_fire_at`` unchanged.
        now: the database's clock (UTC-aware).
        next_after: the schedule's ``next_after`` (first slot strictly after an instant).
        misfire_policy: ``catch_up``, ``fire_once`` or ``skip``.
        misfire_grace: how late a slot may be and still count as on time.
        catch_up_limit: most missed slots ``catch_up`` fires in one plan (the newest ones).
        catch_up_window: ``catch_up`` only fires missed slots at most this old (None: no bound).
        end_at: no slot after this instant fires; the schedule ends there.
        claim_until: the look-ahead bound (UTC-aware, ``now + claim ahead``). When
            ``now < next_fire_at <= claim_until`` the plan fires that one slot with trigger
            ``schedule`` and ``next_fire_at`` becomes the following slot; the caller must
            not publish it before its instant. None (or a slot after it): nothing is due.

    Returns:
        A :class:`Plan`. Deterministic: the same inputs always give the same plan.

    Raises:
        ValueError: a naive datetime.
    """
    for value in (next_fire_at, now, claim_until):
        if value is not None and value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass UTC-aware datetimes")
    policy = MisfirePolicy(misfire_policy)
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
    due: list[datetime] = []
    slot: datetime | None = next_fire_at
    while slot is not None and slot <= now and (end_at is None or slot <= end_at):
        due.append(slot)
        if len(due) > MAX_SLOTS_PER_PLAN:
            due.pop(0)
            plan.unrecorded += 1
        slot = next_after(slot)
    if slot is not None and end_at is not None and slot > end_at:
        slot = None
    plan.next_fire_at = slot
    if not due:
        return plan

    # A slot is on time only while it is the latest due one and at most misfire_grace late:
    # once its successor is due too, it has been missed (whatever the grace), so a
    # frequent entry found late (after downtime or a pause) is never a burst of "on time"
    # runs; its policy decides.
    missed = [s for i, s in enumerate(due) if now - s > misfire_grace or i < len(due) - 1]
    fire_missed: set[datetime] = set()
    reasons: dict[datetime, str] = {}
    if policy is MisfirePolicy.CATCH_UP:
        # sets, not lists: a day of 1 s slots must plan in milliseconds, inside the claim
        # transaction (idle_in_transaction_session_timeout counts this time)
        eligible = [s for s in missed if catch_up_window is None or now - s <= catch_up_window]
        eligible_set = set(eligible)
        for s in missed:
            if s not in eligible_set:
                reasons[s] = "misfire:catch_up_window"
        keep = set(eligible[-catch_up_limit:]) if catch_up_limit > 0 else set()
        for s in eligible:
            if s in keep:
                fire_missed.add(s)
            else:
                reasons[s] = "misfire:catch_up_limit"
    elif policy is MisfirePolicy.FIRE_ONCE:
        if missed:
            fire_missed.add(missed[-1])
        for s in missed[:-1]:
            reasons[s] = "misfire:fire_once"
    else:
        for s in missed:
            reasons[s] = "misfire:skip"

    missed_set = set(missed)
    for s in due:
        if s not in missed_set:
            plan.decisions.append(SlotDecision(s, True, "schedule"))
        elif s in fire_missed:
            plan.decisions.append(SlotDecision(s, True, "catch_up"))
        else:
            plan.decisions.append(SlotDecision(s, False, reason=reasons[s]))
    return plan
