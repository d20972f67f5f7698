"""Schedules: cron, interval and one-off timing rules, and their slots.

A :class:`Schedule` turns time into *slots*: whole-second UTC instants at which an
entry is due. Every method takes tz-aware datetimes in any offset (naive input
raises :class:`ValueError`, never guessed) and returns tz-aware UTC datetimes
(:data:`datetime.timezone.utc`) with ``microsecond == 0``.

Cron entries are evaluated on the *wall clock* of the entry's IANA zone, then each
wall time is mapped to UTC instants with :mod:`zoneinfo` by one rule
(:func:`_wall_to_instants`; see ``docs/dst.md``), the Vixie/ISC cron policy with
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
"""

from __future__ import annotations

import abc
import heapq
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, CroniterError, croniter

from reliable_beat.errors import InvalidScheduleError, UnknownTimezoneError
from reliable_beat.redaction import get_logger
from reliable_beat.slots import format_fire_at, truncate

log = get_logger(__name__)

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

UTC = timezone.utc

#: Longest cron expression accepted (characters). Real expressions are far shorter (a list
#: of all 60 minutes is 170); an 85 KB one was accepted once and cost 0.5 s per slot step.
MAX_CRON_LENGTH = 256

#: Allowed values of ``CronSchedule(nonexistent=...)`` (wall time inside a DST gap).
NONEXISTENT_RULES = ("shift", "gap_end", "skip")
#: Allowed values of ``CronSchedule(repeated=...)`` (wall time occurring twice).
REPEATED_RULES = ("first", "last", "both")

_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

#: Wall-clock margin around a DST transition: larger than any real offset change
#: in tzdata except Samoa/Tokelau's 2011 date-line jump (24 h), which is unsupported.
_MARGIN = timedelta(hours=3)
_ONE_SECOND = timedelta(seconds=1)
_ZERO = timedelta(0)
#: slots_between releases an instant once the wall clock is this far past it.
_RELEASE_LAG = timedelta(hours=14) + _MARGIN
#: croniter gives up after this many years without a match (``15 22 29 2 *`` needs 8).
_MAX_YEARS = 30
#: Fixed reference for construction checks and ``nominal_period`` (a Monday, UTC).
_REFERENCE = datetime(2001, 1, 1, tzinfo=UTC)


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


def _local_wall(at: datetime, zone: ZoneInfo) -> datetime:
    """Naive wall-clock time of the instant ``at`` in ``zone``."""
    return at.astimezone(zone).replace(tzinfo=None)


def _offset(at: datetime, zone: ZoneInfo) -> timedelta:
    off = at.astimezone(zone).utcoffset()
    assert off is not None
    return off


def _offset_of_wall(wall: datetime, zone: ZoneInfo) -> timedelta:
    """UTC offset of a naive wall time (``fold=0``), so ``wall - offset`` is UTC-naive."""
    off = zone.utcoffset(wall)
    assert off is not None
    return off


def _transition_instant(lo: datetime, hi: datetime, zone: ZoneInfo) -> datetime:
    """First instant in ``(lo, hi]`` (UTC, whole seconds) whose offset differs from ``lo``'s."""
    before = _offset(lo, zone)
    lo_s, hi_s = 0, int((hi - lo).total_seconds())
    while hi_s - lo_s > 1:
        mid = (lo_s + hi_s) // 2
        if _offset(lo + timedelta(seconds=mid), zone) == before:
            lo_s = mid
        else:
            hi_s = mid
    return lo + timedelta(seconds=hi_s)


def _wall_to_instants(
    wall: datetime, zone: ZoneInfo, nonexistent: str, repeated: str
) -> list[datetime]:
    """Map one naive wall time of ``zone`` to the UTC instants it fires at (the DST rule).

    This is the only place the DST rule lives.

    * ordinary wall time: one instant.
    * wall time in a spring-forward gap (PEP 495: ``fold=0`` and ``fold=1`` give
      different offsets and the post-transition offset is larger):
      ``"shift"`` → read with the pre-gap offset (``fold=0``, RFC 5545 §3.3.5);
      ``"gap_end"`` → the transition instant (first instant after the gap);
      ``"skip"`` → none.
    * repeated wall time (fall-back, post-transition offset is smaller):
      ``"first"`` → the earlier instant, ``"last"`` → the later one, ``"both"`` → both.

    Args:
        wall: naive local wall-clock time (whole seconds).
        zone: the entry's zone.
        nonexistent: one of :data:`NONEXISTENT_RULES`.
        repeated: one of :data:`REPEATED_RULES`.

    Returns:
        0, 1 or 2 UTC instants, ascending.
    """
    off0 = zone.utcoffset(wall.replace(fold=0))
    off1 = zone.utcoffset(wall.replace(fold=1))
    assert off0 is not None and off1 is not None
    naive0 = (wall - off0).replace(tzinfo=UTC)
    if off0 == off1:
        return [naive0]
    naive1 = (wall - off1).replace(tzinfo=UTC)
    if off1 > off0:  # gap: clocks jumped forward over this wall time
        if nonexistent == "shift":
            return [naive0]
        if nonexistent == "gap_end":
            return [_transition_instant(naive1, naive0, zone)]
        return []
    # repeated: naive0 (pre-transition offset, larger) is the earlier instant
    if repeated == "first":
        return [naive0]
    if repeated == "last":
        return [naive1]
    return [naive0, naive1]


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


