"""Misfire, overlap and retry policies, and the full-jitter backoff formula.

Misfire and overlap semantics follow design.md §6; the retry backoff is "full jitter" from
Marc Brooker, *Exponential Backoff And Jitter* (AWS Architecture Blog, 2015):
https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass
from datetime import datetime, timedelta

__all__ = ["BACKOFF_CAP", "MAX_CATCH_UP_LIMIT", "MISSED_MARGIN_SECONDS", "MisfirePolicy",
           "OverlapPolicy", "RetryPolicy", "backoff_delay", "backoff_wait",
           "catch_up_limit_problem", "is_missed"]

#: Slack (seconds) on top of an entry's ``misfire_grace`` before a due entry counts as
#: missed: a beat sleeps at most ``beat_max_loop_interval`` (default 300 s on stock Celery,
#: usually far less with NOTIFY) and a tick takes a moment.
MISSED_MARGIN_SECONDS = 60.0


def is_missed(next_fire_at: object, misfire_grace_seconds: object, now: datetime,
              margin_seconds: float = MISSED_MARGIN_SECONDS) -> bool:
    """The MISSED check of one enabled, unpaused entry: its next slot is overdue (on the
    store's clock ``now``) by more than its ``misfire_grace`` + ``margin_seconds``, so no
    beat is claiming entries. ``reliable-beat status`` (MISSED SLOTS), the
    ``reliable_beat_entries_late`` metric and the Django admin all ask this one function.

    A ``next_fire_at`` that is not an instant (a malformed row) is not missed; a grace that
    is not a number >= 0 counts as 0.
    """
    if not isinstance(next_fire_at, datetime):
        return False
    try:
        grace = float(misfire_grace_seconds)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        grace = 0.0
    if isinstance(misfire_grace_seconds, bool) or math.isnan(grace) or grace < 0:
        grace = 0.0
    try:
        return now - next_fire_at > timedelta(seconds=grace + margin_seconds)
    except (TypeError, OverflowError):  # a naive value, or one out of range
        return False

#: The largest ``catch_up_limit`` accepted: one catch-up plan walks at most this many
#: schedule steps (about 0.5 s for a cron), inside the claim transaction. A larger value is
#: refused where it enters (settings, ``beat_schedule``, CLI, admin, a stored row), never
#: quietly lowered: lowering it would skip slots the entry says it wants fired.
MAX_CATCH_UP_LIMIT = 10_000


def catch_up_limit_problem(value: object) -> str | None:
    """Why ``value`` is not a valid ``catch_up_limit`` (text naming the fix), or ``None``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return f"catch_up_limit={value!r}: expected an integer >= 0"
    if value > MAX_CATCH_UP_LIMIT:
        return (f"catch_up_limit={value!r}: at most {MAX_CATCH_UP_LIMIT} (one catch-up walks "
                "that many slots inside the claim transaction); set catch_up_limit to "
                f"{MAX_CATCH_UP_LIMIT} or less, or bound the catch-up by time with "
                "catch_up_window")
    return None


class MisfirePolicy(str, enum.Enum):
    """What missed slots get (e.g. after downtime).

    A slot is on time (it fires, under every policy) when it is late by at most
    ``misfire_grace`` **and** is still its entry's latest due slot; every other due slot is
    missed, however small its delay (a slot whose successor is already due). Example: a 5 s
    entry after a 45 s outage under ``FIRE_ONCE`` fires once (the latest slot, on time) and
    records the 8 before it as skipped; ``CATCH_UP`` fires all 9.

    * ``CATCH_UP``: every missed slot fires, oldest first, at most ``catch_up_limit`` of them
      (and only those inside the catch-up window); older ones are recorded as skipped.
    * ``FIRE_ONCE`` (default, what stock beat users expect): one run for everything due at
      once, the latest due slot (the on-time one when it is on time, else the latest missed
      slot); the others are recorded as skipped.
    * ``SKIP``: none fire; every missed slot is recorded as skipped.
    """

    CATCH_UP = "catch_up"
    FIRE_ONCE = "fire_once"
    SKIP = "skip"


class OverlapPolicy(str, enum.Enum):
    """What a slot gets while the entry's previous run is still unfinished.

    * ``ALLOW`` (default): fire anyway.
    * ``SKIP``: record the slot as skipped.
    * ``BUFFER_ONE``: keep the slot waiting (state ``buffered``, not sent) until the running
      one finishes; at most one slot is buffered, later ones are skipped.

    ``SKIP`` and ``BUFFER_ONE`` decide from run state, which only ``IdempotentTask`` keeps.
    """

    ALLOW = "allow"
    SKIP = "skip"
    BUFFER_ONE = "buffer_one"


def backoff_delay(
    attempt: int,
    *,
    base: float = 1.0,
    cap: float = 600.0,
    rng: random.Random | None = None,
) -> float:
    """Full-jitter exponential backoff: ``uniform(0, min(cap, base * 2**attempt))``.

    Args:
        attempt: 0 for the first retry, 1 for the second, ... (any size: the power is capped
            before it can overflow a float, so ``attempt=2000`` is fine).
        base: seconds, > 0.
        cap: seconds, the largest possible delay.
        rng: a ``random.Random`` for reproducible draws; the module RNG by default.

    Returns:
        The delay in seconds (``float``), in ``[0, min(cap, base * 2**attempt)]``.

    Raises:
        ValueError: ``attempt`` < 0, ``base`` <= 0 or ``cap`` < 0.
    """
    if attempt < 0 or base <= 0 or cap < 0:
        raise ValueError(f"backoff_delay(attempt={attempt}, base={base}, cap={cap}): bad arguments")
    # 2**attempt overflows a float at 1024; once base*2**attempt passes cap, cap binds anyway.
    ceiling = cap if attempt >= 1023 else min(cap, base * 2.0**attempt)
    return (rng or random).uniform(0.0, ceiling)


#: The re-send backoff's cap: a run or message already re-sent k times waits
#: ``after * 2**min(k, cap)`` (cap 4: 16 periods; 32 min at the 120 s default) before the
#: next re-send.
BACKOFF_CAP = 4


def backoff_wait(after: timedelta, resends: int) -> timedelta:
    """How long a message re-sent ``resends`` times before waits before its next re-send:
    ``after * 2**min(resends, BACKOFF_CAP)``. The one backoff rule of both sweeps (the run
    sweep, :func:`~reliable_beat.redispatch.redispatch_stuck_runs`, and the workflow sweep,
    :func:`~reliable_beat.workflows.engine.redispatch_workflows`)."""
    factor: int = 2 ** min(max(resends, 0), BACKOFF_CAP)
    return after * factor


@dataclass(frozen=True)
class RetryPolicy:
    """How a failing run is retried.

    Attributes:
        max_attempts: tries in all, the first included (``max_retries + 1``); then dead letter.
        base_seconds: backoff base (see :func:`backoff_delay`).
        cap_seconds: the largest delay between two attempts.
    """

    max_attempts: int = 6
    base_seconds: float = 1.0
    cap_seconds: float = 600.0

    def delay(self, retry_number: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry ``retry_number`` (0 for the first retry)."""
        return backoff_delay(retry_number, base=self.base_seconds, cap=self.cap_seconds, rng=rng)
