"""A schedule rebuilt from its stored spec (:meth:`Schedule.to_spec`'s inverse)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from reliable_beat.errors import InvalidScheduleError
from reliable_beat.schedules.base import Schedule
from reliable_beat.schedules.cron import CronSchedule
from reliable_beat.schedules.interval import IntervalSchedule, OneOffSchedule, _parse_instant

__all__ = ["schedule_from_spec"]


def schedule_from_spec(spec: Mapping[str, Any]) -> Schedule:
    """Rebuild a schedule from :meth:`Schedule.to_spec` output (its exact inverse).

    Args:
        spec: a mapping with ``"kind"`` in ``{"cron", "interval", "once"}``.

    Raises:
        InvalidScheduleError: unknown kind, missing or malformed fields.
        UnknownTimezoneError: unknown zone.
    """
    try:
        kind = spec["kind"]
        tz = spec.get("timezone", "UTC")
        if kind == "cron":
            return CronSchedule(
                spec["expr"],
                tz,
                day_or=spec.get("day_or", True),
                nonexistent=spec.get("nonexistent"),
                repeated=spec.get("repeated"),
            )
        if kind == "interval":
            seconds = spec["every_seconds"]
            if not isinstance(seconds, int) or isinstance(seconds, bool):
                raise InvalidScheduleError(
                    f"interval spec: every_seconds must be an int, got {seconds!r}"
                )
            return IntervalSchedule(
                timedelta(seconds=seconds), _parse_instant(spec["anchor"], "interval anchor"), tz
            )
        if kind == "once":
            return OneOffSchedule(_parse_instant(spec["at"], "one-off 'at'"), tz)
    except KeyError as exc:
        raise InvalidScheduleError(f"schedule spec {dict(spec)!r} lacks field {exc}") from exc
    raise InvalidScheduleError(
        f"schedule spec {dict(spec)!r}: kind must be 'cron', 'interval' or 'once'"
    )
