"""Interval and one-off schedules: elapsed time, which DST never moves.

Interval entries are elapsed time: ``anchor + k * every`` in UTC for every integer
``k``; the zone only changes how slots are shown. A one-off entry has a single slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any, ClassVar

from reliable_beat.errors import InvalidScheduleError
from reliable_beat.schedules.base import UTC, Schedule, validate_timezone
from reliable_beat.slots import format_fire_at, truncate

__all__ = ["IntervalSchedule", "OneOffSchedule"]


def _whole_seconds(every: timedelta, what: str) -> int:
    if not isinstance(every, timedelta):
        raise InvalidScheduleError(f"{what}: interval must be a timedelta, got {every!r}")
    if every.microseconds or every < timedelta(seconds=1):
        raise InvalidScheduleError(
            f"{what}: interval {every!r} must be a whole number of seconds, at least 1 s"
        )
    return every.days * 86400 + every.seconds


def _micros(delta: timedelta) -> int:
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


def _parse_instant(text: str, what: str) -> datetime:
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
        return truncate(value)
    except (ValueError, AttributeError, TypeError) as exc:
        raise InvalidScheduleError(
            f"{what}: {text!r} is not a tz-aware ISO 8601 instant such as '2026-01-10T10:05:00Z'"
        ) from exc


class IntervalSchedule(Schedule):
    """Every ``every`` of elapsed time on a grid anchored at ``anchor``.

    Slots are ``anchor + k * every`` (UTC) for every integer ``k``, computed with
    integer arithmetic (no float drift); DST never moves them. The zone only changes
    how slots are shown.

    Args:
        every: whole number of seconds, at least 1 s.
        anchor: tz-aware instant on the grid (truncated to whole seconds); persist it
            with the entry and never reset it on restart.
        timezone: IANA zone for display.

    Raises:
        InvalidScheduleError: ``every`` is not a whole number of seconds ≥ 1 s.
        UnknownTimezoneError: unknown zone.
        ValueError: ``anchor`` is naive.
    """

    kind: ClassVar[str] = "interval"

    def __init__(self, every: timedelta, anchor: datetime, timezone: str = "UTC") -> None:
        self.every_seconds = _whole_seconds(every, "interval schedule")
        self.every = timedelta(seconds=self.every_seconds)
        self.anchor = truncate(anchor)
        self.timezone = validate_timezone(timezone)

    def _k_floor(self, at: datetime) -> int:
        """Largest k with ``anchor + k * every <= at``."""
        return _micros(at.astimezone(UTC) - self.anchor) // (self.every_seconds * 1_000_000)

    def _slot(self, k: int) -> datetime:
        return self.anchor + timedelta(seconds=k * self.every_seconds)

    def next_after(self, after: datetime) -> datetime:
        """Return the smallest grid point strictly after ``after`` (UTC).

        Raises:
            ValueError: ``after`` is naive.
        """
        truncate(after)
        return self._slot(self._k_floor(after) + 1)

    def previous_at_or_before(self, at: datetime) -> datetime:
        """Return the largest grid point at or before ``at`` (UTC).

        Raises:
            ValueError: ``at`` is naive.
        """
        truncate(at)
        return self._slot(self._k_floor(at))

    def slots_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Yield the grid points in ``[start, end)`` (UTC, ascending).

        Raises:
            ValueError: ``start`` or ``end`` is naive.
        """
        truncate(start)
        truncate(end)
        k = self._k_floor(start)
        if self._slot(k) < start:
            k += 1
        while (slot := self._slot(k)) < end:
            yield slot
            k += 1

    def to_spec(self) -> dict[str, Any]:
        """Return ``{"kind": "interval", "every_seconds": int, "anchor": "ISO Z", "timezone"}``."""
        return {
            "kind": "interval",
            "every_seconds": self.every_seconds,
            "anchor": format_fire_at(self.anchor),
            "timezone": self.timezone,
        }

    @property
    def nominal_period(self) -> timedelta:
        """``every``."""
        return self.every


class OneOffSchedule(Schedule):
    """A single slot at ``at`` (truncated to whole seconds).

    Args:
        at: tz-aware instant, any offset.
        timezone: IANA zone for display.

    Raises:
        ValueError: ``at`` is naive.
        UnknownTimezoneError: unknown zone.
    """

    kind: ClassVar[str] = "once"

    def __init__(self, at: datetime, timezone: str = "UTC") -> None:
        self.at = truncate(at)
        self.timezone = validate_timezone(timezone)

    def next_after(self, after: datetime) -> datetime | None:
        """Return ``at`` if it is strictly after ``after``, else None."""
        return self.at if self.at > truncate(after) else None

    def previous_at_or_before(self, at: datetime) -> datetime | None:
        """Return ``self.at`` if it is at or before ``at``, else None."""
        return self.at if self.at <= truncate(at) else None

    def slots_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Yield ``at`` if ``start <= at < end``."""
        truncate(start)
        truncate(end)
        if start <= self.at < end:
            yield self.at

    def to_spec(self) -> dict[str, Any]:
        """Return ``{"kind": "once", "at": "ISO Z", "timezone"}``."""
        return {"kind": "once", "at": format_fire_at(self.at), "timezone": self.timezone}

    @property
    def nominal_period(self) -> None:
        """None: a one-off has no period."""
        return None