def _split_fields(expr: str) -> list[str]:
    text = expr.strip()
    return _ALIASES.get(text.lower(), text).split()


_DAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_SMALL_LIST = re.compile(r"[0-7](-[0-7])?(,[0-7](-[0-7])?)*(/[0-9]+)?")


def _day_of_week_like(field: str) -> bool:
    """A field that reads as a day of week, not seconds: names, ``L``/``#``/``?``, or a
    range or list within 0-7 (``1-5``, ``1,3,5``); a single number is not enough."""
    f = field.lower()
    if any(name in f for name in _DAY_NAMES) or any(c in f for c in "l#?"):
        return True
    return bool(_SMALL_LIST.fullmatch(f)) and ("-" in f or "," in f)


def _valid_seconds_first(fields: list[str]) -> bool:
    """Whether the 6 fields also parse as a seconds-first cron."""
    try:
        croniter(" ".join(fields).replace("?", "*"), _REFERENCE.replace(tzinfo=None),
                 second_at_beginning=True)
    except (CroniterError, ValueError, KeyError, TypeError):
        return False
    return True


def _reads_seconds_first(fields: list[str]) -> bool:
    """The seconds-first forms we can tell apart (docs/dst.md lists the ones we cannot).

    Both readings must be valid, and the seconds-last reading implausible: a last field
    that reads as a day of week (``1-5``, ``MON-FRI``, ``L5``, ``5#2``), or the usual
    Spring/Quartz shape ``0 <minute> <hour> * <month> <0-7>`` (seconds ``0`` first,
    day-of-month ``*``, a single day of week last), which read seconds-last would be
    "second 0-7 of the matching minutes of <hour>th day of the month".
    """
    if not _valid_seconds_first(fields):
        return False
    if _day_of_week_like(fields[5]):
        return True
    return fields[0] == "0" and fields[3] == "*" and fields[5] in {str(d) for d in range(8)}


def _seconds_first_why(fields: list[str]) -> str:
    if _day_of_week_like(fields[5]):
        return f"its last field {fields[5]!r} reads as days of the week, not seconds"
    return (
        f"'0' first, '*' fourth and {fields[5]!r} last is the seconds-first shape "
        f"(read seconds-last it would be 'second {fields[5]} of day-of-month {fields[2]}')"
    )


def _seconds_first_fix(fields: list[str], *, ambiguous: bool = False) -> str:
    """The rewrite for a seconds-first string: seconds moved last, or dropped when 0."""
    rest = [f.replace("?", "*") for f in fields[1:]]
    if len(fields) != 6:
        return f"E.g. {' '.join(f.replace('?', '*') for f in fields)!r}"
    moved = " ".join(rest) if fields[0] == "0" else " ".join([*rest, fields[0]])
    text = f"If you meant seconds first, write {moved!r}" + (
        " (5 fields: second 0 is the default)." if fields[0] == "0" else " (seconds last)."
    )
    if ambiguous:
        text += (
            " If you did mean seconds last, write the month field as '1-12' instead of '*' "
            "(docs/dst.md lists the forms that cannot be told apart)."
        )
    return text


