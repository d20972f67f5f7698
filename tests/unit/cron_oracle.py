"""An independent brute-force cron oracle (no croniter, no reliable_beat code).

It reads croniter's syntax (5 fields, or 6 with the seconds field LAST) with its own
parser, decides whether a naive wall time matches by testing every field on its own
(ranges, steps, lists, names, day-of-month ``L`` and ``nW``, day-of-week ``L<d>`` and
``<d>#<n>``; POSIX OR of day-of-month and day-of-week when both are restricted, i.e.
neither is exactly ``*``: ``1-31`` and ``sun-sat`` restrict), walks the window day by
day, hour by hour, minute by minute (and second by second for 6 fields), and maps each
matching wall time to UTC instants with the default DST rule of design.md §7, written
here from the rule, not copied from the engine:

* fixed-time (neither minute nor hour field starts with ``*``): a wall time in a gap fires
  once, read with the offset before the gap (PEP 495 ``fold=0``); a repeated wall time
  fires once, at its first occurrence.
* wildcard: nothing in a gap, both occurrences of a repeated wall time.
* two wall times giving the same instant are one slot.
"""

from __future__ import annotations

import calendar
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

UTC = timezone.utc

MONTHS = {m.lower(): i for i, m in enumerate(calendar.month_abbr) if m}
DAYS = {"sun": 0, "mon": 1, "tue": 2, "wed": 3, "thu": 4, "fri": 5, "sat": 6}
ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


def _number(text: str, names: dict[str, int]) -> int:
    return names[text.lower()] if text.lower() in names else int(text)


def _plain(part: str, lo: int, hi: int, names: dict[str, int]) -> set[int]:
    """``*``, ``*/n``, ``a``, ``a-b``, ``a-b/n``, ``a/n`` (a up to the field's end)."""
    step = 1
    if "/" in part:
        part, step_text = part.split("/")
        step = int(step_text)
    if part == "*":
        first, last = lo, hi
    elif "-" in part:
        a, b = part.split("-")
        first, last = _number(a, names), _number(b, names)
    else:
        first = _number(part, names)
        last = hi if step != 1 else first
    if not (lo <= first <= hi and lo <= last <= hi and first <= last and step >= 1):
        raise ValueError(f"bad field part {part!r}")
    return set(range(first, last + 1, step))


@dataclass(frozen=True)
class Cron:
    """A parsed cron expression; :meth:`matches` tests a naive wall time."""

    text: str
    seconds: frozenset[int]
    minutes: frozenset[int]
    hours: frozenset[int]
    months: frozenset[int]
    dom_parts: tuple[str, ...]
    dow_parts: tuple[str, ...]
    dom_restricted: bool
    dow_restricted: bool
    day_or: bool
    fixed_time: bool

    @classmethod
    def parse(cls, expr: str, *, day_or: bool = True) -> Cron:
        fields = ALIASES.get(expr.strip().lower(), expr).split()
        if len(fields) not in (5, 6):
            raise ValueError(expr)
        second = fields[5] if len(fields) == 6 else "0"

        def full(
            text: str, lo: int, hi: int, names: dict[str, int] | None = None
        ) -> frozenset[int]:
            out: set[int] = set()
            for part in text.split(","):
                out |= _plain(part, lo, hi, names or {})
            return frozenset(out)

        return cls(
            text=expr,
            seconds=full(second, 0, 59),
            minutes=full(fields[0], 0, 59),
            hours=full(fields[1], 0, 23),
            months=full(fields[3], 1, 12, MONTHS),
            dom_parts=tuple(fields[2].lower().split(",")),
            dow_parts=tuple(fields[4].lower().split(",")),
            dom_restricted=fields[2] != "*",
            dow_restricted=fields[4] != "*",
            day_or=day_or,
            fixed_time=not fields[0].startswith("*") and not fields[1].startswith("*"),
        )

    # -- days -----------------------------------------------------------------------

    def _dom_matches(self, d: date) -> bool:
        last = calendar.monthrange(d.year, d.month)[1]
        for part in self.dom_parts:
            if part == "l":
                if d.day == last:
                    return True
            elif part.endswith("w"):
                if d == _nearest_weekday(d.year, d.month, int(part[:-1])):
                    return True
            elif d.day in _plain(part, 1, 31, {}):
                return True
        return False

    def _dow_matches(self, d: date) -> bool:
        weekday = d.isoweekday() % 7  # 0 = Sunday
        last = calendar.monthrange(d.year, d.month)[1]
        for part in self.dow_parts:
            if part.startswith("l"):  # L<d>: the last <d> of the month
                if weekday == _number(part[1:], DAYS) % 7 and d.day + 7 > last:
                    return True
            elif "#" in part:  # <d>#<n>: the n-th <d> of the month
                day_text, nth = part.split("#")
                if weekday == _number(day_text, DAYS) % 7 and (d.day - 1) // 7 + 1 == int(nth):
                    return True
            elif weekday in {v % 7 for v in _plain(part, 0, 7, DAYS)}:
                return True
        return False

    def day_matches(self, d: date) -> bool:
        if d.month not in self.months:
            return False
        dom = self._dom_matches(d)
        dow = self._dow_matches(d)
        if self.day_or and self.dom_restricted and self.dow_restricted:
            return dom or dow  # POSIX: either restricted day field
        return dom and dow

    def matches(self, wall: datetime) -> bool:
        return (
            self.day_matches(wall.date())
            and wall.hour in self.hours
            and wall.minute in self.minutes
            and wall.second in self.seconds
        )


