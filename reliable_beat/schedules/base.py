"""The timing rule every schedule follows (:class:`Schedule`) and the zone check.

A :class:`Schedule` turns time into *slots*: whole-second UTC instants at which an
entry is due. Every method takes tz-aware datetimes in any offset (naive input
raises :class:`ValueError`, never guessed) and returns tz-aware UTC datetimes
(:data:`datetime.timezone.utc`) with ``microsecond == 0``.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from reliable_beat.errors import UnknownTimezoneError

__all__ = ["Schedule", "validate_timezone"]

UTC = timezone.utc


def validate_timezone(name: str) -> str:
    """Check that ``name`` is an IANA zone known to :mod:`zoneinfo`.

    Args:
        name: an IANA zone name such as ``"Europe/Berlin"`` or ``"UTC"``.

    Returns:
        ``name`` unchanged.

    Raises:
        UnknownTimezoneError: the zone is unknown; the message names it and the fix.
    """
    try:
        if not isinstance(name, str) or not name:
            raise ValueError("empty or not a string")
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
        raise UnknownTimezoneError(
            f"unknown time zone {name!r}: use an IANA zone name such as 'Europe/Berlin' "
            "or 'UTC' (install the 'tzdata' package if the system has no zone database)"
        ) from exc
    return name


class Schedule(abc.ABC):
    """The timing rule of an entry: which UTC instants (slots) it is due at.

    Attributes:
        kind: ``"cron"``, ``"interval"`` or ``"once"``.
        timezone: IANA zone name the entry is evaluated (cron) or shown (others) in.

    Every method accepts tz-aware datetimes in any offset and raises
    :class:`ValueError` on naive ones; results are UTC, whole seconds.
    Instances are immutable, hashable and compare equal when their specs do.
    """

    kind: ClassVar[str]
    timezone: str

    @abc.abstractmethod
    def next_after(self, after: datetime) -> datetime | None:
        """Return the first slot strictly after ``after``, or None if there is none ever.

        Raises:
            ValueError: ``after`` is naive.
        """

    @abc.abstractmethod
    def previous_at_or_before(self, at: datetime) -> datetime | None:
        """Return the latest slot at or before ``at``, or None if there is none.

        Raises:
            ValueError: ``at`` is naive.
        """

    @abc.abstractmethod
    def slots_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Yield the slots in the half-open window ``[start, end)``, ascending, unique.

        Raises:
            ValueError: ``start`` or ``end`` is naive.
        """

    @abc.abstractmethod
    def to_spec(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict (with ``"kind"`` and ``"timezone"``).

        :func:`schedule_from_spec` is its exact inverse.
        """

    @property
    @abc.abstractmethod
    def nominal_period(self) -> timedelta | None:
        """Rough spacing between slots, for warnings only (None for a one-off)."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return self.to_spec() == other.to_spec()

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, str(v)) for k, v in self.to_spec().items())))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.to_spec().items() if k != "kind")
        return f"{type(self).__name__}({args})"