class CronSchedule(Schedule):
    """A cron expression evaluated on the wall clock of an IANA zone.

    Syntax is croniter's: 5 fields (minute hour day-of-month month day-of-week), or 6
    with the **seconds field last**; ``@hourly``, ``@daily``, ``@midnight``,
    ``@weekly``, ``@monthly``, ``@yearly``/``@annually``; names (``mon``, ``jan``),
    ``L``, ``W`` and ``#``.

    Args:
        expr: the cron string.
        timezone: IANA zone whose wall clock the expression reads.
        day_or: POSIX cron (True): when both day-of-month and day-of-week are
            restricted, a day matching *either* fires. False: both must match
            (Celery ``crontab`` meaning).
        nonexistent: wall time inside a DST gap: ``"shift"`` (pre-gap offset),
            ``"gap_end"`` (the transition instant) or ``"skip"``; None = default
            (``"shift"`` for fixed-time entries, ``"skip"`` for wildcard ones).
        repeated: wall time occurring twice: ``"first"``, ``"last"`` or ``"both"``;
            None = default (``"first"`` fixed-time, ``"both"`` wildcard).

    Raises:
        InvalidScheduleError: unreadable expression (croniter's error as
            ``__cause__``), longer than :data:`MAX_CRON_LENGTH` characters,
            seconds-first 6-field string, an expression that never
            matches (none within 30 years), or an unknown rule name.
        UnknownTimezoneError: unknown zone.
    """

    kind: ClassVar[str] = "cron"

    def __init__(
        self,
        expr: str,
        timezone: str = "UTC",
        *,
        day_or: bool = True,
        nonexistent: str | None = None,
        repeated: str | None = None,
    ) -> None:
        if not isinstance(expr, str):
            raise InvalidScheduleError(f"cron expression must be a string, got {expr!r}")
        if len(expr) > MAX_CRON_LENGTH:
            raise InvalidScheduleError(
                f"cron expression {expr[:40]!r}... is {len(expr)} characters long; at most "
                f"{MAX_CRON_LENGTH} are accepted (each slot step re-reads it): use ranges and "
                "steps ('0-59/5') instead of long lists, or split the entry in two"
            )
        self.expr = expr
        self.timezone = validate_timezone(timezone)
        self.day_or = bool(day_or)
        self.nonexistent = nonexistent
        self.repeated = repeated
        self._zone = ZoneInfo(timezone)
        fields = _split_fields(expr)
        self._croniter_expr = " ".join(fields)
        self._check_syntax(fields)
        # POSIX OR of two restricted day fields (neither is exactly '*') is walked as the
        # union of two croniter expressions with one day field each: croniter ANDs them
        # when one holds L, W or #, and when it normalises the other to '*' ('1-31' with
        # '*/2'): tests/unit/test_cron_oracle.py lists the cases.
        self._exprs: tuple[str, ...] = (self._croniter_expr,)
        if self.day_or and fields[2] != "*" and fields[4] != "*":
            self._exprs = (
                " ".join([*fields[:4], "*", *fields[5:]]),
                " ".join([*fields[:2], "*", *fields[3:]]),
            )
        # One reusable croniter per expression and direction, per thread: building one
        # re-parses the expression (about half the cost of a step); a step repositions it.
        self._steppers = threading.local()
        self.fixed_time = not fields[0].startswith("*") and not fields[1].startswith("*")
        if nonexistent is not None and nonexistent not in NONEXISTENT_RULES:
            raise InvalidScheduleError(
                f"cron {expr!r}: nonexistent={nonexistent!r} is not one of "
                f"{', '.join(NONEXISTENT_RULES)} (or None for the default)"
            )
        if repeated is not None and repeated not in REPEATED_RULES:
            raise InvalidScheduleError(
                f"cron {expr!r}: repeated={repeated!r} is not one of "
                f"{', '.join(REPEATED_RULES)} (or None for the default)"
            )
        self._nonexistent = nonexistent or ("shift" if self.fixed_time else "skip")
        self._repeated = repeated or ("first" if self.fixed_time else "both")
        self._period: timedelta | None = None
        if self.next_after(_REFERENCE) is None:
            raise InvalidScheduleError(
                f"cron {expr!r} never matches (no slot within {_MAX_YEARS} years of "
                f"{_REFERENCE:%Y-%m-%d}), e.g. a day that does not exist in that month"
            )

    def _check_syntax(self, fields: list[str]) -> None:
        hint = (
            "croniter syntax: 5 fields 'minute hour day-of-month month day-of-week', "
            "or 6 with the seconds field LAST ('* * * * * */15' = every 15 seconds)"
        )
        if len(fields) not in (5, 6):
            raise InvalidScheduleError(
                f"cron {self.expr!r} has {len(fields)} fields; expected {hint}"
            )
        if any("?" in f for f in fields):
            raise InvalidScheduleError(
                f"cron {self.expr!r}: '?' is Quartz syntax, not cron: write '*' instead. "
                "Quartz also puts seconds FIRST and numbers days of the week 1=Sunday..7="
                "Saturday (cron: 0=Sunday, 1=Monday), so write the days as names (MON-FRI). "
                + _seconds_first_fix(fields)
            )
        if len(fields) == 6 and fields[5] == "*" and fields != ["*"] * 6:
            raise InvalidScheduleError(
                f"cron {self.expr!r}: a 6-field string has its seconds field LAST, so this "
                "means 'every second' of the matching minutes; that is almost always the "
                "seconds-first mistake. Put seconds last, e.g. '* * * * * */15' for every "
                "15 seconds (or use '* * * * * *' for every second). "
                + _seconds_first_fix(fields)
            )
        if len(fields) == 6 and _reads_seconds_first(fields):
            raise InvalidScheduleError(
                f"cron {self.expr!r} looks like a seconds-FIRST cron (Spring/Quartz "
                "'second minute hour day-of-month month day-of-week'): "
                + _seconds_first_why(fields)
                + ". reliable_beat reads 6 fields with the seconds field LAST (croniter). "
                + _seconds_first_fix(fields, ambiguous=not _day_of_week_like(fields[5]))
            )
        dom = fields[2].lower()
        if "w" in dom:
            day = dom[:-1]
            if not (dom.endswith("w") and day.isdigit() and 1 <= int(day) <= 28):
                raise InvalidScheduleError(
                    f"cron {self.expr!r}: day-of-month {fields[2]!r}: 'W' (nearest weekday) "
                    "is supported as a single day 1W..28W only (a list, a range, LW or a day "
                    "some months lack has no agreed meaning); use e.g. '15W', 'L', or a list "
                    "of days"
                )
        try:
            for expr in (self._croniter_expr,):
                croniter(expr, _REFERENCE.replace(tzinfo=None), day_or=self.day_or)
        except (CroniterError, ValueError, KeyError, TypeError) as exc:
            extra = ""
            if len(fields) == 6 and _valid_seconds_first(fields):
                extra = " It reads as a seconds-FIRST (Spring/Quartz) cron. " + (
                    _seconds_first_fix(fields)
                )
            raise InvalidScheduleError(
                f"cron {self.expr!r} is not valid: {exc}; expected {hint}.{extra}"
            ) from exc

    # -- wall-clock iteration -------------------------------------------------------

    def _iter(self, expr: str, wall: datetime) -> croniter:
        return croniter(
            expr,
            wall,
            day_or=self.day_or,
            max_years_between_matches=_MAX_YEARS,
        )

    def _instants(self, wall: datetime) -> list[datetime]:
        return _wall_to_instants(wall, self._zone, self._nonexistent, self._repeated)

    def _stream(self, expr: str, after_wall: datetime) -> Iterator[datetime]:
        it = self._iter(expr, after_wall)
        while True:
            try:
                yield it.get_next(datetime)
            except CroniterBadDateError:
                return

    def _walls_forward(self, after_wall: datetime) -> Iterator[datetime]:
        """Matching naive wall times strictly after ``after_wall``, ascending, unique."""
        if len(self._exprs) == 1:
            yield from self._stream(self._exprs[0], after_wall)
            return
        last: datetime | None = None
        for wall in heapq.merge(*(self._stream(e, after_wall) for e in self._exprs)):
            if wall != last:
                last = wall
                yield wall

    def _step(self, expr: str, wall: datetime, forward: bool) -> datetime | None:
        """One croniter step from ``wall`` (exclusive), or None when there is no match.

        Reuses this thread's croniter for ``(expr, forward)``, repositioned at ``wall``
        (``set_current``): the same answer as a fresh ``croniter(expr, wall)``, checked by
        tests/unit/test_cron_oracle.py, without re-parsing the expression.
        """
        cache: dict[tuple[str, bool], croniter] = self._steppers.__dict__.setdefault("c", {})
        it = cache.pop((expr, forward), None)
        if it is None:
            it = self._iter(expr, wall)
        else:
            it.set_current(wall, force=True)
        try:
            found = it.get_next(datetime) if forward else it.get_prev(datetime)
        except CroniterBadDateError:
            return None  # the instance is dropped: a failed search leaves no state behind
        cache[(expr, forward)] = it
        return found  # type: ignore[no-any-return]

    def _wall_after(self, wall: datetime) -> datetime | None:
        """First matching naive wall time strictly after ``wall`` (one croniter step each)."""
        found = [w for w in (self._step(e, wall, True) for e in self._exprs) if w is not None]
        return min(found) if found else None

    def _wall_before(self, wall: datetime) -> datetime | None:
        """Last matching naive wall time strictly before ``wall`` (one croniter step each)."""
        found = [w for w in (self._step(e, wall, False) for e in self._exprs) if w is not None]
        return max(found) if found else None

    def _transition_around(self, at: datetime) -> datetime | None:
        """The DST transition instant within ±3 h of ``at`` (UTC), or None."""
        lo, hi = at - _MARGIN, at + _MARGIN
        if _offset(lo, self._zone) == _offset(hi, self._zone):
            return None
        return _transition_instant(lo, hi, self._zone)

    def _pieces(self, transition: datetime) -> tuple[timedelta, timedelta, datetime, datetime]:
        """Offsets before/after ``transition`` and the wall times where pieces change.

        Around one transition the wall clock splits into three pieces, each with a
        fixed, monotone wall → instant map (``instant = wall - offset``): before the
        gap/repeated range (offset before), inside it (by the rule), after it (offset
        after). Returns ``(offset_before, offset_after, p1, p2)`` with ``p1 <= p2`` the
        naive wall times where the middle piece starts and ends.
        """
        before = _offset(transition - _ONE_SECOND, self._zone)
        after = _offset(transition, self._zone)
        at = transition.replace(tzinfo=None)
        return before, after, at + min(before, after), at + max(before, after)

    def _candidates_after(self, t: datetime, transition: datetime) -> list[datetime]:
        """Slots > ``t`` containing the smallest one whose wall time is near ``transition``.

        Within a piece with offset ``o`` the smallest slot > t comes from the first
        matching wall time after ``max(piece start, t + o)``; so one croniter step
        from each of four wall times suffices.
        """
        before, after, p1, p2 = self._pieces(transition)
        tn = t.replace(tzinfo=None)
        out: list[datetime] = []
        for start in {tn + before, tn + after, p1 - _ONE_SECOND, p2 - _ONE_SECOND}:
            wall = self._wall_after(start)
            if wall is not None:
                out.extend(i for i in self._instants(wall) if i > t)
        return out

    def _candidates_at_or_before(self, t: datetime, transition: datetime) -> list[datetime]:
        """Mirror of :meth:`_candidates_after`: slots <= ``t`` containing the largest."""
        before, after, p1, p2 = self._pieces(transition)
        tn = t.replace(tzinfo=None) + _ONE_SECOND
        out: list[datetime] = []
        for start in {tn + before, tn + after, p1, p2}:
            wall = self._wall_before(start)
            if wall is not None:
                out.extend(i for i in self._instants(wall) if i <= t)
        return out

    # -- public API -----------------------------------------------------------------

    def next_after(self, after: datetime) -> datetime | None:
        """Return the first slot strictly after ``after`` (UTC), or None if none ever.

        Common case (no offset change within ±3 h of ``after`` and of the result):
        one croniter step on the wall clock. Near a DST transition, wall-time order
        is not UTC order; then the wall clock is cut into pieces around the
        transition and one croniter step per piece finds the answer (at most four
        steps, whatever the cron's frequency).

        Args:
            after: tz-aware instant, any offset.

        Raises:
            ValueError: ``after`` is naive.
        """
        t = truncate(after)
        transition = self._transition_around(t)
        if transition is None:
            wall = self._wall_after(_local_wall(t, self._zone))
            if wall is None:
                return None
            later = [i for i in self._instants(wall) if i > t]
            probe = (
                later[0]
                if later
                else (wall - _offset_of_wall(wall, self._zone)).replace(tzinfo=UTC)
            )
            if later and self._transition_around(probe) is None:
                return later[0]
            transition = self._transition_around(probe)
            if transition is None:  # pragma: no cover - a skipped wall is at a transition
                return later[0] if later else None
        seen: set[datetime] = set()
        best: datetime | None = None
        while transition is not None and transition not in seen:
            seen.add(transition)
            found = self._candidates_after(t, transition)
            if best is not None:
                found.append(best)
            if not found:
                return None
            best = min(found)
            transition = self._transition_around(best)
        return best

    def previous_at_or_before(self, at: datetime) -> datetime | None:
        """Return the latest slot at or before ``at`` (UTC), or None if none.

        Mirror image of :meth:`next_after` (same fast path, same pieces).

        Args:
            at: tz-aware instant, any offset.

        Raises:
            ValueError: ``at`` is naive.
        """
        t = truncate(at)
        transition = self._transition_around(t)
        if transition is None:
            wall = self._wall_before(_local_wall(t, self._zone) + _ONE_SECOND)
            if wall is None:
                return None
            earlier = [i for i in self._instants(wall) if i <= t]
            probe = (
                earlier[-1]
                if earlier
                else (wall - _offset_of_wall(wall, self._zone)).replace(tzinfo=UTC)
            )
            if earlier and self._transition_around(probe) is None:
                return earlier[-1]
            transition = self._transition_around(probe)
            if transition is None:  # pragma: no cover
                return earlier[-1] if earlier else None
        seen: set[datetime] = set()
        best: datetime | None = None
        while transition is not None and transition not in seen:
            seen.add(transition)
            found = self._candidates_at_or_before(t, transition)
            if best is not None:
                found.append(best)
            if not found:
                return None
            best = max(found)
            transition = self._transition_around(best)
        return best

    def slots_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Yield the slots in ``[start, end)`` (UTC, ascending, unique), in one pass.

        Wall times are walked once (widened by the offset drop when a fall-back is
        within 3 h of ``start`` or ``end``); instants are buffered in a heap and
        released once no later wall time can map before them, so the window may be
        long.

        Args:
            start: tz-aware, inclusive.
            end: tz-aware, exclusive.

        Raises:
            ValueError: ``start`` or ``end`` is naive.
        """
        truncate(start)  # rejects naive
        truncate(end)
        start_u, end_u = start.astimezone(UTC), end.astimezone(UTC)
        zone = self._zone
        if start_u >= end_u:
            return
        # A wall time w maps to w - o for an offset o in force within 3 h (a gap wall
        # read with the pre-gap offset included), so the walk is widened by the
        # offset change near start and end; usually zero.
        around_start = (_offset(start_u - _MARGIN, zone), _offset(start_u + _MARGIN, zone))
        around_end = (_offset(end_u - _MARGIN, zone), _offset(end_u + _MARGIN, zone))
        lookback = max(_offset(start_u, zone) - min(around_start), _ZERO)
        lookahead = max(max(around_end) - _offset(end_u, zone), _ZERO)
        first_wall = _local_wall(truncate(start_u), zone) - lookback - _ONE_SECOND
        end_wall = _local_wall(truncate(end_u), zone) + lookahead + _ONE_SECOND
        pending: list[datetime] = []
        last: datetime | None = None
        for wall in self._walls_forward(first_wall):
            if wall > end_wall:
                break
            for instant in self._instants(wall):
                if start_u <= instant < end_u:
                    heapq.heappush(pending, instant)
            # a later wall time w' maps to w' - offset >= wall - 14 h (largest offset) - margin
            floor = wall.replace(tzinfo=UTC) - _RELEASE_LAG
            while pending and pending[0] < floor:
                instant = heapq.heappop(pending)
                if instant != last:
                    last = instant
                    yield instant
        while pending:
            instant = heapq.heappop(pending)
            if instant != last:
                last = instant
                yield instant

    def to_spec(self) -> dict[str, Any]:
        """Return ``{"kind": "cron", "expr", "timezone", "day_or", "nonexistent", "repeated"}``.

        ``nonexistent``/``repeated`` are the overrides as given (None = default rule).
        """
        return {
            "kind": "cron",
            "expr": self.expr,
            "timezone": self.timezone,
            "day_or": self.day_or,
            "nonexistent": self.nonexistent,
            "repeated": self.repeated,
        }

    @property
    def nominal_period(self) -> timedelta:
        """Gap between the first two slots after 2001-01-01T00:00Z (for warnings only)."""
        if self._period is None:
            first = self.next_after(_REFERENCE)
            second = self.next_after(first) if first is not None else None
            self._period = (
                second - first if first is not None and second is not None else timedelta(0)
            )
        return self._period


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


_CELERY_FIELDS = (
    # (attribute, original-value attribute, keyword, lowest, highest)
    ("minute", "_orig_minute", "minute", 0, 59),
    ("hour", "_orig_hour", "hour", 0, 23),
    ("day_of_month", "_orig_day_of_month", "day_of_month", 1, 31),
    ("month_of_year", "_orig_month_of_year", "month_of_year", 1, 12),
    ("day_of_week", "_orig_day_of_week", "day_of_week", 0, 6),
)


def describe_crontab(obj: Any) -> str:
    """Quote a Celery ``crontab`` as the user wrote it: ``crontab(minute='*/2 5', hour=3)``.

    Built from Celery's ``_orig_*`` attributes (the arguments as given); fields left at
    Celery's default ``'*'`` are omitted. Used in every error about a crontab, so a
    message never quotes our rendered cron string instead of the user's text.
    """
    parts: list[str] = []
    for _attr, orig_attr, keyword, _lo, _hi in _CELERY_FIELDS:
        orig = getattr(obj, orig_attr, "*")
        if isinstance(orig, str) and orig == "*":
            continue
        parts.append(f"{keyword}={orig!r}")
    return f"crontab({', '.join(parts)})"


def _runs(values: list[int]) -> str:
    """``[1, 2, 3, 5, 7, 8]`` → ``"1-3,5,7,8"`` (runs of three or more become ranges)."""
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{values[i]}-{values[j]}")
        else:
            out.extend(str(v) for v in values[i : j + 1])
        i = j + 1
    return ",".join(out)


def _render_celery_field(values: list[int], lo: int, hi: int, star: bool) -> str | None:
    """Render one expanded crontab field (Celery's own set) as a croniter field.

    ``star`` (the user's text starts with ``*``) must survive for the minute and hour
    fields, because it decides the DST rule (wildcard vs fixed-time, ``docs/dst.md``):
    a star field renders as ``*``, ``*/n`` or ``*/n,<extra values>``; any other field as a
    plain list with ranges, never starting with ``*``. Returns None when a star field
    cannot be written (its set lacks the field's lowest value).
    """
    if not star:
        step = values[1] - values[0] if len(values) >= 3 else 0
        if step > 1 and values == list(range(values[0], values[-1] + 1, step)):
            return f"{values[0]}-{values[-1]}/{step}"  # '0-58/2', short and not '*'
        return _runs(values)
    if values == list(range(lo, hi + 1)):
        return "*"
    if not values or values[0] != lo:
        return None
    have = set(values)
    # smallest step whose progression lo, lo+s, ... lies inside the set (s = span: {lo})
    step = next(s for s in range(2, hi - lo + 2) if set(range(lo, hi + 1, s)) <= have)
    rest = sorted(have - set(range(lo, hi + 1, step)))
    return f"*/{step}" + (f",{_runs(rest)}" if rest else "")


def _croniter_sets(expr: str) -> list[set[int]]:
    """The five field sets croniter expands ``expr`` to (``*`` → the full range; 7 → 0)."""
    expanded = croniter(expr, _REFERENCE.replace(tzinfo=None), day_or=False).expanded
    out: list[set[int]] = []
    for field, (_a, _o, _k, lo, hi) in zip(expanded, _CELERY_FIELDS, strict=True):
        if field == ["*"]:
            out.append(set(range(lo, hi + 1)))
        else:
            out.append({int(v) % 7 if hi == 6 else int(v) for v in field})
    return out


#: (where, crontab as written) already warned about by :func:`_warn_lenient_fields`: a beat
#: builds its definitions more than once at start; the warning is said once per process.
_LENIENT_WARNED: set[tuple[str, str]] = set()


def _warn_lenient_fields(obj: Any, where: str, expr: str) -> None:
    """Log a WARNING when a crontab field's text holds spaces (a whole cron string given as
    ``minute=``, say): Celery reads each comma-separated part up to its first space and
    ignores the rest, without a word. Celery's meaning is kept; the warning names the
    entry, the field, what Celery read and what it ignored."""
    ignored: list[str] = []
    for _attr, orig_attr, keyword, _lo, _hi in _CELERY_FIELDS:
        orig = getattr(obj, orig_attr, None)
        if not isinstance(orig, str) or not any(c.isspace() for c in orig.strip()):
            continue
        parts = [p.strip() for p in orig.split(",")]
        read = ",".join(p.split(None, 1)[0] for p in parts if p)
        dropped = "; ".join(p.split(None, 1)[1] for p in parts if len(p.split(None, 1)) > 1)
        ignored.append(f"{keyword}={orig!r} is read as {keyword}={read!r}, ignoring "
                       f"{dropped!r}")
    if not ignored:
        return
    source = describe_crontab(obj)
    if (where, source) in _LENIENT_WARNED:
        return
    if len(_LENIENT_WARNED) < 10_000:
        _LENIENT_WARNED.add((where, source))
    log.warning(
        "%s%s: %s. That is Celery's own reading of it, kept as is: cron %r. If the ignored "
        "part was meant (a whole cron string given as one field), give each field its own "
        "argument, e.g. crontab(minute='*/2', hour='6-17'), or give the cron string itself "
        "as the schedule", where, source, "; ".join(ignored), expr)


def _crontab_expr(obj: Any, where: str) -> str:
    """Render a Celery ``crontab`` as a 5-field croniter string, from Celery's own sets.

    Every field is rendered from the set Celery expanded (``crontab.minute``, ``.hour``,
    ``.day_of_month``, ``.month_of_year``, ``.day_of_week``), never from the text the user
    wrote: Celery's parsing is what counts (``minute='*/2 5'`` is every 2 minutes in Celery,
    and stays so). Only the *star-ness* of the minute and hour text is kept (it decides the
    DST rule; a full set counts as ``*``). The result is checked: croniter must expand it
    back to exactly Celery's sets. Day-of-week numbering is the same in both (0 = Sunday).

    Raises:
        InvalidScheduleError: the crontab cannot be written as a cron string with the same
            meaning (quotes the crontab as written, never our rendering).
    """
    source = describe_crontab(obj)
    celery_sets: list[set[int]] = []
    parts: list[str] = []
    for attr, orig_attr, keyword, lo, hi in _CELERY_FIELDS:
        try:
            values = sorted({int(v) for v in getattr(obj, attr)})
        except (TypeError, ValueError) as exc:
            raise InvalidScheduleError(
                f"{where}{source}: field {keyword} is not a set of integers ({exc}); build "
                "it with celery.schedules.crontab(...)"
            ) from exc
        if not values or values[0] < lo or values[-1] > hi:
            raise InvalidScheduleError(
                f"{where}{source}: Celery expanded {keyword} to {values!r}, outside "
                f"{lo}-{hi}; give values in that range"
            )
        orig = getattr(obj, orig_attr, None)
        if orig is None:  # pragma: no cover - every Celery 5 crontab keeps its arguments
            star = values == list(range(lo, hi + 1))
        else:
            star = isinstance(orig, str) and orig.strip().startswith("*")
        # a full set is '*' whatever its text (hour=range(24) stays an hourly wildcard)
        star = star or values == list(range(lo, hi + 1))
        rendered = _render_celery_field(values, lo, hi, star)
        if rendered is None:
            raise InvalidScheduleError(
                f"{where}{source}: field {keyword}={orig!r} starts with '*' but Celery expanded "
                f"it to {values!r}, which has no cron form that keeps the wildcard DST rule; "
                "write the values as a list without '*'"
            )
        celery_sets.append(set(values))
        parts.append(rendered)
    expr = " ".join(parts)
    try:
        ours = _croniter_sets(expr)
    except (CroniterError, ValueError, KeyError, TypeError) as exc:  # pragma: no cover
        raise InvalidScheduleError(
            f"{where}{source} cannot be converted to a cron string ({exc}); please report it"
        ) from exc
    for got, want, field in zip(ours, celery_sets, _CELERY_FIELDS, strict=True):
        keyword = field[2]
        if got != want:  # pragma: no cover - a rendering bug; refuse rather than guess
            raise InvalidScheduleError(
                f"{where}{source}: converting field {keyword} would change its meaning "
                f"(Celery: {sorted(want)}, cron {expr!r}: {sorted(got)}); please report it, "
                "and write the schedule as a cron string meanwhile"
            )
    _warn_lenient_fields(obj, where, expr)
    return expr


def _crontab_zone(obj: Any, where: str) -> str | None:
    """The zone a crontab carries itself, or None (then Celery uses the app's ``timezone``).

    Celery evaluates a crontab on the clock ``nowfun()`` returns (django-celery-beat's
    ``TzAwareCrontab`` keeps it as ``.tz``); that zone is the crontab's meaning.

    Raises:
        InvalidScheduleError: ``nowfun`` gives a naive time (the host's local clock) or a
            zone with no IANA name.
    """
    # an instance attribute only: BaseSchedule.tz is a property giving the app's zone
    tz = vars(obj).get("tz")
    if tz is None and getattr(obj, "nowfun", None) is not None:
        try:
            now = obj.nowfun()
        except Exception as exc:
            raise InvalidScheduleError(
                f"{where}{describe_crontab(obj)}: its nowfun() failed ({exc!r}); drop nowfun "
                "and set the entry's zone with options['reliable_beat']['timezone']"
            ) from exc
        if not isinstance(now, datetime) or now.tzinfo is None:
            raise InvalidScheduleError(
                f"{where}{describe_crontab(obj)}: its nowfun() returns a naive time (the "
                "host's local clock), which no slot can be keyed on; drop nowfun and set the "
                "entry's zone with options['reliable_beat']['timezone']"
            )
        tz = now.tzinfo
    if tz is None:
        return None
    name = getattr(tz, "key", None) or getattr(tz, "zone", None)  # zoneinfo / pytz
    if name is None and tz.utcoffset(None) == timedelta(0) and str(tz) == "UTC":
        name = "UTC"
    if not isinstance(name, str):
        raise InvalidScheduleError(
            f"{where}{describe_crontab(obj)} is evaluated in {tz!r}, which has no IANA zone "
            "name; drop nowfun/tz and set the entry's zone with "
            "options['reliable_beat']['timezone'] (e.g. 'Europe/Berlin')"
        )
    return validate_timezone(name)


def _type_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _overrides(obj: object, base: type, names: tuple[str, ...]) -> list[str]:
    """Methods of ``names`` that ``type(obj)`` redefines below ``base``."""
    return [n for n in names if getattr(type(obj), n, None) is not getattr(base, n, None)]


def from_celery(
    obj: object,
    *,
    timezone: str,
    anchor: datetime,
    entry: str = "?",
    relative: bool = False,
) -> Schedule:
    """Convert a Celery ``beat_schedule`` value into a :class:`Schedule`, same meaning or refused.

    * ``celery.schedules.crontab`` → :class:`CronSchedule` with ``day_or=False``
      (Celery ANDs day_of_month and day_of_week; cron strings OR them), rendered from the
      field sets Celery itself expanded and checked against them, in the zone of its own
      clock when it has one (``nowfun``, django-celery-beat's ``tz``), else ``timezone``.
    * ``celery.schedules.schedule``, :class:`~datetime.timedelta`, int/float seconds →
      :class:`IntervalSchedule` anchored at ``anchor``.
    * a cron string → :class:`CronSchedule` (POSIX ``day_or=True``).
    * one of our :class:`Schedule` objects → returned as is (its own zone is kept).

    ``relative`` is the ``beat_schedule`` entry key of the same name, applied as Celery's
    ``maybe_schedule`` applies it: only to a number or ``timedelta`` (it builds
    ``schedule(td, relative=True)``); Celery ignores it on every other value, and so do
    we.

    Args:
        obj: the schedule value.
        timezone: IANA zone of the entry (Celery's ``timezone`` setting).
        anchor: tz-aware grid anchor for intervals.
        entry: entry name, for error messages.
        relative: the entry's ``relative`` key (Celery default False).

    Raises:
        InvalidScheduleError: ``solar`` schedules (no stable slots), relative intervals
            (``schedule(..., relative=True)``: Celery rounds each run to the interval's
            resolution from when beat started, no fixed grid), custom ``BaseSchedule``
            subclasses (decided at run time, no fixed slots), unsupported types, or
            invalid values; the message names the entry, quotes what the user wrote and
            says what to use instead.
        UnknownTimezoneError: unknown zone.
    """
    where = f"entry {entry!r}: "
    if isinstance(obj, Schedule):
        return obj
    # A Celery schedule object exists only once celery.schedules is imported: look it up
    # instead of importing Celery (the core imports no framework; Celery is an extra).
    celery_schedules: Any = sys.modules.get("celery.schedules")
    relative_hint = (
        "Celery's relative=True rounds each run to the interval's resolution counted from "
        "when beat started, so its slots move with every restart; reliable_beat slots sit "
        "on a fixed grid (anchor + k x interval, the anchor kept with the entry). Drop "
        "relative=True (set the grid with options['reliable_beat']['anchor'] if the phase "
        "matters) or use a crontab"
    )
    try:
        if celery_schedules is not None:
            if isinstance(obj, celery_schedules.solar):
                raise InvalidScheduleError(
                    f"{where}celery solar schedules are not supported (their "
                    "slots move with the sun and cannot be keyed); use a crontab instead"
                )
            if isinstance(obj, celery_schedules.crontab):
                expr = _crontab_expr(obj, where)
                zone = _crontab_zone(obj, where) or timezone
                try:
                    return CronSchedule(expr, zone, day_or=False)
                except UnknownTimezoneError:
                    raise
                except InvalidScheduleError as exc:
                    message = str(exc).replace(f"cron {expr!r}", describe_crontab(obj))
                    raise InvalidScheduleError(f"{where}{message}") from exc
            if isinstance(obj, celery_schedules.schedule):
                custom = _overrides(
                    obj, celery_schedules.schedule, ("is_due", "remaining_estimate")
                )
                if custom:
                    raise InvalidScheduleError(
                        f"{where}{_type_name(obj)} (a celery schedule subclass) overrides "
                        f"{', '.join(custom)}: when it runs is decided at run time, so it has "
                        "no fixed slots to key runs by. Use a plain schedule/timedelta, a "
                        "crontab or a cron string, or add/remove a runtime entry from your "
                        "code when the condition changes"
                    )
                if getattr(obj, "relative", False):
                    raise InvalidScheduleError(
                        f"{where}schedule({obj.run_every!r}, relative=True): {relative_hint}"
                    )
                return IntervalSchedule(obj.run_every, anchor, timezone)
            if isinstance(obj, celery_schedules.BaseSchedule):
                raise InvalidScheduleError(
                    f"{where}{_type_name(obj)} is a custom celery schedule (a BaseSchedule "
                    "subclass): its is_due() decides at run time whether to run (e.g. by a "
                    "query per tick), so it has no fixed slots, and reliable_beat keys every "
                    "run by its slot (what makes it run once). Use a cron string or crontab, "
                    "or an interval (timedelta), whichever grid the condition is checked on "
                    "(and check the condition in the task), or add and remove a runtime entry "
                    "from your code when the condition changes (`reliable-beat entries add`)"
                )
        if isinstance(obj, (timedelta, int, float)) and not isinstance(obj, bool):
            every = obj if isinstance(obj, timedelta) else timedelta(seconds=obj)
            if relative:
                raise InvalidScheduleError(
                    f"{where}'relative': True with schedule {obj!r}: {relative_hint}"
                )
            return IntervalSchedule(every, anchor, timezone)
        if isinstance(obj, str):
            return CronSchedule(obj, timezone)
    except InvalidScheduleError as exc:
        if str(exc).startswith(where):
            raise
        raise InvalidScheduleError(f"{where}{exc}") from exc
    shown = repr(obj)
    if " object at 0x" in shown:  # the default repr says nothing useful
        shown = f"a {_type_name(obj)} object"
    raise InvalidScheduleError(
        f"{where}unsupported schedule {shown} ({type(obj).__name__}); use a "
        "celery crontab or schedule, a timedelta, seconds, or a cron string"
    )