def _nearest_weekday(year: int, month: int, day: int) -> date | None:
    """``nW``: the weekday (Mon-Fri) nearest to day n, never leaving the month."""
    last = calendar.monthrange(year, month)[1]
    if day > last:
        return None
    d = date(year, month, day)
    if d.weekday() == 5:  # Saturday -> Friday, or Monday when the 1st
        return d - timedelta(days=1) if day > 1 else d + timedelta(days=2)
    if d.weekday() == 6:  # Sunday -> Monday, or Friday when the last day
        return d + timedelta(days=1) if day < last else d - timedelta(days=2)
    return d


def instants(wall: datetime, zone: ZoneInfo, fixed_time: bool) -> list[datetime]:
    """The default DST rule (design.md §7) for one naive wall time."""
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    exists = first.astimezone(zone).replace(tzinfo=None) == wall
    if not exists:  # in a spring-forward gap
        return [first] if fixed_time else []
    if first == second:
        return [first]
    return [min(first, second)] if fixed_time else sorted({first, second})


def slots(cron: Cron, zone_name: str, start: datetime, end: datetime) -> list[datetime]:
    """Every slot of ``cron`` in ``[start, end)`` (UTC, ascending, unique), by brute force."""
    return walk(
        cron.day_matches, cron.hours, cron.minutes, cron.seconds, cron.matches,
        zone_name, start, end, fixed_time=cron.fixed_time,
    )


def walk(
    day_matches: Callable[[date], bool],
    hours: frozenset[int] | set[int],
    minutes: frozenset[int] | set[int],
    seconds: frozenset[int] | set[int],
    matches: Callable[[datetime], bool],
    zone_name: str,
    start: datetime,
    end: datetime,
    *,
    fixed_time: bool,
) -> list[datetime]:
    """Walk the local calendar days around ``[start, end)``; on each day that matches, test
    every hour, minute and second against its field, then the whole wall time, and map it
    to instants with the DST rule. Returns UTC instants, ascending, unique."""
    zone = ZoneInfo(zone_name)
    found: set[datetime] = set()
    day = (start - timedelta(days=1)).astimezone(zone).date()
    last_day = (end + timedelta(days=1)).astimezone(zone).date()
    while day <= last_day:
        if day_matches(day):
            for h in range(24):
                if h not in hours:
                    continue
                for m in range(60):
                    if m not in minutes:
                        continue
                    for s in range(60):
                        if s not in seconds:
                            continue
                        wall = datetime(day.year, day.month, day.day, h, m, s)
                        if not matches(wall):
                            continue
                        for instant in instants(wall, zone, fixed_time):
                            if start <= instant < end:
                                found.add(instant)
        day += timedelta(days=1)
    return sorted(found)
