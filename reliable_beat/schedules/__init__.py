"""Schedules: cron, interval and one-off timing rules, and their slots.

A :class:`Schedule` turns time into *slots*: whole-second UTC instants at which an
entry is due. Every method takes tz-aware datetimes in any offset (naive input
raises :class:`ValueError`, never guessed) and returns tz-aware UTC datetimes
(:data:`datetime.timezone.utc`) with ``microsecond == 0``.

Cron entries are evaluated on the *wall clock* of the entry's IANA zone, then each
wall time is mapped to UTC instants with :mod:`zoneinfo` by one rule
(``cron._wall_to_instants``; see ``docs/dst.md``), the Vixie/ISC cron policy with
RFC 5545 §3.3.5 / PEP 495 for the exact instant:

* **fixed-time** entries (neither the minute nor the hour field starts with ``*``):
  a wall time inside a spring-forward gap fires once, read with the offset in force
  before the gap (``nonexistent="shift"``: Europe/Berlin 2026-03-29 02:30 → 01:30Z);
  a repeated wall time fires once, at its first occurrence (``repeated="first"``).
* **wildcard** entries: nothing inside a gap (``"skip"``), both passes of a repeated
  hour (``"both"``).
* two wall times mapping to the same instant are one slot.

Cron strings use croniter's syntax: a 6-field string has its **seconds field
LAST** (``"* * * * * */15"`` = every 15 s). Other tools put seconds first; a
6-field string whose last field is ``*`` is rejected as that mistake (except
``"* * * * * *"``), and so are the other seconds-first forms that can be told apart
(a last field reading as days of the week, the shape ``0 m h * mon d``) and Quartz's
``?``; each error gives the rewrite (docs/dst.md lists what cannot be told apart).
When both day fields are restricted (neither is exactly ``*``), cron strings OR them
(POSIX), computed as the union of two croniter walks because croniter alone ANDs some
combinations (``L``, ``W``, ``#``).

Interval entries are elapsed time: ``anchor + k * every`` in UTC for every integer
``k``; the zone only changes how slots are shown.

The package: :mod:`~reliable_beat.schedules.base` (:class:`Schedule`, the zone check),
:mod:`~reliable_beat.schedules.cron`, :mod:`~reliable_beat.schedules.interval` (and one-off),
:mod:`~reliable_beat.schedules.spec` (a schedule rebuilt from its stored spec) and
:mod:`~reliable_beat.schedules.convert` (Celery ``beat_schedule`` values). Every name is
imported from here.
"""

from __future__ import annotations

# croniter stays reachable as ``reliable_beat.schedules.croniter`` (tests count its steps)
from croniter import croniter as croniter

from reliable_beat.schedules.base import UTC as UTC
from reliable_beat.schedules.base import Schedule, validate_timezone
from reliable_beat.schedules.convert import describe_crontab, from_celery
from reliable_beat.schedules.cron import (
    MAX_CRON_LENGTH,
    NONEXISTENT_RULES,
    REPEATED_RULES,
    CronSchedule,
)
from reliable_beat.schedules.interval import IntervalSchedule, OneOffSchedule
from reliable_beat.schedules.spec import schedule_from_spec

__all__ = [
    "MAX_CRON_LENGTH",
    "NONEXISTENT_RULES",
    "REPEATED_RULES",
    "CronSchedule",
    "IntervalSchedule",
    "OneOffSchedule",
    "Schedule",
    "describe_crontab",
    "from_celery",
    "schedule_from_spec",
    "validate_timezone",
]
